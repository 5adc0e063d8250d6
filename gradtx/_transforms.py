"""Applying sparse updates, and the sparse-aware versions of the optax
transforms people chain around an optimizer: ``apply_updates``, ``scale``,
``scale_by_learning_rate``, ``clip_by_global_norm``, ``add_decayed_weights``,
``global_norm``, and ``densify``, the escape hatch to any dense optax
transform.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradtx._base import (
  SparseRows,
  check_rows_match,
  check_tree_match,
  gather_rows,
  safe_increment,
  scatter_add_rows,
  stateless,
  tree_leaves,
  tree_map,
  with_extra_args,
  zero_counter,
)

# ----------------------------------------------------------------------------
# apply_updates


def apply_updates(params: Any, updates: Any) -> Any:
  """Adds ``updates`` to ``params``; SparseRows are scatter-added in place.

  Like ``optax.apply_updates``: each result keeps its parameter's dtype and
  a None update leaves the parameter unchanged. A :class:`SparseRows`
  update is added row by row (duplicates add up, padding ids write nothing)
  with one XLA scatter, which updates the table in place when the caller
  donates ``params`` to its jitted step.

  Args:
    params: a tree of arrays.
    updates: a tree of the same structure; arrays, None or SparseRows.

  Returns:
    The updated params.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> u = gtx.SparseRows(jnp.array([1]), jnp.full((1, 2), 0.5), 3)
    >>> gtx.apply_updates({"emb": jnp.zeros((3, 2))}, {"emb": u})["emb"]
    Array([[0. , 0. ],
           [0.5, 0.5],
           [0. , 0. ]], dtype=float32)
  """
  check_tree_match(updates, params, name="updates", reference_name="params")

  def apply(u, p):
    if u is None:
      return p
    if isinstance(u, SparseRows):
      check_rows_match(u, p, "gradtx.apply_updates")
      return scatter_add_rows(jnp.asarray(p), u)
    if jnp.shape(u) != jnp.shape(p):
      raise ValueError(
        f"gradtx.apply_updates: an update of shape {jnp.shape(u)} for a "
        f"parameter of shape {jnp.shape(p)}. Updates must have their "
        "parameter's shape (no broadcasting)."
      )
    return jnp.asarray(p + u).astype(jnp.asarray(p).dtype)

  return tree_map(apply, updates, params)


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


def _scale_tree(updates: Any, factor: Any, cast_first: bool = False) -> Any:
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

  def f(u):
    if u is None:
      return None
    if isinstance(u, SparseRows):
      return u.with_values(mul(u.values))
    return mul(jnp.asarray(u))

  return tree_map(f, updates)


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
    return _scale_tree(updates, step_size), state

  return stateless(update_fn)


class ScaleByScheduleState(NamedTuple):
  """State of :func:`scale_by_learning_rate` with a schedule."""

  count: jax.Array  # int32 [], steps taken (saturating)


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
    A transformation; with a schedule its state counts the steps.

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
    return ScaleByScheduleState(count=zero_counter())

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    lr = learning_rate(state.count)
    return _scale_tree(
      updates, sign * lr, cast_first=True
    ), ScaleByScheduleState(count=safe_increment(state.count))

  return with_extra_args(init_fn, update_fn)


def _valid_values(u: SparseRows) -> jax.Array:
  """The values of ``u``'s valid rows, zeros at its padding rows."""
  keep = u.valid_indices() < u.num_rows
  keep = keep.reshape(keep.shape + (1,) * (u.values.ndim - 1))
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

    def clip_leaf(u):
      if u is None:
        return None
      if isinstance(u, SparseRows):
        return u.with_values(clip(u.values))
      return clip(u)

    return tree_map(clip_leaf, updates), state

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
