"""Publishing to serving: the rows changed since the last publish.

:func:`track_changes` is one more transformation in the chain: it passes
the updates through and records, for every row of a table (a params leaf
of at least two dimensions, as :func:`gradtx.bytes_per_row` counts them),
the step that last changed it (int32, 4 bytes a row), and for every other
leaf the step it last changed. A row changes when the update writes it:
every row a SparseRows update carries (a valid id, whatever its values:
checking them would read the update's rows once more), and every row of a
dense update with a nonzero element. Accumulate's micro-steps and dropped
stale gradients carry no row (all padding, or dense zeros), so they record
nothing.

:func:`delta` reads that record wherever it sits in an optimizer state
(chains, ``optax.multi_transform``, :func:`gradtx.accumulate`,
:func:`gradtx.drop_stale`, ``optax.inject_hyperparams``) and returns the
rows changed after a step ``since`` with their current values, a plain
pytree of numpy arrays; :func:`apply_delta` writes one into a copy of the
params. With a :class:`gradtx.TableStack` and its id maps, the delta of a
hashed table also gives each changed row's owner raw id and the raw ids
evicted since the last publish (tombstones).

:func:`gradtx.reset_rows` changes the rows it gives to new ids outside the
optimizer, and resets their record with the rest of the optimizer state.
The id map records when it gave each row out (``VocabState.born``), so
:func:`delta` finds those rows there: publishing a hashed table needs its
``vocab`` (and, after the first publish, the map of the last publish, which
also names the evicted ids).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradtx._fresh_rows import FreshMarks
from gradtx._rowio import gather_rows, scatter_rows
from gradtx._sharded import is_split, per_row_full
from gradtx._sparse_rows import SparseRows
from gradtx._stack import TableStack
from gradtx._update_trees import broadcast_prefix, tree_map, zero_counter
from gradtx._vocab import VocabState

__all__ = [
  "Delta",
  "TrackChangesState",
  "apply_delta",
  "delta",
  "track_changes",
]


class TrackChangesState(NamedTuple):
  """State of :func:`track_changes`."""

  step: jax.Array  # int32 [], update calls so far (saturating)
  # Like params: a table's leaf is int32 [rows] (split like its rows), the
  # step each row last changed; any other leaf's is int32 [], the step it
  # last changed. 0: not changed since init.
  changed: Any
  # Which leaves gradtx.reset_rows made rows fresh in (an id map gave
  # them to new ids): their changes are in the map, not in `changed`.
  fresh: FreshMarks


class Delta(NamedTuple):
  """What changed after a step: the output of :func:`delta`.

  A plain pytree of numpy arrays (orbax and ``numpy.savez`` save it as it
  is; orbax restores it as a dict with these keys, which
  :func:`apply_delta` takes too).

  Attributes:
    step: int32 ``[]``, the tracker's step: pass it as the next ``since``.
    params: shaped like the params: for a table, ``{"ids": int32 [k],
      "values": [k, *row]}``, its changed rows in increasing order and
      their current values, or None when no row changed; for any other
      leaf its current value, or None when it did not change.
    maps: with ``vocab``: stack name -> ``{"tables": int32 [k], "owners":
      int64 [k], "tombstones": ...}``: for each changed row of the stack
      (the ids of its params entry), the index of its table in
      ``list(stack.tables)`` and the raw id that owns it (-1 for a row of a
      table that is not hashed); ``tombstones`` is ``{"tables": int32
      [t], "ids": int64 [t]}``, the raw ids evicted since the last publish
      that own no row now, or None. Without ``vocab``: None.
  """

  step: Any
  params: Any
  maps: Any = None


# ----------------------------------------------------------------------------
# the tracker


def _flags(per_row: Any, params: Any) -> Any:
  """A bool per params leaf: recorded per row or as a whole."""
  if per_row is None:
    return tree_map(lambda p: None if p is None else jnp.ndim(p) >= 2, params)
  if isinstance(per_row, bool):
    return tree_map(lambda p: None if p is None else per_row, params)
  try:
    return broadcast_prefix(per_row, params)
  except ValueError as e:
    raise ValueError(
      "gradtx.track_changes `per_row` must be None (every leaf of at least "
      "two dimensions), a bool, or a pytree prefix of params with a bool "
      "per leaf; its structure "
      f"{jax.tree.structure(per_row, is_leaf=lambda x: x is None)} is not a "
      f"prefix of params' {jax.tree.structure(params)}."
    ) from e


def _new_record(p: Any, per_row: bool) -> jax.Array:
  if not per_row:
    return zero_counter()
  if jnp.ndim(p) < 1:
    raise ValueError(
      "gradtx.track_changes `per_row` is True for a scalar parameter; only "
      "arrays with a row axis have rows. Set it to False for this leaf."
    )
  return per_row_full(p, 0, jnp.int32)


def _nonzero_rows(x: jax.Array) -> jax.Array:
  """``[n]`` bool: which rows of ``[n, ...]`` have a nonzero element."""
  return jnp.any(x.reshape(x.shape[0], -1) != 0, axis=1)


def _record(u: Any, rec: jax.Array, step: jax.Array) -> jax.Array:
  """``rec`` with the rows (or the leaf) ``u`` changes stamped ``step``."""
  if u is None:
    return rec
  if isinstance(u, SparseRows):
    # Every row the update carries, without reading its values: a check of
    # the values would read (or recompute) the update's rows once more.
    idx = u.valid_indices()
    if rec.ndim == 0:
      return jnp.where(jnp.any(idx < u.num_rows), step, rec)
    stamps = jnp.broadcast_to(step, idx.shape)
    return scatter_rows(rec, idx, stamps, unique=u.unique)
  u = jnp.asarray(u)
  if rec.ndim == 0:
    return jnp.where(jnp.any(u != 0), step, rec)
  return jnp.where(_nonzero_rows(u), step, rec)


def track_changes(per_row: Any = None) -> optax.GradientTransformationExtraArgs:
  """Records which rows the updates change, for :func:`delta`.

  Put it anywhere after the optimizer, in the chain: it returns the updates
  as they are, and its state records, per row of each table, the step
  (the count of its ``update`` calls, from 1) that last changed the row,
  and for every other leaf the step that last changed it. A row changes
  when the update writes it: every row a SparseRows update carries (its
  valid ids; the values are not read), every row of a dense update with a
  nonzero element, a dense leaf whose update has one. Accumulate's
  micro-steps and a dropped stale gradient carry no row, so they record
  nothing. The work is one int32 scatter of the update's ids per table;
  the state is 4 bytes a row of each table (counted by
  :func:`gradtx.bytes_per_row`) and 4 bytes a dense leaf, split with the
  rows of a row-sharded table. The state is
  checkpointed with the rest of the optimizer state, so a resumed run
  publishes what the uninterrupted run would.

  :func:`gradtx.reset_rows` resets a row's record with the rest of its
  optimizer state and marks its leaf in this state; :func:`delta` finds
  the rows given to new ids in the id map instead, and refuses a marked
  leaf without ``vocab``.

  Args:
    per_row: which leaves are recorded row by row: None for every leaf of
      at least two dimensions (the tables), a bool for every leaf, or a
      pytree prefix of params with a bool per leaf (for example from
      :func:`sparse_labels`: ``jax.tree.map(lambda l: l == "sparse",
      labels)``). A leaf recorded whole is published whole.

  Returns:
    A transformation whose state is a :class:`TrackChangesState`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradtx as gtx
    >>> params = {"emb": jnp.zeros((5, 2)), "b": jnp.zeros(2)}
    >>> tx = optax.chain(gtx.lazy_sgd(1.0), gtx.track_changes())
    >>> state = tx.init(params)
    >>> g = {"emb": gtx.SparseRows(jnp.array([3]), jnp.ones((1, 2)), 5),
    ...      "b": jnp.zeros(2)}
    >>> u, state = tx.update(g, state, params)
    >>> params = gtx.apply_updates(params, u)
    >>> d = gtx.delta(params, state)
    >>> d.params["emb"]["ids"], d.params["b"], int(d.step)
    (array([3], dtype=int32), None, 1)
  """
  if per_row is not None and not isinstance(per_row, bool):
    bad = [x for x in jax.tree.leaves(per_row) if not isinstance(x, bool)]
    if bad:
      raise TypeError(
        "gradtx.track_changes `per_row` must hold Python bools (True: "
        f"recorded row by row); got {bad[0]!r}."
      )

  def init_fn(params):
    flags = _flags(per_row, params)
    changed = jax.tree.map(
      lambda f, p: None if p is None else _new_record(p, f),
      flags,
      params,
      is_leaf=lambda x: x is None,
    )
    made = jax.tree.map(
      lambda p: None if p is None else zero_counter(),
      params,
      is_leaf=lambda x: x is None,
    )
    return TrackChangesState(zero_counter(), changed, FreshMarks(made))

  def update_fn(updates, state, params=None, **extra):
    del params, extra
    step = optax.safe_increment(state.step)
    changed = tree_map(
      lambda u, rec: rec if rec is None else _record(u, rec, step),
      updates,
      state.changed,
    )
    return updates, TrackChangesState(step, changed, state.fresh)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# ----------------------------------------------------------------------------
# finding the record


def _is_skip(x: Any) -> bool:
  return x is None or isinstance(x, optax.MaskedNode)


def _trackers(opt_state: Any) -> list[TrackChangesState]:
  found = jax.tree.leaves(
    opt_state, is_leaf=lambda x: isinstance(x, TrackChangesState)
  )
  return [s for s in found if isinstance(s, TrackChangesState)]


def _records(params: Any, opt_state: Any) -> tuple[int, list[Any], list[bool]]:
  """The tracker's step, one record per params leaf (None: no param), and
  per params leaf whether :func:`gradtx.reset_rows` made rows of it fresh."""
  trackers = _trackers(opt_state)
  if not trackers:
    raise ValueError(
      "gradtx.delta: `opt_state` holds no gradtx.track_changes state. Add "
      "it to the chain after the optimizer: `optax.chain(opt, "
      "gtx.track_changes())`, and pass the state of that chain."
    )
  steps = {int(t.step) for t in trackers}
  if len(steps) > 1:
    raise ValueError(
      "gradtx.delta: `opt_state` holds several gradtx.track_changes states "
      f"at different steps {sorted(steps)}, so `since` is ambiguous. Keep "
      "one, in the outermost chain."
    )
  leaves, treedef = jax.tree.flatten(params, is_leaf=_is_skip)
  out: list[Any] = [None] * len(leaves)
  fresh = [False] * len(leaves)
  for t in trackers:
    recs = jax.tree.leaves(t.changed, is_leaf=_is_skip)
    # one transfer for every mark, not one per leaf
    made = jax.device_get(jax.tree.leaves(t.fresh.made, is_leaf=_is_skip))
    if len(recs) != len(leaves) or len(made) != len(leaves):
      raise ValueError(
        "gradtx.delta: the gradtx.track_changes state in `opt_state` does not "
        f"have the tree structure of `params` ({treedef}). Pass the params "
        "this optimizer state was made for."
      )
    for i, (r, f) in enumerate(zip(recs, made, strict=True)):
      fresh[i] |= not _is_skip(f) and bool(f)
      if _is_skip(r):
        continue
      if out[i] is not None:
        raise ValueError(
          "gradtx.delta: two gradtx.track_changes states in `opt_state` "
          "record the same params leaf; keep one."
        )
      out[i] = r
  missing = [
    jax.tree_util.keystr(k)
    for (k, p), r in zip(
      jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_skip)[0],
      out,
      strict=True,
    )
    if r is None and not _is_skip(p)
  ]
  if missing:
    raise ValueError(
      f"gradtx.delta: no gradtx.track_changes state records the params "
      f"leaves {missing}. Put track_changes after optax.multi_transform or "
      "optax.masked, in the chain, so that it sees every leaf."
    )
  return steps.pop(), out, fresh


def _since(since: Any, step: int) -> int:
  if since is None:
    return 0
  value = np.asarray(since)
  if value.ndim != 0 or not np.issubdtype(value.dtype, np.integer):
    raise TypeError(
      "gradtx.delta `since` must be None or the int step of an earlier "
      f"delta (`d.step`); got {since!r}."
    )
  value = int(value)
  if not 0 <= value <= step:
    raise ValueError(
      f"gradtx.delta `since` is {value}, outside [0, {step}] (the tracker's "
      "step now): pass the `step` of a delta of this run."
    )
  return value


# ----------------------------------------------------------------------------
# the delta, on the device


def _whole(x: jax.Array) -> jax.Array:
  """``x`` unsplit: row-sharded records are read whole at publish time."""
  if is_split(x):
    return jax.device_put(x, NamedSharding(x.sharding.mesh, P()))
  return x


@jax.jit
def _count(mask: jax.Array) -> jax.Array:
  return jnp.sum(mask.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames="size")
def _ids(mask: jax.Array, size: int) -> jax.Array:
  return jnp.nonzero(mask, size=size, fill_value=mask.shape[0])[0].astype(
    jnp.int32
  )


@jax.jit
def _take(table: jax.Array, ids: jax.Array) -> jax.Array:
  return gather_rows(table, ids)


def _bucket(n: int) -> int:
  """A padded size (a power of two) so that publishes of nearby sizes share
  one compiled program."""
  return 1 << max(0, int(n - 1).bit_length())


def _changed_rows(mask: jax.Array) -> tuple[np.ndarray, jax.Array]:
  """``(ids, padded ids)``: the true rows of ``mask`` (numpy, increasing)
  and the same ids padded with the row count to a bucket size."""
  n = int(_count(mask))
  padded = _ids(mask, _bucket(n))
  return np.asarray(padded)[:n], padded


@jax.jit
def _changed_mask(rec: jax.Array, since: jax.Array) -> jax.Array:
  return rec > since


@jax.jit
def _fresh_mask(
  rec: jax.Array, since: jax.Array, last_seen: jax.Array, born: jax.Array, v
) -> jax.Array:
  """Changed by an update after ``since``, or given to an id by the map
  after its step ``v``."""
  return (rec > since) | ((last_seen >= 0) & (born >= v))


def _finite(x: np.ndarray) -> bool:
  """No NaN or inf in ``x`` (True for integers)."""
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return True
  return bool(np.isfinite(x).all())


def _raw(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
  """int64 raw ids from their uint32 words."""
  return ((hi.astype(np.uint64) << np.uint64(32)) | lo).view(np.int64)


# ----------------------------------------------------------------------------
# hashed tables


class _Map(NamedTuple):
  """One stack's id map at the delta and at the last publish."""

  name: str
  stack: Any  # the TableStack
  now: VocabState
  then: VocabState | None


def _check_alive(tree: Any, name: str, fix: str) -> None:
  """Refuses a tree with an array freed by donation: reading it would fail
  later with JAX's error, which names no argument."""
  if any(
    isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(tree)
  ):
    raise ValueError(
      f"gradtx.delta `{name}` holds arrays that were deleted (donated to a "
      f"jitted step, which reused their memory). {fix}"
    )


def _maps(
  params: Any, stack: Any, vocab: Any, since_vocab: Any, since: int
) -> dict[Any, _Map]:
  """The id maps by params key path, checked against ``stack``."""
  _check_alive(
    vocab, "vocab", "Pass the maps the step returned, after the step."
  )
  _check_alive(
    since_vocab,
    "since_vocab",
    "Keep a copy of the maps at each publish, beside `last`: "
    "`last_vocab = jax.tree.map(jnp.copy, vocab)`, and pass it as "
    "`since_vocab`.",
  )
  if vocab is None:
    if stack is not None or since_vocab is not None:
      raise ValueError(
        "gradtx.delta: `stack` and `since_vocab` go with `vocab`, the id maps "
        "of the stack's hashed tables; pass all three (since_vocab None on "
        "the first publish)."
      )
    return {}
  if not isinstance(stack, TableStack):
    raise ValueError(
      "gradtx.delta `vocab` needs `stack=`, the gradtx.TableStack whose id "
      "maps it holds."
    )
  is_vocab = lambda x: isinstance(x, VocabState)  # noqa: E731
  now = dict(jax.tree_util.tree_flatten_with_path(vocab, is_leaf=is_vocab)[0])
  if since_vocab is None:
    if since:
      raise ValueError(
        "gradtx.delta: a hashed table's delta after a publish needs "
        "`since_vocab`, the id maps as they were at that publish (a copy of "
        "`vocab` taken then), which names the ids evicted since."
      )
    then = dict.fromkeys(now)
  else:
    then = dict(
      jax.tree_util.tree_flatten_with_path(since_vocab, is_leaf=is_vocab)[0]
    )
  if set(then) != set(now) or not all(is_vocab(v) for v in now.values()):
    raise ValueError(
      "gradtx.delta: `vocab` and `since_vocab` must be the dict "
      "`stack.init_vocab` returns (or a tree prefix of params placing it "
      "where the stack's params sit), both of one shape."
    )
  out = {}
  for path, v in now.items():
    name = getattr(path[-1], "key", None) if path else None
    if name not in stack.maps:
      raise ValueError(
        f"gradtx.delta `vocab` has a map at {jax.tree_util.keystr(path)}, "
        f"which is not one of the stack's maps {list(stack.maps)}."
      )
    out[path] = _Map(name, stack, v, then[path])
  return out


def _table_of(stack: TableStack, name: str, ids: np.ndarray) -> np.ndarray:
  """Index in ``list(stack.tables)`` of the table of each array row."""
  s = stack.stacks[name]
  names = list(stack.tables)
  index = np.asarray([names.index(t) for t in s.tables], np.int32)
  return index[s.table_of(ids)]


@jax.jit
def _words(state: VocabState, ids: jax.Array) -> tuple[jax.Array, ...]:
  """The owner words, liveness and birth step of rows ``ids``."""
  at = jnp.minimum(ids, state.key_hi.shape[0] - 1)
  return state.key_hi[at], state.key_lo[at], state.last_seen[at], state.born[at]


def _owners(m: _Map, ids: np.ndarray, padded: jax.Array) -> dict[str, Any]:
  """Each changed row's table and owner, and the tombstones."""
  n = ids.shape[0]
  hi, lo, seen, born = (np.asarray(x)[:n] for x in _words(m.now, padded))
  tables = _table_of(m.stack, m.name, ids)
  live = seen >= 0
  owners = np.where(live, _raw(hi, lo), -1)
  tombstones = None
  if m.then is not None:
    v = int(m.then.step)
    new = live & (born >= v)
    ohi, olo, oseen, _ = (np.asarray(x)[:n] for x in _words(m.then, padded))
    gone = new & (oseen >= 0)
    old_tables, old_ids = tables[gone], _raw(ohi[gone], olo[gone])
    # an evicted id that owns a row again is an upsert, not a tombstone
    keep = np.ones(len(old_ids), bool)
    for t in np.unique(old_tables):
      here = old_tables == t
      keep[here] = ~np.isin(old_ids[here], owners[live & (tables == t)])
    if keep.any():
      pairs = np.unique(np.stack([old_tables[keep], old_ids[keep]], 1), axis=0)
      tombstones = {
        "tables": pairs[:, 0].astype(np.int32),
        "ids": pairs[:, 1].astype(np.int64),
      }
  return {"tables": tables, "owners": owners, "tombstones": tombstones}


# ----------------------------------------------------------------------------
# delta and apply_delta


def delta(
  params: Any,
  opt_state: Any,
  since: Any = None,
  *,
  stack: Any = None,
  vocab: Any = None,
  since_vocab: Any = None,
  skip_hashed: bool = False,
) -> Delta:
  """The rows changed after step ``since``, with their current values.

  Reads the :func:`track_changes` record wherever it sits in ``opt_state``
  and returns, per table, the sorted ids of the rows changed after
  ``since`` and their current values in ``params``, and every other leaf
  whole when it changed; ``step`` is where the next delta starts. Applying
  every delta in order (:func:`apply_delta`) to a copy of the initial
  params gives ``params`` bit for bit, and a delta holds only rows that
  an update wrote after ``since`` or the id map gave out since.

  Call it outside ``jit``, between steps. It compiles small programs (a
  count, the ids, a gather) once per table shape and size bucket, reads
  the record whole (of a row-sharded table too: 4 bytes a row) and copies
  the changed rows to the host.

  Hashed tables: pass the :class:`gradtx.TableStack` as ``stack`` and its
  id maps as ``vocab`` (``stack.init_vocab``'s dict, or a tree prefix of
  params placing it where the stack's params sit, as for
  :func:`gradtx.reset_rows`), and from the second publish on the maps as
  they were at the last publish as ``since_vocab`` (keep a copy:
  ``jax.tree.map(jnp.copy, vocab)``; save it with ``since``). The rows
  the map gave to new ids since then count as changed (their fresh values
  were written by :func:`gradtx.reset_rows`), and ``maps`` gives every
  changed row's table and owner raw id, and the evicted raw ids. The first
  delta (``since=None``) gives every live row with its owner: the whole
  map, for a first publish.

  Params whose rows :func:`gradtx.reset_rows` made fresh (a hashed stack's)
  are refused without ``vocab``: their record is in the map, and a delta
  without it would miss those rows and name no owner. A consumer that
  serves none of them passes ``skip_hashed=True``. A delta whose rows hold
  NaN or inf is refused too: a non-finite update never reaches serving
  (``optax.apply_if_finite`` around the chain skips such steps).

  Args:
    params: the params now.
    opt_state: the state of an optimizer holding :func:`track_changes`.
    since: None (since init) or the ``step`` of an earlier delta.
    stack: a :class:`gradtx.TableStack` (with ``vocab``).
    vocab: its id maps now.
    since_vocab: its id maps at the delta ``since`` came from.
    skip_hashed: True to publish without the leaves whose rows
      :func:`gradtx.reset_rows` made fresh (their entries None, ``maps``
      None), for a consumer that serves none of the hashed tables;
      without ``vocab`` only.

  Returns:
    A :class:`Delta`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradtx as gtx
    >>> params = {"emb": jnp.zeros((4, 2))}
    >>> tx = optax.chain(gtx.lazy_sgd(1.0), gtx.track_changes())
    >>> state = tx.init(params)
    >>> serving, last = params, None
    >>> for row in [1, 3]:
    ...   g = {"emb": gtx.SparseRows(jnp.array([row]), jnp.ones((1, 2)), 4)}
    ...   u, state = tx.update(g, state, params)
    ...   params = gtx.apply_updates(params, u)
    ...   d = gtx.delta(params, state, since=last)
    ...   last = d.step
    ...   serving = gtx.apply_delta(serving, d)
    ...   print(d.params["emb"]["ids"])
    [1]
    [3]
    >>> bool((serving["emb"] == params["emb"]).all())
    True
  """
  step, records, fresh = _records(params, opt_state)
  since = _since(since, step)
  maps = _maps(params, stack, vocab, since_vocab, since)
  paths, treedef = jax.tree_util.tree_flatten_with_path(
    params, is_leaf=_is_skip
  )
  # Which leaves hold a hashed stack's rows: those gradtx.reset_rows made
  # fresh, as the tracker's state records it (FreshMarks). Not the params'
  # keys (a plain stack's are named alike) nor a registry of stacks (a
  # publishing process may never build one): the mark lives in the
  # optimizer state, is checkpointed with it, and is set by the one call
  # whose writes the record cannot see, so a delta without the map would
  # miss rows, not only their owners. (A step that maps ids without
  # reset_rows leaves no mark; it also gives new ids stale rows, which the
  # guides' step rules out.)
  marked = [k for (k, _), f in zip(paths, fresh, strict=True) if f]
  _check_fresh(
    _names(marked),
    _names([k for k in marked if k not in maps]),
    vocab,
    skip_hashed,
  )
  since_arr = jnp.asarray(since, jnp.int32)
  out, map_out, bad = [], {}, []
  for (path, p), rec, f in zip(paths, records, fresh, strict=True):
    if _is_skip(p):
      out.append(None)
      continue
    m = maps.pop(path, None)
    if skip_hashed and f:
      out.append(None)
      continue
    if rec.ndim == 0:
      if m is not None:
        raise ValueError(
          "gradtx.delta `vocab` has a map for the params leaf "
          f"{jax.tree_util.keystr(path)}, which gradtx.track_changes records "
          "whole; record it row by row (`per_row` True for it)."
        )
      out.append(np.asarray(p) if int(rec) > since else None)
      if out[-1] is not None and not _finite(out[-1]):
        bad.append(path)
      continue
    rec = _whole(rec)
    if m is None:
      mask = _changed_mask(rec, since_arr)
    else:
      v = 0 if m.then is None else int(m.then.step)
      mask = _fresh_mask(
        rec, since_arr, m.now.last_seen, m.now.born, jnp.asarray(v, jnp.int32)
      )
    ids, padded = _changed_rows(mask)
    if not len(ids):
      out.append(None)
      if m is not None:
        map_out[m.name] = None
      continue
    if m is not None:
      map_out[m.name] = _owners(m, ids, padded)
    values = np.asarray(_take(jnp.asarray(p), padded))[: len(ids)]
    out.append({"ids": ids, "values": values})
    if not _finite(values):
      bad.append(path)
  if bad:
    raise ValueError(
      f"gradtx.delta: the rows it would publish of {_names(bad)} "
      "hold NaN or inf: a non-finite update reached the params, and "
      "nothing was published. Restore the params and optimizer state from "
      "the last checkpoint, and skip such steps with "
      "`optax.apply_if_finite(optax.chain(opt, gtx.track_changes()), "
      "max_consecutive_errors)` (it applies a non-finite update after that "
      "many in a row)."
    )
  if maps:
    raise ValueError(
      "gradtx.delta `vocab` places maps at "
      f"{[jax.tree_util.keystr(k) for k in maps]}, where params has no "
      "table; place it where the stack's params sit."
    )
  return Delta(
    step=np.asarray(step, np.int32),
    params=jax.tree.unflatten(treedef, out),
    maps=map_out if vocab is not None else None,
  )


def _names(paths: list[Any]) -> str:
  """Params leaves as the user indexes them: ``params['emb'], ...``."""
  return ", ".join("params" + jax.tree_util.keystr(k) for k in paths)


def _check_fresh(
  fresh: str, unmapped: str, vocab: Any, skip_hashed: bool
) -> None:
  """Refuses a delta that would lose the rows an id map gave out."""
  if not isinstance(skip_hashed, bool):
    raise TypeError(
      f"gradtx.delta `skip_hashed` must be a bool; got {skip_hashed!r}."
    )
  if skip_hashed:
    if vocab is not None:
      raise ValueError(
        "gradtx.delta: `skip_hashed=True` publishes without the hashed "
        "tables, `vocab` with them; pass one of the two."
      )
    return
  if vocab is None and fresh:
    raise ValueError(
      f"gradtx.delta: gradtx.reset_rows made rows of {fresh} fresh (a "
      "hashed gtx.TableStack's rows given to new ids); "
      "their changes are in the id map, not in the track_changes record, "
      "so a delta without it would miss rows and name no owner or evicted "
      "id. Pass the stack and its maps: `gtx.delta(params, state, "
      "since=last, stack=stack, vocab=vocab, since_vocab=last_vocab)` "
      "(`last_vocab = jax.tree.map(jnp.copy, vocab)` kept at each "
      "publish), or `skip_hashed=True` to publish without these leaves "
      "(for a consumer that serves none of them)."
    )
  if vocab is not None and unmapped:
    raise ValueError(
      f"gradtx.delta `vocab` has no map for {unmapped}, "
      "whose rows gradtx.reset_rows made fresh: pass every stack's maps "
      "(`stack.init_vocab`'s dict, placed where the stack's params sit)."
    )


def _field(d: Any, name: str) -> Any:
  if isinstance(d, Mapping):
    return d[name]
  return getattr(d, name)


def _write(s: Any, change: Any) -> Any:
  if change is None:
    return s
  if isinstance(change, Mapping):
    ids = np.asarray(change["ids"])
    values = change["values"]
    if isinstance(s, jax.Array):
      return s.at[jnp.asarray(ids)].set(jnp.asarray(values, s.dtype))
    s = np.array(s)
    s[ids] = np.asarray(values, s.dtype)
    return s
  if jnp.shape(change) != jnp.shape(s):
    raise ValueError(
      f"gradtx.apply_delta: a delta leaf of shape {jnp.shape(change)} for a "
      f"serving leaf of shape {jnp.shape(s)}; apply deltas of this model."
    )
  if isinstance(s, jax.Array):
    return jax.device_put(jnp.asarray(change, s.dtype), s.sharding)
  return np.array(change, dtype=np.asarray(s).dtype)


def apply_delta(serving: Any, d: Any) -> Any:
  """``serving`` with the changes of delta ``d`` written in: a new tree.

  ``serving`` is shaped like the params (jax or numpy arrays, for example
  a copy of the initial params or of an earlier publish); a table's
  changed rows are set, a changed dense leaf replaced, the rest kept.
  Applying every :func:`delta` of a run in order to a copy of its initial
  params gives its params, bit for bit. ``d`` may be the :class:`Delta` or
  what orbax restores of it (a dict with the same keys).

  Args:
    serving: the serving copy.
    d: a delta.

  Returns:
    The serving copy with the delta applied (``serving`` itself is not
    changed).
  """
  leaves, treedef = jax.tree.flatten(serving, is_leaf=_is_skip)
  try:
    changes = treedef.flatten_up_to(_field(d, "params"))
  except (ValueError, TypeError) as e:
    raise ValueError(
      "gradtx.apply_delta: the delta's params do not have the tree structure "
      f"of `serving` ({treedef}); apply deltas of this model's params."
    ) from e
  out = [
    s if _is_skip(s) else _write(s, c)
    for s, c in zip(leaves, changes, strict=True)
  ]
  return jax.tree.unflatten(treedef, out)
