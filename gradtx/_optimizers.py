"""Sparse optimizers on the row engine: adagrad, rowwise_adagrad, ftrl,
lazy_sgd, and their building blocks.

Each is a per-row rule plus a state layout; :mod:`gradtx._rows` deduplicates,
gathers, scatters and handles padding. Dense leaves run the same rule on the
whole array, so they are the dense optimizer (``optax.adagrad``,
``optax.sgd``) operation for operation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike, DTypeLike

from gradtx._precision import (
  INT8,
  check_block_size,
  state_dtype,
  state_full,
)
from gradtx._rowio import per_row
from gradtx._rows import (
  check_nonnegative,
  concrete_float,
  row_optimizer,
)
from gradtx._sharded import per_row_full
from gradtx._sparse_rows import SparseRows
from gradtx._transforms import scale_by_learning_rate
from gradtx._update_trees import stateless, tree_map


def _float_dtype(dtype: Any, what: str, why: str) -> Any:
  """A state dtype that must be a float: ``"int8"`` is refused with ``why``."""
  parsed = state_dtype(dtype, what, "accumulator_dtype")
  if parsed == INT8:
    raise ValueError(
      f'gradtx.{what} `accumulator_dtype` cannot be "int8": {why} Use '
      "jnp.float32 (or jnp.bfloat16 to halve it)."
    )
  return parsed


# ----------------------------------------------------------------------------
# Adagrad


class ScaleByRssState(NamedTuple):
  """State of :func:`scale_by_rss`."""

  sum_of_squares: Any  # like params; accumulator_dtype (default param dtype)


def scale_by_rss(
  initial_accumulator_value: ArrayLike = 0.1,
  eps: ArrayLike = 1e-7,
  *,
  eps_outside_sqrt: bool = False,
  accumulator_dtype: DTypeLike | str | None = None,
  block_size: int = 64,
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales updates by the root of the summed squared gradients (Adagrad).

  ``optax.scale_by_rss``'s rule: dense leaves are exactly optax's (same
  operations, same order). A :class:`~gradtx.SparseRows` leaf is deduplicated
  (duplicates summed) and only its rows are updated; the others have a zero
  gradient, which changes neither their accumulator nor their parameter, so
  the result is optax's on the dense gradient.

  .. math::
    G_i \leftarrow G_i + g_i^2, \qquad
    u_i = \frac{g_i}{\sqrt{G_i + \epsilon}}
    \ (\text{and } 0 \text{ where } G_i = 0).

  With ``eps_outside_sqrt=True`` the update is instead

  .. math::
    u_i = \frac{g_i}{\sqrt{G_i} + \epsilon}
    \ (\text{and } 0 \text{ where } G_i = 0),

  the form of Keras 2's ``Adagrad`` (``tf.keras`` optimizer_v2), FBGEMM's
  EXACT_ADAGRAD and ``torch.optim.Adagrad`` (Keras 3, like optax, puts
  :math:`\epsilon` inside). :math:`G_i = 0` means :math:`g_i = 0`, so the
  zero there only matters when :math:`\epsilon = 0` (it avoids 0/0).

  Args:
    initial_accumulator_value: starting value of :math:`G` (>= 0).
    eps: added to :math:`G` inside the square root, or to
      :math:`\sqrt{G}` with ``eps_outside_sqrt``.
    eps_outside_sqrt: add ``eps`` after the square root (Keras 2, FBGEMM)
      instead of inside it (optax, the default).
    accumulator_dtype: dtype of :math:`G`; None uses each parameter's dtype
      (as optax does). ``jnp.float32`` is the safe choice for bf16 tables.
      ``"int8"``: 8-bit block-wise dynamic quantization with unsigned codes
      (:class:`~gradtx.QuantizedRows`; :math:`G \ge 0`, and a non-zero
      :math:`G` never rounds to zero); leaves with fewer than 2 dimensions
      keep float32.
    block_size: the most elements per quantization block of an ``"int8"``
      accumulator (blocks never span two rows).

  Returns:
    A transformation whose ``update`` takes dense arrays or SparseRows.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> tx = gtx.scale_by_rss(initial_accumulator_value=0.0, eps=0.0)
    >>> g = gtx.SparseRows(jnp.array([2, 0, 2]), jnp.ones((3, 1)), 4)
    >>> u, state = tx.update(g, tx.init(jnp.zeros((4, 1))))
    >>> u.indices, u.values[:, 0]
    (Array([2, 0, 4], dtype=int32), Array([1., 1., 0.], dtype=float32))
    >>> state.sum_of_squares[:, 0]
    Array([1., 0., 4., 0.], dtype=float32)

  References:
    Duchi, Hazan and Singer, `Adaptive Subgradient Methods for Online
    Learning and Stochastic Optimization
    <https://jmlr.org/papers/v12/duchi11a.html>`_, 2011.
  """
  what = "gradtx.scale_by_rss"
  check_nonnegative(what, initial_accumulator_value=initial_accumulator_value)
  acc_dtype = state_dtype(
    accumulator_dtype, "scale_by_rss", "accumulator_dtype"
  )
  block = check_block_size(block_size, "scale_by_rss", acc_dtype)

  def init(p):
    value = initial_accumulator_value
    return (state_full(p, value, acc_dtype, signed=False, block_size=block),)

  def rule(g, p, t):
    del p
    t = (g.conj() * g).real + t

    def update(t):
      if eps_outside_sqrt:
        return jnp.where(t > 0, g / (jnp.sqrt(t) + eps), 0.0)
      return jnp.where(t > 0, jax.lax.rsqrt(t + eps), 0.0) * g

    return (t,), update

  return row_optimizer(rule, init, ScaleByRssState, what=what)


def adagrad(
  learning_rate: float | optax.Schedule,
  initial_accumulator_value: ArrayLike = 0.1,
  eps: ArrayLike = 1e-7,
  *,
  eps_outside_sqrt: bool = False,
  accumulator_dtype: DTypeLike | str | None = None,
  block_size: int = 64,
) -> optax.GradientTransformationExtraArgs:
  r"""Adagrad (``optax.adagrad``'s rule) that updates only the touched rows.

  ``optax.chain(gtx.scale_by_rss(...),
  gtx.scale_by_learning_rate(learning_rate))``. On a SparseRows gradient it
  gives what ``optax.adagrad`` gives on the dense gradient (a row without
  gradient has nothing to do in Adagrad), at a cost proportional to the
  touched rows.

  .. math::
    G_i \leftarrow G_i + g_i^2, \qquad
    \theta_i \leftarrow \theta_i - \eta_t \frac{g_i}{\sqrt{G_i + \epsilon}}
    \quad \text{(optax's form, the default)},

  or, with ``eps_outside_sqrt=True`` (the form of Keras 2's ``Adagrad``,
  FBGEMM's EXACT_ADAGRAD and ``torch.optim.Adagrad``),

  .. math::
    \theta_i \leftarrow \theta_i - \eta_t \frac{g_i}{\sqrt{G_i} + \epsilon}.

  Both move nothing where :math:`G_i = 0` (see :func:`scale_by_rss`).

  State: one accumulator per element (like the parameter).

  Args:
    learning_rate: a float or an optax schedule ``count -> rate``.
    initial_accumulator_value: starting value of :math:`G`.
    eps: added to :math:`G` inside the square root, or to
      :math:`\sqrt{G}` with ``eps_outside_sqrt``.
    eps_outside_sqrt: add ``eps`` after the square root (Keras 2, FBGEMM)
      instead of inside it (optax, the default).
    accumulator_dtype: dtype of :math:`G`; None uses the param dtype;
      ``"int8"`` quantizes it to 8 bits (see :func:`scale_by_rss`).
    block_size: the most elements per block of an ``"int8"`` accumulator.

  Returns:
    A transformation; apply its updates with :func:`gradtx.apply_updates`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> params = jnp.ones((5, 2))
    >>> tx = gtx.adagrad(0.1)
    >>> g = gtx.SparseRows(jnp.array([3, 3]), jnp.ones((2, 2)), 5)
    >>> u, state = tx.update(g, tx.init(params))
    >>> gtx.apply_updates(params, u)[:, 0].round(4)  # 1 - 0.1 * 2 / sqrt(4.1)
    Array([1.    , 1.    , 1.    , 0.9012, 1.    ], dtype=float32)
    >>> keras2 = gtx.adagrad(0.1, eps=0.1, eps_outside_sqrt=True)
    >>> u, _ = keras2.update(g, keras2.init(params))
    >>> u.values[0, 0].round(4)  # -0.1 * 2 / (sqrt(4.1) + 0.1)
    Array(-0.0941, dtype=float32)

  References:
    Duchi, Hazan and Singer, `Adaptive Subgradient Methods for Online
    Learning and Stochastic Optimization
    <https://jmlr.org/papers/v12/duchi11a.html>`_, 2011.
  """
  return optax.chain(
    scale_by_rss(
      initial_accumulator_value,
      eps,
      eps_outside_sqrt=eps_outside_sqrt,
      accumulator_dtype=accumulator_dtype,
      block_size=block_size,
    ),
    scale_by_learning_rate(learning_rate),
  )


# ----------------------------------------------------------------------------
# Row-wise Adagrad


class ScaleByRowwiseRssState(NamedTuple):
  """State of :func:`scale_by_rowwise_rss`."""

  # per leaf: [rows] (shape[:1]) for ndim >= 2, else like the param;
  # accumulator_dtype (default float32)
  sum_of_squares: Any


def scale_by_rowwise_rss(
  eps: ArrayLike = 1e-8,
  initial_accumulator_value: ArrayLike = 0.0,
  weight_decay: ArrayLike = 0.0,
  *,
  accumulator_dtype: DTypeLike | None = "float32",
) -> optax.GradientTransformationExtraArgs:
  r"""Row-wise Adagrad scaling: one accumulator per row (FBGEMM's
  EXACT_ROWWISE_ADAGRAD).

  For a leaf with ``ndim >= 2`` (a table ``[V, *row]``) row :math:`r` keeps
  one accumulator, the running sum of its gradient's mean square; a leaf
  with ``ndim < 2`` (a bias vector, a scalar) keeps one per element, which
  is plain Adagrad with :math:`\epsilon` outside the root:

  .. math::
    g_r &\leftarrow g_r + \lambda \theta_r \quad
      \text{(FBGEMM's L2 weight-decay mode)}, \\
    G_r &\leftarrow G_r + \operatorname{mean}(g_r^2), \qquad
    u_r = \frac{g_r}{\sqrt{G_r} + \epsilon}.

  A :class:`~gradtx.SparseRows` leaf is deduplicated and only its rows are
  updated; weight decay applies to the touched rows only.

  Args:
    eps: added to :math:`\sqrt{G}`.
    initial_accumulator_value: starting value of :math:`G` (>= 0).
    weight_decay: :math:`\lambda`, added as ``weight_decay * params`` to the
      gradient of the touched rows before the accumulator (needs ``params``
      in ``update`` unless it is 0).
    accumulator_dtype: dtype of :math:`G` (float32 by default, as FBGEMM;
      None uses each parameter's dtype).

  Returns:
    A transformation whose ``update`` takes dense arrays or SparseRows.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> tx = gtx.scale_by_rowwise_rss(eps=0.0)
    >>> state = tx.init(jnp.zeros((3, 2)))
    >>> state.sum_of_squares.shape
    (3,)
    >>> g = gtx.SparseRows(jnp.array([1, 1]), jnp.array([[1.0, 2], [1, 0]]), 3)
    >>> u, state = tx.update(g, state)  # the row's gradient is [2, 2]
    >>> state.sum_of_squares
    Array([0., 4., 0.], dtype=float32)
    >>> u.values
    Array([[1., 1.],
           [0., 0.]], dtype=float32)

  References:
    Duchi, Hazan and Singer, `Adaptive Subgradient Methods for Online
    Learning and Stochastic Optimization
    <https://jmlr.org/papers/v12/duchi11a.html>`_, 2011.

    FBGEMM, `split table-batched embeddings, EXACT_ROWWISE_ADAGRAD
    <https://github.com/pytorch/FBGEMM/tree/main/fbgemm_gpu>`_, 2021.
  """
  what = "gradtx.scale_by_rowwise_rss"
  check_nonnegative(
    what,
    eps=eps,
    initial_accumulator_value=initial_accumulator_value,
    weight_decay=weight_decay,
  )
  acc_dtype = _float_dtype(
    accumulator_dtype,
    "scale_by_rowwise_rss",
    "it is one value per row, and 8-bit codes need a float scale per block, "
    "which would take more bytes than the float32 value.",
  )
  decays = concrete_float(weight_decay) != 0.0

  def init(p):
    dtype = acc_dtype or p.dtype
    if jnp.ndim(p) >= 2:  # a table: one accumulator per row
      return (per_row_full(p, initial_accumulator_value, dtype),)
    return (jnp.full_like(p, initial_accumulator_value, dtype=dtype),)

  def rule(g, p, acc):
    # at the accumulator's precision: in a bf16 table's dtype a small decay
    # would round away against g (FBGEMM adds it in float32)
    g = g.astype(jnp.promote_types(g.dtype, acc.dtype))
    if decays:
      g = g + weight_decay * p.astype(g.dtype)
    if acc.ndim < g.ndim:
      acc = acc + jnp.mean(g * g, axis=tuple(range(1, g.ndim)))
    else:
      acc = acc + g * g
    return (acc,), lambda acc: g / (per_row(jnp.sqrt(acc), g.ndim) + eps)

  return row_optimizer(
    rule,
    init,
    ScaleByRowwiseRssState,
    what=what,
    state_names=["row-wise accumulator"],
    needs_params=decays,
  )


def rowwise_adagrad(
  learning_rate: float | optax.Schedule,
  eps: ArrayLike = 1e-8,
  initial_accumulator_value: ArrayLike = 0.0,
  weight_decay: ArrayLike = 0.0,
  *,
  accumulator_dtype: DTypeLike | None = "float32",
) -> optax.GradientTransformationExtraArgs:
  r"""Row-wise Adagrad (FBGEMM/TorchRec's EXACT_ROWWISE_ADAGRAD).

  ``optax.chain(gtx.scale_by_rowwise_rss(...),
  gtx.scale_by_learning_rate(learning_rate))``: the default optimizer for
  large embedding tables. One float of state per row (4 bytes for a row of
  64 floats, where Adam keeps 512), duplicates summed before one update per
  touched row:

  .. math::
    g_r &\leftarrow g_r + \lambda \theta_r, \qquad
    G_r \leftarrow G_r + \frac{1}{D} \sum_{j} g_{rj}^2, \\
    \theta_r &\leftarrow \theta_r - \eta_t \frac{g_r}{\sqrt{G_r} + \epsilon}.

  The state of a ``[V, D]`` table is ``[V]``. Leaves with ``ndim < 2``
  (biases, scalars) use per-element Adagrad (:math:`G` like the parameter,
  :math:`\epsilon` outside the root). Weight decay is FBGEMM's L2 mode: added
  to the gradient of the touched rows before the accumulator, so it is
  scaled by Adagrad like the gradient (not decoupled).

  Args:
    learning_rate: a float or an optax schedule ``count -> rate``.
    eps: added to :math:`\sqrt{G}`.
    initial_accumulator_value: starting value of :math:`G`.
    weight_decay: L2 weight decay :math:`\lambda` (needs ``params``).
    accumulator_dtype: dtype of :math:`G` (float32 by default).

  Returns:
    A transformation; apply its updates with :func:`gradtx.apply_updates`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> params = jnp.zeros((1000, 4))
    >>> tx = gtx.rowwise_adagrad(0.1)
    >>> state = tx.init(params)
    >>> state[0].sum_of_squares.shape
    (1000,)
    >>> g = gtx.SparseRows(jnp.array([7]), jnp.array([[1.0, -1, 1, -1]]), 1000)
    >>> u, state = tx.update(g, state, params)
    >>> gtx.apply_updates(params, u)[7]
    Array([-0.1,  0.1, -0.1,  0.1], dtype=float32)

  References:
    FBGEMM, `split table-batched embeddings, EXACT_ROWWISE_ADAGRAD
    <https://github.com/pytorch/FBGEMM/tree/main/fbgemm_gpu>`_, 2021.
  """
  return optax.chain(
    scale_by_rowwise_rss(
      eps,
      initial_accumulator_value,
      weight_decay,
      accumulator_dtype=accumulator_dtype,
    ),
    scale_by_learning_rate(learning_rate),
  )


# ----------------------------------------------------------------------------
# Lazy SGD (momentum)


class LazyTraceState(NamedTuple):
  """State of :func:`lazy_trace`."""

  trace: Any  # like params; accumulator_dtype (default param dtype)


def lazy_trace(
  decay: ArrayLike,
  nesterov: bool = False,
  accumulator_dtype: DTypeLike | str | None = None,
  block_size: int = 64,
) -> optax.GradientTransformationExtraArgs:
  r"""Momentum (``optax.trace``) whose rows decay only when touched.

  Dense leaves are exactly ``optax.trace``. For a
  :class:`~gradtx.SparseRows` leaf only the touched rows' traces decay and
  accumulate (TensorFlow's sparse momentum); untouched rows keep their
  trace and get no update.

  .. math::
    t_i \leftarrow g_i + \mu t_i, \qquad
    u_i = t_i \ \text{or, with Nesterov,}\ u_i = g_i + \mu t_i.

  Args:
    decay: the momentum :math:`\mu`.
    nesterov: use Nesterov momentum.
    accumulator_dtype: dtype of the trace; None uses the param dtype;
      ``"int8"``: 8-bit block-wise dynamic quantization with signed codes
      (:class:`~gradtx.QuantizedRows`); leaves with fewer than 2 dimensions
      keep float32.
    block_size: the most elements per quantization block of an ``"int8"``
      trace (blocks never span two rows).

  Returns:
    A transformation whose ``update`` takes dense arrays or SparseRows.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> tx = gtx.lazy_trace(0.5)
    >>> state = tx.init(jnp.zeros((3, 1)))
    >>> g = gtx.SparseRows(jnp.array([0]), jnp.ones((1, 1)), 3)
    >>> for _ in range(2):
    ...   u, state = tx.update(g, state)
    >>> state.trace[:, 0]
    Array([1.5, 0. , 0. ], dtype=float32)
  """
  acc_dtype = state_dtype(
    accumulator_dtype, "lazy_trace", "accumulator_dtype", complex_ok=True
  )
  block = check_block_size(block_size, "lazy_trace", acc_dtype)

  def init(p):
    return (state_full(p, 0, acc_dtype, signed=True, block_size=block),)

  def rule(g, p, t):
    del p
    t = g + decay * t
    return (t,), lambda t: g + decay * t if nesterov else t

  return row_optimizer(rule, init, LazyTraceState, what="gradtx.lazy_trace")


def _sum_duplicates() -> optax.GradientTransformationExtraArgs:
  """SparseRows leaves with each id once and its duplicates summed (the row
  engine's deduplication); dense leaves pass through. Stateless, like the
  ``optax.identity`` it stands in for in ``optax.sgd``'s chain."""

  def dedup(g):
    if isinstance(g, SparseRows):
      return g.deduplicated()
    return g

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    return tree_map(dedup, updates), state

  return stateless(update_fn)


def lazy_sgd(
  learning_rate: float | optax.Schedule,
  momentum: ArrayLike | None = None,
  nesterov: bool = False,
  *,
  accumulator_dtype: DTypeLike | str | None = None,
  block_size: int = 64,
) -> optax.GradientTransformationExtraArgs:
  r"""SGD with lazy (touched-rows-only) momentum.

  Without momentum this is ``optax.sgd``; the duplicates of a SparseRows
  gradient are summed first (as in every gtx optimizer), so each touched
  row is written once and rounded once: a scatter-add of every duplicate
  into a bf16 table would round after each. With momentum it is
  ``optax.chain(gtx.lazy_trace(momentum, nesterov),
  gtx.scale_by_learning_rate(learning_rate))``: the trace of a row decays
  and accumulates only on the steps the row is touched, as in TensorFlow's
  sparse momentum and in lazy Adam. ``optax.sgd`` with momentum on the dense
  gradient also decays untouched rows' traces and keeps moving those rows
  (by :math:`-\eta \mu^k t` on the :math:`k`-th step without a gradient); the
  two agree on rows touched every step.

  .. math::
    t_i \leftarrow g_i + \mu t_i, \qquad
    \theta_i \leftarrow \theta_i - \eta_t t_i
    \quad \text{for the touched rows } i.

  Args:
    learning_rate: a float or an optax schedule ``count -> rate``.
    momentum: the momentum :math:`\mu`, or None for plain SGD.
    nesterov: use Nesterov momentum.
    accumulator_dtype: dtype of the trace; None uses the param dtype;
      ``"int8"`` quantizes it to 8 bits (see :func:`lazy_trace`).
    block_size: the most elements per block of an ``"int8"`` trace.

  Returns:
    A transformation; apply its updates with :func:`gradtx.apply_updates`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> params = jnp.zeros((4, 1))
    >>> tx = gtx.lazy_sgd(0.1, momentum=0.9)
    >>> state = tx.init(params)
    >>> g = gtx.SparseRows(jnp.array([1]), jnp.ones((1, 1)), 4)
    >>> for _ in range(2):
    ...   u, state = tx.update(g, state, params)
    ...   params = gtx.apply_updates(params, u)
    >>> params[:, 0]
    Array([ 0.  , -0.29,  0.  ,  0.  ], dtype=float32)
  """
  if momentum is None:
    return optax.chain(_sum_duplicates(), scale_by_learning_rate(learning_rate))
  return optax.chain(
    lazy_trace(momentum, nesterov, accumulator_dtype, block_size),
    scale_by_learning_rate(learning_rate),
  )


# ----------------------------------------------------------------------------
# FTRL-Proximal


class FtrlState(NamedTuple):
  """State of :func:`ftrl`."""

  count: jax.Array  # int32 [], steps taken (saturating), for schedules
  n: Any  # like params; sum of squared gradients, accumulator_dtype
  z: Any  # like params; the linear ("z") accumulator, accumulator_dtype


def ftrl(
  learning_rate: float | optax.Schedule,
  learning_rate_power: ArrayLike = -0.5,
  initial_accumulator_value: ArrayLike = 0.1,
  l1_regularization_strength: ArrayLike = 0.0,
  l2_regularization_strength: ArrayLike = 0.0,
  beta: ArrayLike = 0.0,
  *,
  l2_shrinkage_regularization_strength: ArrayLike = 0.0,
  accumulator_dtype: DTypeLike | None = None,
) -> optax.GradientTransformationExtraArgs:
  r"""FTRL-Proximal, per coordinate, with TensorFlow's parameterisation.

  The optimizer of large linear CTR models (McMahan et al., 2013). Per
  coordinate, with :math:`p` = ``learning_rate_power`` (:math:`-1/2`: the
  paper's per-coordinate rate), :math:`\lambda_1`, :math:`\lambda_2` the
  regularization strengths, :math:`\beta` as in Keras' ``Ftrl`` and
  :math:`\lambda_s` the L2 shrinkage strength (TensorFlow's ``FtrlV2``
  kernel, Keras' ``l2_shrinkage_regularization_strength``):

  .. math::
    n' &= n + g^2, \qquad
    \sigma = \frac{n'^{-p} - n^{-p}}{\eta_t}, \qquad
    z \leftarrow z + (g + 2 \lambda_s \theta) - \sigma \theta, \\
    \theta &\leftarrow \frac{\operatorname{clip}(z, -\lambda_1, \lambda_1) - z}
      {(n'^{-p} + \beta) / \eta_t + 2 \lambda_2}, \qquad n \leftarrow n'.

  So :math:`\theta = 0` exactly wherever :math:`|z| \le \lambda_1`: L1 gives
  true zeros. The update returned is :math:`\theta_{new} - \theta` (it needs
  ``params``); the learning rate is inside the formula, so it takes a
  float or a schedule here, not a chained scale.

  L2 shrinkage is a magnitude penalty :math:`\lambda_s \theta^2` on the loss:
  only the linear accumulator :math:`z` sees its gradient
  :math:`g + 2 \lambda_s \theta`; :math:`n` still sums :math:`g^2`.
  (:math:`\lambda_2` is the paper's stabilising L2 term in the closed
  form.) With :math:`\lambda_s = 0`, the default, the step is the one
  without shrinkage, bit for bit.

  A :class:`~gradtx.SparseRows` leaf is deduplicated and only its rows
  move: a row without gradient keeps :math:`n`, :math:`z` and its weights
  (TensorFlow's sparse FTRL); in a touched row every weight is recomputed
  from its :math:`n` and :math:`z`. A dense leaf recomputes every
  coordinate's weight (TensorFlow's dense FTRL). With a constant learning
  rate the two agree on weights FTRL itself produced (any row ever touched,
  or weights initialised at zero); with a schedule, a dense leaf also moves
  untouched rows as :math:`\eta_t` changes. L2 shrinkage likewise applies
  to every coordinate of a dense leaf each step, but only to the touched
  rows of a SparseRows leaf (as in Keras: "shrinkage will only happen on
  the active weights"); with shrinkage the two agree only while the
  untouched weights are zero.

  Args:
    learning_rate: :math:`\eta`, a float or an optax schedule.
    learning_rate_power: :math:`p \le 0`; 0 gives a fixed rate.
    initial_accumulator_value: starting :math:`n` (>= 0; with 0, a
      coordinate whose gradient is zero on its first step divides by zero
      unless :math:`\lambda_2` or :math:`\beta` is positive).
    l1_regularization_strength: :math:`\lambda_1 \ge 0`.
    l2_regularization_strength: :math:`\lambda_2 \ge 0`.
    beta: :math:`\beta \ge 0`, added to :math:`n'^{-p}` in the denominator.
    l2_shrinkage_regularization_strength: :math:`\lambda_s \ge 0`; adds
      :math:`2 \lambda_s \theta` to the gradient in the :math:`z` update
      only. Keyword-only: Keras passes it before ``beta``.
    accumulator_dtype: dtype of :math:`n` and :math:`z`; None uses the param
      dtype (``jnp.float32`` is the safe choice for bf16 tables). The
      formula runs in at least float32. Not ``"int8"``: the weights are
      computed afresh from :math:`z` and :math:`n` at every step, so a
      state error is a weight error (near the L1 threshold
      :math:`|z| \approx \lambda_1` a few percent of :math:`z` decide whether
      a weight is zero), and :math:`\sigma` is a difference of successive
      :math:`\sqrt{n}` that rounding :math:`n` to 8 bits swamps.

  Returns:
    A transformation that needs ``params`` in ``update``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> params = jnp.zeros((4, 2))
    >>> tx = gtx.ftrl(0.5, l1_regularization_strength=0.3)
    >>> g = gtx.SparseRows(jnp.array([1, 2]), jnp.array([[1.0, 0.1],
    ...                                                   [-2.0, 0.2]]), 4)
    >>> u, state = tx.update(g, tx.init(params), params)
    >>> gtx.apply_updates(params, u)
    Array([[ 0.        ,  0.        ],
           [-0.33371192,  0.        ],
           [ 0.4197851 ,  0.        ],
           [ 0.        ,  0.        ]], dtype=float32)

  References:
    McMahan et al., `Ad Click Prediction: a View from the Trenches
    <https://research.google.com/pubs/archive/41159.pdf>`_, KDD 2013.

    Keras, `Ftrl <https://keras.io/api/optimizers/ftrl/>`_
    (``l2_shrinkage_regularization_strength``), and TensorFlow's kernel
    `ApplyFtrlV2
    <https://www.tensorflow.org/api_docs/python/tf/raw_ops/ApplyFtrlV2>`_.
  """
  what = "gradtx.ftrl"
  check_nonnegative(
    what,
    initial_accumulator_value=initial_accumulator_value,
    l1_regularization_strength=l1_regularization_strength,
    l2_regularization_strength=l2_regularization_strength,
    beta=beta,
    l2_shrinkage_regularization_strength=l2_shrinkage_regularization_strength,
  )
  power = concrete_float(learning_rate_power)
  if power is not None and power > 0:
    raise ValueError(
      f"{what}: `learning_rate_power` must be <= 0; got {power}. Use -0.5 "
      "(the paper's per-coordinate rate) or 0 for a fixed rate."
    )
  acc_dtype = _float_dtype(
    accumulator_dtype,
    "ftrl",
    "FTRL computes the weights afresh from z and n at every step, so 8-bit "
    "rounding of z or n becomes a weight error (and near the L1 threshold, a "
    "zero weight that should not be).",
  )
  l1, l2 = l1_regularization_strength, l2_regularization_strength
  shrinkage = l2_shrinkage_regularization_strength
  # A concrete 0 leaves the term out (the step stays bit for bit the same);
  # a traced one (inject_hyperparams) is always applied.
  shrinks = concrete_float(shrinkage) != 0.0

  def root(n):
    if power == -0.5:
      return jnp.sqrt(n)
    return jnp.power(n, -jnp.asarray(learning_rate_power, n.dtype))

  def init(p):
    return (
      jnp.full_like(p, initial_accumulator_value, dtype=acc_dtype),
      jnp.full_like(p, 0, dtype=acc_dtype),
    )

  def rule(count):
    lr = learning_rate(count) if callable(learning_rate) else learning_rate

    def row_rule(g, w, n, z):
      ctype = jnp.result_type(g, w, n, z, jnp.float32)
      g, w, n, z = (x.astype(ctype) for x in (g, w, n, z))
      n_new = n + g * g
      g_linear = g + 2 * shrinkage * w if shrinks else g
      z = z + g_linear - (root(n_new) - root(n)) / lr * w

      def update(n, z):
        quadratic = (root(n) + beta) / lr + 2 * l2
        return (jnp.clip(z, -l1, l1) - z) / quadratic - w

      return (n_new, z), update

    return row_rule

  return row_optimizer(
    rule,
    init,
    FtrlState,
    what=what,
    state_names=["accumulator n", "accumulator z"],
    needs_params=True,
  )
