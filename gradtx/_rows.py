"""The row engine every sparse optimizer runs on.

An optimizer is one per-row rule plus its state layout (FBGEMM's design:
one kernel template, short per-row update rules). :func:`row_optimizer`
builds the transformation from them; the built-ins and
:func:`gradtx.row_transformation` all go through it.

**The rule form.** ``rule(g, p, *states) -> (new_states, update)``: from
the gradient rows ``g``, the parameter rows ``p`` (None unless the
optimizer needs them) and the old state rows, the new state rows, and
either a function ``update(*new_states)`` that computes the update from
the new state rows or the update itself (an array, for a rule that
computed it already, as :func:`gradtx.row_transformation`'s do). The
engine writes the new state rows back and calls ``update`` on them, so
every optimizer writes its update once; see :func:`_materialize` for the
copy it makes of them first, and when it makes none.

**Groups of tables.** A model with a table per feature holds tens to
hundreds of SparseRows leaves of one row shape. Leaves whose rows are read
alike (row shape and dtype of the gradient, dtypes of the parameter and of
each state's rows, the row sharding) form a *group*, and the group is
deduplicated in one pass: the tables' ids offset into one id space, one
hash loop for all of them, each id kept at its first position, so a
table's unique ids stay in its own static slice. Each table then keeps its
own parameter and state arrays, read and written on its slice (the user's
params are one leaf per table, and the state stays shaped like them:
checkpoints, ``optax.tree.map_params``, row sharding and int8 state are
unchanged; a stacked copy would cost a table-sized copy per step), and the
rule runs per table on its slice: one call over the group's concatenated
rows would concatenate every state kind's rows and copy each slice before
its scatter, extra passes over the rows (benchmarks/results/
design_figures.md). Dense leaves call the rule once each on the whole
arrays, so they get the dense optimizer.

**Cost follows unique rows.** On CPU, a table's slice of many ids (at
least ``LOOP_MIN_IDS``, a stack's or a big table's) with a state of whole
rows runs the rule in a loop over its unique rows, compacted, ``LOOP_CHUNK`` a
trip (:func:`_update_unique`): the state reads and writes, the new rows and
the update then follow the unique rows, in cache a chunk at a time, and
duplicates and padding cost the deduplication and the compaction only.
Smaller slices, and every slice on an accelerator (GPU, TPU: a loop trip
there is a launch and a host sync, and the device is wide enough for every
slot at once; :mod:`gradtx._platform`), take one pass over every id slot
(:func:`_update_all`), whose padding slots read nothing from the tables.
Such a big leaf (a stack) is a group of its own: joined with small leaves
(a head's weights read by a gather), its rows would be copied into the
group's buffer and sliced out again.

A state leaf is shaped like its parameter (``[V, *row]``) or per row
(``[V]``), or is an 8-bit :class:`~gradtx.QuantizedRows`; the row I/O of
:mod:`gradtx._rowio` reads and writes all of them (dequantizing and
requantizing, owner-local on row-sharded tables), so rules see float rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradtx import _platform
from gradtx._jax_compat import barrier_computes_once, varying_axes
from gradtx._rowio import (
  per_row,
  read_param_rows,
  read_state,
  read_state_rows,
  state_array,
  write_state,
  write_state_rows,
)
from gradtx._sharded import is_split, row_axes
from gradtx._sparse_rows import MAX_ROWS, SparseRows, check_rows_match
from gradtx._static import concrete
from gradtx._update_trees import check_tree_match, is_update_leaf, zero_counter

__all__ = [
  "bias_corrections",
  "check_nonnegative",
  "concrete_float",
  "row_optimizer",
  "update_rows",
]

# rule(g, p, *states) -> (new_states, update), update(*new_states) -> u or
# the update u itself
Rule = Callable[..., tuple[Sequence[Any], Callable[..., Any] | Any]]


def concrete_float(x: Any) -> float | None:
  """``float(x)``, or None for a traced value (under inject_hyperparams)."""
  return concrete(x, float)


@functools.partial(jax.jit, inline=True)
def bias_corrections(b1: Any, b2: Any, count: jax.Array) -> tuple:
  """``1 - b^count`` for both moments of an Adam-like rule, computed once per
  step for every leaf (``rule(count)`` of :func:`row_optimizer`).

  Not ``optax.tree.bias_correction`` called per leaf inside the rule: under
  ``jit`` that gives other bits than ``optax.scale_by_adam``, which computes
  one ``1 - b^count`` for all leaves, as this does (tests/test_lazy_adam.py
  compares the bits). Jitted, since an eager ``**`` can round differently
  from a compiled one.
  """
  return 1 - b1**count, 1 - b2**count


def check_nonnegative(what: str, **values: Any) -> None:
  for name, value in values.items():
    v = concrete_float(value)
    if v is not None and not v >= 0:
      raise ValueError(
        f"{what}: `{name}` must be >= 0; got {v}. Pass a non-negative value."
      )


def _check_state_leaf(g: SparseRows, s: Any, what: str, name: str) -> None:
  s = state_array(s)
  if s is None or not hasattr(s, "shape"):
    raise ValueError(
      f"{what}: got a SparseRows gradient of dense shape {g.shape} at a "
      "position whose optimizer state holds no moments or accumulators (the "
      "state was initialized from a params tree with None or no array "
      "there). Call `tx.init(params)` with the table itself at that position."
    )
  if jnp.ndim(s) == len(g.shape):
    check_rows_match(g, s, what, "optimizer state")
  elif jnp.shape(s) != g.shape[:1]:
    raise ValueError(
      f"{what}: the {name} at this position has shape {jnp.shape(s)}, not "
      f"[num_rows] = {list(g.shape[:1])} or the table's shape {g.shape}: it "
      "was initialized for another leaf. Initialize the state from the "
      "params the gradients belong to."
    )


def _check_dense_shape(g: Any, p: Any, states: list[Any], what: str) -> None:
  shape = jnp.shape(g)
  if p is not None:
    want = jnp.shape(p)
  else:  # without params, a state leaf shaped like the parameter shows it
    wants = [
      jnp.shape(state_array(s))
      for s in states
      if s is not None and jnp.shape(state_array(s)) != shape[:1]
    ]
    want = wants[0] if wants else shape
  if shape != want:
    raise ValueError(
      f"{what}: a dense gradient of shape {shape} for a parameter of "
      f"shape {want}. Gradients must have their parameter's shape (no "
      "broadcasting)."
    )


def _materialize(x: jax.Array) -> jax.Array:
  """``x`` exactly, as a value XLA computes once, in a buffer of its own.

  Why: the new state rows feed two consumers, the in-place scatter into
  the table and the update. Left alone, XLA duplicates a cheap
  elementwise producer into each consumer, and the gather of the old
  state rows feeding it stays a kernel of its own (XLA:CPU) or is done
  twice. So the rows go behind an optimization barrier, with the old
  rows' gather fused into their one computation: on accelerators always;
  on CPU where XLA:CPU keeps the barrier through fusion
  (:func:`~gradtx._jax_compat.barrier_computes_once`) and the rows are
  whole rows. Elsewhere on CPU the rows are copied by a scatter into a
  buffer of zeros. Reading the rows back from the written table would do
  the same, but inside a ``lax.cond`` (accumulate, drop_stale,
  optax.apply_if_finite) XLA then copies the whole table. Rows split over
  mesh axes are left as they are.

  No copy is made for an update the rule computed already (an array,
  which reads no new rows), and with ``materialize=False``, for a rule
  whose new rows are cheap next to what else reads the old ones (lazy
  Adam's catch-up reads them again for the drift). What each choice
  measured on XLA:CPU: benchmarks/results/design_figures.md.
  """
  if is_split(x):
    return x
  # On accelerators a barrier: XLA:GPU and TPU keep it, and the rows
  # written and the update read one computation of them.
  return _platform.platform_dependent(
    x, cpu=_materialize_on_cpu, accelerator=lax.optimization_barrier
  )


def _materialize_on_cpu(x: jax.Array) -> jax.Array:
  if x.ndim > 1 and barrier_computes_once():
    return lax.optimization_barrier(x)
  slots = lax.iota(jnp.int32, x.shape[0])
  return jnp.zeros_like(x).at[slots].set(x, mode="drop", unique_indices=True)


def _update_of(
  update: Any, new: Sequence[Any], materialize: bool
) -> tuple[Any, Sequence[Any]]:
  """``(u, new)``: the rule's update ``update(*new)`` and the new rows to
  write, both read from one copy of the new rows when ``materialize``
  (:func:`_materialize`); an update the rule computed already (an array)
  reads no new rows, and they are written as they are."""
  if not callable(update):
    return update, new
  if materialize:
    new = [_materialize(r) for r in new]
  return update(*new), new


def _dtype_key(x: Any) -> Any:
  return None if x is None else jnp.dtype(getattr(x, "dtype", jnp.float32))


def _group_key(g: SparseRows, p: Any, states: list[Any]) -> tuple:
  """Leaves with equal keys read rows alike: one pass deduplicates them."""
  parts = [g.values.shape[1:], g.values.dtype, _dtype_key(p)]
  parts.append((is_split(g.indices), is_split(g.values)))
  for s in states:
    arr = state_array(s)
    per_row_state = jnp.ndim(arr) < len(g.shape)
    rows_dtype = jnp.float32 if arr is not s else arr.dtype
    parts.append((per_row_state, jnp.dtype(rows_dtype)))
  if p is not None:
    parts.append(row_axes(p))
  parts.extend(row_axes(state_array(s)) for s in states)
  return tuple(parts)


def _groups(keys: dict[int, tuple], sizes: dict[int, int]) -> list[list[int]]:
  """Leaves by key, in leaf order, each group's rows within int32 ids."""
  out: dict[tuple, list[list[int]]] = {}
  for i, key in keys.items():
    chunks = out.setdefault(key, [[]])
    if sum(sizes[j] for j in chunks[-1]) + sizes[i] > MAX_ROWS:
      chunks.append([])
    chunks[-1].append(i)
  return [c for chunks in out.values() for c in chunks]


class _Slice(NamedTuple):
  """One table of a group: where its rows sit in the group's arrays."""

  leaf: int
  start: int  # first position of its ids in the group's ids
  stop: int
  offset: int  # its first row in the group's id space
  num_rows: int


def _join_rows(parts: list[jax.Array]) -> jax.Array:
  """``jnp.concatenate(parts)``, written as in-place updates of one buffer:
  XLA:CPU fuses each part's producer (a gradient's cotangent) into its
  update, where a concatenate copies every part once more. Parts split
  over mesh axes are concatenated (their layouts may differ)."""
  if any(is_split(x) for x in parts):
    return jnp.concatenate(parts)
  rest = sum(x.shape[0] for x in parts[1:])
  pads = [(0, rest, 0)] + [(0, 0, 0)] * (parts[0].ndim - 1)
  out = lax.pad(parts[0], jnp.zeros([], parts[0].dtype), pads)
  start = parts[0].shape[0]
  for x in parts[1:]:
    out = lax.dynamic_update_slice_in_dim(out, x, start, axis=0)
    start += x.shape[0]
  return out


def _dedup_group(grads: list[SparseRows]) -> tuple[jax.Array, jax.Array]:
  """The group's ids (offset per table, padding = total rows) deduplicated
  in one pass, each id at its first position: ``(ids, values)``."""
  if len(grads) == 1:
    u = grads[0].deduplicated()
    return u.indices, u.values
  total = sum(g.num_rows for g in grads)
  ids, offset = [], 0
  for g in grads:
    idx = g.valid_indices()
    ids.append(jnp.where(idx < g.num_rows, idx + offset, total))
    offset += g.num_rows
  joined = SparseRows(
    jnp.concatenate(ids),
    _join_rows([g.values for g in grads]),
    total,
    unique=all(g.unique for g in grads),
    normalized=True,
  ).deduplicated()
  return joined.indices, joined.values


def _rule_on_rows(rule, g, ids, p, states, num_rows, materialize):
  """The rule on gradient rows ``g`` of unique ``ids`` (padding
  ``num_rows``) of one table: its parameter rows (``p`` the table, or None)
  and state rows read, ``(update zero at padding, new state rows)``."""
  pr = None if p is None else read_param_rows(p, ids)
  new, update = rule(g, pr, *[read_state_rows(x, ids) for x in states])
  u, new = _update_of(update, new, materialize)
  return jnp.where(per_row(ids < num_rows, u.ndim), u, jnp.zeros_like(u)), new


# A table's slice of at least LOOP_MIN_IDS id slots, with a state of whole
# rows, runs the rule on its unique rows only, LOOP_CHUNK at a time
# (:func:`_update_unique`).
LOOP_CHUNK = 2048
LOOP_MIN_IDS = 8 * LOOP_CHUNK


def _loops(g: SparseRows, p: Any, states: list[Any], nnz: int) -> bool:
  """Whether a table's slice runs :func:`_update_unique`: enough id slots,
  a state of whole rows (whose ``[n, *row]`` new rows and update are what a
  pass over every slot costs; a rule on per-row state only has ``[n]``
  intermediates, in cache), nothing split over mesh axes or varying over
  ``shard_map``'s axes (row-sharded tables take their owner-local writes,
  and a replica's own ids the pass over every slot)."""
  if not nnz or nnz < LOOP_MIN_IDS or is_split(g.values) or is_split(g.indices):
    return False
  arrays = [state_array(x) for x in states] + ([] if p is None else [p])
  if any(row_axes(a) for a in arrays):
    return False
  # inside shard_map, values that vary over mesh axes would change the
  # loop's carried state from invariant to varying
  every = [g.indices, g.values, *jax.tree.leaves((p, states))]
  if any(varying_axes(x) for x in every):
    return False
  return any(jnp.ndim(state_array(x)) == len(g.shape) for x in states)


def _update_unique(rule, ids, values, p, states, num_rows, materialize):
  """One table's rule, state reads and writes on its unique rows only.

  ``ids`` are deduplicated (each id once, padding ``num_rows`` at the
  duplicates' and padding's slots) and ``values`` their rows. The unique
  ids are compacted to the front and a loop runs the rule on ``LOOP_CHUNK`` of
  them a trip, as many trips as the step has unique rows: the new state
  rows and the update live in cache for one chunk, and duplicates and
  padding cost the compaction only. The update is written into ``values``
  in place, at the compacted slots (a chunk's writes land below every
  position a later chunk reads: a row's compacted slot is at most its
  position), and the slots past the unique rows are zeroed. The rule is
  traced once, and the loop is compiled even when called eagerly (its bits
  are jit's, not those of an op-by-op run). Returns ``(update,
  new_states)``, or None when the rule's update has another dtype than
  ``values`` (it could not be written in place)."""
  n = ids.shape[0]
  c = min(LOOP_CHUNK, n)
  chunk = jax.ShapeDtypeStruct((c,) + values.shape[1:], values.dtype)
  cids = jax.ShapeDtypeStruct((c,), ids.dtype)

  def call(g, i, p, states):
    return _rule_on_rows(rule, g, i, p, states, num_rows, materialize)

  # traced once (as the pass over every slot does): its update's dtype
  # decides the path, and the loop evaluates the traced rule
  call, consts = jax.closure_convert(call, chunk, cids, p, states)
  u_shape = jax.eval_shape(call, chunk, cids, p, states, *consts)[0]
  if u_shape.dtype != values.dtype or u_shape.shape != chunk.shape:
    return None
  keep = ids < num_rows
  count = jnp.sum(keep, dtype=jnp.int32)
  slot = jnp.where(keep, jnp.cumsum(keep, dtype=jnp.int32) - 1, n + c)
  # positions of the unique ids in order, then n (reads padding)
  pos = jnp.full([n + c], n, jnp.int32)
  pos = pos.at[slot].set(lax.iota(jnp.int32, n), mode="drop")
  uids = jnp.full([n], num_rows, ids.dtype).at[slot].set(ids, mode="drop")
  rows = lax.iota(jnp.int32, c)

  def trip(k, carry):
    states, vals = carry
    at = lax.dynamic_slice(pos, (k * c,), (c,))
    i = ids.at[at].get(mode="fill", fill_value=num_rows)
    g = vals.at[at].get(mode="fill", fill_value=0)
    u, new = call(g, i, p, states, *consts)
    states = [
      write_state_rows(x, i, r) for x, r in zip(states, new, strict=True)
    ]
    return states, vals.at[k * c + rows].set(u, mode="drop")

  def zero(k, vals):
    return vals.at[k * c + rows].set(jnp.zeros_like(vals[:c]), mode="drop")

  trips = (count + c - 1) // c
  states, vals = lax.fori_loop(0, trips, trip, (list(states), values))
  vals = lax.fori_loop(trips, (n + c - 1) // c, zero, vals)
  return SparseRows(uids, vals, num_rows, unique=True, normalized=True), states


def _update_group(
  rule, group, g_list, p_list, leaf_states, needs_params, materialize
):
  """One pass over a group of SparseRows leaves: returns, per leaf, its
  update (SparseRows) and its new state leaves."""
  grads = [g_list[i] for i in group]
  gid, values = _dedup_group(grads)
  slices, start, offset = [], 0, 0
  for i, g in zip(group, grads, strict=True):
    slices.append(_Slice(i, start, start + g.nnz, offset, g.num_rows))
    start += g.nnz
    offset += g.num_rows
  total = offset
  local = []  # each table's unique ids (padding = its num_rows)
  for s in slices:
    ids = gid[s.start : s.stop]
    if len(slices) > 1:
      ids = jnp.where(ids < total, ids - s.offset, s.num_rows)
    local.append(ids)
  out = {}
  for s, ids in zip(slices, local, strict=True):
    # the rule per table, on its slice (see the module docstring)
    states = leaf_states[s.leaf]
    p = p_list[s.leaf] if needs_params else None
    args = (rule, ids, values[s.start : s.stop], p, states, s.num_rows)
    if _loops(g_list[s.leaf], p, states, s.stop - s.start):
      # The loop is the CPU's tactic; an accelerator runs every unique
      # row at once (a loop trip is a launch and a host sync there).
      u, new = _platform.platform_dependent(
        cpu=functools.partial(_update_looped, *args, materialize),
        accelerator=functools.partial(_update_all, *args, materialize),
      )
      # a SparseRows' facts are not pytree data: said again here
      u = SparseRows(
        u.indices, u.values, s.num_rows, unique=True, normalized=True
      )
      out[s.leaf] = u, new
    else:
      out[s.leaf] = _update_all(*args, materialize)
  return out


def _update_looped(rule, ids, values, p, states, num_rows, materialize):
  """:func:`_update_unique`, or :func:`_update_all` where its update could
  not be written in place."""
  args = (rule, ids, values, p, states, num_rows, materialize)
  done = _update_unique(*args)
  return _update_all(*args) if done is None else done


def _update_all(rule, ids, values, p, states, num_rows, materialize):
  """One table's rule on every id slot of its slice at once (padding and
  duplicate slots read nothing and get a zero update): ``(update,
  new_states)``."""
  u, new = _rule_on_rows(rule, values, ids, p, states, num_rows, materialize)
  return (
    SparseRows(ids, u, num_rows, unique=True, normalized=True),
    [write_state_rows(x, ids, r) for x, r in zip(states, new, strict=True)],
  )


def update_rows(
  rule: Rule,
  updates: Any,
  states: Sequence[Any],
  params: Any = None,
  *,
  what: str,
  state_names: Sequence[str] | None = None,
  needs_params: bool = False,
  materialize: bool = True,
) -> tuple[Any, list[Any]]:
  """Applies a per-row ``rule`` to every leaf; SparseRows only on its rows.

  SparseRows leaves are deduplicated a group at a time (see the module
  docstring); per leaf, the touched rows of the parameter (if needed) and
  of every state leaf are read, the rule called on them, the new state rows
  written back in place, and the update is a SparseRows on the leaf's
  deduplicated ids, zero on padding rows.
  A dense leaf gives the rule whole arrays.

  Args:
    rule: ``rule(g, p, *states) -> (new_states, update)`` with
      ``update(*new_states) -> u`` (or ``u`` itself, an array, when the
      rule computed it already); pure and elementwise along the leading
      (row) axis. ``g`` is ``[n, *row]`` rows of a deduplicated SparseRows
      or a whole dense gradient (a padding row holds
      any value; what the rule makes of it is discarded); ``p`` the
      matching rows of the parameter (None unless ``needs_params``); each
      state is ``[n, *row]`` or ``[n]`` rows.
    updates: the gradient tree (arrays, SparseRows, None).
    states: state trees shaped like params; a leaf is like its parameter or
      per row (``[V]``).
    params: the params tree (needed when ``needs_params``).
    what: the transformation's name, for error messages.
    state_names: names of the states, for error messages.
    needs_params: pass parameter rows to the rule.
    materialize: copy the new state rows of a SparseRows leaf into a
      buffer of their own before ``update`` and the writes read them
      (:func:`_materialize`, which says when not to).

  Returns:
    ``(updates, new_states)``.

  Examples:
    A per-row counter of touches and an update of twice the gradient:

    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> from gradtx._rows import update_rows
    >>> def rule(g, p, hits):
    ...   return (hits + 1,), lambda hits: 2 * g
    >>> g = gtx.SparseRows(jnp.array([3, 0, 3, 9]), jnp.ones((4, 2)), 4)
    >>> u, (hits,) = update_rows(
    ...   rule, g, [jnp.zeros(4, jnp.int32)], what="demo")
    >>> u.indices, u.values[:, 0], hits
    (Array([3, 0, 4, 4], dtype=int32), Array([4., 2., 0., 0.], dtype=float32), \
Array([1, 0, 0, 1], dtype=int32))
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
  treedef = jax.tree.structure(updates, is_leaf=is_update_leaf)
  g_list = treedef.flatten_up_to(updates)
  s_lists = [treedef.flatten_up_to(s) for s in states]
  p_list = (
    [None] * len(g_list) if params is None else treedef.flatten_up_to(params)
  )
  leaf_states = [[s[i] for s in s_lists] for i in range(len(g_list))]
  results: dict[int, tuple[Any, list[Any]]] = {}
  keys, sizes = {}, {}
  for i, (g, p) in enumerate(zip(g_list, p_list, strict=True)):
    if isinstance(g, SparseRows):
      if p is not None:
        check_rows_match(g, p, what, "parameter")
      for s, name in zip(leaf_states[i], names, strict=True):
        _check_state_leaf(g, s, what, name)
      keys[i] = _group_key(g, p if needs_params else None, leaf_states[i])
      if g.nnz >= LOOP_MIN_IDS:
        # a big leaf (a stack) alone: joined with small ones, its rows would
        # be copied into the group's buffer and sliced out again
        keys[i] = ("alone", i, *keys[i])
      sizes[i] = g.num_rows
    elif g is not None:
      _check_dense_shape(g, p, leaf_states[i], what)
      new, update = rule(
        g,
        p if needs_params else None,
        *[read_state(s) for s in leaf_states[i]],
      )
      u, new = _update_of(update, new, False)
      results[i] = (
        u,
        [write_state(s, r) for s, r in zip(leaf_states[i], new, strict=True)],
      )
  for group in _groups(keys, sizes):
    results.update(
      _update_group(
        rule, group, g_list, p_list, leaf_states, needs_params, materialize
      )
    )
  out_u, out_s = [], [[] for _ in states]
  for i in range(len(g_list)):
    u, new = results.get(i, (None, leaf_states[i]))
    out_u.append(u)
    for acc, x in zip(out_s, new, strict=True):
      acc.append(x)
  return treedef.unflatten(out_u), [treedef.unflatten(x) for x in out_s]


def row_optimizer(
  rule: Callable[..., tuple[Sequence[Any], Callable[..., Any] | Any]],
  init: Callable[[Any], tuple[Any, ...]],
  state_type: type,
  *,
  what: str,
  state_names: Sequence[str] | Callable[[int], Sequence[str]] | None = None,
  needs_params: bool = False,
  pack: Callable[[Any, list[Any]], Any] | None = None,
  unpack: Callable[[Any], tuple[Any, list[Any]]] | None = None,
  materialize: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """A transformation from a per-row ``rule`` and a per-leaf ``init``.

  The one constructor of gradtx's row optimizers (the built-ins and
  :func:`gradtx.row_transformation`).

  Args:
    rule: ``rule(g, p, *states) -> (new_states, update)`` (see
      :func:`update_rows`). When ``state_type`` has a ``count`` field,
      ``rule(count)`` returns that step's rule, ``count`` being the steps
      taken before it: per-step scalars (bias corrections, a scheduled
      rate) are computed once, shared by every leaf as in optax.
    init: ``init(p) -> tuple of state arrays`` for each parameter leaf that
      is not None.
    state_type: the state's NamedTuple: an optional leading ``count`` field
      (int32, saturating) and then one tree like params per array ``init``
      returns.
    what: the transformation's name, for error messages.
    state_names: names of the states, for error messages (or a function
      of their number).
    needs_params: pass parameter rows to the rule.
    pack: ``pack(count, trees) -> state`` for a state_type of another form.
    unpack: ``unpack(state) -> (count, trees)``, pack's inverse.
    materialize: see :func:`update_rows` (a speed hint; results are the
      same either way).
  """
  custom = pack is not None
  counted = not custom and state_type._fields[:1] == ("count",)
  if not custom:
    pack = (
      (lambda count, trees: state_type(count, *trees))
      if counted
      else (lambda count, trees: state_type(*trees))
    )
    unpack = (
      (lambda s: (s[0], list(s[1:])))
      if counted
      else (lambda s: (None, list(s)))
    )

  def init_fn(params):
    leaves, treedef = jax.tree.flatten(params, is_leaf=lambda x: x is None)
    per_leaf = [None if p is None else tuple(init(p)) for p in leaves]
    lengths = sorted({len(x) for x in per_leaf if x is not None})
    if len(lengths) > 1:
      raise ValueError(
        f"{what}: `init` returned {lengths[0]} arrays for one parameter and "
        f"{lengths[-1]} for another; return the same number of states for "
        "every parameter."
      )
    n = (
      lengths[0]
      if lengths
      else (0 if custom else len(state_type._fields) - counted)
    )
    trees = [
      treedef.unflatten([None if x is None else x[k] for x in per_leaf])
      for k in range(n)
    ]
    return pack(zero_counter() if counted else None, trees)

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    count, trees = unpack(state)
    step_rule = rule(count) if counted else rule
    names = state_names(len(trees)) if callable(state_names) else state_names
    u, new = update_rows(
      step_rule,
      updates,
      trees,
      params,
      what=what,
      state_names=names,
      needs_params=needs_params,
      materialize=materialize,
    )
    return u, pack(optax.safe_increment(count) if counted else None, new)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
