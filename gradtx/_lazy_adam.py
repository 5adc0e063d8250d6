"""Lazy (row-sparse) Adam: scale_by_lazy_adam, lazy_adam, lazy_adamw.

Adam's per-row rule on the row engine (:mod:`gradtx._rows`). Dense leaves
follow ``optax.scale_by_adam`` operation for operation (the moment updates
are the same ``optax.tree`` calls, the bias corrections the same arithmetic,
in the same order), so they give optax's bits. A
:class:`~gradtx.SparseRows` leaf updates only the rows in its gradient: the
engine deduplicates once, gathers those rows of the moments, calls the
rule, scatters them back in place. With
``catch_up=True`` a row that skipped steps first receives, in closed form,
what dense Adam would have done to it on the steps it had no gradient.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.typing import ArrayLike, DTypeLike

from gradtx._precision import check_block_size, state_dtype, state_full
from gradtx._rowio import per_row
from gradtx._rows import (
  bias_corrections,
  concrete_float,
  row_optimizer,
)
from gradtx._sharded import per_row_full
from gradtx._transforms import add_decayed_weights, scale_by_learning_rate

# Exact terms of the per-step sum R (see _future_sum); the rest of the
# geometric series is summed in closed form.
_CATCH_UP_TERMS = 1024


class ScaleByLazyAdamState(NamedTuple):
  """State of :func:`scale_by_lazy_adam` (``catch_up=False``, the default).

  With ``catch_up=True`` the state is a :class:`ScaleByLazyAdamCatchUpState`:
  the same fields and two per-row ones. They are two types because a
  NamedTuple has one set of fields: giving this one the catch-up fields
  (None without catch-up) would change the tree structure of every default
  state, and checkpoints saved with the three fields would no longer
  restore (orbax's ``StandardCheckpointer`` and ``flax.serialization``
  compare the saved structure with the target's).
  """

  count: jax.Array  # int32 [], steps taken (saturating); shared by all leaves
  mu: Any  # like params; first moment, mu_dtype (default: param dtype)
  nu: Any  # like params; second moment, nu_dtype (default: param dtype)


class ScaleByLazyAdamCatchUpState(NamedTuple):
  """State of :func:`scale_by_lazy_adam` with ``catch_up=True``:
  :class:`ScaleByLazyAdamState`'s fields, then the step of each row's last
  update and its catch-up sum (see :class:`ScaleByLazyAdamState` for why
  two types)."""

  count: jax.Array  # int32 [], steps taken (saturating); shared by all leaves
  mu: Any  # like params; first moment, mu_dtype (default: param dtype)
  nu: Any  # like params; second moment, nu_dtype (default: param dtype)
  last_step: Any  # per leaf int32 [rows] (shape[:1]); step of last update
  future_sum: Any  # per leaf float32 [rows]; R(last_step), see the docstring


def _bias_factor(step: jax.Array, b1: Any, b2: Any) -> jax.Array:
  """``c(i) = sqrt(1 - b2^i) / (1 - b1^i)`` in float32, for ``i >= 1``."""
  step = step.astype(jnp.float32)
  b1 = jnp.asarray(b1, jnp.float32)
  b2 = jnp.asarray(b2, jnp.float32)
  return jnp.sqrt(1 - b2**step) / (1 - b1**step)


# Catch-up in closed form. A row last updated at step s and touched at
# t = s + k + 1 missed the updates d_1..d_k of its decaying moments,
#   d_j = (b1^j m / (1 - b1^(s+j))) / (sqrt(b2^j v / (1 - b2^(s+j)) + eps_root)
#         + eps).
# With r = b1 / sqrt(b2) and c(i) = sqrt(1 - b2^i) / (1 - b1^i), the ratio
# d_j / d_1 is exactly r^(j-1) c(s+j) / c(s+1) when eps = eps_root = 0, so
#   D ~ d_1 (R(s) - r^k R(t-1)) / c(s+1),  R(x) = sum_{j>=1} r^(j-1) c(x+j).
# R(t-1) and R(t) are two scalars per step; each row stores R(s) when it is
# updated, so catch-up costs O(touched rows). eps > 0 is the one
# approximation (its bound is in scale_by_lazy_adam's docstring); beyond it,
# only float rounding (closed-form powers, not dense Adam's repeated
# products).
# R converges for b1 < sqrt(b2): the terms past _CATCH_UP_TERMS, summed with
# c frozen, are below 1e-40 for the default betas.


def _future_sum(x: jax.Array, b1: Any, b2: Any) -> jax.Array:
  """``R(x) = sum_{j >= 1} r^(j-1) c(x + j)``, ``r = b1 / sqrt(b2)``.

  ``x`` is an int32 step (any shape). The first ``_CATCH_UP_TERMS`` terms
  are summed exactly; the remainder with ``c`` frozen at its first value.
  """
  b1 = jnp.asarray(b1, jnp.float32)
  b2 = jnp.asarray(b2, jnp.float32)
  r = b1 / jnp.sqrt(b2)
  # Steps as float32: no int32 overflow near a saturated count, and c(i)
  # is 1 to float32 precision long before i loses integer precision.
  x = x.astype(jnp.float32)
  j = jnp.arange(1, _CATCH_UP_TERMS + 1, dtype=jnp.float32)
  j = j.reshape((1,) * x.ndim + j.shape)
  weights = r ** (j - 1)
  head = jnp.sum(weights * _bias_factor(x[..., None] + j, b1, b2), axis=-1)
  tail_c = _bias_factor(x + (_CATCH_UP_TERMS + 1), b1, b2)
  tail = tail_c * r**_CATCH_UP_TERMS / (1 - r)
  return head + tail


def _catch_up(
  m: jax.Array,
  v: jax.Array,
  last: jax.Array,
  r_last: jax.Array,
  count_inc: jax.Array,
  r_prev: jax.Array,
  b1: Any,
  b2: Any,
  eps: Any,
  eps_root: Any,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Decayed moments, drift (update-direction units) and the skip mask.

  ``m``, ``v``: ``[rows, *row]`` moments as of step ``last`` (``[rows]``);
  ``r_last = R(last)`` per row; ``r_prev = R(count_inc - 1)``.
  """
  k = jnp.maximum(count_inc - 1 - last, 0)
  skipped = k > 0
  kf = k.astype(jnp.float32)
  b1f = jnp.asarray(b1, jnp.float32)
  b2f = jnp.asarray(b2, jnp.float32)
  r = b1f / jnp.sqrt(b2f)
  ndim = m.ndim
  # First skipped step s + 1, exactly as dense Adam computes it.
  s1 = last.astype(jnp.float32) + 1
  bc1 = 1 - b1f**s1
  bc2 = 1 - b2f**s1
  ctype = jnp.promote_types(jnp.promote_types(m.dtype, v.dtype), jnp.float32)
  mc = m.astype(ctype)
  vc = v.astype(ctype)
  d1 = (b1f * mc / per_row(bc1, ndim)) / (
    jnp.sqrt(b2f * vc / per_row(bc2, ndim) + eps_root) + eps
  )
  # Sum of the skipped steps relative to the first one; exact in eps = 0.
  ratio = (r_last - r**kf * r_prev) / (jnp.sqrt(bc2) / bc1)
  drift = jnp.where(
    per_row(skipped, ndim) & (mc != 0), d1 * per_row(ratio, ndim), 0
  )
  m = m * per_row(b1f**kf, ndim).astype(m.dtype)
  v = v * per_row(b2f**kf, ndim).astype(v.dtype)
  return m, v, drift, skipped


def scale_by_lazy_adam(
  b1: ArrayLike = 0.9,
  b2: ArrayLike = 0.999,
  eps: ArrayLike = 1e-8,
  eps_root: ArrayLike = 0.0,
  *,
  mu_dtype: DTypeLike | str | None = None,
  nu_dtype: DTypeLike | str | None = None,
  block_size: int = 64,
  catch_up: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales updates by Adam, touching only the rows a sparse gradient has.

  Dense leaves are exactly ``optax.scale_by_adam`` (same operations, same
  order, same bits). A :class:`~gradtx.SparseRows` leaf is deduplicated
  (duplicates summed) and only its rows are updated, as in TensorFlow's
  ``LazyAdam`` and PyTorch's ``SparseAdam``; every other row keeps its
  moments bit for bit. The step count :math:`t` is global (one per call,
  shared by all leaves, as in optax; PyTorch's ``SparseAdam`` counts per
  tensor, on the steps it has a gradient), so the bias corrections are
  dense Adam's:

  .. math::
    m_i &\leftarrow \beta_1 m_i + (1 - \beta_1) g_i, \qquad
    v_i \leftarrow \beta_2 v_i + (1 - \beta_2) g_i^2, \\
    u_i &= \frac{m_i / (1 - \beta_1^t)}
      {\sqrt{v_i / (1 - \beta_2^t) + \epsilon_{root}} + \epsilon}
    \quad \text{for the touched rows } i.

  The update of a SparseRows leaf is a SparseRows on the deduplicated ids;
  apply it with :func:`gradtx.apply_updates`. When every row is touched
  every step this is dense Adam exactly.

  **Catch-up** (``catch_up=True``). Each row also stores the step of its
  last update. A row touched again after skipping :math:`k` steps first
  receives what dense Adam would have done to it on those steps with a zero
  gradient: its moments decay (:math:`m \leftarrow \beta_1^k m`,
  :math:`v \leftarrow \beta_2^k v`) and the updates of the skipped steps,
  bias corrections included, are added to this step's, in closed form at a
  cost proportional to the touched rows. The added drift is exact when
  :math:`\epsilon = \epsilon_{root} = 0`; otherwise it has the sign of the
  exact one and overshoots it by a relative error of at most
  :math:`\delta / (\sqrt{\hat v_k} + \delta)`, elementwise, where
  :math:`\delta = \epsilon + \sqrt{\epsilon_{root}}` and :math:`\hat v_k`
  is the smallest bias-corrected second moment over the skipped steps.
  The drift is in units of the update direction: a learning rate chained
  after weights every skipped step by the rate of the touching step, and
  weight decay chained after (:func:`lazy_adamw`) is not applied for the
  skipped steps. A dense leaf has no skipped steps and is dense Adam bit
  for bit. Requires :math:`\beta_1 < \sqrt{\beta_2}`.

  Args:
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the denominator outside the square root.
    eps_root: added to the second moment inside the square root.
    mu_dtype: dtype of the first moment: ``None`` (each parameter's
      dtype), a float dtype (e.g. ``jnp.bfloat16``) or ``"int8"``: 8-bit
      block-wise dynamic quantization (:class:`~gradtx.QuantizedRows`; the
      rule sees float32 rows). Leaves with fewer than 2 dimensions keep a
      float32 moment under ``"int8"``.
    nu_dtype: dtype of the second moment, the same choices (unsigned codes
      for ``"int8"``: a non-zero :math:`v` never becomes zero).
    block_size: the most elements per quantization block of an ``"int8"``
      moment; blocks never span two rows.
    catch_up: apply, at a row's next update, the moment decay and the
      parameter drift dense Adam would have applied on the steps the row
      skipped. Adds an int32 and a float32 per row to the state.

  Returns:
    A transformation whose ``update`` takes dense arrays or SparseRows. Its
    state is a :class:`ScaleByLazyAdamState`, or with ``catch_up`` a
    :class:`ScaleByLazyAdamCatchUpState`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> params = {"emb": jnp.zeros((5, 2)), "w": jnp.zeros(3)}
    >>> tx = gtx.scale_by_lazy_adam()
    >>> state = tx.init(params)
    >>> g = {"emb": gtx.SparseRows(jnp.array([3, 1, 3]), jnp.ones((3, 2)), 5),
    ...      "w": jnp.ones(3)}
    >>> u, state = tx.update(g, state, params)
    >>> u["emb"].indices, u["emb"].values.round(4)
    (Array([3, 1, 5], dtype=int32), Array([[1., 1.],
           [1., 1.],
           [0., 0.]], dtype=float32))

  References:
    Kingma and Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, 2014.

    TensorFlow Addons, `LazyAdam
    <https://www.tensorflow.org/addons/api_docs/python/tfa/optimizers/LazyAdam>`_,
    2019.
  """
  mu_dtype = state_dtype(
    mu_dtype, "scale_by_lazy_adam", "mu_dtype", complex_ok=True
  )
  nu_dtype = state_dtype(
    nu_dtype, "scale_by_lazy_adam", "nu_dtype", complex_ok=True
  )
  block_size = check_block_size(
    block_size, "scale_by_lazy_adam", mu_dtype, nu_dtype
  )
  if catch_up:
    fb1, fb2 = concrete_float(b1), concrete_float(b2)
    if fb1 is not None and fb2 is not None and not 0 <= fb1 < math.sqrt(fb2):
      raise ValueError(
        "gradtx.scale_by_lazy_adam(catch_up=True) needs 0 <= b1 < sqrt(b2) "
        f"(the skipped-step drift must decay); got b1={fb1}, b2={fb2}. "
        "Use a larger b2 or a smaller b1, or catch_up=False."
      )

  def init(p):
    mu = state_full(p, 0, mu_dtype, signed=True, block_size=block_size)
    nu = state_full(p, 0, nu_dtype, signed=False, block_size=block_size)
    if not catch_up:
      return mu, nu
    return (
      mu,
      nu,
      per_row_full(p, 0, jnp.int32),
      per_row_full(p, 0, jnp.float32),
    )

  def rule(count):
    count_inc = optax.safe_increment(count)
    bc1, bc2 = bias_corrections(b1, b2, count_inc)
    if catch_up:
      r_prev, r_now = _future_sum(jnp.stack([count_inc - 1, count_inc]), b1, b2)

    def row_rule(g, p, m, v, *rows):
      del p
      if catch_up:
        last, fsum = rows
        m, v, drift, skipped = _catch_up(
          m, v, last, fsum, count_inc, r_prev, b1, b2, eps, eps_root
        )
        # Functions of the rows read (last < count_inc, so these are
        # count_inc and R(count_inc)): the writes depend on the reads and XLA
        # updates the [V] state in place, with no copy.
        rows = (
          jnp.maximum(last, count_inc),
          jnp.where(last < count_inc, r_now, fsum),
        )
      # optax.scale_by_adam's moments, call for call
      m = optax.tree.update_moment(g, m, b1, 1)
      v = optax.tree.update_moment_per_elem_norm(g, v, b2, 2)

      def update(m, v, *_):
        m_hat, v_hat = m / bc1.astype(m.dtype), v / bc2.astype(v.dtype)
        u = m_hat / (jnp.sqrt(v_hat + eps_root) + eps)
        if catch_up:  # what the skipped steps would have applied
          u = jnp.where(per_row(skipped, u.ndim), u + drift.astype(u.dtype), u)
        return u

      return (m, v, *rows), update

    return row_rule

  return row_optimizer(
    rule,
    init,
    ScaleByLazyAdamCatchUpState if catch_up else ScaleByLazyAdamState,
    what="gradtx.scale_by_lazy_adam",
    state_names=["first moment", "second moment"]
    + ["catch-up state"] * (2 * catch_up),
    materialize=not catch_up,
  )


def lazy_adam(
  learning_rate: float | optax.Schedule,
  b1: ArrayLike = 0.9,
  b2: ArrayLike = 0.999,
  eps: ArrayLike = 1e-8,
  eps_root: ArrayLike = 0.0,
  *,
  mu_dtype: DTypeLike | str | None = None,
  nu_dtype: DTypeLike | str | None = None,
  block_size: int = 64,
  catch_up: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""Adam that updates only the rows of a sparse gradient (lazy Adam).

  ``optax.chain(gtx.scale_by_lazy_adam(...),
  gtx.scale_by_learning_rate(learning_rate))``. Dense leaves are exactly
  ``optax.adam``; each :class:`~gradtx.SparseRows` leaf updates only its
  touched rows, at a cost proportional to those rows (when the caller
  donates params and state to the jitted step, the tables are updated in
  place). Untouched rows keep their parameters and moments bit for bit.
  See :func:`scale_by_lazy_adam` for the formulas and ``catch_up``.

  .. math::
    \theta_i \leftarrow \theta_i - \eta_t \,
      \frac{m_i / (1 - \beta_1^t)}
      {\sqrt{v_i / (1 - \beta_2^t) + \epsilon_{root}} + \epsilon}
    \quad \text{for the touched rows } i.

  Args:
    learning_rate: a float or an optax schedule ``count -> rate``. Works
      with ``optax.inject_hyperparams``.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the denominator outside the square root.
    eps_root: added to the second moment inside the square root.
    mu_dtype: dtype of the first moment: ``None`` (the param's), a float
      dtype or ``"int8"`` (see :func:`scale_by_lazy_adam`).
    nu_dtype: dtype of the second moment, the same choices.
    block_size: the most elements per block of an ``"int8"`` moment.
    catch_up: on a row's next update, also apply what dense Adam would have
      applied on the steps it skipped (see :func:`scale_by_lazy_adam`).

  Returns:
    A transformation; apply its updates with :func:`gradtx.apply_updates`.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import gradtx as gtx
    >>> params = {"emb": jnp.ones((1000, 4)), "w": jnp.ones(4)}
    >>> def loss(p, ids):
    ...   return jnp.sum(gtx.lookup(p["emb"], ids) @ p["w"])
    >>> tx = gtx.lazy_adam(1e-2)
    >>> state = tx.init(params)
    >>> grads = gtx.sparse_grad(loss)(params, jnp.array([3, 7, 3]))
    >>> updates, state = tx.update(grads, state, params)
    >>> params = gtx.apply_updates(params, updates)
    >>> [round(float(x), 4) for x in params["emb"][[3, 4, 7], 0]]
    [0.99, 1.0, 0.99]

  References:
    Kingma and Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, 2014.
  """
  return optax.chain(
    scale_by_lazy_adam(
      b1,
      b2,
      eps,
      eps_root,
      mu_dtype=mu_dtype,
      nu_dtype=nu_dtype,
      block_size=block_size,
      catch_up=catch_up,
    ),
    scale_by_learning_rate(learning_rate),
  )


def lazy_adamw(
  learning_rate: float | optax.Schedule,
  b1: ArrayLike = 0.9,
  b2: ArrayLike = 0.999,
  eps: ArrayLike = 1e-8,
  eps_root: ArrayLike = 0.0,
  weight_decay: ArrayLike = 1e-4,
  *,
  mu_dtype: DTypeLike | str | None = None,
  nu_dtype: DTypeLike | str | None = None,
  block_size: int = 64,
  catch_up: bool = False,
  mask: Any = None,
) -> optax.GradientTransformationExtraArgs:
  r"""Lazy Adam with decoupled weight decay (lazy AdamW).

  ``optax.chain(gtx.scale_by_lazy_adam(...),
  gtx.add_decayed_weights(weight_decay, mask),
  gtx.scale_by_learning_rate(learning_rate))``, the order of
  ``optax.adamw``. Dense leaves are exactly ``optax.adamw``. For a
  :class:`~gradtx.SparseRows` leaf only the touched rows decay (once per
  step they are touched, duplicates counted once); rows without a gradient
  keep their values, as users of sparse tables expect. With ``catch_up``,
  the skipped steps' decay is not applied.

  .. math::
    \theta_i \leftarrow \theta_i - \eta_t \left(
      \frac{\hat m_i}{\sqrt{\hat v_i + \epsilon_{root}} + \epsilon}
      + \lambda \theta_i \right)
    \quad \text{for the touched rows } i.

  Args:
    learning_rate: a float or an optax schedule ``count -> rate``.
    b1: decay rate of the first moment.
    b2: decay rate of the second moment.
    eps: added to the denominator outside the square root.
    eps_root: added to the second moment inside the square root.
    weight_decay: the decoupled weight decay rate :math:`\lambda`.
    mu_dtype: dtype of the first moment: ``None`` (the param's), a float
      dtype or ``"int8"`` (see :func:`scale_by_lazy_adam`).
    nu_dtype: dtype of the second moment, the same choices.
    block_size: the most elements per block of an ``"int8"`` moment.
    catch_up: see :func:`scale_by_lazy_adam`.
    mask: a tree of bools like params (or a callable ``params -> tree``);
      weight decay applies where it is True.

  Returns:
    A transformation that needs ``params`` in ``update``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> params = jnp.ones((4, 2))
    >>> tx = gtx.lazy_adamw(0.1, weight_decay=0.5)
    >>> g = gtx.SparseRows(jnp.array([1]), jnp.zeros((1, 2)), 4)
    >>> u, _ = tx.update(g, tx.init(params), params)
    >>> gtx.apply_updates(params, u)[:, 0]
    Array([1.  , 0.95, 1.  , 1.  ], dtype=float32)

  References:
    Loshchilov and Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, 2019.
  """
  return optax.chain(
    scale_by_lazy_adam(
      b1,
      b2,
      eps,
      eps_root,
      mu_dtype=mu_dtype,
      nu_dtype=nu_dtype,
      block_size=block_size,
      catch_up=catch_up,
    ),
    add_decayed_weights(weight_decay, mask),
    scale_by_learning_rate(learning_rate),
  )
