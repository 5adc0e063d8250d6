"""The benchmark harness: every benchmark's arguments, timing, competitors
and results files.

A benchmark holds its model and its table; from here it takes
:func:`parser` / :func:`parse` (``--quick``, ``--rounds`` or the
:class:`Schedule`, ``--steps``, ``--huge-pages``, ``--fresh-memory``),
:func:`time_interleaved` (systems alternated in one process: the machine
is shared and noisy, so it reports medians, ratios, and each system's
:func:`spread`), the competitor runners' plumbing (:func:`import_torch`
with its threads set, :func:`torch_huge_pages`, :func:`fbgemm` and
:func:`tbe`), and :func:`write_results`, which prints a markdown table
and writes ``benchmarks/results/<name>.md`` and ``.json`` with the
machine, the load and the timings' spread. Then the compiled-program
helpers (:func:`hlo_op_counts`, :func:`compile_phases`). It imports jax
only inside functions: ``benchmarks.fbgemm_anchor`` runs where jax is not
installed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

RESULTS = Path(__file__).resolve().parent / "results"
# appended to every results file's name: "_quick" under --quick
SUFFIX_ENV = "GRADTX_BENCH_SUFFIX"


def fake_cpu_devices(n: int) -> None:
  """``n`` fake CPU devices for the benchmarks of several devices: call it
  before anything imports jax (a no-op after)."""
  if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={n}"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def cpu_name() -> str:
  """The CPU model (from /proc/cpuinfo where there is one)."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
  """What the numbers were measured on (jax's devices where jax is
  installed)."""
  out = {"cpu": cpu_name(), "cores": os.cpu_count()}
  out.update(backend="cpu", device="cpu", devices=1, jax="not installed")
  if available("jax"):
    import jax

    dev = jax.devices()[0]
    out.update(
      backend=jax.default_backend(),
      device=getattr(dev, "device_kind", str(dev)),
      devices=jax.device_count(),
      jax=jax.__version__,
    )
  return {**out, "python": platform.python_version()}


def load_note() -> str:
  """The 1/5/15-minute load averages (the machine may be shared)."""
  try:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())
  except OSError:
    return "unknown"


def oversubscribed(consequence: str) -> str:
  """A caution for a results note, empty unless the load average exceeded
  the core count (the machine is shared): ``consequence`` says what that
  does to the figures."""
  if max(os.getloadavg()) <= (os.cpu_count() or 1):
    return ""
  return (
    " OVERSUBSCRIBED: the load average exceeded the core count during the "
    f"run, {consequence}"
  )


# ----------------------------------------------------------------------------
# one run: the arguments every benchmark shares


class _Run:
  """What the harness records of this process's run: one benchmark per
  process (``python -m benchmarks`` starts one for each)."""

  def __init__(self) -> None:
    self.quick = False
    self.huge_pages: bool | None = None  # None: the benchmark has no flag
    self.memory_reused: bool | None = None  # None: no --fresh-memory flag
    self.load_start = load_note()
    self.timings: list[dict[str, Any]] = []


RUN = _Run()

HUGE_PAGES_HELP = (
  "back every system's tables and state by huge pages (gtx.use_huge_pages, "
  "the same madvise for torch; default: the OS's 4 KiB pages, as a user's "
  "step runs)"
)
FRESH_MEMORY_HELP = (
  "give malloc glibc's behaviour back (gtx.reuse_host_memory(False); "
  "default: gradtx's, for every system of the process: each step's "
  "temporaries reuse freed pages)"
)


def parser(
  doc: str | None,
  *,
  schedule: Schedule | None = None,
  rounds: int | None = None,
  steps: int | None = None,
  huge_pages: bool = False,
  fresh_memory: bool = False,
) -> argparse.ArgumentParser:
  """A benchmark's argument parser with the shared flags; the benchmark
  adds its own and reads them with :func:`parse`.

  Always ``--quick`` (alias ``--smoke``: small sizes, results written with
  the suffix ``_quick``). ``schedule``: ``--rounds``, ``--burst`` and
  ``--settle`` of :func:`time_interleaved` with its values as defaults;
  ``rounds`` (without ``schedule``): ``--rounds`` alone; ``steps``:
  ``--steps``; ``huge_pages``: ``--huge-pages``; ``fresh_memory``:
  ``--fresh-memory``.
  """
  if schedule is not None and rounds is not None:
    raise ValueError("parser: give schedule (its rounds) or rounds, not both")
  p = argparse.ArgumentParser(description=doc)
  p.add_argument(
    "--quick",
    "--smoke",
    action="store_true",
    help="small sizes; results written with the suffix _quick",
  )
  if schedule is not None:
    add_schedule_args(p, schedule)
  if rounds is not None:
    p.add_argument("--rounds", type=int, default=rounds)
  if steps is not None:
    p.add_argument("--steps", type=int, default=steps)
  if huge_pages:
    p.add_argument("--huge-pages", action="store_true", help=HUGE_PAGES_HELP)
  if fresh_memory:
    p.add_argument(
      "--fresh-memory", action="store_true", help=FRESH_MEMORY_HELP
    )
  return p


def parse(
  p: argparse.ArgumentParser,
  argv: Sequence[str] | None = None,
  *,
  quick: dict[str, Any] | None = None,
) -> argparse.Namespace:
  """``p``'s arguments, with the shared flags applied: ``--quick`` sets
  the arguments in ``quick`` that the command line left at their defaults,
  and the results suffix ``_quick``;
  ``--huge-pages`` turns on :func:`huge_pages` and
  :func:`torch_huge_pages`; ``--fresh-memory`` calls
  ``gtx.reuse_host_memory(False)``. :func:`write_results` notes them."""
  args = p.parse_args(argv)
  RUN.quick = args.quick
  if args.quick:
    os.environ.setdefault(SUFFIX_ENV, "_quick")
    for k, v in (quick or {}).items():
      if getattr(args, k) == p.get_default(k):
        setattr(args, k, v)
  if hasattr(args, "huge_pages"):
    RUN.huge_pages = args.huge_pages
  if hasattr(args, "fresh_memory"):
    RUN.memory_reused = True
    if args.fresh_memory:
      import gradtx

      RUN.memory_reused = not gradtx.reuse_host_memory(False)
  RUN.load_start = load_note()
  return args


def add_table_args(
  p: argparse.ArgumentParser,
  rows: int = 1_000_000,
  dim: int = 64,
  ids: int = 8192,
) -> None:
  """``--rows``, ``--dim``, ``--ids``: one ``[rows, dim]`` table, ``ids``
  fresh ids a step."""
  p.add_argument("--rows", type=int, default=rows)
  p.add_argument("--dim", type=int, default=dim)
  p.add_argument("--ids", type=int, default=ids)


# --quick's sizes of a one-table step (add_table_args, the Schedule)
QUICK_TABLE = dict(rows=20_000, ids=512, rounds=2, burst=2, settle=1)


def add_head_args(p: argparse.ArgumentParser, optimizers: Any) -> None:
  """``--heads`` (linear, mlp) and ``--mlp-optimizers``: the recommender
  benchmarks' heads, and which of ``optimizers`` also run with the mlp
  one."""
  p.add_argument("--heads", nargs="+", default=["linear", "mlp"])
  p.add_argument(
    "--mlp-optimizers",
    nargs="+",
    default=["lazy_adam", "rowwise_adagrad"],
    choices=optimizers,
    help="the optimizers that also run with the mlp head",
  )


# ----------------------------------------------------------------------------
# timing: systems alternated in one process, medians and spread

# Consecutive steps each system runs per round (time_interleaved) in the
# whole-step benchmarks: a training loop's steady state, which is what a
# user's loop (one system alone) runs in. torch's OpenMP workers keep
# spinning on the cores for tens of ms after torch's step and slow the next
# system's first 2-3 steps (gtx rowwise_adagrad at 1M x 64, medians by
# position after 30 torch steps: 8.5, 6.2, 5.8, then 4.1-5.3 ms; lazy_adam
# after 5: 14.9, 11.4, 14.1, 8.9, 9.2 ms). SETTLE steps run untimed before
# each system's BURST timed ones, for every system alike. --burst 1
# --settle 0 gives strict round-robin.
BURST = 10
SETTLE = 3


class Schedule(NamedTuple):
  """How :func:`time_interleaved` alternates systems (see there)."""

  rounds: int = 10
  burst: int = BURST
  settle: int = SETTLE

  @classmethod
  def from_args(cls, args: Any) -> Schedule:
    return cls(args.rounds, args.burst, args.settle)

  @property
  def steps(self) -> int:
    """Steps each system runs (warmup 2, one HLO check, the rounds), so
    that every step can get fresh ids."""
    return self.rounds * (self.burst + self.settle) + 3

  def time(
    self, fns: dict[str, Callable[[], Any]], *, warmup: int = 2, **kw: Any
  ) -> dict[str, float]:
    """:func:`time_interleaved` of ``fns`` on this schedule."""
    return time_interleaved(fns, warmup=warmup, **self._asdict(), **kw)

  def describe(self) -> str:
    settle = (
      f" after {self.settle} untimed ones (the steps that pay for the "
      "previous system's leftovers)"
      if self.settle
      else ""
    )
    return (
      f"median of {self.rounds} round-robin rounds x {self.burst} timed "
      f"consecutive steps of each system{settle}"
    )


def add_schedule_args(
  p: argparse.ArgumentParser, default: Schedule | None = None
) -> None:
  """``--rounds``, ``--burst`` and ``--settle`` of :func:`time_interleaved`,
  ``default``'s values (a :class:`Schedule`) as the defaults."""
  default = default or Schedule()
  p.add_argument("--rounds", type=int, default=default.rounds)
  p.add_argument(
    "--burst",
    type=int,
    default=default.burst,
    help="timed consecutive steps per system per round (1: strict round-robin)",
  )
  p.add_argument(
    "--settle",
    type=int,
    default=default.settle,
    help="untimed steps of a system before its timed ones, each round (0: "
    "time the steps right after another system's turn too)",
  )


def spread(seconds: Sequence[float], burst: int = 1) -> dict[str, float]:
  """Milliseconds of one system's timed calls (``burst`` consecutive ones
  per round, in order): the median, the 10th percentile, the quartiles,
  and the lowest and highest of the rounds' medians."""
  ms = [1e3 * s for s in seconds]
  rounds = [
    statistics.median(ms[i : i + burst]) for i in range(0, len(ms), burst)
  ]
  if len(ms) > 1:
    deciles = statistics.quantiles(ms, n=10, method="inclusive")
    q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive")
  else:
    deciles, q1, q3 = ms * 9, ms[0], ms[0]
  return {
    "median": statistics.median(ms),
    "p10": deciles[0],
    "q1": q1,
    "q3": q3,
    "round_min": min(rounds),
    "round_max": max(rounds),
  }


def time_interleaved(
  fns: dict[str, Callable[[], Any]],
  *,
  warmup: int = 2,
  rounds: int = 15,
  burst: int = 1,
  settle: int = 0,
  samples: dict[str, list[float]] | None = None,
  label: str | None = None,
) -> dict[str, float]:
  """Median seconds per call of each function, measured round-robin so that
  machine noise hits every variant alike.

  Each round runs every function ``settle`` times untimed, then ``burst``
  times timed; the median is over all ``rounds * burst`` timed calls.
  ``burst > 1`` with ``settle > 0`` measures a training loop's steady
  state, the state a user's loop (one system alone) is in: a system's
  first steps after another system's turn pay for that system's leftovers
  (torch's OpenMP workers spin on the cores for tens of milliseconds after
  each step), and ``settle`` keeps those out of the sample, for every
  system alike. ``samples``, when given, receives every timed call's
  seconds per function. Every call records each function's
  :func:`spread` under ``label`` (default: the functions' names) for the
  json that :func:`write_results` writes.
  """
  for fn in fns.values():
    for _ in range(warmup):
      fn()
  times: dict[str, list[float]] = {k: [] for k in fns}
  if samples is not None:
    samples.update(times)
  for _ in range(rounds):
    for k, fn in fns.items():
      for _ in range(settle):
        fn()
      for _ in range(burst):
        t0 = time.perf_counter()
        fn()
        times[k].append(time.perf_counter() - t0)
  label = label or ", ".join(map(_name, fns))
  record(label, times, burst, rounds=rounds, settle=settle)
  return {k: statistics.median(v) for k, v in times.items()}


def _name(system: Any) -> str:
  """A system's name in the json: a tuple key (the variant of a variant)
  as its parts joined by " / "."""
  if isinstance(system, tuple):
    return " / ".join(map(str, system))
  return str(system)


def record(
  label: str, times: dict[str, Sequence[float]], burst: int = 1, **how: Any
) -> None:
  """Keeps each system's :func:`spread` of ``times`` (seconds of its timed
  calls in order, ``burst`` a round) for the json of :func:`write_results`,
  under ``label``, with ``how`` they were timed: for a benchmark that
  times its systems in a loop of its own (a training run)."""
  RUN.timings.append(
    {
      "label": label,
      "burst": burst,
      **how,
      "ms": {_name(k): spread(v, burst) for k, v in times.items() if v},
    }
  )


def time_fn(
  fn: Callable[[], Any],
  *,
  warmup: int = 2,
  repeats: int = 20,
  label: str | None = None,
) -> float:
  """Median seconds per call of ``fn`` (which must block on its result)."""
  name = label or getattr(fn, "__name__", "fn")
  return time_interleaved(
    {name: fn}, warmup=warmup, rounds=repeats, label=label
  )[name]


# ----------------------------------------------------------------------------
# data: the ids of a step

ZIPF_S = 1.05


def make_ids(rows: int, n: int, steps: int, dist: str, seed: int = 0) -> list:
  """``steps`` fresh int32 id vectors of length ``n`` (uniform or Zipf)."""
  import numpy as np

  rng = np.random.default_rng(seed)
  if dist == "uniform":
    return [rng.integers(0, rows, n).astype(np.int32) for _ in range(steps)]
  # Bounded Zipf: P(rank k) ~ k^-s over the rows; ranks land on a fixed
  # random permutation so the hot rows are spread over the table.
  cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -ZIPF_S)
  cdf /= cdf[-1]
  perm = rng.permutation(rows).astype(np.int32)
  out = []
  for _ in range(steps):
    rank = np.searchsorted(cdf, rng.random(n), side="right")
    out.append(perm[np.minimum(rank, rows - 1)])
  return out


def step_runner(
  step: Callable[..., Any], box: list, args_of: Callable[[int], tuple]
) -> Callable[[int], Any]:
  """``run(i)``: the jitted ``step(params, state, *args_of(i))`` on the
  params and state in ``box`` (donated: the step returns them new, and
  maybe a loss), the new ones kept in ``box``; waits for them and returns
  the step's third output, its loss, where it has one."""
  import jax

  def run(i: int) -> Any:
    out = step(box[0], box[1], *args_of(i))
    box[0], box[1] = out[0], out[1]
    jax.block_until_ready(out)
    return out[2] if len(out) > 2 else None

  return run


class Counter:
  """``fn(i)`` as a call without arguments, ``i`` counting up from
  ``start``: each call a step on the next fresh batch."""

  def __init__(self, fn: Callable[[int], Any], start: int = 1):
    self.fn, self.i = fn, start  # 1: step 0 may have run (torch state init)

  def __call__(self) -> Any:
    out = self.fn(self.i)
    self.i += 1
    return out


# ----------------------------------------------------------------------------
# competitors: torch, FBGEMM, huge pages

TORCH_THREADS = 2


def available(module: str) -> bool:
  """Whether ``module`` imports here."""
  try:
    __import__(module)
  except ImportError:
    return False
  return True


def version(module: str) -> str:
  return __import__(module).__version__


def import_torch(threads: int = TORCH_THREADS) -> Any:
  """torch with ``threads`` intra-op threads, or None where it does not
  import."""
  if not available("torch"):
    return None
  import torch

  torch.set_num_threads(threads)
  return torch


def with_threads(n: int, run: Callable[..., Any]) -> Callable[..., Any]:
  """``run`` with torch's intra-op threads set to ``n`` for each call (a
  process-wide setting; systems of other thread counts run between)."""
  if not available("torch"):
    return run
  import torch

  def call(*args: Any) -> Any:
    torch.set_num_threads(n)
    return run(*args)

  return call


def huge_pages(tree: Any) -> None:
  """``gtx.use_huge_pages(tree)`` under ``--huge-pages``."""
  if RUN.huge_pages:
    import gradtx

    gradtx.use_huge_pages(tree)


def torch_huge_pages(tensors: Sequence[Any]) -> None:
  """Under ``--huge-pages``, torch's tables and state on huge pages too, as
  ``gtx.use_huge_pages`` does for JAX's arrays."""
  if not RUN.huge_pages:
    return
  from gradtx._memory import _advise, _madvise

  madvise = _madvise()
  for t in tensors:
    nbytes = t.numel() * t.element_size()
    if madvise is not None and t.device.type == "cpu" and nbytes >= 4 << 20:
      _advise(t.data_ptr(), nbytes, madvise, collapse=True)


def torch_state(opts: Sequence[Any]) -> list[Any]:
  """The tensors of torch optimizers' state (made on their first step)."""
  import torch

  return [
    t
    for o in opts
    for st in o.state.values()
    for t in st.values()
    if torch.is_tensor(t)
  ]


def fbgemm() -> bool:
  """Whether FBGEMM's table-batched embeddings import (``fbgemm_gpu``, with
  torch)."""
  return available("torch") and available("fbgemm_gpu")


def tbe(rows: int | list[int], dim: int, optim: str, pooling: str, lr: float):
  """FBGEMM's table-batched module on CPU: one table of ``rows`` rows, or
  one table per entry of a list (every table ``dim`` wide)."""
  from fbgemm_gpu.split_embedding_configs import EmbOptimType
  from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    EmbeddingLocation,
    PoolingMode,
  )
  from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
  )

  tables = rows if isinstance(rows, list) else [rows]
  return SplitTableBatchedEmbeddingBagsCodegen(
    [(r, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in tables],
    optimizer=getattr(EmbOptimType, optim),
    pooling_mode=getattr(PoolingMode, pooling),
    learning_rate=lr,
  )


def commit() -> str:
  """The last commit that changed ``gradtx/`` (and whether it has
  uncommitted changes): the code the numbers measure."""
  root = Path(__file__).resolve().parent.parent

  def git(*cmd: str) -> str:
    return subprocess.run(
      ["git", "-C", str(root), *cmd], capture_output=True, text=True, check=True
    ).stdout.strip()

  try:
    last = git("log", "-1", "--format=%h", "--", "gradtx")
    dirty = git("status", "--porcelain", "--", "gradtx")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return last + (" with uncommitted changes" if dirty else "")


# ----------------------------------------------------------------------------
# results: markdown + json, the machine, the load, the settings


def markdown_table(
  headers: Sequence[str], rows: Sequence[Sequence[Any]]
) -> str:
  """A GitHub markdown table."""

  def cell(x: Any) -> str:
    if isinstance(x, float):
      return f"{x:.4g}"
    return str(x)

  lines = ["| " + " | ".join(headers) + " |"]
  lines.append("|" + "|".join("---" for _ in headers) + "|")
  lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
  return "\n".join(lines)


def result_path(name: str, ext: str) -> Path:
  """``results/<name><suffix><ext>`` (the suffix: see
  :func:`write_results`), its folder made."""
  RESULTS.mkdir(exist_ok=True)
  return RESULTS / f"{name}{os.environ.get(SUFFIX_ENV, '')}{ext}"


def settings_note() -> str:
  """The run's shared settings in words: pages, host memory, load."""
  out = []
  if RUN.huge_pages is not None:
    out.append(
      "Every system's tables and optimizer state on transparent huge pages "
      "(`gtx.use_huge_pages`; the same madvise for torch's tensors)."
      if RUN.huge_pages
      else "Tables on the OS's default 4 KiB pages (no `--huge-pages`)."
    )
  if RUN.memory_reused is not None:
    out.append(
      "Host memory reused as gradtx sets it at import, for the whole "
      "process (every system's step reuses freed memory for its "
      "temporaries)."
      if RUN.memory_reused
      else "malloc as it is (`--fresh-memory`: each step faults its "
      "temporaries in afresh)."
    )
  out.append(
    f"Load average (1/5/15 min) at the start: {RUN.load_start}, at the "
    f"end: {load_note()} (the machine is shared: compare ratios within a "
    "row)."
  )
  return " ".join(out)


def write_results(
  name: str,
  title: str,
  headers: Sequence[str],
  rows: Sequence[Sequence[Any]],
  *,
  notes: str = "",
  extra: dict[str, Any] | None = None,
) -> str:
  """Prints and saves ``results/<name>.md`` and ``results/<name>.json``.

  The markdown: the title, the machine, the table, ``notes``, then the
  run's settings and load (:func:`settings_note`). The json also holds
  ``extra``, the load, and the spread of every :func:`time_interleaved`
  call since the previous results file (``timing``).
  ``GRADTX_BENCH_SUFFIX`` (set by ``--quick`` and by ``gpu.sh``) is
  appended to ``name``, so smoke runs and other machines never overwrite
  the reference results.
  """
  m = machine()
  table = markdown_table(headers, rows)
  md = (
    f"## {title}\n\n"
    f"Machine: {m['cpu']}, {m['cores']} cores, backend {m['backend']} "
    f"({m['device']} x{m['devices']}), JAX {m['jax']}.\n\n{table}\n"
  )
  if notes:
    md += f"\n{notes}\n"
  md += f"\n{settings_note()}\n"
  print(md)
  result_path(name, ".md").write_text(md)
  payload = {
    "title": title,
    "machine": m,
    "headers": list(headers),
    "rows": [list(r) for r in rows],
    "notes": notes,
    **(extra or {}),
    "load": {"start": RUN.load_start, "end": load_note()},
    "quick": RUN.quick,
    "timing": RUN.timings,
  }
  result_path(name, ".json").write_text(json.dumps(payload, indent=2))
  RUN.timings = []  # the next results file gets the timings made after
  return md


def memory(compiled: Any) -> dict[str, int]:
  """Bytes from ``compiled.memory_analysis()``."""
  m = compiled.memory_analysis()
  return {
    "argument": int(m.argument_size_in_bytes),
    "output": int(m.output_size_in_bytes),
    "temp": int(m.temp_size_in_bytes),
    "alias": int(m.alias_size_in_bytes),
  }


def copy_bandwidth(num_bytes: int = 256 * 2**20) -> float:
  """Measured device copy bandwidth in bytes/s (read + write counted)."""
  import jax
  import jax.numpy as jnp

  x = jnp.ones(num_bytes // 4, jnp.float32)
  f = jax.jit(lambda a: a + 1.0)
  sec = time_fn(lambda: f(x).block_until_ready(), repeats=10)
  return 2 * num_bytes / sec


def warm_copy_bandwidth(
  num_bytes: int = 256 * 2**20, repeats: int = 10
) -> float:
  """Bytes/s (read + write counted) of a copy into an already-faulted buffer.

  On CPU, ``np.copyto`` into a destination written once before timing: an
  in-place optimizer step never pays page faults, and a fresh output buffer
  would (2-3x slower). On accelerators, a jitted ``a + 1`` updated in
  place (donated). The best of ``repeats``: a floor should be optimistic.
  """
  import jax
  import numpy as np

  if jax.default_backend() == "cpu":
    src = np.ones(num_bytes // 4, np.float32)
    dst = np.zeros_like(src)
    np.copyto(dst, src)  # fault the pages in

    def call():
      np.copyto(dst, src)

  else:
    f = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    box = [jax.numpy.ones(num_bytes // 4, jax.numpy.float32)]

    def call():
      box[0] = f(box[0])
      box[0].block_until_ready()

  call()
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    call()
    best = min(best, time.perf_counter() - t0)
  return 2 * num_bytes / best


def hlo_table_copies(
  jitted: Callable[..., Any], shape: Sequence[int], *args: Any
) -> int:
  """``copy`` instructions producing a value of ``shape`` in the compiled
  ``jitted(*args)`` (a table-sized copy defeats an in-place update)."""
  text = jitted.lower(*args).compile().as_text()
  dims = ",".join(str(d) for d in shape)
  return sum(
    1
    for line in text.splitlines()
    if f"[{dims}]" in line.split("=", 1)[-1].split("(")[0] and " copy(" in line
  )


# ----------------------------------------------------------------------------
# the whole step of one table, for side-by-side A/B runs


def table_step(gtx: Any, tx: Any) -> Callable[..., Any]:
  """The whole step users run on one ``[V, D]`` table: forward with the loss
  returned, sparse backward, ``tx``, apply; jitted, params and state
  donated. ``gtx`` is the gradtx module to run (A/B of two versions)."""
  import jax
  import jax.numpy as jnp

  def loss(p, ids):
    return jnp.sum(jnp.tanh(p["emb"][ids]) * 0.01)

  def step(p, s, ids):
    value, g = gtx.sparse_value_and_grad(loss)(p, ids)
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s, value

  return jax.jit(step, donate_argnums=(0, 1))


def table_runner(
  step: Callable[..., Any], tx: Any, table: Any, batches: Sequence[Any]
) -> Callable[[], None]:
  """A call of ``step`` on its own donated table and state, the next batch
  of fresh ids each time, waiting for the loss."""
  box = {"p": {"emb": table}, "k": 0}
  box["s"] = tx.init(box["p"])

  def run() -> None:
    box["k"] = (box["k"] + 1) % len(batches)
    box["p"], box["s"], v = step(box["p"], box["s"], batches[box["k"]])
    v.block_until_ready()

  return run


def uniform_batches(rng: Any, rows: int, ids: int, count: int = 8) -> list:
  """``count`` batches of ``ids`` uniform int32 ids in ``[0, rows)``."""
  import jax.numpy as jnp

  return [
    jnp.asarray(rng.randint(0, rows, ids), jnp.int32) for _ in range(count)
  ]


def ratio_rows(
  name: str, fns: dict[str, Callable[[], Any]], sched: Schedule
) -> list[list[str]]:
  """Times ``fns`` side by side (:func:`time_interleaved`); one row per
  variant: ``name``, the variant, ms per call, and its ratio to the first."""
  times = sched.time(fns, label=name)
  base = next(iter(times.values()))
  return [
    [name, variant, f"{t * 1e3:.2f}", f"{t / base:.3f}"]
    for variant, t in times.items()
  ]


# ----------------------------------------------------------------------------
# what a compiled program launches

# Opcodes that launch no kernel: values, views and bookkeeping.
_NO_KERNEL = {
  "parameter",
  "constant",
  "tuple",
  "get-tuple-element",
  "bitcast",
  "after-all",
  "partition-id",
  "replica-id",
}
_CONTROL = {"while", "conditional", "call"}


def _hlo_computations(text: str) -> tuple[str, dict[str, list[tuple]]]:
  """``(entry name, {computation: [(opcode, line)]})`` of HLO text."""
  comps: dict[str, list[tuple]] = {}
  entry, current = "", None
  for line in text.splitlines():
    head = re.match(r"(ENTRY )?%(\S+) .*\{$", line)
    if current is None and head:
      current = head.group(2)
      comps[current] = []
      if head.group(1):
        entry = current
      continue
    if line.strip() == "}":
      current = None
      continue
    m = re.match(r"\s*(?:ROOT )?%\S+ = (.*)$", line)
    if current is None or not m:
      continue
    rest = m.group(1)
    if rest.startswith("("):  # a tuple-shaped result: skip to its end
      depth, end = 0, 0
      while end == 0 or depth:
        depth += (rest[end] == "(") - (rest[end] == ")")
        end += 1
      rest = rest[end:].strip()
    else:
      rest = rest.split(" ", 1)[-1]
    comps[current].append((rest.split("(", 1)[0], line))
  return entry, comps


def hlo_op_counts(text: str) -> dict[str, int]:
  """Static op counts of a compiled program (``compiled.as_text()``): what
  it launches, not how often (a while body counts once).

  ``kernels`` counts the ops of the entry computation and of the bodies it
  runs through control flow (while, conditional, call), except values and
  views (parameters, constants, tuples, bitcasts) and the control-flow ops
  themselves: one launch each (a fusion is one kernel). ``while``,
  ``conditional``, ``sort`` and ``fusion`` count those ops; ``scatter`` and
  ``gather`` count them also inside fusions.
  """
  entry, comps = _hlo_computations(text)
  counts = dict.fromkeys(
    ["kernels", "while", "conditional", "sort", "scatter", "gather", "fusion"],
    0,
  )

  def fused(name: str) -> None:
    for op, line in comps.get(name, []):
      if op in ("scatter", "gather"):
        counts[op] += 1
      for sub in re.findall(r"calls=%([\w.\-]+)", line):
        fused(sub)

  def launch(name: str) -> None:
    for op, line in comps.get(name, []):
      if op in counts and op != "kernels":
        counts[op] += 1
      if op not in _NO_KERNEL and op not in _CONTROL:
        counts["kernels"] += 1
      if op == "fusion":
        for sub in re.findall(r"calls=%([\w.\-]+)", line):
          fused(sub)
      if op in _CONTROL:
        refs = re.findall(
          r"(?:condition|body|to_apply|true_computation|false_computation)"
          r"=%([\w.\-]+)",
          line,
        )
        branches = re.search(r"branch_computations=\{([^}]*)\}", line)
        if branches:
          refs += re.findall(r"%([\w.\-]+)", branches.group(1))
        for sub in refs:
          launch(sub)

  launch(entry)
  return counts


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip
COLLECTIVES = (
  "all-gather",
  "all-reduce",
  "reduce-scatter",
  "all-to-all",
  "collective-permute",
)


def hlo_collectives(
  text: str, ops: Sequence[str] = COLLECTIVES
) -> list[tuple[str, int]]:
  """``(op, result bytes)`` of every collective among ``ops`` in HLO text,
  per device."""
  pattern = re.compile(
    r"=\s*(\([^=]*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+"
    rf"({'|'.join(ops)})(?:-start)?\("
  )
  text = re.sub(r"/\*.*?\*/", "", text)  # comments such as /*index=5*/
  return [
    (
      m.group(2),
      sum(
        _DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
        for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
      ),
    )
    for m in pattern.finditer(text)
  ]


def compile_phases(jitted: Any, *args: Any) -> dict[str, Any]:
  """Wall and CPU (this process's) seconds to trace, lower and compile
  ``jitted`` on ``args`` (abstract values are fine), and the compiled
  program's op counts (:func:`hlo_op_counts`) and HLO lines."""
  wall, cpu = [time.perf_counter()], [time.process_time()]

  def mark() -> None:
    wall.append(time.perf_counter())
    cpu.append(time.process_time())

  traced = jitted.trace(*args)
  mark()
  lowered = traced.lower()
  mark()
  compiled = lowered.compile()
  mark()
  text = compiled.as_text()
  out: dict[str, Any] = {}
  for phase, k in (("trace", 1), ("lower", 2), ("compile", 3)):
    out[f"{phase}_s"] = wall[k] - wall[k - 1]
    out[f"{phase}_cpu_s"] = cpu[k] - cpu[k - 1]
  return {
    **out,
    "total_s": wall[3] - wall[0],
    "cpu_s": cpu[3] - cpu[0],
    "hlo_lines": text.count("\n"),
    **hlo_op_counts(text),
  }
