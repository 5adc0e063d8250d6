"""A cost model of the guides' steps on one GPU, read from the program
exported for cuda: a model, not a measurement.

Each step of :mod:`benchmarks.gpu_steps` is exported for ``cuda`` on this
host (no device) and its StableHLO read (:mod:`benchmarks.stablehlo`):
kernels, the bytes they move, host syncs and loop trips, as the table's
note says (:func:`report`), beside FBGEMM's published rates. Writes
``benchmarks/results/gpu_model.md``.

  python -m benchmarks.gpu_model [--platform cuda] [--out PATH] [--toy]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from benchmarks import gpu_steps
from benchmarks import stablehlo as sh
from benchmarks._common import version
from benchmarks._results import RESULTS, commit, markdown_table

HBM_BYTES_PER_S = 3.35e12  # H100 SXM, HBM3
LAUNCH_US = 5.0  # a kernel launch and its gap to the next kernel
SYNC_US = 10.0  # a device-to-host read of a loop's condition or case index
ASSUMED_TRIPS = 4  # a loop with no static bound (hash or placement rounds)
FBGEMM_BACKWARD_BYTES_PER_S = 1.04e12  # TorchRec's reported TBE backward
FBGEMM_SCATTER_BYTES_PER_S = 2.5e12  # FBGEMM's H100 scatter-add ceiling
LABEL = "a model, not a measurement"

KERNELS = set(
  "gather scatter sort reduce reduce_window dot_general dot convolution "
  "custom_call dynamic_slice dynamic_update_slice select_and_scatter "
  "rng_bit_generator fft all_reduce all_gather reduce_scatter all_to_all "
  "collective_permute cholesky triangular_solve".split()
)
FREE = {"constant", "optimization_barrier", "get_dimension_size", "return"}
CONTROL = {"while", "case", "if", "composite"}


@dataclasses.dataclass
class Kernel:
  """One kernel of the program, with how many times a step launches it."""

  op: str
  shapes: str
  read: float  # bytes a launch reads
  written: float  # bytes a launch writes
  launches: float  # per step (a loop's trips included)
  origin: str
  in_loop: bool  # launched by a while loop's trips

  @property
  def bytes(self) -> float:
    return (self.read + self.written) * self.launches

  @property
  def seconds(self) -> float:
    return self.launches * LAUNCH_US * 1e-6 + self.bytes / HBM_BYTES_PER_S


@dataclasses.dataclass
class Loop:
  origin: str
  trips: float
  why: str  # "constant", "worst case ...", "assumed"
  kernels: float  # kernel launches a trip


@dataclasses.dataclass
class Cost:
  """A program's predicted cost on one GPU (:data:`LABEL`)."""

  kernels: list[Kernel] = dataclasses.field(default_factory=list)
  syncs: float = 0.0
  loops: list[Loop] = dataclasses.field(default_factory=list)

  @property
  def launches(self) -> float:
    return sum(k.launches for k in self.kernels)

  @property
  def bytes(self) -> float:
    return sum(k.bytes for k in self.kernels)

  @property
  def launch_s(self) -> float:
    return self.launches * LAUNCH_US * 1e-6 + self.syncs * SYNC_US * 1e-6

  @property
  def seconds(self) -> float:
    return self.launch_s + self.bytes / HBM_BYTES_PER_S

  def loop_seconds(self) -> float:
    """The part of :attr:`seconds` spent in while loops."""
    kernels = sum(k.seconds for k in self.kernels if k.in_loop)
    return kernels + sum(lp.trips for lp in self.loops) * SYNC_US * 1e-6


def _kind(name: str) -> str:
  return name.split(".", 1)[1] if name.startswith("stablehlo.") else name


def _in(op: sh.Op) -> float:
  return sum(t.nbytes for t in op.operands)


def _out(op: sh.Op) -> float:
  return sum(t.nbytes for t in op.results)


class _Model:
  def __init__(self, prog: sh.Program) -> None:
    self.prog, self.cost, self.loop_depth = prog, Cost(), 0
    # (function, value) -> the op that defines it, the ops that read it
    self.defs = {(op.func, op.result): op for op in prog.ops if op.result}
    self.users: dict[tuple[str, str], list[sh.Op]] = {}
    for op in prog.ops:
      for u in op.uses:
        self.users.setdefault((op.func, u), []).append(op)

  def body(self, op: sh.Op, region: int | None = None) -> list[sh.Op]:
    return [
      self.prog.ops[c]
      for c in op.children
      if region is None or self.prog.ops[c].region == region
    ]

  def run(self, ops: list[sh.Op], times: float) -> None:
    for op in ops:
      self.op(op, times)

  def call(self, name: str | None, times: float) -> None:
    callee = self.prog.funcs.get(name or "")
    if callee is not None:
      self.run(self.body(self.prog.ops[callee]), times)

  def op(self, op: sh.Op, times: float) -> None:
    kind = _kind(op.name)
    if op.name == "func.call":
      self.call(op.callee, times)
    elif op.name.startswith("func.") or kind in FREE:
      return
    elif kind == "while":
      self.loop(op, times)
    elif kind in ("case", "if"):
      self.case(op, times)
    elif kind == "composite":
      text = op.head + op.tail
      if '"chlo.' in text:  # a scan the compiler implements
        self.add(op, "scan", _in(op), _out(op), times)
      else:
        m = re.search(r"decomposition = @([\w.\-$]+)", text)
        self.call(m.group(1) if m else None, times)
    elif kind in KERNELS:
      self.kernel(op, kind, times)
    elif self.ends_fusion(op):
      self.add(op, "fusion", _in(op), _out(op), times)

  def add(self, op, kind, read, written, times, launches=1.0) -> None:
    shapes = ", ".join(str(t) for t in op.operands[:3])
    origin, in_loop = self.prog.origin(op), self.loop_depth > 0
    k = Kernel(kind, shapes, read, written, times * launches, origin, in_loop)
    self.cost.kernels.append(k)

  def ends_fusion(self, op: sh.Op) -> bool:
    """An elementwise op whose value no kernel reads: returned by the
    step, carried by a loop, or read by a loop or a case as an operand.
    (A value a private function returns flows on to its caller's ops.)"""
    ops = self.prog.ops
    return any(
      (user.name == "func.return" and op.func == "main")
      or _kind(user.name) in ("while", "case")
      or (
        _kind(user.name) == "return"
        and user.parent is not None
        and _kind(ops[user.parent].name) == "while"
      )
      for user in self.users.get((op.func, op.result), [])
    )

  def kernel(self, op: sh.Op, kind: str, times: float) -> None:
    ins, read, out = op.operands, _in(op), _out(op)
    written = out
    if kind == "gather":  # its rows and indices read, its rows written
      read = out + ins[1].nbytes
    elif kind == "scatter":  # operands..., indices, updates...: in place
      n = len(ins) // 2
      written = sum(t.nbytes for t in ins[n + 1 :]) or ins[-1].nbytes
      read = written * 2 + ins[n].nbytes
      made = self.defs.get((op.func, op.uses[0])) if op.uses else None
      if made is not None and _kind(made.name) not in KERNELS | CONTROL:
        if made.name != "func.call":  # a value no kernel made: written first
          written += ins[0].nbytes
    elif kind == "dynamic_slice":
      read = out
    elif kind == "dynamic_update_slice":
      read = written = ins[1].nbytes
    elif kind == "sort":  # a radix sort: bits / 8 passes over every operand
      passes = math.ceil(sh.dtype_bytes(ins[0].dtype))
      read = written = read * passes
      self.add(op, "sort", read, written, times, passes)
      return
    self.add(op, kind, read, written, times)

  def case(self, op: sh.Op, times: float) -> None:
    branches = op.regions + 1
    index = self.constant(op, op.uses[0]) if op.uses else None
    if branches == 1 or index is not None:
      # XLA folds it: lax.platform_dependent lowers to such cases
      chosen = 0 if branches == 1 else min(max(index, 0), branches - 1)
      self.run(self.body(op, chosen), times)
      return
    outer, costs = self.cost, []
    for r in range(branches):  # the costliest branch
      self.cost = Cost()
      self.run(self.body(op, r), times)
      costs.append(self.cost)
    self.cost, best = outer, max(costs, key=lambda c: c.seconds)
    self.cost.syncs += times  # the branch index read back
    self.cost.kernels += best.kernels
    self.cost.syncs += best.syncs
    self.cost.loops += best.loops

  def loop(self, op: sh.Op, times: float) -> None:
    """Per trip its condition, its body and a host sync (XLA:GPU's
    ``WhileThunk`` reads the condition back)."""
    trips, why = self.trips(op)
    n, before = times * trips, self.cost.launches
    self.loop_depth += 1
    self.run(self.body(op, 0), n)  # the condition
    self.run(self.body(op, 1), n)
    self.loop_depth -= 1
    self.cost.syncs += n
    per_trip = (self.cost.launches - before) / max(n, 1e-9)
    self.cost.loops.append(Loop(self.prog.origin(op), n, why, per_trip))

  def trips(self, op: sh.Op) -> tuple[float, str]:
    """A constant bound, else the worst case where the body walks a buffer
    by dynamic slices (every id slot a unique row), else assumed."""
    head = op.head.split(") :")[0]
    inits = dict(re.findall(r"(%[\w.\-]+) = %([\w.\-]+)", head))
    for c in self.body(op, 0):
      m = re.search(r"compare\s+LT, %([\w.\-]+), %([\w.\-]+)", c.head)
      if m:
        start = self.constant(op, inits.get("%" + m.group(1), ""))
        stop = self.constant(op, m.group(2))
        if start is not None and stop is not None:
          return float(max(stop - start, 0)), "constant"
    for c in self.prog.region_ops(op):
      if _kind(c.name) == "dynamic_slice" and c.operands and c.results:
        whole, part = c.operands[0].shape, c.results[0].shape
        if whole and part and part[0] < whole[0]:
          n = math.ceil(whole[0] / part[0])
          return float(n), f"worst case: {whole[0]:,} slots / {part[0]:,}"
    return float(ASSUMED_TRIPS), "assumed"

  def constant(self, op: sh.Op, value: str) -> int | None:
    d = self.defs.get((op.func, value.lstrip("%")))
    m = re.search(r"dense<(-?\d+)>", d.head) if d else None
    return int(m.group(1)) if m and _kind(d.name) == "constant" else None


def model(prog: sh.Program) -> Cost:
  """The predicted cost of ``prog`` (its ``main``) on one GPU."""
  if "main" not in prog.funcs:
    raise ValueError("model: the program has no main function")
  m = _Model(prog)
  m.call("main", 1.0)
  return m.cost


def predict(program: Any, platform: str = "cuda") -> Cost:
  """The cost of a :class:`benchmarks.gpu_steps.Program`'s step."""
  return model(sh.read(sh.export_text(program.step, program.args, platform)))


def _ms(s: float) -> str:
  return f"{s * 1e3:.3f}"


HEADERS = (
  "step | kernels (static) | launches a step | host syncs | MB moved | model "
  "ms (3.35 TB/s + launches) | of which launches + syncs ms | of which "
  "while loops ms | same bytes at FBGEMM's 2.5 TB/s scatter ceiling ms | "
  "same bytes at FBGEMM's 1.04 TB/s TBE backward ms | while loops"
).split(" | ")


def summary_row(name: str, c: Cost) -> list[str]:
  loops = "; ".join(
    f"{lp.trips:g} trips ({lp.why}) x {lp.kernels:.0f} kernels"
    for lp in c.loops
  )
  return [
    name, f"{len(c.kernels)}", f"{c.launches:,.0f}", f"{c.syncs:,.0f}",
    f"{c.bytes / 1e6:,.1f}", _ms(c.seconds), _ms(c.launch_s),
    _ms(c.loop_seconds()), _ms(c.bytes / FBGEMM_SCATTER_BYTES_PER_S),
    _ms(c.bytes / FBGEMM_BACKWARD_BYTES_PER_S), loops or "none",
  ]  # fmt: skip


def report(costs: dict[str, Cost], platform: str, note: str = "") -> str:
  md = [
    f"## The guides' steps on one H100: {LABEL}",
    "",
    f"**{LABEL.capitalize()}.** Predicted from each step's program exported "
    f"for {platform} on a CPU host (`python -m benchmarks.gpu_model`), "
    "not run on any GPU. Kernels: every op that is not elementwise "
    "(gather, scatter, sort, reduce, dot, dynamic slice/update, custom "
    "call, scan); elementwise ops fuse into the kernel that reads them, or "
    "end a fusion of their own where no kernel reads them. Bytes from the "
    "shapes; one stream, so every kernel is on the critical path. Time = "
    f"launches x {LAUNCH_US:g} us + host syncs x {SYNC_US:g} us (a while "
    "loop's condition or a case's index read back each time) + bytes / "
    f"{HBM_BYTES_PER_S / 1e12:g} TB/s. A while loop's trips: its constant "
    "bound, or the worst case where its body walks a buffer by slices "
    f"(every id slot a unique row), else {ASSUMED_TRIPS} (assumed). "
    "FBGEMM's published figures, for scale: TBE backward about 1.04 TB/s "
    "(TorchRec, meta-pytorch/torchrec#4757, card not stated), scatter-add "
    "ceiling about 2.5 TB/s and gather 2.6 TB/s on an H100 "
    "(pytorch/FBGEMM#3993); TBE fp32 forward + backward, 32 tables of "
    "100k x 128, bags of 20, B=512: 515 us, 978 GB/s.",
    "",
    markdown_table(HEADERS, [summary_row(n, c) for n, c in costs.items()]),
  ]
  md += ["", note] if note else []
  for name, c in costs.items():
    top = sorted(c.kernels, key=lambda k: -k.seconds)[:8]
    rows = [
      [k.op, k.shapes, f"{k.launches:g}", f"{(k.read + k.written) / 1e6:.3f}"]
      + [f"{k.seconds * 1e3:.3f}", k.origin]
      for k in top
    ]
    heads = ["op", "operands", "launches", "MB a launch", "model ms", "from"]
    md += ["", f"### {name}: the costliest kernels ({LABEL})", ""]
    md += [markdown_table(heads, rows)]
  return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> str:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--platform", default="cuda")
  ap.add_argument("--out", type=Path, default=RESULTS / "gpu_model.md")
  ap.add_argument("--toy", action="store_true", help="toy sizes (dry runs)")
  args = ap.parse_args(argv)
  steps = gpu_steps.TOY if args.toy else gpu_steps.STEPS
  costs = {name: predict(make(), args.platform) for name, make in steps.items()}
  note = f"Exported with JAX {version('jax')}" + " (toy sizes)" * args.toy
  md = report(costs, args.platform, f"{note}; gradtx at {commit()}")
  print(md)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(md)
  return md


if __name__ == "__main__":
  main()
