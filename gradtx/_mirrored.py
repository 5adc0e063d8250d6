"""Mirrored replication: one training step run on every device, and the
cross-replica reduction of (row-sparse) gradients.

``Mirrored`` is a 1-D mesh over devices (of one or many processes) with the
helpers a data-parallel loop needs: replicate params and optimizer state,
split the batch, compile the per-replica step (``jit`` + ``shard_map``) and
reduce values across replicas, inside the step (``reduce_in_step``) or
outside it (``reduce``). With ``shard_rows=`` chosen tables are split
by rows over the same devices instead of replicated (hybrid parallelism);
the step then maps the per-replica function with ``jax.vmap`` over the
replica axis at the global view, so a row-sharded table is whole in the
step's eyes and XLA's partitioner reads and updates each row on its owner.
``all_reduce`` is the transformation that puts the cross-replica reduction
of gradients into an optax chain.
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradtx._jax_compat import is_replicated_output_error, varying_axes
from gradtx._sharded import sharded_init
from gradtx._sparse_rows import SparseRows
from gradtx._static import is_int
from gradtx._update_trees import check_tree_match, map_updates, stateless

_TX_OPS = ("mean", "sum")
_OPS = ("sum", "mean", "first")

AxisName = Any  # a mesh / pmap axis name, or a tuple of them


def _check_op(op: Any, allowed: Sequence[str], where: str) -> str:
  """Checks ``op`` eagerly, before any collective is traced."""
  if not isinstance(op, str) or op not in allowed:
    raise ValueError(
      f"{where}: `op` must be one of {', '.join(map(repr, allowed))}; got "
      f"{op!r}."
    )
  return op


# ----------------------------------------------------------------------------
# Reductions across replicas, inside a mapped step (all_reduce and
# Mirrored.reduce_in_step)


def _unbound(where: str, axis_name: AxisName, err: Exception) -> NameError:
  """JAX's unbound-axis error, told in terms of where to call ``where``."""
  return NameError(
    f"{where}: the axis name {axis_name!r} is not bound here ({err}). Call it "
    "inside the function given to `Mirrored.step` (whose axis is "
    "`mirrored.axis_name`), or inside `jax.shard_map` / `jax.pmap` with that "
    "axis name."
  )


def _first(x: Any, axis_name: AxisName) -> jax.Array:
  """Replica 0's value on every replica (a masked psum: exact, any dtype)."""
  x = jnp.asarray(x)
  is_first = lax.axis_index(axis_name) == 0
  if x.dtype == jnp.bool_:
    masked = jnp.where(is_first, x, False).astype(jnp.int32)
    return lax.psum(masked, axis_name).astype(jnp.bool_)
  return lax.psum(jnp.where(is_first, x, jnp.zeros_like(x)), axis_name)


def _is_varying(x: jax.Array, axis_name: AxisName) -> bool:
  """Whether shard_map's type checks see ``x`` differ along the axis."""
  varying = varying_axes(x)
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  return any(n in varying for n in names)


def _checks_types(axis_name: AxisName) -> bool:
  """Whether shard_map's type checks (``check_vma=True``) are on for the
  axis: the replica index varies along it only then."""
  return _is_varying(lax.axis_index(axis_name), axis_name)


def _reduce_dense(x: jax.Array, axis_name: AxisName, op: str) -> jax.Array:
  """A dense leaf: one collective (``first`` is a masked psum)."""
  if op == "sum":
    return lax.psum(x, axis_name)
  if op == "mean":
    return lax.pmean(x, axis_name)
  return _first(x, axis_name)


def _reduce_sparse(u: SparseRows, axis_name: AxisName, op: str) -> SparseRows:
  """A SparseRows: every replica's rows gathered (never densified), so it
  moves ``R * n * (dim + 1)`` numbers, not the table."""
  if op == "first":
    return SparseRows(
      _first(u.indices, axis_name), _first(u.values, axis_name), u.num_rows
    )
  if _checks_types(axis_name) and not (
    _is_varying(u.indices, axis_name) or _is_varying(u.values, axis_name)
  ):
    # The same rows on every replica: under shard_map's type checks,
    # jax.grad (and sparse_value_and_grad) sum a replicated parameter's
    # gradient over the replicas. Reduced as lax.pmean / lax.psum reduce a
    # dense leaf of that kind, and still typed replicated.
    return u.with_values(_reduce_dense(u.values, axis_name, op))
  values = u.values
  if op == "mean":
    # Scaling each replica's rows before the gather is the same arithmetic
    # as after it, on 1/replicas of the rows.
    size = lax.axis_size(axis_name)
    values = (values / size).astype(values.dtype)
  indices = gather_replicas(u.indices, axis_name)
  values = gather_replicas(values, axis_name)
  return SparseRows(indices, values, u.num_rows)


def gather_replicas(x: jax.Array, axis_name: AxisName) -> jax.Array:
  """Every replica's ``x`` concatenated on axis 0, in replica order, the
  same on every replica. Under shard_map's type checks (check_vma=True)
  the result is marked as the same on every replica, so state updated
  from it may be returned replicated; elsewhere (pmap, vmap,
  check_vma=False) a plain all-gather."""
  to = "invarying" if _is_varying(x, axis_name) else "varying"
  return lax.all_gather(x, axis_name, tiled=True, to=to)


def _reduce_tree(tree: Any, axis_name: AxisName, op: str, where: str) -> Any:
  """Every leaf reduced over ``axis_name``; an unbound axis is reported as
  a misuse of ``where``."""
  try:
    return map_updates(
      functools.partial(_reduce_dense, axis_name=axis_name, op=op),
      tree,
      sparse=functools.partial(_reduce_sparse, axis_name=axis_name, op=op),
    )
  except NameError as e:
    raise _unbound(where, axis_name, e) from e


# ----------------------------------------------------------------------------
# Reductions of per-replica values, outside the step (Mirrored.reduce)


def _check_per_replica(tree: Any, n: int) -> None:
  """Each leaf carries the leading replica axis a per-replica output has."""
  for path, x in _paths(tree):
    shape = np.shape(x)
    if not shape or shape[0] != n:
      got = "a scalar" if not shape else f"leading size {shape[0]}"
      raise ValueError(
        f"Mirrored.reduce: leaf `tree{path}` has {got}; per-replica values "
        f"need a leading axis of size num_replicas={n} (list the output "
        "in the step's `per_replica_outputs`)."
      )


def _combine_dense(x: jax.Array, op: str) -> jax.Array:
  """A dense ``[R, ...]`` leaf combined over its replica axis."""
  if op == "first":
    return x[0]
  return jnp.sum(x, axis=0) if op == "sum" else jnp.mean(x, axis=0)


def _combine_sparse(u: SparseRows, op: str, n: int) -> SparseRows:
  """A stacked SparseRows (indices ``[R, n]``) as one of ``R * n`` rows,
  like the in-step gather (or replica 0's rows for ``first``)."""
  idx, vals = u.indices, u.values
  if op == "first":
    return SparseRows(idx[0], vals[0], u.num_rows)
  idx = idx.reshape(-1)
  vals = vals.reshape((-1,) + vals.shape[2:])
  if op == "mean":
    vals = (vals / n).astype(vals.dtype)
  return SparseRows(idx, vals, u.num_rows)


def _reduce_stacked(tree: Any, op: str, n: int) -> Any:
  """What ``Mirrored.reduce`` jits: every leaf combined over its replica
  axis."""
  return map_updates(
    functools.partial(_combine_dense, op=op),
    tree,
    sparse=functools.partial(_combine_sparse, op=op, n=n),
  )


def all_reduce(
  axis_name: AxisName, op: str = "mean"
) -> optax.GradientTransformationExtraArgs:
  """Reduces updates across replicas; SparseRows are all-gathered.

  For use inside a mapped step -- the function given to
  :meth:`Mirrored.step`, ``jax.shard_map`` or ``jax.pmap`` -- as the first
  link of the chain, so everything after it sees the same gradient on
  every replica and the optimizer state stays replicated. With ``R``
  replicas whose gradients are :math:`g_r`:

  .. math::
    \\text{mean}: \\frac{1}{R} \\sum_{r=1}^{R} g_r \\qquad
    \\text{sum}: \\sum_{r=1}^{R} g_r

  Dense leaves use ``lax.pmean`` / ``lax.psum``. A :class:`SparseRows` of
  ``n`` rows becomes one of ``R * n`` rows: the indices and values of every
  replica, concatenated in replica order (values divided by ``R`` for
  ``"mean"``). It stands for the same dense mean / sum, and moves
  ``R * n * (dim + 1)`` numbers instead of the ``num_rows * dim`` of a
  dense all-reduce of the table. Duplicates across replicas are summed by
  whatever consumes it (``lazy_adam`` coalesces, ``apply_updates`` adds).

  In a ``jax.shard_map`` step with ``check_vma=False`` (as
  :meth:`Mirrored.step` runs) each replica's gradient is its own. With
  ``shard_map``'s type checks on (``check_vma=True``, JAX's default), JAX's
  autodiff already sums the gradient of a replicated parameter over the
  replicas, and :func:`~gradtx.sparse_value_and_grad` gathers the rows of
  every replica likewise: a gradient that is the same on every replica is
  reduced as ``lax.pmean`` / ``lax.psum`` reduce such a value (the mean
  keeps it, the sum multiplies it by the number of replicas), without a
  collective, and stays typed replicated. There, ``lax.pmean`` the loss
  inside the loss function for the gradient of the mean loss.

  The transformation is also a function of a gradient tree:
  ``gtx.all_reduce(axis_name)(grads)`` is the drop-in for
  ``lax.pmean(grads, axis_name)`` (and ``gtx.all_reduce(axis_name,
  "sum")(grads)`` for ``lax.psum``) in a training step that reduces its
  gradients by hand. ``lax.psum`` / ``pmean`` / ``pmax`` / ``pmin`` /
  ``psum_scatter`` themselves refuse a tree holding :class:`SparseRows`
  with a ``TypeError`` that names this function: they would combine the
  replicas' row ids elementwise.

  Args:
    axis_name: the name of the replica axis (``mirrored.axis_name``, or
      the ``axis_name`` of ``shard_map``'s mesh / ``pmap``); a tuple of
      names reduces over all of them.
    op: ``"mean"`` (the gradient of the mean loss over the global batch
      when each replica's loss is a mean over its shard) or ``"sum"``.

  Returns:
    An :class:`AllReduce`: a stateless transformation (its state is
    ``optax.EmptyState()``) that is also callable on a gradient tree.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import gradtx as gtx
    >>> tx = optax.chain(gtx.all_reduce("i"), optax.sgd(1.0))
    >>> def step(g):
    ...   updates, _ = tx.update(g, tx.init(g))
    ...   return updates
    >>> n = jax.local_device_count()
    >>> out = jax.pmap(step, axis_name="i")(jnp.arange(n * 1.0))
    >>> bool(jnp.allclose(out, -jnp.mean(jnp.arange(n * 1.0))))
    True
  """
  _check_op(op, _TX_OPS, "gradtx.all_reduce")
  try:
    hash(axis_name)
  except TypeError as e:
    raise TypeError(
      "gradtx.all_reduce `axis_name` must be a hashable axis name (a str, "
      f"or a tuple of them); got {axis_name!r}."
    ) from e

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    if params is not None:
      check_tree_match(updates, params, name="updates", reference_name="params")
    return _reduce_tree(updates, axis_name, op, "gradtx.all_reduce"), state

  return AllReduce(*stateless(update_fn))


class AllReduce(optax.GradientTransformationExtraArgs):
  """The transformation :func:`all_reduce` returns.

  An ``optax.GradientTransformationExtraArgs`` without state (its state is
  ``optax.EmptyState()``) that is also a function of a gradient tree:
  ``gtx.all_reduce(axis_name)(grads)`` reduces the tree, the drop-in for
  ``lax.pmean(grads, axis_name)``.
  """

  __slots__ = ()

  def __call__(self, tree: Any) -> Any:
    return self.update(tree, optax.EmptyState())[0]


# ----------------------------------------------------------------------------
# Mirrored, job by job: the mesh, placement, batch splitting, the two ways
# of running the step, and the per-replica outputs. The class only checks
# its arguments and delegates here.


class _Replicas(NamedTuple):
  """The 1-D mesh of the replicas and the two placements every job uses."""

  mesh: Mesh
  axis_name: str
  replicated: NamedSharding  # whole on every replica
  split: NamedSharding  # leading axis split over the replicas
  local: int  # replicas on this process's devices

  @property
  def size(self) -> int:
    return self.mesh.size


def _replica_devices(
  devices: Sequence[jax.Device] | None,
) -> list[jax.Device]:
  """The checked devices in replica order; by default every process's, in
  process order, so replica ``r`` is the same device on every process."""
  if devices is None:
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  devices = list(devices)
  if not devices:
    raise ValueError("Mirrored `devices` must not be empty.")
  if not all(isinstance(d, jax.Device) for d in devices):
    raise TypeError(
      "Mirrored `devices` must be jax.Device objects (for example "
      "`jax.devices()` or `jax.local_devices()`); got "
      f"{[type(d).__name__ for d in devices]}."
    )
  if len(set(devices)) != len(devices):
    raise ValueError(f"Mirrored `devices` has duplicates: {devices}.")
  return devices


def _make_replicas(
  devices: Sequence[jax.Device] | None, axis_name: Any
) -> _Replicas:
  """Mesh construction: the checked arguments as a 1-D mesh, with the two
  shardings placement and batch splitting use."""
  if not isinstance(axis_name, str) or not axis_name:
    raise TypeError(
      f"Mirrored `axis_name` must be a non-empty str; got {axis_name!r}."
    )
  devices = _replica_devices(devices)
  mesh = Mesh(np.array(devices, dtype=object), (axis_name,))
  return _Replicas(
    mesh=mesh,
    axis_name=axis_name,
    replicated=NamedSharding(mesh, P()),
    split=NamedSharding(mesh, P(axis_name)),
    local=sum(d.process_index == jax.process_index() for d in devices),
  )


def _int_tuple(x: int | Sequence[int], name: str) -> tuple[int, ...]:
  """An int or ints (never bools) as a tuple, checked when ``step`` is built."""
  items = (x,) if isinstance(x, int) else tuple(x)
  if not all(is_int(i) for i in items):
    raise TypeError(f"`{name}` must be an int or a tuple of ints; got {x!r}.")
  return items


def _paths(tree: Any) -> list[tuple[str, Any]]:
  """(keystr path, leaf) pairs, for errors that name the leaf."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves]


# -- placement ---------------------------------------------------------------
RowSelector = Callable[[str, Any], bool]


def _row_selector(shard_rows: Any) -> tuple[RowSelector, tuple[str, ...]]:
  """A predicate ``(path, leaf) -> bool`` and the names it must match.

  ``shard_rows`` is a predicate, a name, or a sequence of names: a key
  path as ``jax.tree_util.keystr`` writes it (``"['tower']['emb']"``) or a
  top-level dict key (``"emb"``).
  """
  if callable(shard_rows):
    return shard_rows, ()
  names = (shard_rows,) if isinstance(shard_rows, str) else shard_rows
  try:
    names = tuple(names)
  except TypeError:
    names = None
  if not names or not all(isinstance(n, str) and n for n in names):
    raise TypeError(
      "Mirrored `shard_rows` must be a table's key path (a str such as "
      "'emb' or \"['tower']['emb']\"), a sequence of them, or a predicate "
      f"`(path: str, leaf) -> bool`; got {shard_rows!r}."
    )
  paths = tuple(n if n.startswith(("[", ".")) else f"[{n!r}]" for n in names)
  return (lambda path, leaf: path in paths), paths


def _replicate_leaf(sharding: NamedSharding, x: Any) -> jax.Array:
  """``x`` whole on every replica, in fresh buffers."""
  if jax.process_count() == 1 or (
    isinstance(x, jax.Array) and not x.is_fully_addressable
  ):
    # A fresh buffer first: device_put may reuse the input's buffer for
    # the shard on its device (even with may_alias=False), and donating
    # that shard would delete the caller's array.
    return jax.device_put(jnp.array(x, copy=True), sharding)
  # The same value on every process: each places its own copy.
  return jax.make_array_from_process_local_data(
    sharding, np.array(x, copy=True)
  )


def _replicate(r: _Replicas, tree: Any) -> Any:
  """Every leaf whole on every replica (``Mirrored.replicate``)."""
  return jax.tree.map(functools.partial(_replicate_leaf, r.replicated), tree)


def _put_rows(r: _Replicas, x: Any) -> jax.Array:
  """``x`` split by rows over the replicas, in fresh buffers."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return jax.device_put(jnp.array(x, copy=True), r.split)
  host = np.asarray(x)
  # Each process builds only its devices' rows, never the whole table on
  # one device.
  return jax.make_array_from_callback(
    host.shape, r.split, lambda index: np.array(host[index], copy=True)
  )


def _check_named_tables(names: tuple[str, ...], paths: list[str]) -> None:
  """A name in ``shard_rows`` that matches no leaf is a typo: say so."""
  missing = [p for p in names if p not in paths]
  if missing:
    raise ValueError(
      f"Mirrored.place: `shard_rows` names {missing}, which are not leaves "
      f"of the params; their leaves are {paths}."
    )


def _check_table_rows(path: str, shape: tuple[int, ...], n: int) -> None:
  """Every replica holds the same number of rows of a row-sharded table."""
  if not shape or shape[0] % n:
    got = "a scalar" if not shape else f"{shape[0]} rows"
    raise ValueError(
      f"Mirrored.place: table `params{path}` (chosen by `shard_rows`) "
      f"has {got}, which does not split evenly over {n} replicas. Pad it "
      f"to a multiple of {n} rows (padding rows are never read)."
    )


def _place(
  r: _Replicas, select: RowSelector, names: tuple[str, ...], params: Any
) -> Any:
  """The leaves ``select`` picks split by rows; every other one replicated."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  paths = [jax.tree_util.keystr(path) for path, _ in leaves]
  _check_named_tables(names, paths)
  out = []
  for path, (_, x) in zip(paths, leaves, strict=True):
    if select(path, x):
      _check_table_rows(path, np.shape(x), r.size)
      out.append(_put_rows(r, x))
    else:
      out.append(_replicate(r, x))
  return jax.tree_util.tree_unflatten(treedef, out)


def _init_state(
  r: _Replicas, tx: optax.GradientTransformation, params: Any
) -> Any:
  """``tx.init`` with each leaf sharded like its param, so the state of a
  row-sharded table stays row-sharded; the rest replicated."""
  state = sharded_init(tx, params)
  return jax.tree.map(functools.partial(_keep_on_mesh, r), state)


def _keep_on_mesh(r: _Replicas, x: Any) -> Any:
  """A leaf already on the mesh as it is, any other replicated."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding) and sharding.mesh == r.mesh:
    return x
  return _replicate(r, x)


# -- batch splitting ---------------------------------------------------------
def _check_local_batch(tree: Any, local: int, what: str) -> None:
  """Each leaf has a leading batch axis that splits over ``local`` replicas."""
  for path, x in _paths(tree):
    shape = np.shape(x)
    if not shape:
      raise ValueError(
        f"Mirrored.shard_batch: batch leaf `batch{path}` is a scalar; "
        "every batch leaf needs a leading batch axis. Pass scalars as "
        "extra (replicated) arguments of the step instead."
      )
    if shape[0] % local:
      raise ValueError(
        f"Mirrored.shard_batch: batch leaf `batch{path}` has leading size "
        f"{shape[0]}, which does not split evenly over {local} {what}. "
        f"Pad or trim the batch to a multiple of {local}."
      )


def _split_batch(r: _Replicas, tree: Any) -> Any:
  """This process's part of the batch, split over its replicas; the global
  batch is the processes' parts in process order."""
  if r.local == 0:
    raise ValueError(
      f"Mirrored.shard_batch: process {jax.process_index()} has none of "
      "the mesh's devices, so it has no part of the batch to place."
    )
  what = "replicas" if r.local == r.size else "local replicas"
  _check_local_batch(tree, r.local, what)
  if jax.process_count() == 1:
    return jax.device_put(tree, r.split)
  return jax.tree.map(
    lambda x: jax.make_array_from_process_local_data(r.split, np.asarray(x)),
    tree,
  )


def _check_global_batch(batch: Any, n: int) -> None:
  """At trace time: the step's batch splits over the ``n`` replicas."""
  for path, x in _paths(batch):
    shape = np.shape(x)
    if not shape or shape[0] % n:
      got = "a scalar" if not shape else f"leading size {shape[0]}"
      raise ValueError(
        f"Mirrored.step: batch leaf `batch{path}` has {got}, which does "
        f"not split evenly over {n} replicas. Every batch leaf needs a "
        f"leading axis whose size is a multiple of {n}; place batches "
        "with `mirrored.shard_batch`."
      )


# -- the step: per-replica outputs -------------------------------------------
def _split_outputs(
  out: Any, per_replica: tuple[int, ...], name: str
) -> tuple[Any, list[Any]]:
  """``fn``'s outputs as (the replicated ones, the per-replica ones)."""
  if not per_replica:
    return out, []
  if not isinstance(out, tuple):
    raise TypeError(
      f"Mirrored.step({name}): `per_replica_outputs` needs the step to "
      f"return a tuple; it returned a {type(out).__name__}."
    )
  k = len(out)
  bad = [i for i in per_replica if not -k <= i < k]
  if bad:
    raise ValueError(
      f"Mirrored.step({name}): `per_replica_outputs` {bad} out of range for "
      f"a step returning {k} outputs."
    )
  chosen = sorted({i % k for i in per_replica})
  rep = tuple(x for i, x in enumerate(out) if i not in chosen)
  return rep, [out[i] for i in chosen]


def _join_outputs(
  rep: Any, per: list[Any], per_replica: tuple[int, ...]
) -> Any:
  """The inverse of :func:`_split_outputs`: ``fn``'s output order again."""
  if not per_replica:
    return rep
  k = len(rep) + len(per)
  chosen = sorted({i % k for i in per_replica})
  rep_iter, per_iter = iter(rep), iter(per)
  return tuple(
    next(per_iter) if i in chosen else next(rep_iter) for i in range(k)
  )


# the replica axis of the Mirrored step whose function is being traced
_REPLICA_AXIS: contextvars.ContextVar = contextvars.ContextVar(
  "gradtx_replica_axis", default=None
)


def replica_axis() -> AxisName | None:
  """The replica axis name of the :class:`Mirrored` step being traced
  here (inside its function), or None outside one."""
  return _REPLICA_AXIS.get()


def _split_call(
  fn: Callable[..., Any],
  per_replica: tuple[int, ...],
  name: str,
  axis_name: AxisName,
  *args: Any,
) -> tuple[Any, list[Any]]:
  """The body both strategies map: ``fn`` with its outputs split, traced
  with :func:`replica_axis` telling its axis."""
  token = _REPLICA_AXIS.set(axis_name)
  try:
    return _split_outputs(fn(*args), per_replica, name)
  finally:
    _REPLICA_AXIS.reset(token)


# -- the step: two execution strategies --------------------------------------
# Each runs ``body`` once per replica and returns (replicated outputs,
# per-replica outputs stacked on a leading replica axis).
Strategy = Callable[..., tuple[Any, list[Any]]]


def _stack_per_replica(body: Callable[..., Any], *args: Any) -> Any:
  """``body`` with a leading axis of 1 on each per-replica output, which
  ``shard_map``'s ``out_specs=P(axis)`` concatenates over the replicas."""
  rep, per = body(*args)
  per = [jax.tree.map(lambda x: jnp.expand_dims(x, 0), p) for p in per]
  return rep, per


def _shard_map_strategy(
  r: _Replicas, body: Callable[..., Any], name: str, args: tuple[Any, ...]
) -> tuple[Any, list[Any]]:
  """Replicated params: ``body`` per replica under ``shard_map``."""
  del name
  # check_vma=False gives pmap's semantics: the gradient of a replicated
  # input is the replica's own, not already summed across replicas.
  return jax.shard_map(
    functools.partial(_stack_per_replica, body),
    mesh=r.mesh,
    in_specs=(P(), P(), P(r.axis_name)) + (P(),) * (len(args) - 3),
    out_specs=(P(), P(r.axis_name)),
    check_vma=False,
  )(*args)


def _vmap_strategy(
  r: _Replicas, body: Callable[..., Any], name: str, args: tuple[Any, ...]
) -> tuple[Any, list[Any]]:
  """Row-sharded tables: ``body`` per replica under ``vmap`` over the
  replica axis, at the global view (see the ``Mirrored`` docstring)."""
  batch = jax.tree.map(lambda x: x.reshape((r.size, -1) + x.shape[1:]), args[2])
  mapped = jax.vmap(
    body,
    in_axes=(None, None, 0) + (None,) * (len(args) - 3),
    out_axes=(None, 0),
    axis_name=r.axis_name,
    spmd_axis_name=r.axis_name,
  )
  try:
    return mapped(args[0], args[1], batch, *args[3:])
  except ValueError as e:
    if not is_replicated_output_error(e):
      raise
    raise ValueError(
      f"Mirrored.step({name}): an output returned as replicated differs "
      "across replicas. Reduce per-replica values inside the step "
      "(`mirrored.reduce_in_step(x, op)`, and `gtx.all_reduce(axis_name)` "
      "first in the optax chain), or list the output's position in "
      f"`per_replica_outputs`. ({e})"
    ) from e


def _compile_step(
  r: _Replicas,
  strategy: Strategy,
  fn: Callable[..., Any],
  donate: tuple[int, ...],
  per_replica: tuple[int, ...],
) -> Callable[..., Any]:
  """The jitted step: checks its arguments at trace time, runs ``fn`` per
  replica with ``strategy`` and puts the outputs back in ``fn``'s order."""
  name = getattr(fn, "__name__", repr(fn))
  body = functools.partial(_split_call, fn, per_replica, name, r.axis_name)

  def run(*args):
    if len(args) < 3:
      raise TypeError(
        f"Mirrored.step({name}): the step takes (params, opt_state, batch, "
        f"*args); got {len(args)} positional argument(s). Pass `()` for an "
        "absent opt_state."
      )
    _check_global_batch(args[2], r.size)
    rep, per = strategy(r, body, name, args)
    return _join_outputs(rep, per, per_replica)

  run.__name__ = f"mirrored_{name}"
  return jax.jit(run, donate_argnums=donate)


class Mirrored:
  """Data-parallel replication over a 1-D mesh of devices.

  Like TensorFlow's ``MirroredStrategy``: params and optimizer state are
  replicated on every device, each replica runs the same step on its part
  of the batch, and gradients are reduced across replicas (put
  :func:`all_reduce` first in the optax chain). Built on ``jax.jit`` +
  ``jax.shard_map``, so the same code runs on the devices of one process
  and across processes started with ``jax.distributed.initialize``.

  A training loop::

    m = gtx.Mirrored()
    tx = optax.chain(gtx.all_reduce(m.axis_name), gtx.lazy_adam(1e-3))

    def train_step(params, opt_state, batch):
      loss, grads = gtx.sparse_value_and_grad(loss_fn)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      params = gtx.apply_updates(params, updates)
      return params, opt_state, m.reduce_in_step(loss, "mean")

    step = m.step(train_step, donate_argnums=(0, 1))
    params = m.replicate(params)
    opt_state = m.replicate(tx.init(params))
    for batch in data:
      params, opt_state, loss = step(params, opt_state, m.shard_batch(batch))

  Outputs of the step are replicated: each must be the same on every
  replica (reduce per-replica values inside the step with
  :meth:`reduce_in_step`, as the loss above). To get per-replica values out
  instead, name their positions in ``per_replica_outputs``; they come
  back with a leading replica axis, and :meth:`reduce` combines them
  outside the step (TensorFlow's ``run`` then ``reduce``).

  **Hybrid parallelism** (TorchRec's model-parallel embeddings with
  data-parallel dense layers): name the tables in ``shard_rows`` and each
  is split by rows over the replicas instead of replicated -- ``V /
  num_replicas`` rows of the table and of every ``[V, ...]`` optimizer
  state leaf per device -- while the dense params stay mirrored and the
  batch split. Place the params with :meth:`place` and the state with
  :meth:`init_state`; the per-replica step and the chain (with
  :func:`all_reduce` first) stay as they are::

    m = gtx.Mirrored(shard_rows=["emb"])
    params = m.place(params)          # "emb" row-sharded, the rest mirrored
    opt_state = m.init_state(tx, params)
    step = m.step(train_step, donate_argnums=(0, 1))

  The step then runs ``fn`` under ``jax.vmap`` over the replica axis (named
  ``axis_name``, split across the devices with ``spmd_axis_name``) rather
  than ``shard_map``: the same per-replica program -- each replica's
  gradient from its own shard, collectives over ``axis_name`` -- but traced
  at the global view, where a row-sharded table has all its rows and the
  compiler reads and updates each row on the device that owns it. No
  collective moves table-sized data. Outputs declared replicated are
  checked: one that still differs across replicas raises.

  Args:
    devices: the devices to replicate over, in replica order. Default: all
      devices of all processes (``jax.devices()``), ordered by process.
    axis_name: the name of the replica axis inside the step.
    shard_rows: the tables to split by rows over the replicas: a key path
      (``"emb"`` for a top-level dict key, or as ``jax.tree_util.keystr``
      writes it, ``"['tower']['emb']"``), a sequence of them, or a
      predicate ``(path, leaf) -> bool``. Default ``None``: replicate
      every param.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import gradtx as gtx
    >>> m = gtx.Mirrored()
    >>> m.num_replicas == jax.device_count(), m.axis_name
    (True, 'replica')
    >>> def fn(w, state, batch):
    ...   return w, state, m.reduce_in_step(jnp.sum(batch @ w), "sum")
    >>> step = m.step(fn)
    >>> batch = m.shard_batch(jnp.ones((2 * m.num_replicas, 3)))
    >>> _, _, total = step(m.replicate(jnp.ones(3)), (), batch)
    >>> int(total) == 6 * m.num_replicas
    True
  """

  def __init__(
    self,
    devices: Sequence[jax.Device] | None = None,
    *,
    axis_name: str = "replica",
    shard_rows: str | Sequence[str] | RowSelector | None = None,
  ):
    self._shard_rows, self._row_paths = (
      (None, ()) if shard_rows is None else _row_selector(shard_rows)
    )
    self._replicas = _make_replicas(devices, axis_name)
    self._reduce_jit = jax.jit(
      _reduce_stacked,
      static_argnums=(1, 2),
      out_shardings=self._replicas.replicated,
    )

  def __repr__(self) -> str:
    rows = "" if self._shard_rows is None else ", shard_rows=..."
    return (
      f"Mirrored(num_replicas={self.num_replicas}, "
      f"axis_name={self.axis_name!r}{rows})"
    )

  @property
  def num_replicas(self) -> int:
    """The number of replicas (devices in the mesh, all processes)."""
    return self._replicas.size

  @property
  def axis_name(self) -> str:
    """The replica axis name, bound inside the function given to step."""
    return self._replicas.axis_name

  @property
  def mesh(self) -> Mesh:
    """The 1-D ``jax.sharding.Mesh`` of the replicas."""
    return self._replicas.mesh

  # -- placing data -----------------------------------------------------------
  def replicate(self, tree: Any) -> Any:
    """Places every leaf, whole, on every replica.

    For params, optimizer states and anything else the step takes
    replicated (SparseRows included: their indices and values are
    leaves). In a multi-process run every process must pass the same
    values; each places them on its own devices.

    The result never shares a buffer with ``tree`` (nor two of its leaves
    with each other), so a step may donate it and ``tree`` stays intact.

    Args:
      tree: a pytree of arrays (numpy, jax or Python scalars).

    Returns:
      The tree with every leaf a ``jax.Array`` replicated on the mesh.
    """
    return _replicate(self._replicas, tree)

  def place(self, params: Any) -> Any:
    """Places params for the step: ``shard_rows`` tables split, rest mirrored.

    Each table chosen by ``shard_rows`` is split by rows over the replicas
    (``NamedSharding(mesh, P(axis_name))``: replica ``r`` holds rows
    ``[r * V / R, (r + 1) * V / R)``); every other leaf is replicated as
    by :meth:`replicate`. Without ``shard_rows`` it is :meth:`replicate`.
    In a multi-process run every process passes the same values and each
    places the rows of its own devices. The result never shares a buffer
    with ``params``, so a step may donate it.

    Args:
      params: a pytree of arrays (numpy, jax or Python scalars).

    Returns:
      The placed params.

    Raises:
      ValueError: a name in ``shard_rows`` matches no leaf, or a chosen
        table is a scalar or its rows do not divide by ``num_replicas``.

    Examples:
      >>> import numpy as np, optax
      >>> import gradtx as gtx
      >>> m = gtx.Mirrored(shard_rows="emb")
      >>> params = m.place({"emb": np.zeros((64, 4)), "w": np.ones(4)})
      >>> params["emb"].sharding.spec, params["w"].sharding.is_fully_replicated
      (P('replica',), True)
      >>> params["emb"].addressable_shards[0].data.shape == (
      ...   64 // m.num_replicas, 4)
      True
      >>> state = m.init_state(gtx.lazy_adam(1e-3), params)
      >>> state[0].mu["emb"].sharding.spec
      P('replica', None)
    """
    if self._shard_rows is None:
      return self.replicate(params)
    return _place(self._replicas, self._shard_rows, self._row_paths, params)

  def init_state(self, tx: optax.GradientTransformation, params: Any) -> Any:
    """``tx.init(params)`` for placed params, each leaf placed like its param.

    The ``[V, ...]`` and per-row ``[V]`` state of a row-sharded table is
    split by rows like the table (``m`` and ``v`` never become replicated);
    every other leaf is replicated. For params from :meth:`place` (or
    :meth:`replicate`).

    Args:
      tx: the optax transformation of the step.
      params: the placed params.

    Returns:
      The optimizer state, placed on the mesh.
    """
    return _init_state(self._replicas, tx, params)

  def shard_batch(self, tree: Any) -> Any:
    """Splits the leading axis of every leaf across the replicas.

    In a single process, ``tree`` is the global batch. In a multi-process
    run each process passes its local part (the same size on every
    process); the global batch is their concatenation in process order,
    and replica ``r`` gets rows ``[r * b, (r + 1) * b)`` of it.

    Args:
      tree: a pytree of arrays, each with a leading batch axis whose size
        is a multiple of the number of replicas (of this process's
        devices, in a multi-process run).

    Returns:
      The tree with every leaf a ``jax.Array`` split on its leading axis.

    Raises:
      ValueError: a leaf is a scalar or its leading size does not divide.
    """
    return _split_batch(self._replicas, tree)

  # -- the step -------------------------------------------------------------
  def step(
    self,
    fn: Callable[..., Any],
    *,
    donate_argnums: int | Sequence[int] = (),
    per_replica_outputs: int | Sequence[int] = (),
  ) -> Callable[..., Any]:
    """Compiles ``fn(params, opt_state, batch, *args)`` to run per replica.

    ``fn`` is written for one replica: it gets the whole (replicated)
    ``params``, ``opt_state`` and ``args``, and its replica's shard of
    ``batch`` (the leading axis divided by ``num_replicas``). Inside it,
    ``self.axis_name`` names the replica axis, for :func:`all_reduce` and
    :meth:`reduce_in_step`. As in ``jax.pmap`` and TensorFlow's
    ``MirroredStrategy``, a gradient taken inside ``fn`` is the replica's
    own, computed from its shard: reduce it across replicas (put
    ``gtx.all_reduce(mirrored.axis_name)`` first in the optax chain).
    With ``shard_rows``, ``fn`` runs under ``jax.vmap`` over the replica
    axis instead of ``shard_map`` (see the class docstring): it still sees
    every param whole, the row-sharded tables included, and its replica's
    part of the batch.

    Every output is replicated: it must be the same on every replica,
    which holds for params and optimizer state updated from reduced
    gradients and for values reduced with :meth:`reduce_in_step` (the loss,
    metrics). This is the caller's promise, not checked by the plain
    step: a per-replica value returned as replicated comes back as some
    replica's value (with ``shard_rows`` it raises). To get per-replica
    values out instead, name their positions in ``fn``'s output tuple in
    ``per_replica_outputs``; they come back with a new leading axis of
    size ``num_replicas`` (split across the devices), and :meth:`reduce`
    combines them.

    Args:
      fn: the per-replica step, taking at least three positional arguments.
      donate_argnums: positional arguments whose buffers the step may reuse
        (as in ``jax.jit``); donate ``(0, 1)`` to update params and state
        in place. Donating the batch buys nothing (no output matches it).
      per_replica_outputs: positions in ``fn``'s output tuple returned per
        replica, stacked on a new leading axis.

    Returns:
      The jitted step, ``step(params, opt_state, batch, *args)``.
    """
    if not callable(fn):
      raise TypeError(f"Mirrored.step `fn` must be callable; got {fn!r}.")
    donate = _int_tuple(donate_argnums, "donate_argnums")
    per_replica = _int_tuple(per_replica_outputs, "per_replica_outputs")
    strategy = (
      _shard_map_strategy if self._shard_rows is None else _vmap_strategy
    )
    return _compile_step(self._replicas, strategy, fn, donate, per_replica)

  # -- reductions -------------------------------------------------------------
  def reduce_in_step(self, tree: Any, op: str) -> Any:
    """Reduces values across replicas, inside the function given to step.

    The in-step counterpart of :meth:`reduce` (which combines per-replica
    outputs after the step); for gradients in an optax chain use
    :func:`gradtx.all_reduce`.

    Args:
      tree: any pytree of arrays (SparseRows included).
      op: ``"sum"``, ``"mean"``, or ``"first"`` (replica 0's value on
        every replica). For SparseRows, ``"sum"`` and ``"mean"`` gather
        every replica's rows (as :func:`all_reduce`).

    Returns:
      The reduced tree, the same on every replica.
    """
    _check_op(op, _OPS, "Mirrored.reduce_in_step")
    return _reduce_tree(tree, self.axis_name, op, "Mirrored.reduce_in_step")

  def all_reduce(self, tree: Any, op: str) -> Any:
    """Deprecated: :meth:`reduce_in_step` (``gtx.all_reduce`` is the
    transformation of gradients; one name, one meaning)."""
    warnings.warn(
      "Mirrored.all_reduce(tree, op) is deprecated: call "
      "Mirrored.reduce_in_step(tree, op) (the same reduction; "
      "gradtx.all_reduce(axis_name, op) is the optax transformation).",
      DeprecationWarning,
      stacklevel=2,
    )
    return self.reduce_in_step(tree, op)

  def reduce(self, tree: Any, op: str) -> Any:
    """Combines per-replica values (a leading replica axis) into one.

    For the ``per_replica_outputs`` of a step, outside the step.

    Args:
      tree: a pytree whose leaves have a leading axis of size
        ``num_replicas``; a per-replica SparseRows (indices
        ``[num_replicas, n]``) becomes one of ``num_replicas * n`` rows.
      op: ``"sum"``, ``"mean"`` or ``"first"`` (replica 0's value).

    Returns:
      The combined tree, replicated on the mesh.
    """
    _check_op(op, _OPS, "Mirrored.reduce")
    _check_per_replica(tree, self.num_replicas)
    return self._reduce_jit(tree, op, self.num_replicas)
