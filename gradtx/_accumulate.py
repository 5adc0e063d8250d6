"""k-step gradient accumulation: emit the inner update once every k calls."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.typing import DTypeLike

from gradtx import _sharded
from gradtx._autodiff import SparsityReport, attribute_path
from gradtx._conditional import apply_if, zeros_like_update
from gradtx._sparse_rows import SparseRows
from gradtx._static import is_int
from gradtx._update_trees import (
  broadcast_prefix,
  check_tree_match,
  is_update_leaf,
  map_updates,
  tree_map,
  zero_counter,
)


class AccumulateState(NamedTuple):
  """State of :func:`accumulate`.

  After ``updates, state = tx.update(...)``, ``state.num_accumulated == 0``
  exactly when that call emitted the inner update (equivalently,
  ``state.num_updates`` went up, until it saturates).
  """

  num_micro_steps: jax.Array  # int32 [], update calls so far (saturating)
  num_updates: jax.Array  # int32 [], inner updates emitted (saturating)
  num_accumulated: jax.Array  # int32 [], gradients held now, in [0, k)
  # Like params: a dense leaf holds the running sum, its shape, in the
  # accumulator dtype; a sparse leaf holds a SparseRows buffer of k * n rows
  # (indices int32 [k * n], padding = num_rows; values [k * n, *row] in the
  # accumulator dtype). Every leaf is None when every_k is the int 1.
  accumulator: Any
  inner_state: Any  # the inner transformation's state


def _check_every_k(every_k: Any, name: str = "every_k") -> int | None:
  """The static k, or None for a schedule."""
  if callable(every_k) and name == "every_k":
    return None
  if not is_int(every_k):
    what = " or a schedule `step -> int`" if name == "every_k" else ""
    raise TypeError(
      f"gradtx.accumulate `{name}` must be a Python int >= 1{what}; got "
      f"{every_k!r} of type {type(every_k).__name__}. Pass `int(k)`"
      + (", or a function of the number of emitted updates." if what else ".")
    )
  if every_k < 1:
    raise ValueError(
      f"gradtx.accumulate `{name}` must be >= 1; got {every_k}. Use "
      "every_k=1 to apply the inner transformation on every call."
    )
  return int(every_k)


def _check_rows(n: Any, path: str) -> int | None:
  """One leaf's ``rows_per_step``: an int >= 1 (sparse) or None (dense)."""
  if n is None:
    return None
  if not is_int(n) or n < 1:
    raise ValueError(
      f"gradtx.accumulate `rows_per_step` at {path or 'the root'} must be "
      f"an int >= 1 (the rows one SparseRows gradient carries) or None for "
      f"a dense leaf; got {n!r}."
    )
  return int(n)


def _spellings(keys: tuple[Any, ...]) -> set[str]:
  """The ways a report may spell a leaf's path: ``keystr`` of its keys, or
  of their attribute form (an nnx module's ``.embed`` for its state's
  ``['embed']``), each with and without nnx's trailing ``.value``."""
  out = set()
  for path in (jax.tree_util.keystr(keys), attribute_path(keys)):
    out |= {path, path.removesuffix(".value")}
  return out


def _rows_from_report(report: SparsityReport, params: Any) -> Any:
  """``rows_per_step`` read off a :func:`gradtx.sparsity_report`: each
  sparse leaf's rows per step (at least 1: a frozen table's gradient is an
  empty SparseRows), None for each dense one."""
  records = {r.path.removesuffix(".value"): r for r in report}
  leaves, treedef = jax.tree_util.tree_flatten_with_path(
    params, is_leaf=lambda x: x is None
  )
  rows, missing = [], []
  for keys, p in leaves:
    found = [records[s] for s in sorted(_spellings(keys)) if s in records]
    if p is None or not found:
      rows.append(None)
      if p is not None:
        missing.append(jax.tree_util.keystr(keys))
      continue
    r = found[0]
    rows.append(max(r.rows_per_step, 1) if r.sparse else None)
  if missing:
    raise ValueError(
      "gradtx.accumulate `rows_per_step` is a SparsityReport with no record "
      f"for the params leaves {', '.join(missing)} (its records: "
      f"{', '.join(r.path for r in report)}). Make the report of the params "
      "that init gets, `gtx.sparsity_report(loss)(params, batch)` with one "
      "differentiated argument, or pass a tree of row counts."
    )
  return jax.tree.unflatten(treedef, rows)


def _resolve_rows_per_step(rows_per_step: Any, params: Any) -> Any:
  """A tree like params with an int (sparse) or None (dense) per leaf."""
  if isinstance(rows_per_step, SparsityReport):
    return _rows_from_report(rows_per_step, params)
  if rows_per_step is None:
    return tree_map(lambda _: None, params)
  if is_int(rows_per_step):
    n = _check_rows(rows_per_step, "")
    return tree_map(lambda p: None if p is None else n, params)
  try:
    return broadcast_prefix(rows_per_step, params)
  except ValueError as e:
    raise ValueError(
      "gradtx.accumulate `rows_per_step` must be an int (every leaf is a "
      "sparse table) or a pytree prefix of params with an int for each "
      "sparse leaf and None for each dense one; its structure "
      f"{jax.tree.structure(rows_per_step, is_leaf=lambda x: x is None)} "
      "is not a prefix of params' "
      f"{jax.tree.structure(params)}."
    ) from e


def _new_buffer(p: Any, rows: int, dtype: Any) -> SparseRows:
  """An all-padding sparse buffer of ``rows`` rows for table ``p``."""
  shape = tuple(p.shape)
  if len(shape) < 1:
    raise ValueError(
      "gradtx.accumulate `rows_per_step` gives a row count to a scalar "
      "parameter; only tables (arrays with a row axis) take SparseRows "
      "gradients. Set it to None for this leaf."
    )
  return SparseRows(
    jnp.full([rows], shape[0], jnp.int32),
    jnp.zeros((rows, *shape[1:]), dtype),
    shape[0],
  )


class _Settings(NamedTuple):
  """The checked arguments of :func:`accumulate`, read by init and update."""

  inner: optax.GradientTransformationExtraArgs
  static_k: int | None  # None with an every_k schedule
  schedule: Callable[[jax.Array], Any] | None
  max_every_k: int | None  # bounds a schedule; sizes the sparse buffers
  mean: bool
  accumulator_dtype: Any  # a jnp.dtype, or None for each param's dtype
  rows_per_step: Any

  @property
  def passthrough(self) -> bool:
    """``every_k=1``: the inner transformation itself, no accumulator."""
    return self.static_k == 1

  @property
  def window(self) -> int | None:
    """The most gradients a window holds: sparse buffers have this many
    slots of ``rows_per_step`` rows."""
    return self.static_k or self.max_every_k


def _check_settings(
  inner: optax.GradientTransformation,
  every_k: Any,
  mean: bool,
  accumulator_dtype: Any,
  rows_per_step: Any,
  max_every_k: Any,
) -> _Settings:
  """Checks the arguments of :func:`accumulate` when it is called, before
  any trace, so a bad one fails at construction."""
  static_k = _check_every_k(every_k)
  schedule = None if static_k is not None else every_k
  if max_every_k is not None:
    if schedule is None:
      raise ValueError(
        "gradtx.accumulate `max_every_k` only bounds an `every_k` schedule; "
        f"every_k is the int {static_k}. Drop max_every_k."
      )
    max_every_k = _check_every_k(max_every_k, "max_every_k")
  if accumulator_dtype is not None:
    accumulator_dtype = jnp.dtype(accumulator_dtype)
    if not jnp.issubdtype(accumulator_dtype, jnp.inexact):
      raise ValueError(
        "gradtx.accumulate `accumulator_dtype` must be a floating dtype "
        f"(for example jnp.float32); got {accumulator_dtype}."
      )
  return _Settings(
    inner=optax.with_extra_args_support(inner),
    static_k=static_k,
    schedule=schedule,
    max_every_k=max_every_k,
    mean=mean,
    accumulator_dtype=accumulator_dtype,
    rows_per_step=rows_per_step,
  )


# ----------------------------------------------------------------------------
# init


def _buffer_k(settings: _Settings, rows: int) -> int:
  """The slots of a sparse buffer; a schedule needs a static bound."""
  if settings.window is None:
    raise ValueError(
      "gradtx.accumulate: with an `every_k` schedule, sparse leaves need "
      "a static buffer size. Pass `max_every_k=` (the largest k the "
      "schedule returns); the buffer then holds max_every_k * "
      f"rows_per_step rows (here rows_per_step={rows})."
    )
  return settings.window


def _new_accumulator(settings: _Settings, p: Any, rows: int | None) -> Any:
  """An empty accumulator leaf for param ``p``: a running sum like ``p``
  (dense), a buffer of ``k * rows`` rows (sparse), or None (no param, or
  ``every_k=1``)."""
  if p is None or settings.passthrough:
    return None
  dtype = settings.accumulator_dtype or p.dtype
  if rows is None:
    return jnp.zeros_like(p, dtype=dtype)  # keeps p's sharding
  return _new_buffer(p, _buffer_k(settings, rows) * rows, dtype)


def _init(settings: _Settings, params: Any) -> AccumulateState:
  """``init``: empty counters, accumulators and the inner state."""
  rows = _resolve_rows_per_step(settings.rows_per_step, params)
  paths_rows, _ = jax.tree_util.tree_flatten_with_path(
    rows, is_leaf=lambda x: x is None
  )
  for path, n in paths_rows:
    _check_rows(n, jax.tree_util.keystr(path))
  accumulator = jax.tree.map(
    functools.partial(_new_accumulator, settings),
    params,
    rows,
    is_leaf=lambda x: x is None,
  )
  return AccumulateState(
    num_micro_steps=zero_counter(),
    num_updates=zero_counter(),
    num_accumulated=zero_counter(),
    accumulator=accumulator,
    inner_state=settings.inner.init(params),
  )


# ----------------------------------------------------------------------------
# update: checks and the window's k


def _check_state(state: Any, updates: Any) -> None:
  """At trace time: the state is ours and ``updates`` is shaped like it."""
  if not isinstance(state, AccumulateState):
    raise TypeError(
      "gradtx.accumulate `state` must be the AccumulateState its init "
      f"returned; got {type(state).__name__}."
    )
  check_tree_match(
    updates,
    state.accumulator,
    name="updates",
    reference_name="params (given to accumulate's init)",
  )


def _stored_as_mapping(x: Any) -> bool:
  """A SparseRows buffer as ``nnx.Optimizer`` stores it: ``{0: indices,
  1: values}``."""
  return isinstance(x, Mapping) and set(x.keys()) == {0, 1}


def _rebuild_buffers(accumulator: Any, updates: Any) -> Any:
  """The accumulator with its SparseRows buffers rebuilt where a model
  library stored them as mappings.

  ``nnx.Optimizer`` keeps its state in nnx Variables and, after each
  update, turns every pytree node inside one (a buffer: ids and rows) into
  an nnx State keyed by child position; the next update hands that back.
  The buffer's row count is its gradient's."""
  is_leaf = lambda x: is_update_leaf(x) or _stored_as_mapping(x)  # noqa: E731
  leaves, treedef = jax.tree.flatten(accumulator, is_leaf=is_leaf)
  if not any(_stored_as_mapping(a) for a in leaves):
    return accumulator
  try:
    grads = treedef.flatten_up_to(updates)
  except (ValueError, TypeError):
    return accumulator  # _check_state says what does not match
  return treedef.unflatten(
    [
      SparseRows(a[0], a[1], g.num_rows)
      if _stored_as_mapping(a) and isinstance(g, SparseRows)
      else a
      for a, g in zip(leaves, grads, strict=True)
    ]
  )


def _current_k(settings: _Settings, num_updates: jax.Array) -> jax.Array:
  """This window's k: the int, or the schedule at the updates emitted so
  far (checked at trace time for its type, at run time for its range)."""
  if settings.schedule is None:
    return jnp.asarray(settings.static_k, jnp.int32)
  k = jnp.asarray(settings.schedule(num_updates))
  if k.shape != () or not jnp.issubdtype(k.dtype, jnp.integer):
    raise TypeError(
      "gradtx.accumulate `every_k` schedule must return an integer scalar;"
      f" it returned {k.dtype}{list(k.shape)}. Return an int (for a float "
      "schedule, round it: `.astype(jnp.int32)`)."
    )
  k = k.astype(jnp.int32)
  bad = k < 1
  if settings.max_every_k is not None:
    bad = bad | (k > settings.max_every_k)
  lax.cond(
    bad,
    lambda: jax.debug.callback(_raise_bad_k, k, settings.max_every_k or -1),
    lambda: None,
  )
  return k


# ----------------------------------------------------------------------------
# update: a gradient leaf against its accumulator leaf (trace time)


def _prepare_sparse(path: str, g: Any, a: SparseRows, n: int) -> SparseRows:
  """A SparseRows gradient checked against its buffer (``n`` rows a slot)
  and padded up to ``n`` rows, so every call fills exactly one slot."""
  if not isinstance(g, SparseRows):
    raise ValueError(
      f"gradtx.accumulate: the gradient at {path} is a dense "
      f"{jnp.shape(g)} array, but `rows_per_step` declares {n} rows for"
      " it (a SparseRows leaf). Set its rows_per_step to None, or pass "
      "a SparseRows gradient."
    )
  if g.shape != a.shape:
    raise ValueError(
      f"gradtx.accumulate: the SparseRows gradient at {path} stands for "
      f"shape {g.shape} but its parameter has shape {a.shape}. Build "
      "it with num_rows=table.shape[0] and rows of the table's shape."
    )
  if g.nnz > n:
    raise ValueError(
      f"gradtx.accumulate: the SparseRows gradient at {path} carries "
      f"{g.nnz} rows but `rows_per_step` declares {n} for it. Pass "
      f"rows_per_step >= {g.nnz} for {path}."
    )
  # Rows split over Explicit mesh axes join the replicated buffer whole.
  idx = _sharded.unsplit(g.valid_indices())
  vals = _sharded.unsplit(g.values)
  if g.nnz < n:
    idx = jnp.concatenate([idx, jnp.full([n - g.nnz], a.num_rows, jnp.int32)])
    vals = jnp.concatenate(
      [vals, jnp.zeros((n - g.nnz, *vals.shape[1:]), vals.dtype)]
    )
  return SparseRows(idx, vals, a.num_rows)


def _check_dense(path: str, g: Any, a: jax.Array) -> Any:
  """A dense gradient must match its running sum; gradtx never densifies a
  SparseRows silently."""
  if isinstance(g, SparseRows):
    raise ValueError(
      f"gradtx.accumulate: the gradient at {path} is a SparseRows, but "
      "`rows_per_step` declares no row count for it, so its accumulator "
      f"is dense. Pass rows_per_step with an int for {path} (the rows one "
      f"gradient carries, here {g.nnz}); gradtx never densifies silently."
    )
  if g is None:
    raise ValueError(
      f"gradtx.accumulate: the gradient at {path} is None but its "
      "parameter has an accumulator. Pass a zero gradient instead."
    )
  if tuple(jnp.shape(g)) != tuple(a.shape):
    raise ValueError(
      f"gradtx.accumulate: the gradient at {path} has shape "
      f"{jnp.shape(g)} but its parameter (given to init) has shape "
      f"{a.shape}."
    )
  return g


def _prepare(updates: Any, accumulator: Any, window: int | None) -> Any:
  """The gradients checked and shaped to add into the accumulator: a tree
  like it (paths in the errors; None where it has no leaf)."""
  acc_paths, acc_def = jax.tree_util.tree_flatten_with_path(
    accumulator, is_leaf=is_update_leaf
  )
  prepared = []
  for (key, a), g in zip(
    acc_paths, acc_def.flatten_up_to(updates), strict=True
  ):
    path = jax.tree_util.keystr(key) or "the root"
    if a is None:
      prepared.append(None)
    elif isinstance(a, SparseRows):
      prepared.append(_prepare_sparse(path, g, a, a.nnz // window))
    else:
      prepared.append(_check_dense(path, g, a))
  return acc_def.unflatten(prepared)


# ----------------------------------------------------------------------------
# update: the window's arithmetic


def _add_sparse(a: SparseRows, g: SparseRows, offset: jax.Array) -> SparseRows:
  """Writes ``g``'s rows into slot ``offset`` of the buffer: rows
  ``[offset * n, offset * n + n)``."""
  # A scatter rather than dynamic_update_slice: it accepts an update whose
  # sharding type differs from the buffer's (explicit meshes); in place
  # when donated.
  n = g.nnz
  slots = offset * n + jnp.arange(n, dtype=jnp.int32)
  kw = dict(mode="drop", indices_are_sorted=True, unique_indices=True)
  return SparseRows(
    a.indices.at[slots].set(g.indices, **kw),
    a.values.at[slots].set(g.values.astype(a.dtype), **kw),
    a.num_rows,
  )


def _add_dense(a: jax.Array, g: Any) -> jax.Array:
  """The running sum, in the accumulator dtype."""
  return a + jnp.asarray(g).astype(a.dtype)


def _accumulated(accumulator: Any, prepared: Any, offset: jax.Array) -> Any:
  """The accumulator with this call's gradient added (a pure function of
  its operands, so each caller can recompute it where it is read)."""
  return map_updates(
    _add_dense,
    accumulator,
    prepared,
    sparse=functools.partial(_add_sparse, offset=offset),
  )


def _total_leaf(a: Any, g: Any, count: jax.Array, mean: bool) -> Any:
  """The accumulated gradient as the inner transformation sees it: the
  mean if asked, in the incoming gradient's dtype. A leaf without an
  accumulator passes the gradient through."""
  if a is None:
    return g
  values = a.values if isinstance(a, SparseRows) else a
  if mean:
    values = values / count.astype(values.dtype)
  values = values.astype(g.dtype)
  if isinstance(a, SparseRows):
    return SparseRows(a.indices, values, a.num_rows)
  return values


# ----------------------------------------------------------------------------
# update: the two branches of the cond, and the accumulator after it


def _emit_branch(
  settings: _Settings,
  state: AccumulateState,
  updates: Any,
  prepared: Any,
  count: jax.Array,
  params: Any,
  extra_args: dict[str, Any],
) -> tuple[tuple[Any, jax.Array], Any]:
  """The emitting branch: the inner update of the window's gradient, and
  True (the skip branch gives False: the flag orders :func:`_reset`)."""
  # Recomputed here, fused into the inner transformation's first read,
  # rather than materialized once for both the cond and the select.
  acc = _accumulated(state.accumulator, prepared, state.num_accumulated)
  total = tree_map(
    functools.partial(_total_leaf, count=count, mean=settings.mean),
    acc,
    updates,
  )
  new_updates, inner_state = settings.inner.update(
    total, state.inner_state, params, **extra_args
  )
  emitted = jnp.ones([], bool)
  return (new_updates, emitted), optax.tree.cast_like(
    inner_state, state.inner_state
  )


def _reset(accumulated: Any, emitted: jax.Array, accumulator: Any) -> Any:
  """The new accumulator: emptied when the cond emitted, else added to."""
  # Outside the cond: one fused elementwise pass, in place when the state
  # is donated. (Returned from the cond, XLA copies it: its new value is
  # not a pass-through of the cond's operand in either branch.) Selecting
  # on the cond's own output orders this write after the emitting branch
  # has read the old accumulator, so XLA needs no defensive copy of it
  # either.
  return jax.tree.map(
    lambda new, zero: jnp.where(emitted, zero, new),
    accumulated,
    zeros_like_update(accumulator),
  )


# ----------------------------------------------------------------------------
# update


def _passthrough_update(
  settings: _Settings,
  updates: Any,
  state: AccumulateState,
  params: Any,
  extra_args: dict[str, Any],
) -> tuple[Any, AccumulateState]:
  """``every_k=1``: the inner update itself; the wrapper only counts."""
  new_updates, inner_state = settings.inner.update(
    updates, state.inner_state, params, **extra_args
  )
  return new_updates, state._replace(
    num_micro_steps=optax.safe_increment(state.num_micro_steps),
    num_updates=optax.safe_increment(state.num_updates),
    inner_state=inner_state,
  )


def _update(
  settings: _Settings,
  updates: Any,
  state: AccumulateState,
  params: Any = None,
  **extra_args: Any,
) -> tuple[Any, AccumulateState]:
  """One call: add the gradient; on the window's last call, emit."""
  if isinstance(state, AccumulateState):
    state = state._replace(
      accumulator=_rebuild_buffers(state.accumulator, updates)
    )
  _check_state(state, updates)
  if settings.passthrough:
    return _passthrough_update(settings, updates, state, params, extra_args)
  k = _current_k(settings, state.num_updates)
  count = state.num_accumulated + 1
  emit = count >= k
  prepared = _prepare(updates, state.accumulator, settings.window)
  emit_fn = functools.partial(
    _emit_branch, settings, state, updates, prepared, count, params, extra_args
  )
  (new_updates, emitted), inner_state = apply_if(
    emit, emit_fn, state.inner_state
  )
  acc = _accumulated(state.accumulator, prepared, state.num_accumulated)
  return new_updates, AccumulateState(
    num_micro_steps=optax.safe_increment(state.num_micro_steps),
    num_updates=jnp.where(
      emit, optax.safe_increment(state.num_updates), state.num_updates
    ),
    num_accumulated=jnp.where(emit, 0, count).astype(jnp.int32),
    accumulator=_reset(acc, emitted, state.accumulator),
    inner_state=inner_state,
  )


def accumulate(
  inner: optax.GradientTransformation,
  every_k: int | Callable[[jax.Array], Any],
  *,
  mean: bool = True,
  accumulator_dtype: DTypeLike | None = None,
  rows_per_step: Any = None,
  max_every_k: int | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Accumulates gradients and applies ``inner`` once every ``every_k`` calls.

  Calls ``1 .. k-1`` of each window add the gradient to an accumulator and
  return zero updates (dense zeros; an all-padding SparseRows where the
  inner transformation returns one); the inner transformation is *not*
  computed on them (it sits in a ``lax.cond``) and its state is untouched.
  Call ``k`` hands the inner transformation the accumulated gradient, with
  ``params`` and the extra keyword args of that call, returns its updates
  and empties the accumulator:

  .. math::
    u_t = \\begin{cases}
      \\text{inner}\\left(c \\sum_{i=t-k+1}^{t} g_i\\right)
        & \\text{if } t \\equiv 0 \\pmod k \\\\
      0 & \\text{otherwise}
    \\end{cases},
    \\qquad c = 1/k \\text{ if mean else } 1.

  A dense leaf keeps one running sum the size of the gradient (mean divides
  once, at emission). A :class:`SparseRows` leaf is accumulated sparsely, in
  a buffer of ``k * n`` rows (never a dense ``[num_rows, ...]`` one): call
  ``i`` of the window writes its rows at offset ``i * n`` and call ``k``
  gives the inner transformation one SparseRows of all ``k * n`` rows
  (duplicates not yet summed, as lazy optimizers expect). ``init`` sees only
  params, so ``rows_per_step`` declares ``n`` per sparse leaf, or hands over
  the :func:`sparsity_report` of the loss, which knows it. A gradient
  with fewer rows than declared is padded up with padding rows; one with
  more, or a SparseRows at a leaf with no declared ``n``, raises at trace
  time.

  With ``every_k=1`` this *is* the inner transformation: no accumulator, no
  ``lax.cond``, identical updates and inner state (the wrapper only counts).

  Works under ``jit``, inside ``jax.shard_map`` (the branches' outputs are
  cast to the same varying mesh axes) and ``jax.pmap``. The predicate comes
  from the state's counters, which stay replicated. Under ``jax.vmap`` over
  states with different counters the ``lax.cond`` becomes a select and both
  branches run.

  To know whether a call applied an update, read the new state: the call
  emitted exactly when ``state.num_accumulated == 0`` after it (or when
  ``state.num_updates`` went up). For example, log or checkpoint with
  ``jax.lax.cond(state.num_accumulated == 0, ...)`` or, outside jit,
  ``if int(state.num_accumulated) == 0``.

  Args:
    inner: the transformation to apply to the accumulated gradient (a plain
      ``GradientTransformation`` works too; it then gets no extra args).
    every_k: an int ``k >= 1``, or a schedule ``num_updates -> k`` like
      optax.MultiSteps' ``every_k_schedule``: it is called with the number of
      inner updates emitted so far, so ``k`` is fixed within a window. It
      must return an integer; a value below 1 (or above ``max_every_k``)
      fails the computation with a runtime error.
    mean: average the ``k`` gradients when True; sum them when False.
    accumulator_dtype: dtype of the accumulator (for example float32 for
      bf16 gradients); defaults to each parameter's dtype. The inner
      transformation receives the accumulated gradient cast back to the
      dtype of the incoming gradient.
    rows_per_step: how many rows ``n`` one SparseRows gradient carries
      (after a mirrored all-gather: replicas x ids per replica). An int when
      every parameter is a sparse table; a pytree prefix of params with an
      int for each sparse leaf and None for dense ones; or the
      :class:`SparsityReport` of ``gtx.sparsity_report(loss)(params,
      batch)``, which gives each leaf it finds sparse its rows per step
      (a frozen table 1) and every other leaf None, matched by path (nnx's
      ``.value`` optional). A report counts the ids of the batch it traced:
      in a mirrored step, where one gradient carries every replica's rows,
      pass the counts instead. Not needed with ``every_k=1``.
    max_every_k: the largest value an ``every_k`` schedule returns; sizes
      the sparse buffers (``max_every_k * n`` rows). Required when
      ``every_k`` is a schedule and ``rows_per_step`` declares a sparse leaf;
      only allowed with a schedule.

  Returns:
    A transformation whose state is an :class:`AccumulateState`.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradtx as gtx
    >>> tx = gtx.accumulate(optax.sgd(1.0), 2)
    >>> state = tx.init(jnp.zeros(2))
    >>> u, state = tx.update(jnp.array([1.0, 2.0]), state)
    >>> u, int(state.num_accumulated)
    (Array([0., 0.], dtype=float32), 1)
    >>> u, state = tx.update(jnp.array([3.0, 4.0]), state)
    >>> u, int(state.num_accumulated), int(state.num_updates)
    (Array([-2., -3.], dtype=float32), 0, 1)

    The rows per step of a sparse table, from the loss's sparsity report:

    >>> params = {"emb": jnp.zeros((100, 4)), "w": jnp.ones(4)}
    >>> def loss(p, ids):
    ...   return jnp.sum(p["emb"][ids] @ p["w"])
    >>> report = gtx.sparsity_report(loss)(params, jnp.array([3, 7, 3]))
    >>> tx = gtx.accumulate(gtx.lazy_adam(1e-2), 2, rows_per_step=report)
    >>> tx.init(params).accumulator["emb"].nnz      # k slots of 3 rows
    6

  References:
    Yuxin Wu and others, `Tensorpack <https://github.com/tensorpack/tensorpack>`_
    (``AccumGradOptimizer``), 2016.
  """
  settings = _check_settings(
    inner, every_k, mean, accumulator_dtype, rows_per_step, max_every_k
  )
  return optax.GradientTransformationExtraArgs(
    functools.partial(_init, settings), functools.partial(_update, settings)
  )


def _raise_bad_k(k: Any, max_every_k: Any) -> None:
  """Host callback: a schedule's k is only known at run time."""
  k, max_every_k = int(k), int(max_every_k)
  bound = f" and <= max_every_k={max_every_k}" if max_every_k > 0 else ""
  raise ValueError(
    f"gradtx.accumulate: the `every_k` schedule returned {k}; it must be "
    f">= 1{bound}."
  )
