"""Stale-gradient dropping for asynchronous training: drop_stale."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from gradtx._conditional import apply_if
from gradtx._static import concrete, is_int
from gradtx._transforms import scale_tree
from gradtx._update_trees import zero_counter


class DropStaleState(NamedTuple):
  """State of :func:`drop_stale`.

  ``step`` is the global step that workers read together with the
  parameters and send back as ``grad_step``; see :func:`staleness_stats`
  for a summary that finds this state inside any enclosing state.
  """

  step: jax.Array  # int32 [], gradients accepted so far: the global step
  num_dropped: jax.Array  # int32 [], gradients dropped as too stale
  last_staleness: jax.Array  # int32 [], step - grad_step of the last call
  inner_state: Any  # the inner transformation's state


def _is_integer_scalar(x: Any) -> bool:
  return (
    hasattr(x, "dtype")
    and jnp.issubdtype(x.dtype, jnp.integer)
    and jnp.ndim(x) == 0
  )


def _check_max_staleness(max_staleness: Any) -> Any:
  if max_staleness is None:
    return None
  if isinstance(max_staleness, bool):
    raise TypeError(
      "gradtx.drop_stale `max_staleness` must be an int >= 0 or None (no "
      f"limit); got the bool {max_staleness!r}."
    )
  if is_int(max_staleness):  # the bool was refused above
    if max_staleness < 0:
      raise ValueError(
        "gradtx.drop_stale `max_staleness` must be >= 0 (0 accepts only "
        f"fresh gradients); got {max_staleness}. Use None for no limit."
      )
    return int(max_staleness)
  if _is_integer_scalar(max_staleness):
    # An integer scalar array, e.g. from optax.inject_hyperparams.
    value = concrete(max_staleness, int)
    if value is None:
      return jnp.asarray(max_staleness, jnp.int32)
    return _check_max_staleness(value)
  raise TypeError(
    "gradtx.drop_stale `max_staleness` must be an int >= 0 (or an integer "
    f"scalar array) or None for no limit; got {max_staleness!r} of type "
    f"{type(max_staleness).__name__}."
  )


def _check_grad_step(grad_step: Any) -> jax.Array:
  if grad_step is None:
    raise TypeError(
      "gradtx.drop_stale needs the extra keyword argument `grad_step`: the "
      "global step at which the parameters behind this gradient were read. "
      "Call `tx.update(grads, state, params, grad_step=step_read)` (through "
      "optax.chain too, which forwards it)."
    )
  if isinstance(grad_step, bool):
    raise TypeError(
      f"gradtx.drop_stale `grad_step` must be an integer; got {grad_step!r}."
    )
  gs = jnp.asarray(grad_step)
  if not jnp.issubdtype(gs.dtype, jnp.integer):
    raise TypeError(
      "gradtx.drop_stale `grad_step` must be an integer step; got dtype "
      f"{gs.dtype}. Pass the int step read with the parameters, e.g. "
      "`int(state.step)` or an int32 array."
    )
  if gs.ndim != 0:
    raise ValueError(
      "gradtx.drop_stale `grad_step` must be a scalar; got shape "
      f"{gs.shape}. Pass one step per update call."
    )
  return gs.astype(jnp.int32)


def concrete_int(x: jax.Array) -> int | None:
  return concrete(x, int)


def _aval(x: Any) -> Any:
  return (tuple(jnp.shape(x)), jnp.result_type(x))


def _check_state_kept(old: Any, new: Any) -> None:
  old_leaves, old_def = jax.tree.flatten(old)
  new_leaves, new_def = jax.tree.flatten(new)
  old_avals = [_aval(x) for x in old_leaves]
  new_avals = [_aval(x) for x in new_leaves]
  if old_def != new_def or old_avals != new_avals:
    raise TypeError(
      "gradtx.drop_stale: the inner transformation's update changes the "
      "structure, shapes or dtypes of its state, so a dropped gradient "
      "(which keeps the state) and an accepted one would differ: "
      f"{old_def} with {old_avals} before, {new_def} with {new_avals} after."
      " Use an inner transformation whose state keeps its types."
    )


def drop_stale(
  inner: optax.GradientTransformation,
  max_staleness: int | jax.Array | None,
  *,
  rescale: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Drops gradients computed from parameters that are too old.

  For asynchronous (parameter-server style) training: a worker reads the
  parameters at global step ``grad_step``, computes a gradient, and by the
  time it arrives other workers' gradients may have moved the parameters
  on. ``update`` takes the extra keyword argument ``grad_step`` and compares
  it with the global step ``state.step`` (the number of gradients accepted
  so far):

  .. math::
    \\tau = \\text{step} - \\text{grad\\_step}, \\qquad
    \\text{accept} \\iff 0 \\le \\tau \\le \\text{max\\_staleness}

  An accepted gradient goes through ``inner`` (all extra arguments are
  forwarded, ``grad_step`` included) and ``step`` grows by one. A dropped
  gradient gives zero updates (an all-padding :class:`SparseRows` where the
  inner would emit one), leaves the inner state untouched and adds one to
  ``num_dropped``; the inner transformation is not computed for it (a
  ``lax.cond``; under ``vmap`` with a batched ``grad_step`` that becomes a
  select and both sides run). ``last_staleness`` records :math:`\\tau` of
  every call.

  With ``rescale=True`` an accepted gradient is first multiplied by
  :math:`1 / \\max(1, \\tau)` (the staleness-dependent learning rate of
  Zhang et al.): fresh and one-step-stale gradients keep their size.

  A ``grad_step`` ahead of ``step`` (:math:`\\tau < 0`) is a bug in the
  caller. With concrete values ``update`` raises a ValueError. Under ``jit``
  it cannot raise, so such a gradient is *dropped* and counted in
  ``num_dropped``, and ``last_staleness`` shows the negative value: a
  gradient whose age is unknown is never applied, whatever the limit, and
  the mistake is visible in :func:`staleness_stats`.

  Args:
    inner: the transformation an accepted gradient goes through.
    max_staleness: the largest accepted :math:`\\tau`: an int >= 0 (0
      accepts only gradients computed from the current parameters), an
      integer scalar array (so ``optax.inject_hyperparams`` can change it;
      a traced value must be >= 0), or None for no limit (only the
      counters and ``rescale`` act).
    rescale: divide an accepted gradient by :math:`\\max(1, \\tau)`.

  Returns:
    A transformation whose ``update`` needs the keyword ``grad_step`` (an
    int or integer scalar array, may be traced) and whose state is a
    :class:`DropStaleState`.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> tx = gtx.drop_stale(gtx.scale_by_learning_rate(0.1), 1)
    >>> params = jnp.ones(2)
    >>> state = tx.init(params)
    >>> for read_at in [0, 0, 0, 2]:  # staleness 0, 1, 2 (dropped), 0
    ...   u, state = tx.update(jnp.ones(2), state, params, grad_step=read_at)
    >>> int(state.step), int(state.num_dropped)
    (3, 1)
    >>> u
    Array([-0.1, -0.1], dtype=float32)

  References:
    Zhang, Gupta, Lian and Liu, `Staleness-aware Async-SGD for Distributed
    Deep Learning <https://arxiv.org/abs/1511.05950>`_, IJCAI 2016.
  """
  if not isinstance(inner, optax.GradientTransformation) and not (
    hasattr(inner, "init") and hasattr(inner, "update")
  ):
    raise TypeError(
      "gradtx.drop_stale `inner` must be an optax GradientTransformation "
      f"(with init and update); got {type(inner).__name__}."
    )
  limit = _check_max_staleness(max_staleness)
  if not isinstance(rescale, bool):
    raise TypeError(
      f"gradtx.drop_stale `rescale` must be a bool; got {rescale!r}."
    )
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return DropStaleState(
      step=zero_counter(),
      num_dropped=zero_counter(),
      last_staleness=zero_counter(),
      inner_state=inner.init(params),
    )

  def update_fn(updates, state, params=None, *, grad_step=None, **extra_args):
    gs = _check_grad_step(grad_step)
    staleness = (jnp.asarray(state.step, jnp.int32) - gs).astype(jnp.int32)
    tau = concrete_int(staleness)
    if tau is not None and tau < 0:
      raise ValueError(
        f"gradtx.drop_stale got `grad_step`={concrete_int(gs)} ahead of the "
        f"global step {concrete_int(state.step)}: a gradient cannot come from "
        "parameters that do not exist yet. Pass the step read together with "
        "the parameters (`state.step` of this drop_stale at that time)."
      )
    accept = staleness >= 0
    if limit is not None:
      accept = accept & (staleness <= limit)

    def run():
      grads = updates
      if rescale:
        factor = 1.0 / jnp.maximum(staleness, 1).astype(jnp.float32)
        grads = scale_tree(grads, factor)
      return inner.update(
        grads, state.inner_state, params, grad_step=grad_step, **extra_args
      )

    new_updates, inner_state = apply_if(
      accept, run, state.inner_state, check=_check_state_kept
    )
    new_state = DropStaleState(
      step=jnp.where(accept, optax.safe_increment(state.step), state.step),
      num_dropped=jnp.where(
        accept, state.num_dropped, optax.safe_increment(state.num_dropped)
      ),
      last_staleness=staleness,
      inner_state=inner_state,
    )
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _find(tree: Any, out: list[DropStaleState]) -> None:
  nodes = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, DropStaleState))
  for node in nodes:
    if isinstance(node, DropStaleState):
      out.append(node)
      _find(node.inner_state, out)


def staleness_stats(state: Any, which: int | None = None) -> dict[str, Any]:
  """Counters of a :func:`drop_stale` state found anywhere in ``state``.

  ``state`` may be the state of ``drop_stale`` itself or of anything that
  nests one (``optax.chain``, ``optax.inject_hyperparams``, other gradtx
  wrappers). The values are jax arrays, so this works under ``jit`` as well.

  .. math::
    \\text{dropped\\_fraction} = \\frac{\\text{num\\_dropped}}
    {\\text{step} + \\text{num\\_dropped}}

  is the fraction of all gradients received that were dropped (0 before any
  arrived); unlike TensorFlow's summary, which divided by the global step,
  it never exceeds 1.

  Args:
    state: an optimizer state containing one or more ``DropStaleState``.
    which: with several ``drop_stale`` states, the index of the one to
      report, in depth-first order (an outer one before those nested in
      it). Leave None when there is exactly one.

  Returns:
    A dict with ``step`` (int32, gradients accepted), ``num_dropped``
    (int32), ``dropped_fraction`` (float32) and ``last_staleness`` (int32).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradtx as gtx
    >>> tx = optax.chain(gtx.drop_stale(gtx.scale(-0.1), 0), gtx.scale(2.0))
    >>> state = tx.init(jnp.ones(1))
    >>> for read_at in [0, 0, 1]:
    ...   _, state = tx.update(jnp.ones(1), state, grad_step=read_at)
    >>> stats = gtx.staleness_stats(state)
    >>> int(stats["num_dropped"]), float(stats["dropped_fraction"])
    (1, 0.3333333432674408)
  """
  found: list[DropStaleState] = []
  _find(state, found)
  if not found:
    raise ValueError(
      "gradtx.staleness_stats found no DropStaleState in `state`. Pass the "
      "state of a transformation built with gradtx.drop_stale (or one that "
      "contains it)."
    )
  if which is None:
    if len(found) > 1:
      raise ValueError(
        f"gradtx.staleness_stats found {len(found)} DropStaleState in "
        "`state`; pass `which=i` to choose one (depth-first order, 0 is the "
        "outermost first one)."
      )
    s = found[0]
  else:
    if not is_int(which):
      raise TypeError(
        f"gradtx.staleness_stats `which` must be an int; got {which!r}."
      )
    if not -len(found) <= which < len(found):
      raise IndexError(
        f"gradtx.staleness_stats `which`={which} out of range: `state` holds "
        f"{len(found)} DropStaleState."
      )
    s = found[which]
  step = jnp.asarray(s.step, jnp.int32)
  dropped = jnp.asarray(s.num_dropped, jnp.int32)
  # float32 before adding: the two saturating int32 counters could overflow.
  total = step.astype(jnp.float32) + dropped.astype(jnp.float32)
  fraction = jnp.where(
    total > 0, dropped.astype(jnp.float32) / jnp.maximum(total, 1.0), 0.0
  )
  return {
    "step": step,
    "num_dropped": dropped,
    "dropped_fraction": fraction.astype(jnp.float32),
    "last_staleness": jnp.asarray(s.last_staleness, jnp.int32),
  }
