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


def assert_tables_updated_in_place(
  compiled: Any, rows: int, dim: int, tables: int
) -> None:
  """Every whole-table op is an in-place scatter; temporaries stay small.

  ``tables`` ``[rows, dim]`` buffers (params and state) must alias their
  donated inputs.
  """
  whole = whole_table_ops(compiled, rows, dim)
  assert whole, "the check can fail: the table updates must show up"
  for line in whole:
    assert re.search(r"scatter", line), line
  mem = compiled.memory_analysis()
  table_bytes = rows * dim * 4
  assert mem.temp_size_in_bytes < table_bytes / 20
  assert mem.alias_size_in_bytes >= tables * table_bytes


def dedups(compiled: Any) -> tuple[int, int]:
  """``(hash loops, sorts)`` in a compiled CPU program: how many times it
  deduplicates row ids (``unique_rows`` hashes on CPU; ``coalesce`` sorts)."""
  from gradtx._base import DEDUP_SCOPE

  lines = compiled.as_text().splitlines()
  loops = [x for x in lines if " while(" in x and f'{DEDUP_SCOPE}/while"' in x]
  sorts = [x for x in lines if re.search(r"\ssort\(", x)]
  return len(loops), len(sorts)
