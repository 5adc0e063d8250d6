"""An independent numpy reference of the id map of hashed tables, in plain
Python loops over ids, from the rules in the docstrings of gradtx/_vocab.py
and gradtx/_placement.py.

Nothing here imports gradtx. The hash is MurmurHash3's 32-bit finalizer on
Python ints; a table's seed is its name's CRC-32 xor its ``seed``, mixed.
"""

from __future__ import annotations

import zlib

import numpy as np

M32 = 0xFFFFFFFF
INT_MAX = 2**31 - 1


def fmix(x: int) -> int:
  x &= M32
  x ^= x >> 16
  x = (x * 0x85EBCA6B) & M32
  x ^= x >> 13
  x = (x * 0xC2B2AE35) & M32
  return x ^ (x >> 16)


def table_seed(name: str, seed: int) -> int:
  return fmix((zlib.crc32(name.encode()) ^ seed) & M32)


def words(raw: int) -> tuple[int, int]:
  """A signed 64-bit id -> (hi, lo) words."""
  v = raw & 0xFFFFFFFFFFFFFFFF
  return v >> 32, v & M32


class Table:
  def __init__(self, name, offset, rows, policy="lru", ttl=None, min_count=1,
               admit_probability=1.0, probes=8, seed=0):  # fmt: skip
    self.name, self.offset, self.rows = name, offset, rows
    self.policy, self.ttl, self.min_count = policy, ttl, min_count
    self.p, self.probes = admit_probability, probes
    self.seed = table_seed(name, seed)


class NumpyMap:
  """The map of one stack: ``tables`` (Table) in the stack, ``size`` rows of
  the array, logical row q at array row ``physical(q)``."""

  def __init__(self, tables: list[Table], size: int, shards: int = 1):
    self.tables, self.size, self.shards = tables, size, shards
    self.key = [(0, 0)] * size
    self.last = [-1] * size
    self.count = [0] * size
    self.born = [0] * size
    self.step = 0
    self.live = [0] * len(tables)
    self.starved = [0] * len(tables)
    self.sketch = {t.name: np.zeros((2, t.rows), np.int64) for t in tables}

  def physical(self, q: int) -> int:
    per = self.size // self.shards
    return (q % self.shards) * per + q // self.shards

  def _window(self, t: Table, h: int) -> list[tuple[int, int]]:
    """(local, array row) of the id's candidate rows, in probe order."""
    width = max(x.probes for x in self.tables)
    out = []
    for j in range(width):
      local = (h % t.rows + j) % t.rows
      out.append((local, self.physical(t.offset + local), j < t.probes))
    return out

  def _find(self, t, h, key):
    for local, r, inside in self._window(t, h):
      if inside and self.last[r] >= 0 and self.key[r] == key:
        return local, r
    return None

  def step_ids(self, slots: list[tuple[int, int, bool]], max_new):
    """``slots``: (table index, signed raw id, valid), the step's ids in
    order; ``max_new``: an int, or one per table: the first ``max_new[t]``
    slots of new admitted ids of table ``t`` compete for its rows.
    Returns (local row or -1 per slot, the array row each competing slot
    got or None, table by table, each padded with None to its bound,
    per-table (inserted, evicted, rejected))."""
    if isinstance(max_new, int):
      max_new = [max_new] * len(self.tables)
    now = self.step
    n = len(slots)
    row = [-1] * n
    arr = [None] * n
    fresh = [None] * n
    info = []
    for ti, raw, ok in slots:
      t = self.tables[ti]
      hi, lo = words(raw)
      h = fmix(lo ^ fmix(hi ^ t.seed))
      info.append((t, (hi, lo), h, ok))
    for k, (t, key, h, ok) in enumerate(info):
      if ok:
        got = self._find(t, h, key)
        if got:
          row[k], arr[k] = got
    for k in range(n):  # read this step: protected
      if arr[k] is not None:
        self.last[arr[k]] = now
    new = [info[k][3] and arr[k] is None for k in range(n)]
    admitted = list(new)
    for k, (t, _, h, _) in enumerate(info):
      if new[k] and t.p < 1:
        u = fmix(h ^ fmix((now & M32) ^ 0x9E3779B9))
        if u >= min(int(np.floor(t.p * 2.0**32)), M32):
          admitted[k] = False
    cols = {}
    for k, (t, _, h, _) in enumerate(info):
      if new[k] and t.min_count > 1:
        cols[k] = []
        for d in range(2):
          c = fmix(h ^ ((0x27D4EB2F * (d + 1)) & M32)) % t.rows
          self.sketch[t.name][d, c] += 1
          cols[k].append(c)
    for k, c in cols.items():
      t = info[k][0]
      est = min(self.sketch[t.name][d, c[d]] for d in range(2))
      admitted[k] = admitted[k] and est >= t.min_count
    parts = [
      [k for k in range(n) if admitted[k] and slots[k][0] == ti][:bound]
      for ti, bound in enumerate(max_new)
    ]
    competing = sorted(k for part in parts for k in part)
    pending = list(competing)
    evicted = [False] * n
    while pending:
      choice = {}
      for k in pending:
        t, key, h, ok = info[k]
        best = None
        for j, (local, r, inside) in enumerate(self._window(t, h)):
          last = self.last[r]
          old = t.ttl is None or now - last > t.ttl
          if not inside or not (last < 0 or (last < now and old)):
            continue
          first = (
            -1 if last < 0 else (self.count[r] if t.policy == "lfu" else 0)
          )
          score = (first, last, j)
          if best is None or score < best[0]:
            best = (score, local, r)
        if best is not None:
          choice[k] = best[1:]
      winner = {}
      for k in sorted(choice):
        winner.setdefault(choice[k][1], k)
      won = set(winner.values())
      for r, k in winner.items():
        evicted[k] = self.last[r] >= 0
        self.key[r] = info[k][1]
        self.last[r] = now
        self.born[r] = now
        row[k], arr[k] = choice[k][0], r
        fresh[k] = r
      rest = []
      found = False
      for k in pending:
        if k in won:
          continue
        t, key, h, ok = info[k]
        got = self._find(t, h, key)
        if got:
          row[k], arr[k] = got
          found = True
        else:
          rest.append(k)
      pending = rest
      if not won and not found:
        break
    for k in range(n):  # a new id that waited: a duplicate may have placed it
      if new[k] and row[k] < 0:
        t, key, h, ok = info[k]
        got = self._find(t, h, key)
        if got:
          row[k], arr[k] = got
    for k in range(n):
      if fresh[k] is not None:
        self.count[fresh[k]] = 0
    for k in range(n):
      if arr[k] is not None:
        self.count[arr[k]] = min(self.count[arr[k]] + 1, INT_MAX)
    stats = []
    for ti in range(len(self.tables)):
      mine = [k for k in range(n) if slots[k][0] == ti]
      stats.append((
        sum(fresh[k] is not None for k in mine),
        sum(evicted[k] for k in mine),
        sum(info[k][3] and row[k] < 0 for k in mine),
      ))  # fmt: skip
    for ti, t in enumerate(self.tables):
      ins, ev, rej = stats[ti]
      self.live[ti] += ins - ev
      held = rej > 0 and ins == 0 and self.live[ti] < t.rows
      self.starved[ti] = self.starved[ti] + 1 if held else 0
    self.step += 1
    placed = []
    for part, bound in zip(parts, max_new, strict=True):
      placed += [fresh[k] for k in part] + [None] * (bound - len(part))
    return row, placed, stats
