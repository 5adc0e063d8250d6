"""Fresh rows: rows made new in the params and in every optimizer state.

:class:`FreshRows` names rows of a params leaf and their new values;
:func:`reset_rows` writes the values into the params and gives the rows, in
every leaf of the optimizer state that follows them, the values the
optimizer's ``init`` gives (a SparseRows buffer drops its entries on them),
so a row made fresh continues as a row never touched. It works for any optax
transformation; the id map of hashed tables (``_vocab``) builds the
FreshRows of the rows it gives to new ids. :func:`drop_entries` makes entries of
a SparseRows padding. :class:`FreshMarks`, a part of a state that must know
which leaves had rows made fresh (``track_changes``, whose record does not
hold them), is stamped by every :func:`reset_rows`. :func:`fresh_normal`
draws the default initializer's values of fresh rows from a counter-based
hash (:func:`threefry2x32` written out round by round).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradtx._rowio import scatter_rows
from gradtx._sparse_rows import SparseRows

__all__ = ["FreshMarks", "FreshRows", "reset_rows"]


class FreshRows(NamedTuple):
  """Rows given to new ids in a step, for :func:`reset_rows`.

  Attributes:
    rows: int32 ``[n]`` rows of the params' array; the array's row count
      marks an unused slot.
    values: ``[n, dim]`` the rows' new values (the table's initializer).
  """

  rows: jax.Array
  values: jax.Array


class FreshMarks(NamedTuple):
  """Which params leaves :func:`reset_rows` made rows fresh in: held by a
  state that must know it (``gradtx.track_changes``: the rows are written
  outside the updates it records), stamped by every :func:`reset_rows`
  that gets the state."""

  # Like params: int32 [] per leaf (1: reset_rows has made rows of it fresh,
  # even if every slot was unused; 0: never), None where no leaf.
  made: Any


# -- fresh rows in the params and every optimizer state -----------------------
def _is_node(x: Any) -> bool:
  return isinstance(x, SparseRows)


def _abstract(params: Any) -> list[jax.ShapeDtypeStruct]:
  return [
    jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
    for x in jax.tree.leaves(params)
  ]


def _check_state(optimizer: Any, opt_state: Any, params: Any) -> list[Any]:
  """``opt_state`` has the structure and shapes ``optimizer.init(params)``
  gives; returns that state's abstract leaves (SparseRows whole)."""
  if not hasattr(optimizer, "init"):
    raise TypeError(
      "gradtx.reset_rows: `optimizer` must be the optax transformation "
      f"whose state `opt_state` is; got {type(optimizer).__name__}."
    )
  treedef = jax.tree.structure(params)
  want = jax.eval_shape(optimizer.init, treedef.unflatten(_abstract(params)))
  same = jax.tree.structure(opt_state, is_leaf=_is_node) == jax.tree.structure(
    want, is_leaf=_is_node
  ) and [jnp.shape(x) for x in jax.tree.leaves(opt_state)] == [
    x.shape for x in jax.tree.leaves(want)
  ]
  if not same:
    raise ValueError(
      "gradtx.reset_rows: `opt_state` is not the state that `optimizer` "
      "builds for `params` (its tree or shapes differ): pass the "
      "transformation whose `init(params)` made `opt_state`, the one its "
      "`update` runs with."
    )
  return jax.tree.leaves(want, is_leaf=_is_node)


def _row_leaves(
  optimizer: Any, params: Any, where: int, base: list[Any]
) -> list[bool]:
  """Which leaves of ``optimizer.init(params)`` (SparseRows whole, their
  abstract values ``base``) follow the rows of params leaf ``where``:
  their leading axis (a SparseRows: its ``num_rows``) grows with that
  leaf's rows."""
  treedef = jax.tree.structure(params)
  grown = _abstract(params)
  x = grown[where]
  grown[where] = jax.ShapeDtypeStruct((x.shape[0] + 1, *x.shape[1:]), x.dtype)
  more = jax.tree.leaves(
    jax.eval_shape(optimizer.init, treedef.unflatten(grown)), is_leaf=_is_node
  )
  if len(base) != len(more):
    raise ValueError(
      "gradtx.reset_rows: the optimizer's state changes its structure with "
      "a table's row count; its rows cannot be found."
    )

  def lead(s):
    if isinstance(s, SparseRows):
      return s.num_rows
    return s.shape[0] if s.shape else None

  return [
    lead(a) is not None and lead(b) == lead(a) + 1
    for a, b in zip(base, more, strict=True)
  ]


def reset_rows(
  optimizer: Any, opt_state: Any, params: Any, fresh: Any
) -> tuple[Any, Any]:
  """Makes rows fresh: new values in the params, init values in every
  optimizer state.

  For each params leaf that ``fresh`` holds a :class:`FreshRows` for, its
  rows are set to the new values, and in ``opt_state`` every leaf whose
  leading axis follows that leaf's rows (moments, accumulators, 8-bit codes
  and scales, lazy Adam's per-row steps) gets the values ``optimizer.init``
  gives those rows, while a SparseRows buffer (``gtx.accumulate``'s) drops
  its entries on them. So a row given to a new id continues exactly as a
  row never touched. Works for any optax transformation whose ``init``
  treats rows alike (every gradtx and optax one), inside ``jit``.

  Args:
    optimizer: the transformation ``opt_state`` is the state of (a state
      that its ``init(params)`` would not build is refused).
    opt_state: its state.
    params: the params (a dict or any pytree).
    fresh: a tree prefix of ``params`` (a dict with some of its keys) whose
      leaves are :class:`FreshRows` (or None): what
      :meth:`gradtx.TableStack.admit` returns, placed where the stack's
      params sit in ``params``.

  Returns:
    ``(params, opt_state)`` with the rows fresh.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> params = {"emb": jnp.ones((4, 2))}
    >>> tx = gtx.lazy_adam(0.1)
    >>> state = tx.init(params)
    >>> # row 1 gets zeros; row 4 (the row count) is an unused slot
    >>> fresh = {"emb": gtx.FreshRows(jnp.array([1, 4]), jnp.zeros((2, 2)))}
    >>> params, state = gtx.reset_rows(tx, state, params, fresh)
    >>> params["emb"][:, 0]
    Array([1., 0., 1., 1.], dtype=float32)
  """
  is_fresh = lambda x: isinstance(x, FreshRows)  # noqa: E731
  where = {
    path: m
    for path, m in jax.tree_util.tree_flatten_with_path(
      fresh, is_leaf=is_fresh
    )[0]
    if isinstance(m, FreshRows)
  }
  paths, treedef = jax.tree_util.tree_flatten_with_path(params)
  leaves = [x for _, x in paths]
  marks = [where.pop(path, None) for path, _ in paths]
  if where:
    raise ValueError(
      "gradtx.reset_rows: `fresh` must be a prefix of `params` (the "
      "FreshRows of TableStack.admit where the stack's params sit); no "
      "params leaf at "
      f"{[jax.tree_util.keystr(k) for k in where]}."
    )
  new_leaves = list(leaves)
  small = list(leaves)
  for i, m in enumerate(marks):
    if m is None:
      continue
    if m.values.shape[1:] != leaves[i].shape[1:]:
      raise ValueError(
        f"gradtx.reset_rows: fresh values of shape {m.values.shape} for a "
        f"params leaf of shape {leaves[i].shape}."
      )
    new_leaves[i] = scatter_rows(leaves[i], m.rows, m.values, unique=False)
    small[i] = m.values.astype(leaves[i].dtype)
  params = treedef.unflatten(new_leaves)
  if opt_state is None:
    return params, None
  base = _check_state(optimizer, opt_state, treedef.unflatten(leaves))
  state_leaves, state_def = jax.tree.flatten(opt_state, is_leaf=_is_node)
  fresh_state = None
  for i, m in enumerate(marks):
    if m is None:
      continue
    follows = _row_leaves(optimizer, treedef.unflatten(leaves), i, base)
    if fresh_state is None:
      fresh_state = jax.tree.leaves(
        optimizer.init(treedef.unflatten(small)), is_leaf=_is_node
      )
    for j, yes in enumerate(follows):
      if yes:
        state_leaves[j] = _reset_leaf(state_leaves[j], fresh_state[j], m.rows)
  made = {
    path for (path, _), m in zip(paths, marks, strict=True) if m is not None
  }
  return params, _stamp(state_def.unflatten(state_leaves), made)


def _stamp(opt_state: Any, made: set[Any]) -> Any:
  """``opt_state`` with every :class:`FreshMarks` marking the leaves at
  the params paths ``made``."""

  def stamp(x):
    if not isinstance(x, FreshMarks):
      return x
    return FreshMarks(
      jax.tree_util.tree_map_with_path(
        lambda path, v: jnp.ones_like(v) if path in made else v, x.made
      )
    )

  return jax.tree.map(
    stamp, opt_state, is_leaf=lambda x: isinstance(x, FreshMarks)
  )


def _reset_leaf(leaf: Any, init: Any, rows: jax.Array) -> Any:
  if isinstance(leaf, SparseRows):
    ordered = jnp.sort(rows)
    at = jnp.clip(jnp.searchsorted(ordered, leaf.indices), 0, rows.shape[0] - 1)
    return drop_entries(leaf, ordered[at] == leaf.indices)
  return scatter_rows(leaf, rows, init, unique=False)


def drop_entries(g: SparseRows, drop: jax.Array) -> SparseRows:
  """``g`` with the entries ``drop`` marks made padding (no row, zeros)."""
  shape = (-1,) + (1,) * (g.values.ndim - 1)
  return SparseRows(
    jnp.where(drop, g.num_rows, g.indices).astype(g.indices.dtype),
    jnp.where(drop.reshape(shape), 0, g.values).astype(g.values.dtype),
    g.num_rows,
  )


_U32 = np.uint32
# Threefry-2x32's rotations and key-schedule constant (Salmon et al. 2011)
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA


def threefry2x32(
  key: tuple[jax.Array, jax.Array], x: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
  """Threefry-2x32 with 20 rounds, written out round by round: two uint32
  words of key and of counter (broadcast alike) to two uint32 words. The
  cipher of JAX's default PRNG; unrolled here so that its program is
  straight-line integer ops, with no loop on any backend."""
  k0, k1 = (jnp.asarray(k, jnp.uint32) for k in key)
  ks = (k0, k1, k0 ^ k1 ^ _U32(_PARITY))
  x0 = jnp.asarray(x[0], jnp.uint32) + ks[0]
  x1 = jnp.asarray(x[1], jnp.uint32) + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = (x1 << _U32(r)) | (x1 >> _U32(32 - r))
      x1 = x1 ^ x0
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + _U32(i + 1)
  return x0, x1


def fresh_normal(
  rng: jax.Array, step: jax.Array, rows: jax.Array, dim: int
) -> jax.Array:
  """``[m, dim]`` float32 standard normal values, row ``k`` a function of
  (``rng``, ``step``, ``rows[k]``) alone: the key of the step is
  Threefry-2x32 of the map's key words ``rng`` and counter ``(step, 0)``;
  element ``(k, j)`` takes word ``j % 2`` of Threefry-2x32 of that key and
  counter ``(rows[k], j // 2)``, as a uniform in ``(-1, 1)`` turned normal
  by ``sqrt(2) * erfinv``, the transform of ``jax.random.normal``. A
  counter-based draw: no state, no loop, the same values on every
  backend and sharding, and a row given out twice in different steps
  gets different values."""
  rng = jnp.asarray(rng, jnp.uint32)
  step_key = threefry2x32(
    (rng[0], rng[1]), (jnp.asarray(step).astype(jnp.uint32), _U32(0))
  )
  blocks = (dim + 1) // 2
  shape = (rows.shape[0], blocks)
  r = jnp.broadcast_to(rows.astype(jnp.uint32)[:, None], shape)
  b = jnp.broadcast_to(lax.iota(jnp.uint32, blocks)[None, :], shape)
  # materialized once a pair: fused into the interleave below, each
  # element would run the cipher for its pair again
  w0, w1 = lax.optimization_barrier(threefry2x32(step_key, (r, b)))
  bits = jnp.stack([w0, w1], axis=-1).reshape(rows.shape[0], 2 * blocks)
  bits = bits[:, :dim]
  # 23 bits of mantissa: a float in [1, 2), then [0, 1), then (-1, 1)
  one = lax.bitcast_convert_type(
    (bits >> _U32(9)) | _U32(0x3F800000), jnp.float32
  )
  low = np.nextafter(np.float32(-1.0), np.float32(1.0))
  u = jnp.maximum(low, (one - 1.0) * (1.0 - low) + low)
  return np.float32(np.sqrt(2.0)) * lax.erf_inv(u)
