"""The row engine every sparse optimizer runs on.

An optimizer is a pure per-row rule plus its state layout (FBGEMM's design:
one kernel template, short per-row update rules). This module does the rest
once: per leaf it coalesces a :class:`~gradtx.SparseRows` gradient (sorted
unique ids, duplicates summed, deterministically), gathers the touched rows of
the parameter and of every state leaf, calls the rule on those rows, scatters
the new state rows back in place (``unique_indices`` / ``indices_are_sorted``
hints, ``mode="drop"`` for padding) and returns the update as a SparseRows on
the coalesced ids. A dense leaf calls the same rule on the whole array, so it
gets exactly the dense optimizer.

A state leaf is either shaped like its parameter (``[V, *row]``, one value per
element) or per row (``[V]``, e.g. row-wise Adagrad's accumulator); the
engine reads both with the same two helpers, :func:`gather_rows` and
:func:`scatter_rows`, the only places that read or write rows of a table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from gradtx._base import SparseRows, check_tree_match
from gradtx._sparse import _check_rows_match

# rule(g, p, *state) -> (update, *new_state), on rows or whole leaves.
Rule = Callable[..., tuple[Any, ...]]


def _is_leaf(x: Any) -> bool:
  return x is None or isinstance(x, SparseRows)


def gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
  """Rows ``x[idx]`` for sorted unique ``idx``; padding ids read zeros."""
  return x.at[idx].get(
    mode="fill", fill_value=0, indices_are_sorted=True, unique_indices=True
  )


def scatter_rows(x: jax.Array, idx: jax.Array, rows: jax.Array) -> jax.Array:
  """``x[idx] = rows`` in place for sorted unique ``idx``; padding dropped."""
  return x.at[idx].set(
    rows.astype(x.dtype),
    mode="drop",
    indices_are_sorted=True,
    unique_indices=True,
  )


def per_row_full(p: Any, fill_value: Any, dtype: DTypeLike) -> jax.Array:
  """A fresh ``[V]`` state leaf (one value per row of ``p``)."""
  return jnp.full(jnp.shape(p)[:1], fill_value, dtype)


def concrete_float(x: Any) -> float | None:
  """``float(x)``, or None for a traced value (under inject_hyperparams)."""
  try:
    return float(x)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return None


def per_row(x: jax.Array, ndim: int) -> jax.Array:
  """Reshapes ``[n]`` to broadcast against ``[n, *row]`` of rank ``ndim``."""
  return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def _check_state_leaf(g: SparseRows, s: Any, what: str, name: str) -> None:
  if s is None or not hasattr(s, "shape"):
    raise ValueError(
      f"{what}: got a SparseRows gradient of dense shape {g.shape} at a "
      "position whose optimizer state holds no moments or accumulators (the "
      "state was initialized from a params tree with None or no array "
      "there). Call `tx.init(params)` with the table itself at that position."
    )
  if jnp.ndim(s) == len(g.shape):
    _check_rows_match(g, s, what, "optimizer state")
  elif jnp.shape(s) != g.shape[:1]:
    raise ValueError(
      f"{what}: the {name} at this position has shape {jnp.shape(s)}, not "
      f"[num_rows] = {list(g.shape[:1])} or the table's shape {g.shape}: it "
      "was initialized for another leaf. Initialize the state from the "
      "params the gradients belong to."
    )


def _sparse_leaf(rule, g, p, states, what, names, needs_params):
  if p is not None:
    _check_rows_match(g, p, what, "parameter")
  for s, name in zip(states, names, strict=True):
    _check_state_leaf(g, s, what, name)
  g = g.coalesce()  # once per leaf: sorted, unique, padding = num_rows
  idx = g.indices
  p_rows = gather_rows(jnp.asarray(p), idx) if needs_params else None
  out = rule(g.values, p_rows, *(gather_rows(s, idx) for s in states))
  u = out[0]
  valid = per_row(idx < g.num_rows, u.ndim)
  u = jnp.where(valid, u, jnp.zeros_like(u))
  new = [scatter_rows(s, idx, r) for s, r in zip(states, out[1:], strict=True)]
  return SparseRows(idx, u, g.num_rows), new


def _dense_leaf(rule, g, p, states, what, needs_params):
  refs = [p] if p is not None else [s for s in states if s is not None]
  want = jnp.shape(refs[0]) if refs else jnp.shape(g)
  if jnp.shape(g) != want and (p is not None or len(want) == jnp.ndim(g)):
    raise ValueError(
      f"{what}: a dense gradient of shape {jnp.shape(g)} for a parameter of "
      f"shape {want}. Gradients must have their parameter's shape (no "
      "broadcasting)."
    )
  out = rule(g, p if needs_params else None, *states)
  new = [r.astype(s.dtype) for s, r in zip(states, out[1:], strict=True)]
  return out[0], new


def update_rows(
  rule: Rule,
  updates: Any,
  states: Sequence[Any],
  params: Any = None,
  *,
  what: str,
  state_names: Sequence[str] | None = None,
  needs_params: bool = False,
) -> tuple[Any, list[Any]]:
  """Applies a per-row ``rule`` to every leaf; SparseRows only on its rows.

  Args:
    rule: ``rule(g, p, *state) -> (update, *new_state)``, pure and
      elementwise along the leading (row) axis. ``g`` is ``[n, *row]`` rows of
      a coalesced SparseRows (padding rows are zero) or a whole dense
      gradient; ``p`` the matching rows of the parameter (None unless
      ``needs_params``); each state is ``[n, *row]`` or ``[n]`` rows.
    updates: the gradient tree (arrays, SparseRows, None).
    states: state trees shaped like params; a leaf is like its parameter or
      per row (``[V]``).
    params: the params tree (needed when ``needs_params``).
    what: the transformation's name, for error messages.
    state_names: names of the states, for error messages.
    needs_params: pass parameter rows to the rule.

  Returns:
    ``(updates, new_states)``; a SparseRows leaf's update is a SparseRows on
    the coalesced ids (padding rows zero), its new states written in place.
  """
  names = list(state_names or ["optimizer state"] * len(states))
  for s in states:
    check_tree_match(updates, s, name="updates", reference_name="params")
  if params is not None:
    check_tree_match(updates, params, name="updates", reference_name="params")
  elif needs_params:
    raise ValueError(
      f"{what} needs `params`: call `tx.update(updates, state, params)`."
    )
  treedef = jax.tree.structure(updates, is_leaf=_is_leaf)
  g_list = treedef.flatten_up_to(updates)
  s_lists = [treedef.flatten_up_to(s) for s in states]
  p_list = (
    [None] * len(g_list) if params is None else treedef.flatten_up_to(params)
  )
  out_u, out_s = [], [[] for _ in states]
  for i, (g, p) in enumerate(zip(g_list, p_list, strict=True)):
    leaf_states = [s[i] for s in s_lists]
    if g is None:
      u, new = None, leaf_states
    elif isinstance(g, SparseRows):
      u, new = _sparse_leaf(rule, g, p, leaf_states, what, names, needs_params)
    else:
      u, new = _dense_leaf(rule, g, p, leaf_states, what, needs_params)
    out_u.append(u)
    for acc, x in zip(out_s, new, strict=True):
      acc.append(x)
  return treedef.unflatten(out_u), [treedef.unflatten(x) for x in out_s]
