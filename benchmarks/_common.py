"""The benchmark harness's shared pieces besides the timer (``_timing``) and
the writer (``_results``): the shared arguments (:func:`parser`,
:func:`parse`), a step's ids (:func:`make_ids`), torch's and FBGEMM's
plumbing, the one-table step of the A/B runs and gradtx's versions from git,
and the compiled-program readers. It imports jax only inside functions
(``benchmarks.probes fbgemm_anchor`` runs without jax).
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
  """``n`` fake CPU devices (a no-op once jax is imported)."""
  if "jax" not in sys.modules:
    os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "")
      + f" --xla_force_host_platform_device_count={n}"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def parser(
  doc: str | None,
  *,
  schedule: Schedule | None = None,
  rounds: int | None = None,
  steps: int | None = None,
  huge_pages: bool = False,
  fresh_memory: bool = False,
) -> argparse.ArgumentParser:
  """A parser with ``--quick`` and the shared flags asked for: ``schedule``
  (``--rounds``, ``--burst``, ``--settle``, its values the defaults) or
  ``rounds``, ``steps``, ``--huge-pages``, ``--fresh-memory``."""
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
    rounds = schedule.rounds
  if rounds is not None:
    p.add_argument("--rounds", type=int, default=rounds)
  if schedule is not None:
    p.add_argument(
      "--burst",
      type=int,
      default=schedule.burst,
      help="timed consecutive steps per system per round (1: strict "
      "round-robin)",
    )
    p.add_argument(
      "--settle",
      type=int,
      default=schedule.settle,
      help="untimed steps of a system before its timed ones, each round (0: "
      "time the steps right after another system's turn too)",
    )
  if steps is not None:
    p.add_argument("--steps", type=int, default=steps)
  if huge_pages:
    p.add_argument(
      "--huge-pages",
      action="store_true",
      help="back every system's tables and state by huge pages "
      "(gtx.use_huge_pages, the same madvise for torch; default: the OS's "
      "4 KiB pages, as a user's step runs)",
    )
  if fresh_memory:
    p.add_argument(
      "--fresh-memory",
      action="store_true",
      help="give malloc glibc's behaviour back (gtx.reuse_host_memory(False);"
      " default: gradtx's, for every system of the process: each step's "
      "temporaries reuse freed pages)",
    )
  return p


def parse(p, argv=None, *, quick=None) -> argparse.Namespace:
  """``p``'s arguments: ``--quick`` sets the suffix ``_quick`` and those in
  ``quick`` left at their defaults; ``--fresh-memory`` calls
  ``gtx.reuse_host_memory(False)``."""
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


def add_memory_arg(p: argparse.ArgumentParser, cpu_gib: float) -> None:
  """``--mem-gib`` (read by :func:`memory_budget`)."""
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


# --quick's sizes of a one-table step (--rows, --ids, the Schedule)
QUICK_TABLE = dict(rows=20_000, ids=512, rounds=2, burst=2, settle=1)


def add_head_args(p: argparse.ArgumentParser, optimizers: Any) -> None:
  """``--heads`` and ``--mlp-optimizers`` (the recommenders')."""
  p.add_argument("--heads", nargs="+", default=["linear", "mlp"])
  p.add_argument(
    "--mlp-optimizers",
    nargs="+",
    default=["lazy_adam", "rowwise_adagrad"],
    choices=optimizers,
    help="the optimizers that also run with the mlp head",
  )


ZIPF_S = 1.05


def make_ids(rows: int, n: int, steps: int, dist: str, seed: int = 0) -> list:
  """``steps`` fresh int32 id vectors of length ``n`` (uniform or Zipf)."""
  import numpy as np

  rng = np.random.default_rng(seed)
  if dist == "uniform":
    return [rng.integers(0, rows, n).astype(np.int32) for _ in range(steps)]
  # P(rank k) ~ k^-s, the ranks on a fixed permutation of the rows
  cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -ZIPF_S)
  cdf /= cdf[-1]
  perm = rng.permutation(rows).astype(np.int32)
  out = []
  for _ in range(steps):
    rank = np.searchsorted(cdf, rng.random(n), side="right")
    out.append(perm[np.minimum(rank, rows - 1)])
  return out


def available(module: str) -> bool:
  try:
    __import__(module)
  except ImportError:
    return False
  return True


def version(module: str) -> str:
  return __import__(module).__version__


def import_torch(threads: int = 2) -> Any:
  """torch with ``threads`` intra-op threads, or None."""
  if not available("torch"):
    return None
  import torch

  torch.set_num_threads(threads)
  return torch


def with_threads(n: int, run: Callable[..., Any]) -> Callable[..., Any]:
  """``run`` with torch's intra-op threads set to ``n`` for each call."""
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
  """Under ``--huge-pages``, torch's tensors on huge pages too."""
  if not _timing.RUN.huge_pages:
    return
  from gradtx._memory import _advise, _madvise

  madvise = _madvise()
  for t in tensors:
    nbytes = t.numel() * t.element_size()
    if madvise is not None and t.device.type == "cpu" and nbytes >= 4 << 20:
      _advise(t.data_ptr(), nbytes, madvise, collapse=True)


def torch_state(opts: Sequence[Any]) -> list[Any]:
  """The tensors of torch optimizers' state."""
  import torch

  return [
    t
    for o in opts
    for st in o.state.values()
    for t in st.values()
    if torch.is_tensor(t)
  ]


def fbgemm() -> bool:
  """Whether ``fbgemm_gpu`` (with torch) imports."""
  return available("torch") and available("fbgemm_gpu")


def tbe(rows, dim, optim, pooling, lr, device="cpu"):
  """FBGEMM's table-batched module on ``device``: one table, or one per
  entry of ``rows``."""
  from fbgemm_gpu import split_embedding_configs as configs
  from fbgemm_gpu import split_table_batched_embeddings_ops_common as common
  from fbgemm_gpu import split_table_batched_embeddings_ops_training as train

  tables = rows if isinstance(rows, list) else [rows]
  where = common.EmbeddingLocation.HOST, train.ComputeDevice.CPU
  if str(device) != "cpu":
    where = common.EmbeddingLocation.DEVICE, train.ComputeDevice.CUDA
  return train.SplitTableBatchedEmbeddingBagsCodegen(
    [(r, dim, *where) for r in tables],
    optimizer=getattr(configs.EmbOptimType, optim),
    pooling_mode=getattr(common.PoolingMode, pooling),
    learning_rate=lr,
  ).to(device)


def tbe_step(rows, dim, optim, pooling, lr, ids, ct):
  """FBGEMM's fused step on ``[rows, dim]``, bags of one id, the loss
  ``sum(tanh(E[ids]) * ct)``: ``(run(i), state bytes per row, module)``."""
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
  kinds = "argument", "output", "temp", "alias"
  return {k: int(getattr(m, f"{k}_size_in_bytes")) for k in kinds}


def hlo_table_copies(jitted, shape: Sequence[int], *args: Any) -> int:
  """``copy`` instructions of a ``shape`` value in compiled ``jitted``."""
  text = jitted.lower(*args).compile().as_text()
  dims = ",".join(str(d) for d in shape)
  return sum(
    1
    for line in text.splitlines()
    if f"[{dims}]" in line.split("=", 1)[-1].split("(")[0] and " copy(" in line
  )


def table_step(gtx: Any, tx: Any) -> Callable[..., Any]:
  """One table's whole step on ``gtx`` (a version of gradtx), jitted,
  params and state donated, the loss returned."""
  import jax
  import jax.numpy as jnp

  def loss(p, ids):
    return jnp.sum(jnp.tanh(p["emb"][ids]) * 0.01)

  def step(p, s, ids):
    value, g = gtx.sparse_value_and_grad(loss)(p, ids)
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s, value

  return jax.jit(step, donate_argnums=(0, 1))


def table_variants(doc, argv, name, title, headers, cases) -> None:
  """One table's step in variants: ``cases`` maps an optimizer to makers
  of ``(tx, jitted step)``, alternated; a row each (ms, ratio to the
  first), ``title`` formatted with ``rows``, ``dim`` and ``ids``."""
  import jax.numpy as jnp
  import numpy as np

  from benchmarks._results import write_results

  p = parser(doc, schedule=Schedule())
  p.add_argument("--rows", type=int, default=1_000_000)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--ids", type=int, default=8192)
  args = parse(p, argv, quick=QUICK_TABLE)
  sched = Schedule.from_args(args)
  rng = np.random.RandomState(0)
  batches = [
    jnp.asarray(rng.randint(0, args.rows, args.ids), jnp.int32)
    for _ in range(8)
  ]

  def runner(tx, step):
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


ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_version(rev: str, name: str = "gradtx_before") -> Any:
  """``gradtx`` as of ``rev``, imported as ``name`` in this process."""
  sys.path.insert(0, _write_version(rev, name))
  return importlib.import_module(name)


def export_version(rev: str) -> str:
  """A folder holding ``gradtx`` as of ``rev`` (or ``rev``, a checkout)."""
  if (pathlib.Path(rev) / "gradtx" / "__init__.py").exists():
    return str(pathlib.Path(rev).resolve())
  return _write_version(rev, "gradtx")


def _write_version(rev: str, name: str) -> str:
  def git(*args: str) -> str:
    return subprocess.run(
      ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout

  out = pathlib.Path(tempfile.mkdtemp()) / name
  out.mkdir()
  for n in git("ls-tree", "--name-only", rev, "gradtx/").split():
    if n.endswith(".py"):
      text = re.sub(r"\bgradtx\b(?=[._ ])", name, git("show", f"{rev}:{n}"))
      (out / pathlib.PurePath(n).name).write_text(text)
  return str(out.parent)


# Opcodes that launch no kernel: values, views, bookkeeping, control flow.
_NO_KERNEL = set(
  "parameter constant tuple get-tuple-element bitcast after-all "
  "partition-id replica-id while conditional call".split()
)
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
  """Static op counts of compiled HLO text (a while body counts once):
  ``kernels``, the launching ops of the entry and the bodies it runs
  (a fusion one); ``while``, ``conditional``, ``sort``, ``fusion``;
  ``scatter`` and ``gather`` also inside fusions."""
  entry, comps = _hlo_computations(text)
  ops = "kernels while conditional sort scatter gather fusion"
  counts = dict.fromkeys(ops.split(), 0)

  def walk(name: str, fused: bool) -> None:
    for op, line in comps.get(name, []):
      if op in counts and (not fused or op in ("scatter", "gather")):
        counts[op] += 1
      if not fused and op not in _NO_KERNEL:
        counts["kernels"] += 1
      if fused or op == "fusion":
        for sub in re.findall(r"calls=%([\w.\-]+)", line):
          walk(sub, True)
      elif op in _CONTROL:
        refs = re.findall(
          r"(?:condition|body|to_apply|true_computation|false_computation)"
          r"=%([\w.\-]+)",
          line,
        )
        branches = re.search(r"branch_computations=\{([^}]*)\}", line)
        if branches:
          refs += re.findall(r"%([\w.\-]+)", branches.group(1))
        for sub in refs:
          walk(sub, False)

  walk(entry, False)
  return counts


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip
COLLECTIVES = tuple(
  "all-gather all-reduce reduce-scatter all-to-all collective-permute".split()
)


def hlo_collectives(text: str, ops=COLLECTIVES) -> list[tuple[str, int]]:
  """``(op, result bytes per device)`` of each collective among ``ops``."""
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
  """Wall and CPU seconds to trace, lower and compile ``jitted`` on
  ``args`` (abstract values are fine), its op counts and HLO lines."""
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
  return {**out, "hlo_lines": text.count("\n"), **hlo_op_counts(text)}
