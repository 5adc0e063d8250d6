"""Deduplication: each row id once, its duplicates' rows summed.

Three algorithms, all deterministic:

- :func:`coalesce_rows` (``SparseRows.coalesce``): sorted unique ids, each
  segment of equal ids summed; on CPU by a scatter-add in input order
  (:func:`_segment_sum_scatter`), on accelerators (GPU, TPU) by a
  segmented scan over the stably sorted rows (:func:`_segment_sum_scan`),
  whose order of additions is fixed where an atomic scatter-add's is not.
- :func:`unique_rows` (the row engine's, ``SparseRows.deduplicated``): each
  id kept at its first position, so a group of tables deduplicated
  together keeps each table's ids in its own slice. On CPU without a
  sort: a hash ``while_loop`` finds each id's first position
  (:func:`_first_positions`) and the later duplicates are added into it
  (:func:`_add_duplicates`); on accelerators coalesce's sort and scan,
  placed in the same layout, with no loop (see :mod:`gradtx._platform`).

The kernels take ids whose padding is exactly ``num_rows`` (a SparseRows'
``valid_indices()``); ids split over Explicit mesh axes are made whole
first.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradtx import _platform, _sharded

# The name scope of a deduplication's hash loop (CPU) in compiled HLO.
DEDUP_SCOPE = "gtx_dedup"


def coalesce_rows(
  idx: jax.Array, values: jax.Array, num_rows: int
) -> tuple[jax.Array, jax.Array]:
  """``(ids, sums)``: the sorted unique ids of ``idx`` (``n > 0`` ids,
  padding ``num_rows``), then the padding id to length ``n``, and each id's
  rows summed (zero rows at the padding)."""
  n = idx.shape[0]
  # Ids split over Explicit mesh axes are sorted whole on every device.
  idx, values = _sharded.unsplit(idx), _sharded.unsplit(values)
  # The ids alone are sorted, without an argsort: a sort of keys alone is
  # the cheaper one, and the CPU sum (_segment_sum_scatter) needs no
  # permutation (it finds each row's segment by a binary search).
  sidx = jnp.sort(idx)
  first = jnp.concatenate([jnp.ones([1], bool), sidx[1:] != sidx[:-1]])
  seg = _platform.prefix_sum(first) - 1
  uniq = jnp.full([n], num_rows, jnp.int32)
  uniq = uniq.at[jnp.where(first, seg, n)].set(
    sidx, mode="drop", unique_indices=True
  )
  summed = _platform.platform_dependent(
    values,
    idx,
    sidx,
    seg,
    cpu=_segment_sum_scatter,
    accelerator=_segment_sum_scan,
  )
  keep = (uniq < num_rows).reshape((n,) + (1,) * (summed.ndim - 1))
  summed = jnp.where(keep, summed, jnp.zeros_like(summed))
  return uniq, summed


def unique_rows(
  idx: jax.Array, values: jax.Array, num_rows: int
) -> tuple[jax.Array, jax.Array]:
  """``(ids, values)`` deduplicated for the row engine: each id of ``idx``
  (padding ``num_rows``) once with its duplicates summed, static length
  ``n``.

  On CPU the ids stay in input order: an id's first position holds
  its sum and every later duplicate (and every padding id) becomes the
  padding index ``num_rows``, its value left as it was (consumers skip
  padding rows). No sort: :func:`_first_positions` finds each id's first
  position by hashing into a ``4n`` scratch, and :func:`_add_duplicates`
  adds the later duplicates into it in input order, the same additions as
  :func:`coalesce_rows` (sequential scatter). On accelerators (GPUs, whose
  scatter-add is atomic, and TPUs), the sums are :func:`coalesce_rows`' (a
  stable sort and a segmented scan, fixed order), placed in the same
  layout.

  Examples:
    >>> import jax.numpy as jnp
    >>> from gradtx._dedup import coalesce_rows, unique_rows
    >>> ids = jnp.array([5, 2, 5, 9])  # 9: the padding id of 9 rows
    >>> rows = jnp.array([[1.0], [2.0], [3.0], [4.0]])
    >>> uniq, sums = unique_rows(ids, rows, 9)
    >>> uniq, sums[:2]
    (Array([5, 2, 9, 9], dtype=int32), Array([[4.],
           [2.]], dtype=float32))
    >>> coalesce_rows(ids, rows, 9)
    (Array([2, 5, 9, 9], dtype=int32), Array([[2.],
           [4.],
           [0.],
           [0.]], dtype=float32))
  """
  if idx.shape[0] == 0:
    return idx, values
  idx, values = _sharded.unsplit(idx), _sharded.unsplit(values)
  by_hash = functools.partial(_unique_by_hash, num_rows=num_rows)
  by_sort = functools.partial(_unique_by_sort, num_rows=num_rows)
  return _platform.platform_dependent(
    idx, values, cpu=by_hash, accelerator=by_sort
  )


def _segment_sum_scatter(
  values: jax.Array, idx: jax.Array, sidx: jax.Array, seg: jax.Array
) -> jax.Array:
  """Sums rows into their segments, in input order, without a zero pass.

  ``seg`` is the segment of each position of the sorted ids ``sidx``; a
  binary search finds each input row's segment, so the rows are never
  sorted. Each segment starts as a copy of its first input row (one gather)
  and a scatter-add adds the segment's other rows, skipping the first ones
  (most ids are unique, so it writes little). A scatter on CPU is
  sequential: each sum runs in input order, the same additions as summing
  into zeros (except that a lone ``-0.0`` stays ``-0.0``; ``0 + x`` made it
  ``0.0``, which no optimizer can tell apart).
  """
  n = values.shape[0]
  seg_of_input = seg[jnp.searchsorted(sidx, idx, method="scan")]
  pos = lax.iota(jnp.int32, n)
  first = jnp.full([n], n, jnp.int32).at[seg_of_input].min(pos)
  sums = values.at[first].get(mode="fill", fill_value=0)
  rest = jnp.where(first[seg_of_input] == pos, n, seg_of_input)
  return sums.at[rest].add(values, mode="drop")


def _segment_sum_scan(
  values: jax.Array, idx: jax.Array, sidx: jax.Array, seg: jax.Array
) -> jax.Array:
  """Sums rows into their segments by a segmented associative scan over the
  stably sorted rows: no atomics and no loop, so the order of additions
  is fixed on accelerators."""
  del sidx
  n = values.shape[0]
  svals = values[jnp.argsort(idx, stable=True)]
  first = jnp.concatenate([jnp.ones([1], bool), seg[1:] != seg[:-1]])

  def combine(a, b):
    fa, va = a
    fb, vb = b
    fb_rows = fb.reshape(fb.shape + (1,) * (vb.ndim - fb.ndim))
    return fa | fb, jnp.where(fb_rows, vb, va + vb)

  _, sums = lax.associative_scan(combine, (first, svals))
  last = jnp.concatenate([first[1:], jnp.ones([1], bool)])
  target = jnp.where(last, seg, n)
  return (
    jnp.zeros_like(svals).at[target].set(sums, mode="drop", unique_indices=True)
  )


def _unique_by_hash(idx: jax.Array, values: jax.Array, num_rows: int):
  """:func:`unique_rows` on CPU: hashing, no sort."""
  n = idx.shape[0]
  first = _first_positions(idx, num_rows)
  pos = lax.iota(jnp.int32, n)
  is_first = first == pos
  uniq = jnp.where(is_first, idx, num_rows)
  return uniq, _add_duplicates(values, first, (~is_first) & (idx < num_rows))


def _unique_by_sort(idx: jax.Array, values: jax.Array, num_rows: int):
  """:func:`unique_rows` on accelerators: :func:`coalesce_rows`'
  fixed-order sums (a stable sort and a segmented scan), each placed at
  its id's first position, the layout of :func:`_unique_by_hash` (a
  group's tables keep their ids' slices)."""
  n = idx.shape[0]
  order = jnp.argsort(idx, stable=True).astype(jnp.int32)
  sidx = idx[order]
  first = jnp.concatenate([jnp.ones([1], bool), sidx[1:] != sidx[:-1]])
  seg = lax.associative_scan(lax.add, first.astype(jnp.int32)) - 1
  sums = _segment_sum_scan(values, idx, sidx, seg)  # segment k's sum at k
  start = jnp.where(first, seg, n)
  at = jnp.full([n], n, jnp.int32).at[start].set(order, mode="drop")
  # the ids' own dtype, as the CPU branch keeps it (int64 under x64)
  ids = jnp.full([n], num_rows, idx.dtype).at[start].set(sidx, mode="drop")
  uniq = jnp.full([n], num_rows, idx.dtype).at[at].set(ids, mode="drop")
  return uniq, values.at[at].set(sums.astype(values.dtype), mode="drop")


def _add_duplicates(
  values: jax.Array, first: jax.Array, dup: jax.Array, chunk: int = 1024
) -> jax.Array:
  """``values`` with each duplicate row (``dup``) added into the row at its
  id's ``first`` position, in input order, at a cost proportional to the
  duplicates: ``chunk`` of them per loop trip, gathered and scatter-added
  in place (one scatter-add of all ``n`` rows onto a copy of ``values``
  would read and write every row, most ids being unique)."""
  n = values.shape[0]
  chunk = min(chunk, n)
  pos = lax.iota(jnp.int32, n)
  count = jnp.sum(dup, dtype=jnp.int32)
  # The duplicates' positions, in input order, then n (gathers zeros).
  slot = jnp.where(dup, jnp.cumsum(dup, dtype=jnp.int32) - 1, n)
  dups = (
    jnp.full([n + chunk], n, jnp.int32)
    .at[slot]
    .set(pos, mode="drop", unique_indices=True)
  )

  def add_chunk(k, vals):
    src = lax.dynamic_slice(dups, (k * chunk,), (chunk,))
    dst = first.at[src].get(mode="fill", fill_value=n)
    rows = vals.at[src].get(mode="fill", fill_value=0)
    return vals.at[dst].add(rows, mode="drop")

  trips = (count + chunk - 1) // chunk
  return lax.fori_loop(0, trips, add_chunk, values)


def _first_positions(idx: jax.Array, num_rows: int) -> jax.Array:
  """For each position, the first position holding the same id (padding:
  itself), in ``O(n)`` expected time and ``O(n)`` memory, deterministic.

  Rounds of multiplicative hashing into ``4n`` slots: each unresolved
  position scatters its position into its slot with ``min``; a position
  whose slot's winner holds the same id takes the winner (all positions of
  one id share a slot, so the winner is the id's first position). Positions
  whose slot was won by another id retry with a new multiplier. Each round
  resolves at least the winner of every slot, so the loop ends; with a
  ``4n`` table most positions resolve in the first round. Integer ``min``
  gives the same result in any order, on every backend.
  """
  n = idx.shape[0]
  bits = min(max(int(np.ceil(np.log2(4 * n))), 1), 31)
  size = 1 << bits
  pos = lax.iota(jnp.int32, n)
  key = idx.astype(jnp.uint32)

  def unresolved(carry):
    return jnp.any(carry[1] < 0)

  def round_(carry):
    r, first = carry
    todo = first < 0
    mult = (jnp.uint32(0x9E3779B1) + r * jnp.uint32(0x6C8E9CF6)) | 1
    slot = ((key * mult) >> (32 - bits)).astype(jnp.int32)
    slot = jnp.where(todo, slot, size)  # resolved positions sit out
    winner = jnp.full([size], n, jnp.int32).at[slot].min(pos, mode="drop")
    cand = winner.at[slot].get(mode="fill", fill_value=n)
    same = idx.at[cand].get(mode="fill", fill_value=-1) == idx
    return r + 1, jnp.where(todo & same, cand, first)

  first = jnp.where(idx < num_rows, -1, pos)
  with jax.named_scope(DEDUP_SCOPE):  # tests count the dedups of a step
    _, first = lax.while_loop(unresolved, round_, (jnp.uint32(0), first))
  return first
