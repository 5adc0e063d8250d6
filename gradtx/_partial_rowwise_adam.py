"""Partial row-wise Adam (FBGEMM's PARTIAL_ROWWISE_ADAM): a first moment
per element and a second moment per row, on the row engine.

scale_by_partial_rowwise_adam is the per-row rule and state layout;
partial_rowwise_adam chains it with FBGEMM's weight decay and the learning
rate. Dense leaves and leaves with ``ndim < 2`` keep one second moment per
element: plain Adam.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike

from gradtx._rowio import per_row
from gradtx._rows import (
  bias_corrections,
  check_nonnegative,
  concrete_float,
  row_optimizer,
)
from gradtx._sharded import per_row_full
from gradtx._transforms import add_decayed_weights, scale_by_learning_rate


class ScaleByPartialRowwiseAdamState(NamedTuple):
  """State of :func:`scale_by_partial_rowwise_adam`."""

  count: jax.Array  # int32 [], steps taken (saturating); shared by all leaves
  mu: Any  # like params; first moment, param dtype
  # per leaf: float32 [rows] (shape[:1]) for ndim >= 2, else like the param
  nu: Any


def scale_by_partial_rowwise_adam(
  b1: ArrayLike = 0.9,
  b2: ArrayLike = 0.999,
  eps: ArrayLike = 1e-8,
) -> optax.GradientTransformationExtraArgs:
  r"""Adam with a first moment per element and a second moment per row
  (FBGEMM's PARTIAL_ROWWISE_ADAM), touching only the rows of a sparse
  gradient.

  For a leaf with ``ndim >= 2`` (a table ``[V, *row]``) row :math:`r` keeps
  one second moment, the running mean square of its gradient; a leaf with
  ``ndim < 2`` has rows of one element, so it keeps one per element (plain
  Adam). With the global step :math:`t` (one per call, as FBGEMM's
  ``iter``):

  .. math::
    v_r &\leftarrow \beta_2 v_r + (1 - \beta_2)\,
      \operatorname{mean}_j g_{rj}^2, \qquad
    m_r \leftarrow \beta_1 m_r + (1 - \beta_1) g_r, \\
    u_r &= \frac{m_r / (1 - \beta_1^t)}{\sqrt{v_r / (1 - \beta_2^t)} +
      \epsilon}.

  A :class:`~gradtx.SparseRows` leaf is deduplicated (duplicates summed:
  FBGEMM's EXACT semantics) and only its rows are updated; the others keep
  their moments bit for bit. The second moment is float32 whatever the
  table's dtype (4 bytes a row: a 64-wide float32 table with its state
  holds 516 bytes a row, Adam's 768).

  Args:
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the root of the second moment (>= 0).

  Returns:
    A transformation whose ``update`` takes dense arrays or SparseRows.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> tx = gtx.scale_by_partial_rowwise_adam(eps=0.0)
    >>> state = tx.init(jnp.zeros((3, 2)))
    >>> state.nu.shape
    (3,)
    >>> g = gtx.SparseRows(jnp.array([1]), jnp.array([[2.0, -2.0]]), 3)
    >>> u, state = tx.update(g, state)  # the row's mean square is 4
    >>> u.values.round(4)
    Array([[ 1., -1.]], dtype=float32)
    >>> state.nu
    Array([0.   , 0.004, 0.   ], dtype=float32)

  References:
    FBGEMM, `split table-batched embeddings, PARTIAL_ROWWISE_ADAM
    <https://github.com/pytorch/FBGEMM/tree/main/fbgemm_gpu>`_, 2021.
  """
  check_nonnegative("gradtx.scale_by_partial_rowwise_adam", eps=eps)

  def init(p):
    mu = jnp.zeros_like(p)
    if jnp.ndim(p) >= 2:  # a table: one second moment per row
      return mu, per_row_full(p, 0, jnp.float32)
    return mu, jnp.zeros_like(p, dtype=jnp.float32)

  def rule(count):
    count_inc = optax.safe_increment(count)
    bc1, bc2 = bias_corrections(b1, b2, count_inc)

    def row_rule(g, p, m, v):
      del p
      sq = jnp.square(g.astype(jnp.promote_types(g.dtype, v.dtype)))
      if v.ndim < g.ndim:
        sq = jnp.mean(sq, axis=tuple(range(1, g.ndim)))
      m = optax.tree.update_moment(g, m, b1, 1)
      v = optax.tree.update_moment(sq, v, b2, 1)

      def update(m, v):
        m_hat, v_hat = m / bc1.astype(m.dtype), v / bc2.astype(v.dtype)
        return m_hat / (per_row(jnp.sqrt(v_hat), m.ndim) + eps)

      return (m, v), update

    return row_rule

  return row_optimizer(
    rule,
    init,
    ScaleByPartialRowwiseAdamState,
    what="gradtx.scale_by_partial_rowwise_adam",
    state_names=["first moment", "row-wise second moment"],
  )


def partial_rowwise_adam(
  learning_rate: float | optax.Schedule,
  b1: ArrayLike = 0.9,
  b2: ArrayLike = 0.999,
  eps: ArrayLike = 1e-8,
  *,
  weight_decay: ArrayLike = 0.0,
) -> optax.GradientTransformationExtraArgs:
  r"""FBGEMM/TorchRec's PARTIAL_ROWWISE_ADAM: Adam whose second moment is
  one float per row.

  ``optax.chain(gtx.scale_by_partial_rowwise_adam(b1, b2, eps),
  gtx.add_decayed_weights(weight_decay),
  gtx.scale_by_learning_rate(learning_rate))``. Between row-wise Adagrad
  (one float a row, no momentum) and Adam (two floats an element): the
  first moment keeps Adam's per-element direction, the second moment is the
  row's mean square, so a 64-wide float32 table holds 516 bytes a row
  against Adam's 768. Weight decay is FBGEMM's: decoupled, scaled by the
  learning rate, on the touched rows only.

  .. math::
    \theta_r \leftarrow \theta_r - \eta_t \left(
      \frac{m_r / (1 - \beta_1^t)}{\sqrt{v_r / (1 - \beta_2^t)} + \epsilon}
      + \lambda \theta_r \right)
    \quad \text{for the touched rows } r

  (see :func:`scale_by_partial_rowwise_adam` for :math:`m` and :math:`v`).

  Args:
    learning_rate: a float or an optax schedule ``count -> rate``.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the root of the second moment.
    weight_decay: :math:`\lambda \ge 0` (needs ``params`` in ``update``
      unless it is 0).

  Returns:
    A transformation; apply its updates with :func:`gradtx.apply_updates`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> params = {"emb": jnp.zeros((1000, 64))}
    >>> gtx.bytes_per_row(gtx.partial_rowwise_adam(1e-3), params)
    {"['emb']": 516.0}

  References:
    FBGEMM, `split table-batched embeddings, PARTIAL_ROWWISE_ADAM
    <https://github.com/pytorch/FBGEMM/tree/main/fbgemm_gpu>`_, 2021.
  """
  check_nonnegative("gradtx.partial_rowwise_adam", weight_decay=weight_decay)
  parts = [scale_by_partial_rowwise_adam(b1, b2, eps)]
  if concrete_float(weight_decay) != 0.0:
    parts.append(add_decayed_weights(weight_decay))
  return optax.chain(*parts, scale_by_learning_rate(learning_rate))
