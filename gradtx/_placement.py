"""The id map's placement of new ids: budgets, admission, the rounds and
the fresh rows' values (:func:`admit`), in named phases.

Each hashed table has its own budget of new ids a step (:func:`budgets`),
so the new ids of one table never take another's share. :func:`admit`
runs the phases in order: match (the ids the map knows, marked read),
admission (``admit_probability``, then ``min_count``), budget (each
table's first new ids into the placement buffer), place and account.
The new ids are placed in rounds, all at once: each takes its best row
(an eviction policy is a scoring function of its window's rows,
:data:`EVICTION_SCORES`), and where two want one row the first in the
step's id order gets it (a scatter-min of positions into the map's
``claim`` scratch, which is back to its resting value after every step);
the others look again, and a duplicate of a placed id then finds it. Each
round an id either gets a row, finds its twin's, or loses one of its
``probes`` rows, so there are at most ``probes`` rounds. The same ids in
the same order give the same rows on every backend.

A row given to a new id is fresh: its new values come from the table's
initializer (the layout carries it), keyed by the map's key and step, and
go out as :class:`gradtx.FreshRows`. The default initializer's normal
values come from a counter-based hash of (the map's key, step, row,
column), ``_fresh_rows.fresh_normal``: straight-line integer ops, no
loop, whatever the number of new ids. :func:`gradtx.reset_rows` writes
them into the params and resets the row in every optimizer state, so
that the new id inherits nothing from the old one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradtx import _platform
from gradtx._fresh_rows import FreshRows, fresh_normal
from gradtx._static import is_int
from gradtx._vocab import (
  INT_MAX,
  SKETCH_DEPTH,
  Layout,
  Probe,
  VocabState,
  check_not_split,
  fmix,
  id_hashes,
  match,
  pick,
  probe,
)

_U32 = np.uint32
# admit's default `max_new`: a fraction of each table's id slots in the step
DEFAULT_MAX_NEW = 0.125
# the least new ids a fractional `max_new` lets a table place in a step
MIN_NEW = 64


def budgets(layout: Layout, tab: np.ndarray, max_new: Any) -> np.ndarray:
  """Each hashed table's bound of new ids for a step (static ints):
  ``max_new`` per table (an int, or a fraction of the table's own id
  slots, at least ``MIN_NEW`` or all of them when there are fewer),
  never more than its slots.

  Examples:
    >>> import numpy as np
    >>> import gradtx as gtx
    >>> from gradtx import _placement
    >>> stack = gtx.TableStack({
    ...     "user": gtx.TableSpec(100, 4, hashed=gtx.Hashed()),
    ...     "item": gtx.TableSpec(100, 4, hashed=gtx.Hashed())})
    >>> (layout,) = stack.maps.values()
    >>> tab = np.repeat(np.arange(2), [1000, 10])  # each slot's table
    >>> _placement.budgets(layout, tab, 0.125)  # at least 64, at most 10
    array([125,  10], dtype=int32)
    >>> _placement.budgets(layout, tab, {"item": 3})
    array([125,   3], dtype=int32)
  """
  slots = np.bincount(tab, minlength=len(layout.tables))
  out = []
  for t, n in zip(layout.tables, slots, strict=True):
    v = (
      max_new.get(t, DEFAULT_MAX_NEW)
      if isinstance(max_new, Mapping)
      else max_new
    )
    if not is_int(v):  # a fraction
      v = max(min(n, MIN_NEW), math.ceil(n * v))
    out.append(min(int(v), int(n)))
  return np.asarray(out, np.int32)


def admit(
  state: VocabState,
  layout: Layout,
  hi,
  lo,
  tab: np.ndarray,
  valid,
  max_new: np.ndarray,
) -> tuple[jax.Array, VocabState, FreshRows]:
  """Maps ids to rows, placing new ones: ``(local rows or -1, new state,
  fresh rows)``, the fresh rows ``[sum(max_new)]`` array rows
  (``layout.size`` for none) and their new values (:func:`_fresh_values`).

  ``hi, lo, valid``: ``[n]`` id words and which slots are ids (not
  padding); ``tab``: static ``[n]``, each slot's hashed table;
  ``max_new``: static, each table's bound (:func:`budgets`). The first
  ``max_new[t]`` slots of new admitted ids of table ``t`` (in slot order)
  compete for its rows, each table in its own part of the placement
  buffer; the others wait for a later step, unless a duplicate placed
  theirs.

  In phases: match (the ids the map knows), admission (which new ids may
  take a row), budget (each table's first new ids into the placement
  buffer), place (the rounds) and account (counts and the step's stats)."""
  check_not_split(state, "admit")
  table = np.asarray(tab, np.int32)
  hashes = id_hashes(layout, hi, lo, table)
  window = probe(layout, table, hashes)
  known = _match_known(state, layout, window, hi, lo, valid)
  new = valid & ~known.found
  admitted, sketch = _admission(state, layout, table, hashes, new)
  buffer = _budget(layout, table, max_new, admitted, window, hi, lo)
  placed = _place(state, layout, buffer, known.last_seen)
  rows = _rows_after_placement(
    state, known.rows, placed, buffer, window, hi, lo, new
  )
  new_state = _account(
    state, layout, table, valid, rows, placed, buffer.table, sketch
  )
  values = _fresh_values(state, layout, buffer.table, placed.fresh)
  return rows, new_state, FreshRows(placed.fresh, values)


# -- match: the ids the map knows ---------------------------------------------
class _Known(NamedTuple):
  """The ids the map knows: per id slot (``[n]``) and the map's reads."""

  found: jax.Array  # bool [n], the slot's id owns a row of its window
  rows: jax.Array  # int32 [n], that table-local row; -1: none
  last_seen: jax.Array  # int32 [rows], the map's, those rows read now


def _match_known(
  state: VocabState, layout: Layout, window: Probe, hi, lo, valid
) -> _Known:
  """The rows of the ids the map knows, marked read this step (so that no
  new id of this step evicts them)."""
  found, column = match(state, window, hi, lo, valid)
  local, array_row = pick(window, column)
  read = jnp.where(found, array_row, layout.size)
  last_seen = state.last_seen.at[read].set(state.step, mode="drop")
  return _Known(found, jnp.where(found, local, -1), last_seen)


# -- admission: which new ids may take a row ----------------------------------
def _admission(
  state: VocabState, layout: Layout, table: np.ndarray, hashes, new
) -> tuple[jax.Array, jax.Array]:
  """Which new ids may take a row this step (by ``admit_probability``,
  then ``min_count``), and the updated sketch."""
  admitted = new
  by_chance = _admitted_by_chance(layout, table, hashes, state.step)
  if by_chance is not None:
    admitted = admitted & by_chance
  by_count, sketch = _admitted_by_count(
    state.sketch, layout, table, hashes, new
  )
  if by_count is not None:
    admitted = admitted & by_count
  return admitted, sketch


def _admitted_by_chance(
  layout: Layout, table: np.ndarray, hashes, step
) -> jax.Array | None:
  """A draw per id (a hash of the id and the step) below its table's
  ``admit_probability``; None when every table admits every id."""
  probability = np.asarray([s.admit_probability for s in layout.settings])
  if (probability >= 1).all():
    return None
  limit = np.minimum(np.floor(probability * 2.0**32), 2**32 - 1)
  limit = limit.astype(np.uint32)
  draw = fmix(hashes ^ fmix(step.astype(jnp.uint32) ^ _U32(0x9E3779B9)))
  return (probability[table] >= 1) | (draw < jnp.asarray(limit[table]))


def _admitted_by_count(
  sketch, layout: Layout, table: np.ndarray, hashes, new
) -> tuple[jax.Array | None, jax.Array]:
  """The new ids of the tables with ``min_count`` > 1, counted in the
  count-min sketch: those counted ``min_count`` times (the others pass),
  and the sketch; None when no table waits for a count."""
  min_count = np.asarray([s.min_count for s in layout.settings], np.int32)
  if (min_count <= 1).all():
    return None, sketch
  start = np.asarray(layout.sketch_offsets[:-1], np.uint32)[table]
  width = np.asarray(layout.rows, np.uint32)[table]
  counted = jnp.asarray(min_count[table] > 1) & new
  estimate = None
  for depth in range(SKETCH_DEPTH):
    salt = _U32(0x27D4EB2F * (depth + 1) & 0xFFFFFFFF)
    cell = (fmix(hashes ^ salt) % width) + start
    cell = jnp.where(counted, cell.astype(jnp.int32), sketch.shape[1])
    cells = sketch[depth].at[cell].add(1, mode="drop")
    cells = jnp.where(cells < 0, INT_MAX, cells)  # saturate
    sketch = sketch.at[depth].set(cells)
    seen = cells[jnp.minimum(cell, sketch.shape[1] - 1)]
    estimate = seen if estimate is None else jnp.minimum(estimate, seen)
  return ~counted | (estimate >= jnp.asarray(min_count[table])), sketch


# -- budget: each table's first new ids into the placement buffer -------------
class _Buffer(NamedTuple):
  """The placement buffer: ``[m]`` entries, table ``t`` owning the
  ``max_new[t]`` from its part's start, each holding a new id or none."""

  slot: jax.Array  # int32 [m], the id slot the entry holds; n: none
  holds: jax.Array  # bool [m], the entry holds an id
  table: np.ndarray  # static int32 [m], the hashed table the entry is for
  key_hi: jax.Array  # uint32 [m], the entry's id
  key_lo: jax.Array  # uint32 [m]
  window: Probe  # [m, P], empty for an entry that holds no id


def _budget(
  layout: Layout,
  table: np.ndarray,
  max_new: np.ndarray,
  admitted,
  window: Probe,
  hi,
  lo,
) -> _Buffer:
  """Each table's first ``max_new[t]`` admitted slots, compacted in slot
  order into its part of the buffer: the slots sorted by table (a static
  order), each counted from its table's first slot."""
  n, tables = table.shape[0], len(layout.tables)
  max_new = np.asarray(max_new, np.int32)
  size = max(1, int(max_new.sum()))
  by_table = np.argsort(table, kind="stable").astype(np.int32)
  sorted_table = table[by_table]
  table_start = np.searchsorted(sorted_table, np.arange(tables))
  table_start = table_start.clip(0, n - 1)
  part_start = np.concatenate([[0], np.cumsum(max_new)[:-1]]).astype(np.int32)
  wanted = admitted[by_table].astype(jnp.int32)
  before = _platform.prefix_sum(wanted) - wanted
  nth = before - before[table_start][sorted_table]  # in the slot's table
  fits = (wanted > 0) & (nth < max_new[sorted_table])
  entry = jnp.where(fits, part_start[sorted_table] + nth, size)
  slot = (
    jnp.full(size, n, jnp.int32)
    .at[entry]
    .set(jnp.asarray(by_table), mode="drop")
  )
  holds = slot < n
  source = jnp.minimum(slot, n - 1)
  entry_table = np.repeat(np.arange(tables, dtype=np.int32), max_new)
  entry_table = np.pad(entry_table, (0, size - entry_table.shape[0]))
  entry_window = Probe(
    window.local[source],
    window.phys[source],
    window.inwin[source] & holds[:, None],
  )
  key_hi, key_lo = hi[source], lo[source]
  return _Buffer(slot, holds, entry_table, key_hi, key_lo, entry_window)


# -- place: the rounds --------------------------------------------------------
class _Candidates(NamedTuple):
  """The rows of each entry's window (``[m, P]``) as an eviction policy
  sees them."""

  empty: jax.Array  # bool, no id owns the row
  last_seen: jax.Array  # int32, the step that last read it; -1: empty
  count: jax.Array  # int32, the reads of the id that owns it


def _candidates(last_seen, count, window: Probe) -> _Candidates:
  """The map's rows of each entry's window, as policies see them."""
  seen = last_seen[window.phys]
  return _Candidates(seen < 0, seen, count[window.phys])


def _least_recently_read(rows: _Candidates) -> Any:
  """``"lru"``: every live row alike, so the least recently read goes."""
  del rows
  return 0


def _least_often_read(rows: _Candidates) -> jax.Array:
  """``"lfu"``: the least often read goes, ties to the least recent."""
  return rows.count


# each policy scores a live row, the lowest evicted first, ties to the
# least recently read; an empty row goes before any live one
EVICTION_SCORES: dict[str, Callable[[_Candidates], Any]] = {
  "lru": _least_recently_read,
  "lfu": _least_often_read,
}


def _policy_scores(rows: _Candidates, policy: np.ndarray) -> Any:
  """Each candidate's score by its entry's policy (``policy``: static, a
  name per entry), the stack's policies in one vectorized step."""
  present = [p for p in EVICTION_SCORES if (policy == p).any()]
  score = EVICTION_SCORES[present[0]](rows)
  for p in present[1:]:
    score = jnp.where((policy == p)[:, None], EVICTION_SCORES[p](rows), score)
  return score


def _evictable(rows: _Candidates, in_window, ttl: np.ndarray, now) -> Any:
  """The rows an entry may take: in its window, and empty, or unread this
  step and (``ttl``, static per entry, -1 for none) unread for more than
  ``ttl`` steps."""
  expired = (ttl[:, None] < 0) | (now - rows.last_seen > ttl[:, None])
  return in_window & (rows.empty | ((rows.last_seen < now) & expired))


def _best_column(rows: _Candidates, evictable, policy: np.ndarray) -> Any:
  """Each entry's best row (a column of its window): the lowest score of
  its evictable rows (an empty row first), ties to the least recent."""
  score = jnp.where(rows.empty, -1, _policy_scores(rows, policy))
  score = jnp.where(evictable, score, INT_MAX)
  tie = evictable & (score == score.min(1, keepdims=True))
  return jnp.argmin(jnp.where(tie, rows.last_seen, INT_MAX), axis=1)


class _Rounds(NamedTuple):
  """The carry of the placement rounds: the map's fields they write, and
  per entry of the placement buffer (``[m]``) how its id fares."""

  key_hi: jax.Array  # uint32 [rows]
  key_lo: jax.Array  # uint32 [rows]
  last_seen: jax.Array  # int32 [rows]
  born: jax.Array  # int32 [rows]
  claim: jax.Array  # int32 [rows], 2**31 - 1 again after each round
  pending: jax.Array  # bool [m], the id still looks for a row
  local: jax.Array  # int32 [m], the table-local row it got or found; -1
  fresh: jax.Array  # int32 [m], the array row it was given; rows: none
  evicted: jax.Array  # bool [m], that row held a live id
  moved: jax.Array  # bool [], some id got or found a row this round


def _place(
  state: VocabState, layout: Layout, buffer: _Buffer, last_seen
) -> _Rounds:
  """The rounds, while some id is pending and the last round moved one:
  each pending entry claims the best row of its window, the first entry
  that claims a row wins it, and a duplicate of a winner finds its twin.
  ``last_seen``: the map's, the rows of known ids read this step."""
  size, entries = layout.size, buffer.slot.shape[0]
  order = jnp.arange(entries, dtype=jnp.int32)
  settings = [layout.settings[t] for t in buffer.table]
  policy = np.asarray([s.policy for s in settings])
  ttl = np.asarray([-1 if s.ttl is None else s.ttl for s in settings])
  ttl = ttl.astype(np.int32)

  def any_pending(carry: _Rounds) -> jax.Array:
    return carry.moved & carry.pending.any()

  def one_round(carry: _Rounds) -> _Rounds:
    now = state.step
    rows = _candidates(carry.last_seen, state.count, buffer.window)
    evictable = _evictable(rows, buffer.window.inwin, ttl, now)
    column = _best_column(rows, evictable, policy)
    claims = carry.pending & evictable.any(1)
    local, row = pick(buffer.window, column)
    won, claim = _first_claims(carry.claim, row, claims, order, size)
    carry = _write_winners(carry, won, row, local, buffer, now, claim, size)
    return _find_twins(state, carry, buffer, won)

  start = _Rounds(
    key_hi=state.key_hi,
    key_lo=state.key_lo,
    last_seen=last_seen,
    born=state.born,
    claim=state.claim,
    pending=buffer.holds,
    local=jnp.full(entries, -1, jnp.int32),
    fresh=jnp.full(entries, size, jnp.int32),
    evicted=jnp.zeros(entries, bool),
    moved=jnp.asarray(True),
  )
  with jax.named_scope("gtx_id_map_placement"):  # tests tell it apart
    return lax.while_loop(any_pending, one_round, start)


def _first_claims(claim, row, claims, order, size: int) -> tuple[Any, Any]:
  """Which claims win their row: the first entry (in ``order``) of those
  claiming a row, by a scatter-min into ``claim``, which is back to its
  resting value after."""
  target = jnp.where(claims, row, size)
  claim = claim.at[target].min(order, mode="drop")
  won = claims & (claim[jnp.minimum(row, size - 1)] == order)
  return won, claim.at[target].set(INT_MAX, mode="drop")


def _write_winners(
  carry: _Rounds, won, row, local, buffer: _Buffer, now, claim, size: int
) -> _Rounds:
  """The winners' ids into their rows, read and born now."""
  target = jnp.where(won, row, size)
  was_live = won & (carry.last_seen[jnp.minimum(row, size - 1)] >= 0)
  return carry._replace(
    key_hi=carry.key_hi.at[target].set(buffer.key_hi, mode="drop"),
    key_lo=carry.key_lo.at[target].set(buffer.key_lo, mode="drop"),
    last_seen=carry.last_seen.at[target].set(now, mode="drop"),
    born=carry.born.at[target].set(now, mode="drop"),
    claim=claim,
    local=jnp.where(won, local, carry.local),
    fresh=jnp.where(won, row, carry.fresh),
    evicted=carry.evicted | was_live,
    pending=carry.pending & ~won,
  )


def _find_twins(
  state: VocabState, carry: _Rounds, buffer: _Buffer, won
) -> _Rounds:
  """A pending duplicate of an id placed this round finds its row."""
  twin, local = _placed_twins(
    state, carry, buffer.window, buffer.key_hi, buffer.key_lo, carry.pending
  )
  return carry._replace(
    local=jnp.where(twin, local, carry.local),
    pending=carry.pending & ~twin,
    moved=won.any() | twin.any(),
  )


def _rows_after_placement(
  state: VocabState,
  known_rows,
  placed: _Rounds,
  buffer: _Buffer,
  window: Probe,
  hi,
  lo,
  new,
) -> jax.Array:
  """Each slot's table-local row or -1: a known id's, a placed one's, or
  (for a new id that waited) a duplicate's placed in the rounds."""
  n = known_rows.shape[0]
  holder = jnp.where(placed.local >= 0, buffer.slot, n)
  rows = known_rows.at[holder].set(placed.local, mode="drop")
  twin, local = _placed_twins(state, placed, window, hi, lo, new & (rows < 0))
  return jnp.where(twin, local, rows)


def _placed_twins(
  state: VocabState, placed: _Rounds, window: Probe, hi, lo, wanted
) -> tuple[jax.Array, jax.Array]:
  """Which wanted ids own a row in the map as the rounds left it (a
  duplicate placed theirs), and that table-local row."""
  after = state._replace(
    key_hi=placed.key_hi, key_lo=placed.key_lo, last_seen=placed.last_seen
  )
  twin, column = match(after, window, hi, lo, wanted)
  local, _ = pick(window, column)
  return twin, local


# -- account: counts and the step's stats -------------------------------------
def _account(
  state: VocabState,
  layout: Layout,
  table: np.ndarray,
  valid,
  rows,
  placed: _Rounds,
  entry_table: np.ndarray,
  sketch,
) -> VocabState:
  """The map after the step: the placed rows' counts restarted, every read
  counted (saturating), and per table the ids inserted, evicted, rejected,
  the live rows and the starved steps."""
  size, tables = layout.size, len(layout.tables)
  now = state.step
  got = rows >= 0
  offset = np.asarray(layout.offsets, np.int32)[table]
  read = jnp.where(got, layout.physical(rows + offset), size)
  given = placed.fresh < size
  count = state.count.at[jnp.where(given, placed.fresh, size)].set(
    0, mode="drop"
  )
  count = count.at[read].add(1, mode="drop")
  count = jnp.where(count < 0, INT_MAX, count)  # saturate

  def per_table(x, of_table):
    return jax.ops.segment_sum(x.astype(jnp.int32), of_table, tables)

  inserted = per_table(given, entry_table)
  evicted = per_table(placed.evicted, entry_table)
  rejected = per_table(valid & ~got, table)
  live = state.live + inserted - evicted
  held = (rejected > 0) & (inserted == 0) & (live < np.asarray(layout.rows))
  return VocabState(
    step=jnp.minimum(now, INT_MAX - 1) + 1,
    key_hi=placed.key_hi,
    key_lo=placed.key_lo,
    last_seen=placed.last_seen,
    count=count,
    born=placed.born,
    claim=placed.claim,
    inserted=inserted,
    evicted=evicted,
    rejected=rejected,
    live=live,
    starved=jnp.where(held, jnp.minimum(state.starved, INT_MAX - 1) + 1, 0),
    sketch=sketch,
    rng=state.rng,
  )


def _fresh_values(
  state: VocabState, layout: Layout, tab: np.ndarray, rows: jax.Array
) -> jax.Array:
  """``[m, dim]`` new rows, the k-th for the k-th row placed (row
  ``rows[k]`` of hashed table ``tab[k]``): the default initializer's from
  :func:`fresh_normal`, keyed by the map's key and step; a table's own
  initializer from JAX's PRNG with the same key, the tables of one
  initializer sharing one draw."""
  n, dtype = tab.shape[0], jnp.dtype(layout.dtype)
  by_init: dict[Any, list[int]] = {}
  for k, init in enumerate(layout.initializers):
    by_init.setdefault(init, []).append(k)
  values = None
  for g, (init, members) in enumerate(by_init.items()):
    if init is None:
      std = 1.0 / math.sqrt(layout.dim)
      z = fresh_normal(state.rng, state.step, rows, layout.dim)
      v = (std * z).astype(dtype)
    else:
      key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
      v = init(jax.random.fold_in(key, g), (n, layout.dim), dtype)
      v = v.astype(dtype)
    if values is None:
      values = v
    else:
      values = jnp.where(jnp.isin(tab, np.asarray(members))[:, None], v, values)
  return values
