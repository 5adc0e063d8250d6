"""The wrappers' one conditional: an inner update applied where a
predicate holds, traced once.

``accumulate`` and ``drop_stale`` run their inner transformation only on
some calls. :func:`apply_if` traces it once (:func:`trace_once`: the skip
branch takes its types from that trace instead of a second ``eval_shape``
trace, which would double trace and compile time at every level of
nesting), and skips with zero updates (:func:`zeros_like_update`) and the
state kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from gradtx._jax_compat import cast_varying, shape_struct, varying_axes
from gradtx._sparse_rows import SparseRows
from gradtx._static import concrete
from gradtx._update_trees import tree_map


def trace_once(fn: Callable[[], Any]) -> tuple[Callable[[], Any], Any]:
  """``fn()`` traced once: ``(replay, shapes)``.

  ``replay()`` binds the traced operations again in whatever trace is
  current (a ``lax.cond`` branch) without calling ``fn``; ``shapes`` is its
  output tree with ``jax.ShapeDtypeStruct`` leaves that keep the varying
  mesh axes. A conditional that needs the types of one branch to build the
  other then traces the Python function once, not twice (``eval_shape`` and
  the branch), at every level of nesting.
  """
  box = []

  def flat():
    out, tree = jax.tree.flatten(fn())
    box.append(tree)
    return out

  closed = jax.make_jaxpr(flat)()
  tree = box[-1]
  shapes = [shape_struct(a) for a in closed.out_avals]

  def replay():
    return jax.tree.unflatten(tree, jcore.jaxpr_as_fun(closed)())

  return replay, jax.tree.unflatten(tree, shapes)


def zeros_like_update(x: Any) -> Any:
  """The update that changes nothing, of the same structure as ``x``.

  Dense arrays give zeros; a SparseRows gives an all-padding SparseRows of
  the same static length (every index is the padding row, values zero), so
  the two branches of a ``lax.cond`` have identical types. ``x`` may be
  abstract (``jax.eval_shape``'s result).
  """

  def zero(leaf: Any) -> Any:
    if leaf is None:
      return None
    if isinstance(leaf, SparseRows):
      return SparseRows.padding_like(leaf)
    return jnp.zeros(jnp.shape(leaf), leaf.dtype)

  return tree_map(zero, x)


def apply_if(
  pred: Any,
  run: Callable[[], tuple[Any, Any]],
  state: Any,
  check: Callable[[Any, Any], None] | None = None,
) -> tuple[Any, Any]:
  """``run()`` where ``pred`` holds, else zero updates and ``state`` kept.

  The one conditional of gradtx's wrappers (``accumulate``, ``drop_stale``):
  ``run`` returns ``(updates, new_state)`` and is traced once, whatever the
  nesting (the skip branch takes its types from that trace, see
  :func:`trace_once`). The skip branch gives zeros of the
  updates' types (an all-padding SparseRows where ``run`` gives one) and
  ``state`` as it is. Inside ``shard_map`` both branches are cast to the
  union of the mesh axes their outputs vary over (jax-ml/jax#23693). A
  concrete ``pred`` (an eager call) branches in Python: an eager
  ``lax.cond`` would compile at each call.

  Args:
    pred: a bool scalar, traced or concrete.
    run: ``run() -> (updates, new_state)``; ``new_state`` has the structure
      and types of ``state``.
    state: the state the skip branch keeps.
    check: ``check(state, new_state_types)``, called once ``run`` is traced
      (to refuse a ``run`` that changes the state's types).

  Returns:
    ``(updates, state)`` of the branch taken.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from gradtx._conditional import apply_if
    >>> def run():
    ...   return jnp.ones(2), jnp.int32(1)
    >>> step = jax.jit(lambda pred: apply_if(pred, run, jnp.int32(0)))
    >>> step(True)
    (Array([1., 1.], dtype=float32), Array(1, dtype=int32))
    >>> step(False)
    (Array([0., 0.], dtype=float32), Array(0, dtype=int32))
  """
  decided = concrete(pred, bool)
  if decided and check is None:
    return run()
  replay, (u_types, s_types) = trace_once(run)
  if check is not None:
    check(state, s_types)
  if decided:
    return replay()

  def skip():
    return zeros_like_update(u_types), state

  if decided is not None:
    return skip()
  varying = jax.tree.map(
    lambda a, b: varying_axes(a) | varying_axes(b),
    (u_types, s_types),
    jax.eval_shape(skip),
  )

  def cast(tree):
    return jax.tree.map(cast_varying, tree, varying)

  return lax.cond(pred, lambda: cast(replay()), lambda: cast(skip()))
