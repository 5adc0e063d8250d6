"""Applying sparse updates, and the sparse-aware versions of the optax
transforms people chain around an optimizer: ``apply_updates``, ``scale``,
``scale_by_learning_rate``, ``clip_by_global_norm``, ``add_decayed_weights``,
``global_norm``, and ``densify``, the escape hatch to any dense optax
transform.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradtx._precision import (
  ROUNDED_DTYPES,
  check_key,
  round_with_bits,
  row_bits,
)
from gradtx._rowio import (
  gather_rows,
  per_row,
  scatter_add_rows,
  scatter_rows,
)
from gradtx._sparse_rows import SparseRows, check_rows_match
from gradtx._update_trees import (
  check_tree_match,
  is_update_leaf,
  map_updates,
  stateless,
  tree_leaves,
  tree_map,
  zero_counter,
)

# ----------------------------------------------------------------------------
# apply_updates


def _round_rows(rows: jax.Array, dtype: Any, key: Any, ids: jax.Array):
  """float32 ``rows`` ``[n, ...]`` rounded stochastically to ``dtype``, row
  ``j`` with the bits of row id ``ids[j]`` (:func:`row_bits`): the same
  whichever rows are updated together and however they are sharded."""
  flat = rows.reshape(rows.shape[0], -1)
  bits = row_bits(key, ids, flat.shape[1])
  return round_with_bits(flat, dtype, bits).reshape(rows.shape)


def _apply_rounded(u: Any, p: jax.Array, key: Any) -> jax.Array:
  """``p + u`` in float32, written to ``p``'s low-precision dtype with
  stochastic rounding (only the touched rows of a SparseRows)."""
  f32 = jnp.float32
  if isinstance(u, SparseRows):
    u = u.deduplicated()
    idx = u.valid_indices()
    rows = gather_rows(p, idx, unique=True).astype(f32) + u.values.astype(f32)
    return scatter_rows(p, idx, _round_rows(rows, p.dtype, key, idx))
  whole = p.reshape((p.shape[0] if p.ndim else 1, -1))
  new = whole.astype(f32) + jnp.asarray(u, f32).reshape(whole.shape)
  ids = jnp.arange(whole.shape[0], dtype=jnp.int32)
  return _round_rows(new, p.dtype, key, ids).reshape(p.shape)


def apply_updates(params: Any, updates: Any, *, key: Any = None) -> Any:
  """Adds ``updates`` to ``params``; SparseRows are scatter-added in place.

  Like ``optax.apply_updates``: each result keeps its parameter's dtype and
  a None update leaves the parameter unchanged. A :class:`SparseRows`
  update is added row by row (duplicates add up, padding ids write nothing)
  with one XLA scatter, which updates the table in place when the caller
  donates ``params`` to its jitted step.

  With a ``key``, every bfloat16 / float16 parameter is computed as float32
  ``p + u`` and written with :func:`stochastic_round` (a SparseRows: its
  touched rows only), so updates smaller than half a unit in the last place
  survive on average instead of rounding away (FBGEMM's
  ``stochastic_rounding`` of FP16 tables), with :func:`stochastic_round`'s
  rule. The random bits of an element come from ``fold_in(key, leaf)``
  (``leaf``: the position in the tree), its row id and its column, through
  an integer hash (a few integer ops per element, not a PRNG key per row),
  so the result does not depend on sharding or on which rows are
  updated together; pass a fresh key each step
  (``jax.random.fold_in(key, step)``) for reruns and resumes that are
  bit-identical. float32 parameters are added as without a key.

  Args:
    params: a tree of arrays.
    updates: a tree of the same structure; arrays, None or SparseRows.
    key: None, or a JAX PRNG key for stochastic rounding.

  Returns:
    The updated params.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import gradtx as gtx
    >>> u = gtx.SparseRows(jnp.array([1]), jnp.full((1, 2), 0.5), 3)
    >>> gtx.apply_updates({"emb": jnp.zeros((3, 2))}, {"emb": u})["emb"]
    Array([[0. , 0. ],
           [0.5, 0.5],
           [0. , 0. ]], dtype=float32)
    >>> p = jnp.ones((3, 2), jnp.bfloat16)    # 1e-3 is below bf16's ulp
    >>> tiny = gtx.SparseRows(jnp.array([1]), jnp.full((1, 2), 1e-3), 3)
    >>> gtx.apply_updates(p, tiny)[1]           # nearest: lost
    Array([1, 1], dtype=bfloat16)
    >>> keys = jax.random.split(jax.random.key(0), 2000)
    >>> draws = jax.vmap(lambda k: gtx.apply_updates(p, tiny, key=k)[1])(keys)
    >>> bool(abs(jnp.mean(draws.astype(jnp.float32)) - 1.001) < 3e-4)
    True
  """
  check_tree_match(updates, params, name="updates", reference_name="params")
  if key is not None:
    key = check_key(key, "gradtx.apply_updates")
  leaves, treedef = jax.tree.flatten(updates, is_leaf=is_update_leaf)
  p_leaves = treedef.flatten_up_to(params)

  def apply(i, u, p):
    if u is None:
      return p
    if isinstance(u, SparseRows):
      check_rows_match(u, p, "gradtx.apply_updates")
    elif jnp.shape(u) != jnp.shape(p):
      raise ValueError(
        f"gradtx.apply_updates: an update of shape {jnp.shape(u)} for a "
        f"parameter of shape {jnp.shape(p)}. Updates must have their "
        "parameter's shape (no broadcasting)."
      )
    p = jnp.asarray(p)
    if key is not None and p.dtype in ROUNDED_DTYPES:
      return _apply_rounded(u, p, jax.random.fold_in(key, i))
    if isinstance(u, SparseRows):
      return scatter_add_rows(p, u.valid_indices(), u.values, unique=u.unique)
    return jnp.asarray(p + u).astype(p.dtype)

  pairs = enumerate(zip(leaves, p_leaves, strict=True))
  out = [apply(i, u, p) for i, (u, p) in pairs]
  return jax.tree.unflatten(treedef, out)


# ----------------------------------------------------------------------------
# sparse-aware transformations


def densify() -> optax.GradientTransformationExtraArgs:
  """Turns every SparseRows in the updates into a dense array.

  The escape hatch to any dense optax transform: ``optax.chain(
  gtx.densify(), optax.adam(1e-3))``. It builds a ``[num_rows, ...]`` array
  per table, so put it as late in the chain as you can.

  Returns:
    A stateless transformation.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradtx as gtx
    >>> g = gtx.SparseRows(jnp.array([0, 0]), jnp.ones((2, 1)), 2)
    >>> gtx.densify().update(g, optax.EmptyState())[0]
    Array([[2.],
           [0.]], dtype=float32)
  """

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    return tree_map(
      lambda u: u.to_dense() if isinstance(u, SparseRows) else u, updates
    ), state

  return stateless(update_fn)


def scale_tree(updates: Any, factor: Any, cast_first: bool = False) -> Any:
  """Each leaf times ``factor``, returned in the leaf's dtype.

  ``cast_first``: ``factor`` is rounded to the leaf's dtype before the
  product (optax's ``scale_by_schedule``). Otherwise the product follows
  JAX's promotion (``optax.scale``): a Python float is weakly typed, so the
  same; a float32 array (under ``inject_hyperparams``) multiplies in
  float32 and the product is rounded once.
  """

  def mul(x):
    f = jnp.asarray(factor, x.dtype) if cast_first else factor
    return (f * x).astype(x.dtype)

  return map_updates(mul, updates)


def scale(step_size: float) -> optax.GradientTransformationExtraArgs:
  """Multiplies updates by ``step_size``; SparseRows scale their values.

  Dense leaves behave exactly as ``optax.scale``.

  Args:
    step_size: a scalar.

  Returns:
    A stateless transformation.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradtx as gtx
    >>> g = gtx.SparseRows(jnp.array([1]), jnp.ones((1, 2)), 4)
    >>> gtx.scale(-0.1).update(g, optax.EmptyState())[0].values
    Array([[-0.1, -0.1]], dtype=float32)
  """

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    return scale_tree(updates, step_size), state

  return stateless(update_fn)


def scale_by_learning_rate(
  learning_rate: float | optax.Schedule, *, flip_sign: bool = True
) -> optax.GradientTransformationExtraArgs:
  """Scales updates by ``-learning_rate`` (a float or an optax schedule).

  Dense leaves behave exactly as ``optax.scale_by_learning_rate``;
  SparseRows scale their values.

  Args:
    learning_rate: a float, or a schedule ``count -> learning rate``.
    flip_sign: multiply by ``-learning_rate`` (descent) when True.

  Returns:
    A transformation; with a schedule its state is optax's
    ``ScaleByScheduleState``, the int32 count of steps taken (saturating).

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> tx = gtx.scale_by_learning_rate(0.5)
    >>> tx.update(jnp.ones(2), tx.init(jnp.ones(2)))[0]
    Array([-0.5, -0.5], dtype=float32)
  """
  sign = -1 if flip_sign else 1
  if not callable(learning_rate):
    return scale(sign * learning_rate)

  def init_fn(params):
    del params
    return optax.ScaleByScheduleState(count=zero_counter())

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    lr = learning_rate(state.count)
    return scale_tree(
      updates, sign * lr, cast_first=True
    ), optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _valid_values(u: SparseRows) -> jax.Array:
  """The values of ``u``'s valid rows, zeros at its padding rows."""
  keep = per_row(u.valid_indices() < u.num_rows, u.values.ndim)
  return jnp.where(keep, u.values, jnp.zeros((), u.dtype))


def global_norm(updates: Any) -> jax.Array:
  """The global L2 norm of a tree of arrays and SparseRows.

  A SparseRows counts as the dense array it stands for: duplicates are
  summed first, padding rows count zero.
  """
  total = jnp.zeros([], jnp.float32)
  for u in tree_leaves(updates):
    if isinstance(u, SparseRows):
      u = _valid_values(u.deduplicated())
    total = total + jnp.sum(jnp.square(jnp.asarray(u, jnp.float32)))
  return jnp.sqrt(total)


def clip_by_global_norm(
  max_norm: float,
) -> optax.GradientTransformationExtraArgs:
  """Clips updates to a maximum global L2 norm (``optax.clip_by_global_norm``).

  The norm covers every dense leaf and every SparseRows as the dense array
  it stands for (duplicates summed, so a row counts once). SparseRows come
  out deduplicated (each id once, :attr:`SparseRows.unique`), which the
  next sparse step would do anyway: it then skips its own deduplication.

  .. math::
    u \\leftarrow u \\cdot \\min(1, \\text{max\\_norm} / \\lVert u \\rVert_2)

  Args:
    max_norm: the largest allowed global norm.

  Returns:
    A stateless transformation.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradtx as gtx
    >>> g = gtx.SparseRows(jnp.array([0, 0]), jnp.full((2, 1), 3.0), 3)
    >>> u, _ = gtx.clip_by_global_norm(1.0).update(g, optax.EmptyState())
    >>> u.to_dense()
    Array([[1.],
           [0.],
           [0.]], dtype=float32)
  """

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    updates = tree_map(
      lambda u: u.deduplicated() if isinstance(u, SparseRows) else u, updates
    )
    norm = global_norm(updates)
    trigger = norm < max_norm

    def clip(x):
      return lax.select(trigger, x, (x / norm.astype(x.dtype)) * max_norm)

    return map_updates(clip, updates), state

  return stateless(update_fn)


def _resolve_mask(mask: Any, params: Any) -> Any:
  if mask is None:
    return tree_map(lambda _: True, params)
  return mask(params) if callable(mask) else mask


def add_decayed_weights(
  weight_decay: float = 0.0, mask: Any = None
) -> optax.GradientTransformationExtraArgs:
  """Adds ``weight_decay * params`` to the updates (decoupled weight decay).

  Dense leaves behave exactly as ``optax.add_decayed_weights``. For a
  SparseRows update only the touched rows decay: the update is coalesced
  and ``weight_decay * params[row]`` is added once per touched row. Rows
  not in the gradient are left alone, as users of sparse tables expect.

  Args:
    weight_decay: the decay rate.
    mask: a tree of bools like params (or a callable ``params -> tree``);
      leaves where it is False pass through unchanged.

  Returns:
    A stateless transformation that needs ``params``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradtx as gtx
    >>> p = jnp.ones((3, 1))
    >>> g = gtx.SparseRows(jnp.array([2]), jnp.zeros((1, 1)), 3)
    >>> tx = gtx.add_decayed_weights(0.1)
    >>> tx.update(g, optax.EmptyState(), p)[0].to_dense()
    Array([[0. ],
           [0. ],
           [0.1]], dtype=float32)
  """

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if params is None:
      raise ValueError(
        "gradtx.add_decayed_weights needs `params`: call "
        "`tx.update(updates, state, params)`."
      )
    check_tree_match(updates, params, name="updates", reference_name="params")
    m = _resolve_mask(mask, params)

    def decay(u, p, keep):
      if u is None or not keep:
        return u
      if isinstance(u, SparseRows):
        check_rows_match(u, p, "gradtx.add_decayed_weights")
        u = u.deduplicated()
        rows = gather_rows(jnp.asarray(p), u.indices, unique=True)
        return u.with_values((u.values + weight_decay * rows).astype(u.dtype))
      return (u + weight_decay * p).astype(jnp.asarray(u).dtype)

    return tree_map(decay, updates, params, m), state

  return stateless(update_fn)
