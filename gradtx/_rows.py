"""The row engine every sparse optimizer runs on.

An optimizer is a pure per-row rule plus its state layout (FBGEMM's design:
one kernel template, short per-row update rules). This module does the rest
once: per leaf it deduplicates a :class:`~gradtx.SparseRows` gradient
(:func:`~gradtx._base.unique_rows`: duplicates summed, deterministically;
on CPU without a sort), gathers the touched rows of the parameter and of
every state leaf, calls the rule on those rows, scatters the new state rows
back in place (``unique_indices`` hint, ``mode="drop"`` for padding) and
returns the update as a SparseRows on the deduplicated ids. A dense leaf
calls the same rule on the whole array, so it
gets exactly the dense optimizer.

A state leaf is either shaped like its parameter (``[V, *row]``, one value per
element) or per row (``[V]``, e.g. row-wise Adagrad's accumulator); the
engine reads both with the bottom layer's row I/O, ``gather_rows`` and
``scatter_rows`` (:mod:`gradtx._base`, owner-local for row-sharded tables),
the only places that read or write rows of a table; ``per_row_full``
allocates ``[V]`` state split like the table's rows. A state leaf may also
be an 8-bit :class:`~gradtx.QuantizedRows` (``"int8"`` state dtypes): the
engine reads its rows' codes and scales and dequantizes them, the rule
computes in float32, and the new rows are quantized and written back
(:mod:`gradtx._precision`), so rules never see the storage format.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from gradtx._base import (
  SparseRows,
  check_rows_match,
  check_tree_match,
  concrete,
  gather_rows,
  is_update_leaf,
  scatter_rows,
  unique_rows,
)
from gradtx._precision import (
  read_state,
  read_state_rows,
  state_array,
  write_state,
  write_state_rows,
)
from gradtx._sharded import is_split, per_row_full

__all__ = [
  "concrete_float",
  "gather_rows",
  "per_row",
  "per_row_full",
  "scatter_rows",
  "update_rows",
]

# rule(g, p, *state) -> (update, *new_state), on rows or whole leaves.
Rule = Callable[..., tuple[Any, ...]]


def concrete_float(x: Any) -> float | None:
  """``float(x)``, or None for a traced value (under inject_hyperparams)."""
  return concrete(x, float)


def per_row(x: jax.Array, ndim: int) -> jax.Array:
  """Reshapes ``[n]`` to broadcast against ``[n, *row]`` of rank ``ndim``."""
  return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def _check_state_leaf(
  g: SparseRows, s: Any, what: str, name: str, row_states: bool
) -> None:
  s = state_array(s)
  if s is None or not hasattr(s, "shape"):
    raise ValueError(
      f"{what}: got a SparseRows gradient of dense shape {g.shape} at a "
      "position whose optimizer state holds no moments or accumulators (the "
      "state was initialized from a params tree with None or no array "
      "there). Call `tx.init(params)` with the table itself at that position."
    )
  if jnp.ndim(s) == len(g.shape) or not row_states:
    check_rows_match(g, s, what, "optimizer state")
  elif jnp.shape(s) != g.shape[:1]:
    raise ValueError(
      f"{what}: the {name} at this position has shape {jnp.shape(s)}, not "
      f"[num_rows] = {list(g.shape[:1])} or the table's shape {g.shape}: it "
      "was initialized for another leaf. Initialize the state from the "
      "params the gradients belong to."
    )


class _Leaf(NamedTuple):
  """One leaf's inputs to the rule and how to write its outputs back."""

  g: jax.Array  # [n, *row] deduplicated rows, or the whole dense gradient
  p: Any  # matching rows of the parameter, or None
  states: list[jax.Array]  # matching rows of each state leaf
  idx: Any  # int32 [n] unique ids (padding = num_rows); None if dense
  num_rows: int


def _read_sparse(g, p, states, what, names, needs_params, row_states):
  if p is not None:
    check_rows_match(g, p, what, "parameter")
  for s, name, rows in zip(states, names, row_states, strict=True):
    _check_state_leaf(g, s, what, name, rows)
  idx, values = unique_rows(g)  # once per leaf; padding = num_rows
  p_rows = (
    gather_rows(jnp.asarray(p), idx, unique=True) if needs_params else None
  )
  rows = [read_state_rows(s, idx) for s in states]
  return _Leaf(values, p_rows, rows, idx, g.num_rows)


def _read_dense(g, p, states, what, needs_params, row_states):
  shape = jnp.shape(g)
  if p is not None:
    wants = [jnp.shape(p)]
  else:  # without params, a state leaf shaped like the parameter shows it
    wants = [
      jnp.shape(state_array(s))
      for s, rows in zip(states, row_states, strict=True)
      if s is not None and not (rows and jnp.shape(state_array(s)) == shape[:1])
    ]
  for want in wants[:1]:
    if shape != want:
      raise ValueError(
        f"{what}: a dense gradient of shape {shape} for a parameter of "
        f"shape {want}. Gradients must have their parameter's shape (no "
        "broadcasting)."
      )
  return _Leaf(
    g, p if needs_params else None, [read_state(s) for s in states], None, 0
  )


def _materialize(x: jax.Array) -> jax.Array:
  """``x`` exactly, as a value XLA computes once: copied into a buffer of
  its own by a scatter (a small pass over ``[n, *row]`` values in cache).

  Why: the new state rows feed two consumers, the in-place scatter into the
  table and the update. XLA:CPU duplicates a cheap elementwise producer
  into each consumer, so the gather of the old state rows gets two
  consumers and stays a standalone gather kernel, 2-3x slower per row than
  a gather fused into its one consumer's loop. Scatters take their updates
  whole, so behind this one the new rows are computed once, with the old
  rows' gather fused in (lazy_adam's whole step at 1M x 64 with 8,192 ids:
  9.1 -> 6.9 ms). Reading the rows back from the written table does the
  same, but inside a ``lax.cond`` (accumulate, drop_stale,
  optax.apply_if_finite) XLA then copies the whole table. Rows split over mesh
  axes are left as they are.
  """
  if is_split(x):
    return x
  slots = lax.iota(jnp.int32, x.shape[0])
  return jnp.zeros_like(x).at[slots].set(x, mode="drop", unique_indices=True)


def _call(fn: Rule, args: dict[int, tuple], across_leaves: bool) -> dict:
  """``fn`` on each leaf's args, or once on lists over the leaves."""
  if not across_leaves or not args:
    return {i: fn(*a) for i, a in args.items()}
  out = fn(*(list(col) for col in zip(*args.values(), strict=True)))
  return dict(zip(args, out, strict=True))


def _finish(leaf: _Leaf, u: Any, tables: list[Any]):
  if leaf.idx is None:
    return u, tables
  valid = per_row(leaf.idx < leaf.num_rows, u.ndim)
  u = jnp.where(valid, u, jnp.zeros_like(u))
  update = SparseRows(leaf.idx, u, leaf.num_rows, unique=True, normalized=True)
  return update, tables


def update_rows(
  rule: Rule,
  updates: Any,
  states: Sequence[Any],
  params: Any = None,
  *,
  what: str,
  state_names: Sequence[str] | None = None,
  needs_params: bool = False,
  row_states: bool | Sequence[bool] = False,
  across_leaves: bool = False,
  update_of: Rule | None = None,
) -> tuple[Any, list[Any]]:
  """Applies a per-row ``rule`` to every leaf; SparseRows only on its rows.

  Per leaf: a SparseRows gradient is deduplicated once and the rows it touches
  are read from the parameter (if needed) and every state leaf; the rule
  computes on those rows; the new state rows are written back in place and
  the update is a SparseRows on the deduplicated ids, zero on padding rows. A
  dense leaf gives the rule whole arrays.

  Args:
    rule: ``rule(g, p, *state) -> (update, *new_state)``, pure and
      elementwise along the leading (row) axis. ``g`` is ``[n, *row]`` rows of
      a deduplicated SparseRows or a whole dense gradient (a padding row
      holds any value; what the rule makes of it is discarded); ``p`` the
      matching rows of the parameter (None unless ``needs_params``); each
      state is ``[n, *row]`` or ``[n]`` rows.
    updates: the gradient tree (arrays, SparseRows, None).
    states: state trees shaped like params; a leaf is like its parameter or
      per row (``[V]``).
    params: the params tree (needed when ``needs_params``).
    what: the transformation's name, for error messages.
    state_names: names of the states, for error messages.
    needs_params: pass parameter rows to the rule.
    row_states: whether state leaves may be per row (``[V]``) instead of
      shaped like their parameter; one bool, or one per state.
    across_leaves: call the rule once with lists (one entry per non-None
      leaf) instead of once per leaf; it returns lists. For rules written
      with optax's tree-level helpers, whose compiled form can depend on
      the leaves computed together (so dense leaves keep optax's bits).
    update_of: ``update_of(g, p, *new_state) -> update``, the rule's update
      as a function of the new state rows (lists over the leaves when
      ``across_leaves``, as for the rule). Given, a SparseRows leaf's new
      state rows are computed once (:func:`_materialize`) and its update
      comes from them, which XLA:CPU compiles to faster gathers; the rule's
      own update is then unused for that leaf.

  Returns:
    ``(updates, new_states)``; a SparseRows leaf's update is a SparseRows on
    the deduplicated ids (padding rows zero), its new states written in place.

  Examples:
    A per-row counter of touches and an update of twice the gradient:

    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> from gradtx._rows import update_rows
    >>> def rule(g, p, hits):
    ...   return 2 * g, hits + 1
    >>> g = gtx.SparseRows(jnp.array([3, 0, 3, 9]), jnp.ones((4, 2)), 4)
    >>> u, (hits,) = update_rows(
    ...   rule, g, [jnp.zeros(4, jnp.int32)], what="demo", row_states=True)
    >>> u.indices, u.values[:, 0], hits
    (Array([3, 0, 4, 4], dtype=int32), Array([4., 2., 0., 0.], dtype=float32), \
Array([1, 0, 0, 1], dtype=int32))
  """
  names = list(state_names or ["optimizer state"] * len(states))
  if isinstance(row_states, bool):
    row_states = [row_states] * len(states)
  for s in states:
    check_tree_match(updates, s, name="updates", reference_name="params")
  if params is not None:
    check_tree_match(updates, params, name="updates", reference_name="params")
  elif needs_params:
    raise ValueError(
      f"{what} needs `params`: call `tx.update(updates, state, params)`."
    )
  treedef = jax.tree.structure(updates, is_leaf=is_update_leaf)
  g_list = treedef.flatten_up_to(updates)
  s_lists = [treedef.flatten_up_to(s) for s in states]
  p_list = (
    [None] * len(g_list) if params is None else treedef.flatten_up_to(params)
  )
  leaf_states = [[s[i] for s in s_lists] for i in range(len(g_list))]
  read = {}
  for i, (g, p) in enumerate(zip(g_list, p_list, strict=True)):
    if isinstance(g, SparseRows):
      read[i] = _read_sparse(
        g, p, leaf_states[i], what, names, needs_params, row_states
      )
    elif g is not None:
      read[i] = _read_dense(
        g, p, leaf_states[i], what, needs_params, row_states
      )
  outs = _call(
    lambda *a: (
      tuple(zip(*rule(*a), strict=True)) if across_leaves else rule(*a)
    ),
    {i: (x.g, x.p, *x.states) for i, x in read.items()},
    across_leaves,
  )
  us = {i: out[0] for i, out in outs.items()}
  tables, back_args = {}, {}
  for i, x in read.items():
    new = outs[i][1:]
    if x.idx is None:
      tables[i] = [
        write_state(s, r) for s, r in zip(leaf_states[i], new, strict=True)
      ]
    else:
      if update_of is not None:
        new = [_materialize(r) for r in new]
      tables[i] = [
        write_state_rows(s, x.idx, r)
        for s, r in zip(leaf_states[i], new, strict=True)
      ]
    back_args[i] = (x.g, x.p, *new)
  if update_of is not None and any(x.idx is not None for x in read.values()):
    # Called on every leaf, as the rule was (an across_leaves rule then
    # compiles alike); used for the SparseRows leaves.
    back = _call(update_of, back_args, across_leaves)
    us.update((i, back[i]) for i, x in read.items() if x.idx is not None)
  out_u, out_s = [], [[] for _ in states]
  for i in range(len(g_list)):
    if i in read:
      u, new = _finish(read[i], us[i], tables[i])
    else:
      u, new = None, leaf_states[i]
    out_u.append(u)
    for acc, x in zip(out_s, new, strict=True):
      acc.append(x)
  return treedef.unflatten(out_u), [treedef.unflatten(x) for x in out_s]
