"""Reading compiled HLO in tests: which ops produce whole-table values."""

from __future__ import annotations

import re
from typing import Any


def whole_table_ops(compiled: Any, rows: int, dim: int | None = None) -> list:
  """Entry-computation ops (not parameters) producing a ``[rows, ...]`` value.

  With ``dim``, only ``[rows]`` and ``[rows, dim]`` values count.
  """
  shape = rf"{rows}(,{dim})?\]" if dim is not None else rf"{rows},"
  entry = compiled.as_text().split("ENTRY", 1)[1]
  return [
    line.strip()
    for line in entry.splitlines()
    if re.search(rf"= [a-z0-9]+\[{shape}", line) and "parameter(" not in line
  ]


def row_ops(compiled: Any, rows: int) -> list:
  """Entry-computation ops (not parameters) producing a value of ``rows``
  leading rows, of any rank (``[rows]``, ``[rows, ...]``)."""
  entry = compiled.as_text().split("ENTRY", 1)[1]
  return [
    line.strip()
    for line in entry.splitlines()
    if re.search(rf"= [a-z0-9]+\[{rows}[,\]]", line)
    and "parameter(" not in line
  ]


def written_in_place(line: str) -> bool:
  """Whether a ``row_ops`` line writes the table in place: a scatter, or
  the table carried out of a while loop (the row engine's loop over unique
  rows scatters inside it; a copy would show in the program's temporaries
  and aliases, which the callers check too)."""
  return "scatter" in line or re.search(r"get-tuple-element\(%while", line)


def dedups(compiled: Any) -> tuple[int, int]:
  """``(hash loops, sorts)`` in a compiled CPU program: how many times it
  deduplicates row ids (``unique_rows`` hashes on CPU; ``coalesce`` sorts)."""
  from gradtx._dedup import DEDUP_SCOPE

  lines = compiled.as_text().splitlines()
  loops = [x for x in lines if " while(" in x and f'{DEDUP_SCOPE}/while"' in x]
  sorts = [x for x in lines if re.search(r"\ssort\(", x)]
  return len(loops), len(sorts)


def standalone_gathers(compiled: Any, rows: int) -> list[str]:
  """Fusions of a compiled program that only gather rows of a ``[rows,
  ...]`` operand (their root the gather, or a bitcast of it): a gather not
  fused into the computation that reads the rows, one more pass over them."""
  text = compiled.as_text()
  out = []
  for m in re.finditer(
    r"\n(%[\w.\-]+) \(([^)]*)\) -> [^{]*\{\n(.*?)\n\}", text, re.S
  ):
    name, params, body = m.groups()
    if not re.search(rf"\[{rows},", params):
      continue
    lines = body.splitlines()
    root = next((x for x in lines if x.strip().startswith("ROOT ")), "")
    ops = {
      re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = \S+ (\w[\w\-]*)\(", x).group(1): x
      for x in lines
      if re.match(r"\s*(?:ROOT )?%[\w.\-]+ = \S+ \w[\w\-]*\(", x)
    }
    while root and re.search(r" (bitcast|reshape)\(", root):
      src = re.search(r" (?:bitcast|reshape)\((%[\w.\-]+)\)", root)
      root = ops.get(src.group(1), "") if src else ""
    if re.search(r" gather\(", root):
      out.append(name)
  return out
