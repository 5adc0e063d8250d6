"""The benchmark harness's shared pieces besides the timer (``_timing``)
and the writer (``_results``): the arguments every benchmark shares
(:func:`parser` / :func:`parse`: ``--quick``, ``--rounds`` or the
:class:`~benchmarks._timing.Schedule`, ``--steps``, ``--huge-pages``,
``--fresh-memory``, ``--mem-gib``), the ids of a step (:func:`make_ids`),
the competitors' plumbing (:func:`import_torch` with its threads set,
:func:`torch_huge_pages`, :func:`fbgemm`, :func:`tbe` and
:func:`tbe_step`), the one-table step of the A/B runs and the versions of
gradtx they load from git (:func:`load_version`, :func:`export_version`),
and the compiled-program readers (:func:`hlo_op_counts`,
:func:`compile_phases`). It imports jax only inside functions:
``benchmarks.fbgemm_anchor`` runs where jax is not installed.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks import _timing
from benchmarks._results import SUFFIX_ENV
from benchmarks._timing import Clock, Schedule, load_note


def fake_cpu_devices(n: int) -> None:
  """``n`` fake CPU devices for the benchmarks of several devices: call it
  before anything imports jax (a no-op after)."""
  if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={n}"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


# ----------------------------------------------------------------------------
# one run: the arguments every benchmark shares


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
  _timing.RUN.quick = args.quick
  if args.quick:
    os.environ.setdefault(SUFFIX_ENV, "_quick")
    for k, v in (quick or {}).items():
      if getattr(args, k) == p.get_default(k):
        setattr(args, k, v)
  if hasattr(args, "huge_pages"):
    _timing.RUN.huge_pages = args.huge_pages
  if hasattr(args, "fresh_memory"):
    _timing.RUN.memory_reused = True
    if args.fresh_memory:
      import gradtx

      _timing.RUN.memory_reused = not gradtx.reuse_host_memory(False)
  _timing.RUN.load_start = load_note()
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


def add_memory_arg(p: argparse.ArgumentParser, cpu_gib: float) -> None:
  """``--mem-gib``: what the systems may hold at once (read it with
  :func:`memory_budget`)."""
  p.add_argument(
    "--mem-gib",
    type=float,
    default=None,
    help=f"memory the systems may hold at once (default {cpu_gib:g} GiB on "
    "CPU, half the device memory on accelerators)",
  )
  p.set_defaults(cpu_gib=cpu_gib)


def memory_budget(args: argparse.Namespace) -> float:
  """Bytes of :func:`add_memory_arg`'s ``--mem-gib``."""
  if args.mem_gib is not None:
    return args.mem_gib * 2**30
  import jax

  dev = jax.devices()[0]
  stats = dev.memory_stats() if dev.platform != "cpu" else None
  limit = (stats or {}).get("bytes_limit")
  return 0.5 * limit if limit else args.cpu_gib * 2**30


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
  if _timing.RUN.huge_pages:
    import gradtx

    gradtx.use_huge_pages(tree)


def torch_huge_pages(tensors: Sequence[Any]) -> None:
  """Under ``--huge-pages``, torch's tables and state on huge pages too, as
  ``gtx.use_huge_pages`` does for JAX's arrays."""
  if not _timing.RUN.huge_pages:
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


def tbe(
  rows: int | list[int],
  dim: int,
  optim: str,
  pooling: str,
  lr: float,
  device: str = "cpu",
):
  """FBGEMM's table-batched module on the host (``device`` "cpu") or on
  the GPU: one table of ``rows`` rows, or one table per entry of a list
  (every table ``dim`` wide)."""
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
  where = (EmbeddingLocation.HOST, ComputeDevice.CPU)
  if str(device) != "cpu":
    where = (EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
  return SplitTableBatchedEmbeddingBagsCodegen(
    [(r, dim, *where) for r in tables],
    optimizer=getattr(EmbOptimType, optim),
    pooling_mode=getattr(PoolingMode, pooling),
    learning_rate=lr,
  ).to(device)


def tbe_step(rows, dim, optim, pooling, lr, ids, ct):
  """FBGEMM's fused training step on ``[rows, dim]``: ``run(i)`` reads
  ``ids[i % len(ids)]`` (int64 tensors) as bags of one id, returns the loss
  ``sum(tanh(E[ids]) * ct)`` as a float after the backward, which runs the
  optimizer fused. Also the optimizer state's bytes per row and the
  module."""
  import torch

  module = tbe(rows, dim, optim, pooling, lr)
  n = ct.shape[0]
  offsets = torch.arange(n + 1, dtype=torch.int64)

  def run(i):
    out = module(ids[i % len(ids)], offsets)
    loss = (torch.tanh(out.view(n, dim)) * ct).sum()
    loss.backward()  # the optimizer runs fused in the backward
    return loss.item()

  states = [t for table in module.split_optimizer_states() for t in table]
  per_row = sum(t.numel() * t.element_size() for t in states) / rows
  return run, per_row, module


def memory(compiled: Any) -> dict[str, int]:
  """Bytes from ``compiled.memory_analysis()``."""
  m = compiled.memory_analysis()
  return {
    "argument": int(m.argument_size_in_bytes),
    "output": int(m.output_size_in_bytes),
    "temp": int(m.temp_size_in_bytes),
    "alias": int(m.alias_size_in_bytes),
  }


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


def table_variants(
  doc: str | None,
  argv: Sequence[str] | None,
  name: str,
  title: str,
  headers: Sequence[str],
  cases: dict[str, dict[str, Callable[[], tuple[Any, Any]]]],
) -> None:
  """A benchmark of one table's whole step in variants, side by side.

  ``cases`` maps an optimizer to its variants, each a call that makes
  ``(tx, jitted step)`` (a step of :func:`table_step`'s form). Every
  variant runs on its own ``[--rows, --dim]`` table and donated state, the
  next of 8 batches of ``--ids`` uniform ids each call, all of an
  optimizer's variants alternated on the :class:`Schedule`. One row per
  variant: the optimizer, the variant, ms per step and the ratio to its
  optimizer's first variant; written as ``results/<name>``, ``title``
  formatted with ``rows``, ``dim`` and ``ids``."""
  import jax.numpy as jnp
  import numpy as np

  from benchmarks._results import write_results

  p = parser(doc, schedule=Schedule())
  add_table_args(p)
  args = parse(p, argv, quick=QUICK_TABLE)
  sched = Schedule.from_args(args)
  rng = np.random.RandomState(0)
  batches = [
    jnp.asarray(rng.randint(0, args.rows, args.ids), jnp.int32)
    for _ in range(8)
  ]

  def runner(tx: Any, step: Any) -> Callable[[], None]:
    table = jnp.asarray(rng.normal(size=(args.rows, args.dim)), jnp.float32)
    box = [{"emb": table}, None]
    box[1] = tx.init(box[0])
    run = _timing.step_runner(step, box, lambda k: (batches[k % 8],))
    return _timing.Counter(run)

  rows = []
  for opt, variants in cases.items():
    fns = {variant: runner(*make()) for variant, make in variants.items()}
    times = sched.time(fns, label=opt)
    base = next(iter(times.values()))
    rows += [
      [opt, variant, f"{t * 1e3:.2f}", f"{t / base:.3f}"]
      for variant, t in times.items()
    ]
  write_results(
    name,
    title.format(rows=args.rows, dim=args.dim, ids=args.ids),
    headers,
    rows,
    notes=sched.describe() + "; both variants in one process.",
  )


# ----------------------------------------------------------------------------
# versions of gradtx from git, for the A/B runs

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_version(rev: str, name: str = "gradtx_before") -> Any:
  """``gradtx`` as of ``rev``, imported as ``name`` in this process."""
  out = pathlib.Path(tempfile.mkdtemp()) / name
  out.mkdir()
  for path, text in _version_files(rev):
    text = re.sub(r"\bgradtx\b(?=[._ ])", out.name, text)
    (out / path.name).write_text(text)
  sys.path.insert(0, str(out.parent))
  return importlib.import_module(out.name)


def export_version(rev: str) -> str:
  """A folder holding ``gradtx`` as of ``rev``, for a process to import;
  ``rev`` may be such a folder itself (another checkout)."""
  if (pathlib.Path(rev) / "gradtx" / "__init__.py").exists():
    return str(pathlib.Path(rev).resolve())
  out = pathlib.Path(tempfile.mkdtemp()) / "gradtx"
  out.mkdir()
  for path, text in _version_files(rev):
    (out / path.name).write_text(text)
  return str(out.parent)


def _version_files(rev: str) -> list[tuple[pathlib.PurePath, str]]:
  def git(*args: str) -> str:
    return subprocess.run(
      ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout

  names = git("ls-tree", "--name-only", rev, "gradtx/").split()
  return [
    (pathlib.PurePath(n), git("show", f"{rev}:{n}"))
    for n in names
    if n.endswith(".py")
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
  out: dict[str, Any] = {}
  total, program = Clock(), jitted
  for phase, call in (
    ("trace", lambda f: f.trace(*args)),
    ("lower", lambda traced: traced.lower()),
    ("compile", lambda lowered: lowered.compile()),
  ):
    clock = Clock()
    program = call(program)
    out[f"{phase}_s"], out[f"{phase}_cpu_s"] = clock.wall(), clock.cpu()
  out.update(total_s=total.wall(), cpu_s=total.cpu())
  text = program.as_text()
  return {
    **out,
    "hlo_lines": text.count("\n"),
    **hlo_op_counts(text),
  }
