"""Your own sparse optimizer: a per-row rule and an init on the row engine.

:func:`row_transformation` wraps a user's pure per-row ``rule`` and per-leaf
``init`` as a transformation built by :func:`gradtx._rows.row_optimizer`,
the engine of the built-in optimizers: deduplication once per leaf, the
touched rows of params and state gathered, the new state rows scattered back
in place (owner-local on row-sharded tables), padding discarded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from gradtx._precision import QuantizedRows
from gradtx._rows import row_optimizer
from gradtx._sharded import owner_sharding


class RowTransformationState(NamedTuple):
  """State of :func:`row_transformation`."""

  # one tree like params per array init returns; a leaf is [V, *row] (like
  # its parameter) or [V] (per row), dtype as init made it
  states: tuple[Any, ...]


def _name(fn: Any) -> str:
  return getattr(fn, "__qualname__", None) or type(fn).__name__


def _describe(x: Any) -> str:
  if isinstance(x, jax.Array | np.ndarray):
    return f"one array of shape {tuple(x.shape)}"
  return type(x).__name__


def _with_its_rows(s: jax.Array, p: Any, per_row: bool) -> jax.Array:
  """``s`` with the placement the built-in optimizers give their state: a
  row-sharded table's state stays with its rows, so a step never moves it
  (``jnp.zeros(p.shape[:1])`` alone would be replicated)."""
  target = owner_sharding(p, per_row)
  if target is None:
    return s
  if isinstance(s, jax.core.Tracer):
    now = jax.typeof(s).sharding
    if isinstance(now, NamedSharding) and now.spec == target.spec:
      return s
    return jax.sharding.reshard(s, target)
  if s.sharding == target:
    return s
  return jax.device_put(s, target)


def row_transformation(
  rule: Callable[..., tuple[Any, ...]],
  init: Callable[[Any], tuple[Any, ...]],
  *,
  needs_params: bool = False,
) -> optax.GradientTransformationExtraArgs:
  r"""A sparse optimizer from a per-row rule and a state initializer.

  The built-in optimizers (:func:`gradtx.lazy_adam`,
  :func:`gradtx.rowwise_adagrad`, ...) are each a per-row rule plus a state
  layout on one row engine; this gives a rule of yours the same engine. For
  each leaf with gradient :math:`g` and states :math:`s^{(1..K)}`:

  .. math::
    (u_r, s^{(1)}_r, \dots, s^{(K)}_r) \leftarrow
      \text{rule}(g_r, \theta_r, s^{(1)}_r, \dots, s^{(K)}_r)
    \quad \text{for the touched rows } r,

  and untouched rows keep their state bit for bit and get no update (a lazy
  optimizer, as TensorFlow's sparse optimizers and PyTorch's ``SparseAdam``).
  A :class:`~gradtx.SparseRows` gradient is deduplicated first (duplicate
  ids summed) and its padding ids are discarded; the rows of the parameter
  and of each state are gathered, the new state rows scattered back in place
  (a donated step updates the tables without a copy; a row-sharded table's
  rows are read and written by the device that owns them), and the update
  is a SparseRows on the deduplicated ids. A dense gradient calls the rule
  once on the whole arrays, so dense leaves get the dense optimizer.

  The result composes like any gradtx optimizer: ``optax.chain``,
  :func:`gradtx.accumulate`, :func:`gradtx.drop_stale`,
  :class:`gradtx.Mirrored` / :func:`gradtx.all_reduce`, and
  ``optax.inject_hyperparams`` over a function that builds it with the
  hyperparameters closed over by the rule.

  Args:
    rule: ``rule(g, p, *states) -> (update, *new_states)``, pure. Called per
      leaf on the deduplicated rows of a SparseRows gradient (``g`` is
      ``[n, *row]``) or on a whole dense gradient. ``p`` holds the matching
      rows of the parameter when ``needs_params``, else None. Each state
      arrives as its matching rows: ``[n, *row]`` for a state shaped like the
      parameter, ``[n]`` for a per-row one (broadcast it yourself, e.g.
      ``acc[:, None]``). Rows must not depend on each other (no sums over
      the leading axis): a padding row is computed too, on arbitrary values,
      and discarded. Return arrays of the shapes you were given; states are
      cast back to their dtype.
    init: ``init(p) -> tuple of arrays``, called on every parameter leaf
      that is not None (also on ``jax.ShapeDtypeStruct`` leaves under
      ``jax.eval_shape`` and under ``jit``); each array is shaped like ``p``
      (``[V, *row]``) or per row (``[V]``), or is an 8-bit
      ``gtx.QuantizedRows.zeros_like(p)`` (the rule sees float32 rows,
      requantized after it); every leaf returns as many.
    needs_params: pass the parameter rows to ``rule`` (then ``update`` needs
      ``params``).

  Returns:
    A transformation whose state is a :class:`RowTransformationState`:
    ``states[k]`` is a tree like params holding the ``k``-th array ``init``
    returned for each leaf (None where the parameter is None).

  Raises:
    TypeError: ``rule`` or ``init`` is not callable, or ``init`` / ``rule``
      returns something other than a tuple of arrays.
    ValueError: an array of the wrong shape, or a tuple of the wrong length.

  Examples:
    Lazy SGD with momentum, in four lines:

    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> def rule(g, p, trace):
    ...   trace = 0.9 * trace + g
    ...   return -0.1 * trace, trace
    >>> tx = gtx.row_transformation(rule, lambda p: (jnp.zeros_like(p),))
    >>> params = jnp.zeros((4, 2))
    >>> g = gtx.SparseRows(jnp.array([1, 1, 4]), jnp.ones((3, 2)), 4)
    >>> u, state = tx.update(g, tx.init(params))
    >>> gtx.apply_updates(params, u)[:, 0]  # row 1: twice; id 4 is padding
    Array([ 0. , -0.2,  0. ,  0. ], dtype=float32)
    >>> state.states[0][:, 0]
    Array([0., 2., 0., 0.], dtype=float32)

  References:
    Mudigere et al., `Software-Hardware Co-design for Fast and Scalable
    Training of Deep Learning Recommendation Models
    <https://arxiv.org/abs/2104.05158>`_, 2021 (FBGEMM's per-row optimizer
    template).
  """
  if not callable(rule):
    raise TypeError(
      "gradtx.row_transformation: `rule` must be a function "
      f"`rule(g, p, *states) -> (update, *new_states)`; got {rule!r}."
    )
  if not callable(init):
    raise TypeError(
      "gradtx.row_transformation: `init` must be a function "
      f"`init(p) -> tuple of arrays`; got {init!r}. For an optimizer "
      "without state pass `lambda p: ()`."
    )
  what = f"gradtx.row_transformation(rule={_name(rule)})"

  def init_leaf(p: Any) -> tuple[Any, ...]:
    out = init(p)
    if not isinstance(out, tuple | list):
      raise TypeError(
        f"{what}: `init` ({_name(init)}) must return a tuple of arrays, one "
        f"per state; got {_describe(out)}. Write `return (x,)` for one "
        "state and `return ()` for none."
      )
    shape = tuple(jnp.shape(p))
    allowed = [shape] + ([shape[:1]] if len(shape) > 1 else [])
    layouts = " or ".join(
      f"{how} ({list(x)})"
      for how, x in zip(
        ["like its parameter", "per row"], allowed, strict=False
      )
    )
    seen: set[int] = set()
    states = []
    for k, s in enumerate(out):
      if isinstance(s, np.ndarray):
        s = jnp.asarray(s)
      if isinstance(s, QuantizedRows):  # 8-bit, placed by zeros_like
        if s.shape != shape:
          raise ValueError(
            f"{what}: `init` ({_name(init)}) returned a QuantizedRows of "
            f"shape {s.shape} at position {k} for a parameter of shape "
            f"{shape}; build it with `gtx.QuantizedRows.zeros_like(p)`."
          )
        states.append(s)
        continue
      if not isinstance(s, jax.Array):
        raise TypeError(
          f"{what}: `init` ({_name(init)}) returned {type(s).__name__} at "
          f"position {k}; return JAX arrays (e.g. `jnp.zeros_like(p)`) or "
          "8-bit `gtx.QuantizedRows.zeros_like(p)`."
        )
      if s.shape not in allowed:
        raise ValueError(
          f"{what}: `init` ({_name(init)}) returned an array of shape "
          f"{s.shape} at position {k} for a parameter of shape {shape}; a "
          f"state must be shaped {layouts}. Use `jnp.zeros_like(p)` or "
          "`jnp.zeros(p.shape[:1])`."
        )
      if s is p or id(s) in seen:
        s = jnp.copy(s)  # a donated step cannot donate one buffer twice
      seen.add(id(s))
      states.append(_with_its_rows(s, p, per_row=s.ndim < len(shape)))
    return tuple(states)

  def checked(g, p, *rows):
    out = rule(g, p, *rows)
    if not isinstance(out, tuple | list):
      raise TypeError(
        f"{what}: `rule` must return a tuple `(update, *new_states)`; got "
        f"{_describe(out)}. Write e.g. `return update, new_m` (one new state "
        "per state, in order; `return (update,)` without state)."
      )
    if len(out) != 1 + len(rows):
      raise ValueError(
        f"{what}: `rule` got {len(rows)} states and returned "
        f"{len(out)} values; it must return `(update, *new_states)`, "
        f"{1 + len(rows)} values, new states in the order they came in."
      )
    for k, (x, want) in enumerate(zip(out, (g, *rows), strict=True)):
      name = "the update" if k == 0 else f"new state {k - 1}"
      if jnp.shape(x) != jnp.shape(want):
        raise ValueError(
          f"{what}: `rule` returned {name} of shape {jnp.shape(x)} for "
          f"input of shape {jnp.shape(want)}; return it in the shape it "
          "came in (a per-row state stays [n]; broadcast it with "
          "`s[:, None]` inside the rule, not in its result)."
        )
    # The update is computed already: the engine writes the new states and
    # copies nothing for an update that does not read them.
    return tuple(out[1:]), out[0]

  return row_optimizer(
    checked,
    init_leaf,
    RowTransformationState,
    what=what,
    state_names=lambda n: [
      f"state {k} (init's result [{k}])" for k in range(n)
    ],
    needs_params=needs_params,
    pack=lambda count, trees: RowTransformationState(tuple(trees)),
    unpack=lambda state: (None, list(state.states)),
  )
