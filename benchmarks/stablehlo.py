"""Reading an exported program's StableHLO text, with no device.

``jax.export.export(jitted, platforms=[p])(*abstract_args)`` lowers a step
for ``p`` ("cuda", "rocm", "tpu", "cpu") on any host;
``exported.mlir_module()`` is its StableHLO text, locations included.
:func:`read` parses that text into :class:`Op` records (name, operand and
result types, the region they sit in, the named scopes and source frames
of their location), enough for the properties tests assert
(:meth:`Program.whiles`, :meth:`Program.float_scatter_adds`,
:meth:`Program.op_count`, :func:`strip_locations`) and for the cost model
of :mod:`benchmarks.gpu_model`.

The parser reads the text MLIR prints (generic ``"stablehlo.x"(...)`` and
pretty ``stablehlo.x ...`` forms, one op a line, regions between braces);
it is a reader of this one printer, not an MLIR parser.
"""

from __future__ import annotations

import dataclasses
import math
import re
from functools import cached_property
from typing import Any

# The named scope of the id map's placement rounds (``gradtx._placement``),
# the one while loop an accelerator step may keep.
PLACEMENT_SCOPE = "gtx_id_map_placement"

_OP = re.compile(
  r"^\s*(?:(%[\w.\-]+)(?::(\d+))?(?:\s*,\s*%[\w.\-]+(?::\d+)?)*\s*=\s*)?"
  r"\"?([a-z_]+\.[a-z_0-9.]+|call|return)\b\"?"
)
_SHORT = {"call": "func.call", "return": "func.return"}
_REF = re.compile(r"%([\w.\-]+)(?:#\d+)?")
_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$")
_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]+\d*)>")
_DTYPE_BITS = {"i1": 8, "pred": 8}  # a bool is a byte in memory
FLOATS = ("f", "bf")  # f16, f32, f64, f8E4M3..., bf16


def dtype_bytes(dtype: str) -> float:
  """Bytes of one element of an MLIR element type (``f32``, ``ui8``...)."""
  if dtype in _DTYPE_BITS:
    return _DTYPE_BITS[dtype] / 8
  m = re.search(r"(\d+)", dtype)
  return int(m.group(1)) / 8 if m else 4.0


@dataclasses.dataclass(frozen=True)
class Tensor:
  """A ranked tensor type: its shape and element type."""

  shape: tuple[int, ...]
  dtype: str

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def nbytes(self) -> float:
    return self.size * dtype_bytes(self.dtype)

  @property
  def is_float(self) -> bool:
    return self.dtype.startswith(FLOATS)

  def __str__(self) -> str:
    return "x".join([*map(str, self.shape), self.dtype])


def tensors(text: str) -> list[Tensor]:
  """The tensor types written in ``text``, in order."""
  return [
    Tensor(tuple(int(d) for d in dims.split("x") if d), dt)
    for dims, dt in _TENSOR.findall(text)
  ]


@dataclasses.dataclass
class Op:
  """One operation of the program text."""

  index: int
  name: str  # "stablehlo.scatter", "func.call", ...
  head: str  # its first line
  tail: str = ""  # its last line (the same for a one-line op)
  parent: int | None = None  # the op whose region holds it
  func: str = ""  # the function it is in
  children: list[int] = dataclasses.field(default_factory=list)
  loc: str = ""  # the location reference or literal of its last line
  region: int = 0  # which region of its parent holds it (while: 0 cond)
  result: str = ""  # its (first) SSA result name, without "%"
  regions: int = 0  # how many regions it has

  @cached_property
  def uses(self) -> list[str]:
    """The SSA values it reads (names without ``%``): its operands, not
    the values its regions read."""
    body = self.head.split(" = ", 1)[1] if self.result else self.head
    if self.name == "stablehlo.while":  # "%iterArg = %137": the inits
      return re.findall(r"= %([\w.\-]+)", body)
    ends = [body.find(t) for t in (" : ", " <{", " ({", " loc(")]
    cut = min([e for e in ends if e >= 0], default=len(body))
    return _REF.findall(body[:cut])

  @cached_property
  def signature(self) -> str:
    """The types after the op's `` : `` (operands ``->`` results)."""
    if self.name == "stablehlo.while":  # types written once, on its head
      m = re.search(r"\) : (.*?)(?: loc\(|$)", self.head)
      return m.group(1) if m else ""
    line = self.tail
    cut = line.rfind(" loc(")
    if cut >= 0:
      line = line[:cut]
    at = line.rfind(" : ")
    return line[at + 3 :] if at >= 0 else ""

  @cached_property
  def operands(self) -> list[Tensor]:
    return tensors(self.signature.split("->", 1)[0])

  @cached_property
  def results(self) -> list[Tensor]:
    sig = self.signature
    if "->" in sig:
      return tensors(sig.split("->", 1)[1])
    ts = tensors(sig)
    return ts if self.name == "stablehlo.while" else ts[-1:]

  @property
  def callee(self) -> str | None:
    m = re.search(r"(?:func\.)?call @([\w.\-$]+)", self.head)
    return m.group(1) if m else None

  def attribute(self, name: str) -> bool:
    """A boolean attribute of the op (absent: false)."""
    return re.search(rf"\b{name} = true\b", self.head) is not None


@dataclasses.dataclass
class Program:
  """A parsed program: its ops in text order and its locations."""

  text: str
  ops: list[Op]
  locs: dict[str, str]
  funcs: dict[str, int]  # function name -> index of its func.func op

  # -- locations

  def _resolve(self, ref: str, seen: set[str]) -> tuple[list, list]:
    names: list[str] = []
    frames: list[str] = []
    body = self.locs.get(ref, ref) if ref.startswith("#loc") else ref
    for s in re.findall(r'"((?:[^"\\]|\\.)*)"(?::(\d+))?', body):
      text, line = s
      (frames if line else names).append(f"{text}:{line}" if line else text)
    for r in re.findall(r"#loc\d*", body):
      if r not in seen:
        seen.add(r)
        n, f = self._resolve(r, seen)
        names += n
        frames += f
    return names, frames

  def where(self, op: Op) -> tuple[list[str], list[str]]:
    """``(names, frames)`` of ``op``'s location: the name-stack paths and
    names it carries (``"jit(step)/gtx_dedup/while"``) and its source
    frames (``"/path/gradtx/_rows.py:120"``), innermost first."""
    return self._resolve(op.loc, set())

  def scope(self, op: Op) -> str:
    """The name-stack path of ``op`` (its named scopes), or ``""``."""
    names, _ = self.where(op)
    paths = [n for n in names if "/" in n]
    return paths[0] if paths else (names[0] if names else "")

  def origin(self, op: Op, package: str = "gradtx") -> str:
    """``scope`` and the innermost source frame in ``package``."""
    _, frames = self.where(op)
    mine = [f for f in frames if f"/{package}/" in f]
    frame = mine[0].split(f"/{package}/", 1)[1] if mine else "?"
    return f"{self.scope(op)} ({package}/{frame})"

  # -- what the properties read

  def by_name(self, name: str) -> list[Op]:
    return [o for o in self.ops if o.name == name]

  def region_ops(self, op: Op) -> list[Op]:
    """Every op inside ``op``'s regions, nested ones included."""
    out = []
    for c in op.children:
      out.append(self.ops[c])
      out += self.region_ops(self.ops[c])
    return out

  def whiles(self) -> list[Op]:
    return self.by_name("stablehlo.while")

  def is_placement(self, op: Op) -> bool:
    """Whether ``op`` is (or is inside) the id map's placement loop."""
    return PLACEMENT_SCOPE in self.scope(op)

  def float_scatter_adds(self) -> list[Op]:
    """Every scatter whose update computation adds floats."""
    out = []
    for op in self.by_name("stablehlo.scatter"):
      body = [o.name for o in self.region_ops(op)]
      floats = any(t.is_float for t in op.results)
      if "stablehlo.add" in body and floats:
        out.append(op)
    return out

  def op_count(self) -> int:
    """StableHLO ops in the text (terminators not counted; a function's
    ops once, however many calls)."""
    return sum(
      o.name.startswith("stablehlo.") and o.name != "stablehlo.return"
      for o in self.ops
    )


def read(text: str) -> Program:
  """Parses StableHLO text (``exported.mlir_module()``)."""
  ops: list[Op] = []
  locs: dict[str, str] = {}
  funcs: dict[str, int] = {}
  open_: list[tuple[int, int]] = []  # (op index, depth at its start)
  depth = 0
  func = ""
  for line in text.splitlines():
    m = _LOC_DEF.match(line)
    if m:
      locs[m.group(1)] = m.group(2)
      continue
    start = None
    om = _OP.match(line)
    stripped = line.lstrip()
    if stripped.startswith("}") and stripped.rstrip().endswith("{") and open_:
      ops[open_[-1][0]].regions += 1  # "} do {", "}, {": the next region
    if om and not stripped.startswith(("}", "^")):
      op = Op(len(ops), _SHORT.get(om.group(3), om.group(3)), line)
      op.result = (om.group(1) or "").lstrip("%")
      if open_:
        op.parent = open_[-1][0]
        op.region = ops[op.parent].regions
        ops[op.parent].children.append(op.index)
      if op.name == "func.func":
        fm = re.search(r"@([\w.\-$]+)", line)
        func = fm.group(1) if fm else ""
        funcs[func] = op.index
      op.func = func
      ops.append(op)
      start = (op.index, depth)
    depth += _braces(line)
    if start is not None:
      # a pretty-printed while opens its regions on the next line
      pretty_while = ops[start[0]].name == "stablehlo.while"
      if depth == start[1] and not pretty_while:
        _close(ops[start[0]], line)
      else:
        open_.append(start)
    elif open_ and line.lstrip().startswith("}") and depth == open_[-1][1]:
      _close(ops[open_.pop()[0]], line)
  return Program(text, ops, locs, funcs)


def _braces(line: str) -> int:
  # strings (locations' names) may hold braces: not counted
  line = re.sub(r'"(?:[^"\\]|\\.)*"', '""', line)
  return line.count("{") - line.count("}")


def _close(op: Op, line: str) -> None:
  op.tail = line
  m = re.search(r" loc\((.*)\)\s*$", line)
  op.loc = m.group(1) if m else ""


def strip_locations(text: str) -> str:
  """``text`` without its locations (``loc(...)`` and ``#loc`` lines): two
  programs traced from different lines or names compare equal."""
  lines = [x for x in text.splitlines() if not x.startswith("#loc")]
  out = []
  for line in lines:
    while True:
      at = line.find(" loc(")
      if at < 0:
        break
      depth, end = 0, at + 4
      for end in range(at + 4, len(line)):
        depth += (line[end] == "(") - (line[end] == ")")
        if depth == 0:
          break
      line = line[:at] + line[end + 1 :]
    out.append(line)
  return "\n".join(out)


def export_text(jitted: Any, args: tuple, platform: str) -> str:
  """The StableHLO text of ``jitted(*args)`` exported for ``platform``."""
  from jax import export

  return export.export(jitted, platforms=[platform])(*args).mlir_module()
