"""Reading an exported program's StableHLO text, with no device.

:func:`export_text` lowers a step for a platform on any host; :func:`read`
parses the text MLIR prints (generic and pretty forms, one op a line,
regions between braces) into :class:`Op` records, enough for the properties
the tests assert and for :mod:`benchmarks.gpu_model`. It reads this one
printer; it is not an MLIR parser.
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
_STRING = r'"((?:[^"\\]|\\.)*)"'


def dtype_bytes(dtype: str) -> float:
  """Bytes of one element of an MLIR element type (a bool is a byte)."""
  if dtype in ("i1", "pred"):
    return 1.0
  m = re.search(r"(\d+)", dtype)
  return int(m.group(1)) / 8 if m else 4.0


@dataclasses.dataclass(frozen=True)
class Tensor:
  """A ranked tensor type: its shape and element type."""

  shape: tuple[int, ...]
  dtype: str

  @property
  def nbytes(self) -> float:
    return math.prod(self.shape) * dtype_bytes(self.dtype)

  @property
  def is_float(self) -> bool:
    return self.dtype.startswith(("f", "bf"))  # f16, f32, f8E4M3.., bf16

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
    """The SSA values it reads (without ``%``), not its regions'."""
    body = self.head.split(" = ", 1)[1] if self.result else self.head
    if self.name == "stablehlo.while":  # "%iterArg = %137": the inits
      return re.findall(r"= %([\w.\-]+)", body)
    return _REF.findall(re.split(r" : | <\{| \(\{| loc\(", body, maxsplit=1)[0])

  @cached_property
  def types(self) -> tuple[list[Tensor], list[Tensor]]:
    """Its operands' and results' types, read after its `` : ``."""
    if self.name == "stablehlo.while":  # written once, on its head
      m = re.search(r"\) : (.*?)(?: loc\(|$)", self.head)
      sig = m.group(1) if m else ""
    else:
      _, sep, sig = self.tail.rsplit(" loc(", 1)[0].rpartition(" : ")
      sig = sig if sep else ""
    ins, arrow, outs = sig.partition("->")
    if arrow:
      return tensors(ins), tensors(outs)
    ts = tensors(ins)
    return ts, ts if self.name == "stablehlo.while" else ts[-1:]

  @property
  def operands(self) -> list[Tensor]:
    return self.types[0]

  @property
  def results(self) -> list[Tensor]:
    return self.types[1]

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

  def where(self, op: Op) -> tuple[list[str], list[str]]:
    """``(names, frames)`` of ``op``'s location: its name-stack paths and
    names (``"jit(step)/gtx_dedup/while"``) and its source frames
    (``"/path/gradtx/_rows.py:120"``), innermost first."""
    names: list[str] = []
    frames: list[str] = []
    seen: set[str] = set()

    def walk(ref: str) -> None:
      body = self.locs.get(ref, ref) if ref.startswith("#loc") else ref
      for text, line in re.findall(_STRING + r"(?::(\d+))?", body):
        (frames if line else names).append(f"{text}:{line}" if line else text)
      for r in re.findall(r"#loc\d*", body):
        if r not in seen:
          seen.add(r)
          walk(r)

    walk(op.loc)
    return names, frames

  def scope(self, op: Op) -> str:
    """The name-stack path of ``op`` (its named scopes), or ``""``."""
    names, _ = self.where(op)
    paths = [n for n in names if "/" in n]
    return paths[0] if paths else (names[0] if names else "")

  def origin(self, op: Op, package: str = "gradtx") -> str:
    """``scope`` and the innermost source frame in ``package``."""
    mine = [f for f in self.where(op)[1] if f"/{package}/" in f]
    frame = mine[0].split(f"/{package}/", 1)[1] if mine else "?"
    return f"{self.scope(op)} ({package}/{frame})"

  def region_ops(self, op: Op) -> list[Op]:
    """Every op inside ``op``'s regions, nested ones included."""
    out = []
    for c in op.children:
      out += [self.ops[c], *self.region_ops(self.ops[c])]
    return out

  def whiles(self) -> list[Op]:
    return [o for o in self.ops if o.name == "stablehlo.while"]

  def is_placement(self, op: Op) -> bool:
    """Whether ``op`` is (or is inside) the id map's placement loop."""
    return PLACEMENT_SCOPE in self.scope(op)

  def float_scatter_adds(self) -> list[Op]:
    """Every scatter whose update computation adds floats."""
    return [
      op
      for op in self.ops
      if op.name == "stablehlo.scatter"
      and any(o.name == "stablehlo.add" for o in self.region_ops(op))
      and any(t.is_float for t in op.results)
    ]

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
  depth, func = 0, ""
  for line in text.splitlines():
    m = _LOC_DEF.match(line)
    if m:
      locs[m.group(1)] = m.group(2)
      continue
    start = None
    om = _OP.match(line)
    stripped = line.strip()
    if stripped.startswith("}") and stripped.endswith("{") and open_:
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
    # strings (locations' names) may hold braces: not counted
    bare = re.sub(_STRING, '""', line)
    depth += bare.count("{") - bare.count("}")
    if start is not None:
      # a pretty-printed while opens its regions on the next line
      if depth == start[1] and ops[start[0]].name != "stablehlo.while":
        _close(ops[start[0]], line)
      else:
        open_.append(start)
    elif open_ and stripped.startswith("}") and depth == open_[-1][1]:
      _close(ops[open_.pop()[0]], line)
  return Program(text, ops, locs, funcs)


def _close(op: Op, line: str) -> None:
  op.tail = line
  m = re.search(r" loc\((.*)\)\s*$", line)
  op.loc = m.group(1) if m else ""


def strip_locations(text: str) -> str:
  """``text`` without its locations (``loc(...)`` and ``#loc`` lines): two
  programs traced from different lines or names compare equal."""
  out = []
  for line in text.splitlines():
    if line.startswith("#loc"):
      continue
    while (at := line.find(" loc(")) >= 0:
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
