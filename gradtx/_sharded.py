"""Reading and updating row-sharded tables.

A ``[V, ...]`` table placed ``NamedSharding(mesh, P(axis, ...))`` on a mesh
with ``AxisType.Explicit`` axes carries its sharding in its type, and JAX's
own gather refuses to read it without resharding (an all-gather of the whole
table). Here each device reads or writes only the rows it owns: the ids
(``n`` of them, small) travel to the row owners, each owner reads its rows
with the others masked to zero, and a sum across the row axes puts every
row where its id was (a reduce-scatter when the ids are split along the
same axes). No collective moves table-sized data, and a row's update stays
on the device that owns it.

On ``AxisType.Auto`` meshes the sharding is not in the type and XLA's
partitioner already reads row-sharded tables locally; these helpers then
fall back to plain gathers and scatters.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def _names(entry: Any) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _spec(x: Any, ndim: int) -> tuple[Any, ...] | None:
  """The explicit sharding spec of ``x``'s type, padded to ``ndim``."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return None
  spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
  return spec


def _explicit_axes(mesh: Any) -> frozenset:
  return frozenset(
    name
    for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True)
    if kind == AxisType.Explicit
  )


def row_axes(table: Any) -> tuple[str, ...]:
  """The Explicit mesh axes that split ``table``'s rows (empty if none).

  Args:
    table: an array or tracer (``jax.typeof`` must work on it).

  Returns:
    The axis names of the first entry of the table's sharding spec, in
    order, when they are Explicit axes; ``()`` for an unsharded table, a
    table on an Auto mesh, or one inside ``shard_map`` over those axes.
  """
  if not hasattr(table, "shape") or not jnp.ndim(table):
    return ()
  try:
    sharding = jax.typeof(table).sharding
  except TypeError:
    return ()
  if not isinstance(sharding, NamedSharding) or not len(sharding.spec):
    return ()
  axes = _names(sharding.spec[0])
  explicit = _explicit_axes(sharding.mesh)
  return axes if axes and all(a in explicit for a in axes) else ()


def is_row_sharded(table: Any) -> bool:
  """Whether ``table``'s rows are split over Explicit mesh axes."""
  return bool(row_axes(table))


def _mesh_of(x: Any) -> Any:
  return jax.typeof(x).sharding.mesh


def _num_shards(mesh: Any, axes: tuple[str, ...]) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def _check_divisible(table: Any, axes: tuple[str, ...], what: str) -> int:
  shards = _num_shards(_mesh_of(table), axes)
  rows = table.shape[0]
  if rows % shards:
    raise ValueError(
      f"{what}: a table of {rows} rows is split over mesh axes {axes} of "
      f"{shards} devices, which does not divide it. Pad the table to a "
      f"multiple of {shards} rows (the padding rows are never read)."
    )
  return rows // shards


def _index_spec(x: Any, mesh: Any) -> tuple[Any, ...]:
  """``x``'s spec on ``mesh`` (replicated if its type carries none)."""
  spec = _spec(x, jnp.ndim(x))
  if spec is None or _mesh_of(x) != mesh:
    return (None,) * jnp.ndim(x)
  return spec


def _reshard(x: jax.Array, mesh: Any, spec: tuple[Any, ...]) -> jax.Array:
  """``x`` with sharding ``spec`` on ``mesh`` (a no-op if it has it)."""
  if _spec(x, jnp.ndim(x)) == tuple(spec) and _mesh_of(x) == mesh:
    return x
  return jax.sharding.reshard(x, NamedSharding(mesh, P(*spec)))


def _owner_offset(axes: tuple[str, ...], local_rows: int) -> jax.Array:
  """First global row owned by this device (inside ``shard_map``)."""
  return (lax.axis_index(axes) * local_rows).astype(jnp.int32)


def _gather_dims(
  x: jax.Array, spec: tuple[Any, ...], axes: tuple[str, ...]
) -> jax.Array:
  """All-gathers ``x`` along its dims split over any of ``axes``."""
  for dim, entry in enumerate(spec):
    shared = tuple(a for a in _names(entry) if a in axes)
    if shared:
      x = lax.all_gather(x, shared, axis=dim, tiled=True)
  return x


def _sum_back(
  x: jax.Array, spec: tuple[Any, ...], axes: tuple[str, ...]
) -> jax.Array:
  """Sums ``x`` over ``axes``, scattering dims split over them back."""
  done = set()
  for dim, entry in enumerate(spec):
    shared = tuple(a for a in _names(entry) if a in axes)
    if shared:
      x = lax.psum_scatter(x, shared, scatter_dimension=dim, tiled=True)
      done.update(shared)
  rest = tuple(a for a in axes if a not in done)
  return lax.psum(x, rest) if rest else x


def _run_manual(
  fn: Callable[..., Any],
  mesh: Any,
  in_specs: tuple[Any, ...],
  out_specs: Any,
  *args: Any,
) -> Any:
  return jax.shard_map(
    fn,
    mesh=mesh,
    in_specs=in_specs,
    out_specs=out_specs,
    axis_names=_explicit_axes(mesh),
  )(*args)


def _local_ids(
  ids: jax.Array, axes: tuple[str, ...], local_rows: int, num_rows: int
) -> jax.Array:
  """Local row of each id on this device; ``local_rows`` if not owned.

  Ids outside ``[0, num_rows)`` belong to no device.
  """
  local = ids.astype(jnp.int32) - _owner_offset(axes, local_rows)
  owned = (local >= 0) & (local < local_rows) & (ids >= 0) & (ids < num_rows)
  return jnp.where(owned, local, local_rows)


def is_split(x: Any) -> bool:
  """Whether ``x``'s type splits it over Explicit mesh axes."""
  if not hasattr(x, "shape"):
    return False
  spec = _spec(x, jnp.ndim(x))
  if spec is None:
    return False
  explicit = _explicit_axes(_mesh_of(x))
  return any(a in explicit for e in spec for a in _names(e))


def _read_whole(table: jax.Array, ids: jax.Array, unique: bool):
  """Rows of a table whose rows are not split; the output is split as the
  ids are (JAX asks for the output sharding of such a gather)."""
  num_rows = table.shape[0]
  ids = jnp.where(ids < 0, num_rows, ids.astype(jnp.int32))
  out = None
  if is_split(ids) and _mesh_of(ids) == _mesh_of(table):
    t_spec = _spec(table, table.ndim)
    spec = P(*_spec(ids, ids.ndim), *t_spec[1:])
    out = NamedSharding(_mesh_of(ids), spec)
  return table.at[ids].get(
    mode="fill",
    fill_value=0,
    unique_indices=unique,
    out_sharding=out,
  )


def read_rows(
  table: jax.Array,
  ids: jax.Array,
  *,
  unique: bool = False,
  what: str = "gradtx",
) -> jax.Array:
  """``table[ids]`` for a row-sharded ``table``; ids off the table read 0.

  Each device reads the ids that fall in its rows (the others masked to a
  zero fill), and one sum over the row axes combines them: an all-gather of
  the ids and a reduce-scatter of the ``ids.size`` rows when the ids are
  split along the table's row axes, a psum of those rows otherwise. Exact:
  each row is a sum of itself and zeros.

  Args:
    table: ``[V, *row]``, rows split over Explicit mesh axes.
    ids: integer ids of any shape and sharding on the same mesh; negative
      ids and ids ``>= V`` are padding and read zeros.
    unique: no id appears twice, padding aside (an XLA hint).
    what: the caller's name, for errors.

  Returns:
    ``ids.shape + row`` rows, sharded as ``ids`` on its dims.
  """
  axes = row_axes(table)
  if not axes:
    return _read_whole(table, ids, unique)
  mesh = _mesh_of(table)
  local_rows = _check_divisible(table, axes, what)
  num_rows = table.shape[0]
  t_spec = _spec(table, table.ndim)
  row_spec = t_spec[1:]
  # Ids may not be split along an axis that also splits the row dims.
  taken = {a for e in row_spec for a in _names(e)}
  i_spec = tuple(
    tuple(a for a in _names(e) if a not in taken) or None
    for e in _index_spec(ids, mesh)
  )
  ids = _reshard(ids, mesh, i_spec)
  t_in = t_spec

  def body(t, i):
    i = _gather_dims(i, i_spec, axes)
    local = _local_ids(i, axes, local_rows, num_rows)
    rows = t.at[local].get(
      mode="fill",
      fill_value=0,
      unique_indices=unique,
    )
    return _sum_back(rows, i_spec, axes)

  return _run_manual(
    body, mesh, (P(*t_in), P(*i_spec)), P(*i_spec, *row_spec), table, ids
  )


def write_rows(
  table: jax.Array,
  ids: jax.Array,
  rows: jax.Array,
  *,
  add: bool,
  unique: bool = False,
  what: str = "gradtx",
) -> jax.Array:
  """``table.at[ids].set(rows)`` (or ``.add``) for a row-sharded table.

  Every device receives the ``ids`` and ``rows`` it does not already hold
  (an all-gather of ``n`` ids and rows when they are split along the row
  axes; nothing moves when they are replicated) and writes the ones it
  owns. Ids outside ``[0, V)`` write nothing.

  Args:
    table: ``[V, *row]``, rows split over Explicit mesh axes.
    ids: ``[n]`` integer ids.
    rows: ``[n, *row]`` values (cast to the table's dtype).
    add: add the rows (duplicates summed) instead of setting them.
    unique: no id appears twice, padding aside (an XLA hint).
    what: the caller's name, for errors.

  Returns:
    The table with the rows written, sharded as before.
  """
  axes = row_axes(table)
  mesh = _mesh_of(table)
  local_rows = _check_divisible(table, axes, what)
  num_rows = table.shape[0]
  t_spec = P(*_spec(table, table.ndim))
  i_spec = _index_spec(ids, mesh)[:1]
  r_spec = (i_spec[0],) + tuple(t_spec[1:])
  ids = _reshard(ids, mesh, i_spec)
  rows = _reshard(rows.astype(table.dtype), mesh, r_spec)

  def body(t, i, r):
    i = _gather_dims(i, i_spec, axes)
    r = _gather_dims(r, r_spec[:1], axes)
    local = _local_ids(i, axes, local_rows, num_rows)
    ref = t.at[local]
    kwargs = dict(
      mode="drop",
      unique_indices=unique,
    )
    return ref.add(r, **kwargs) if add else ref.set(r, **kwargs)

  return _run_manual(
    body, mesh, (t_spec, P(*i_spec), P(*r_spec)), t_spec, table, ids, rows
  )


def _owner_sharding(p: Any) -> NamedSharding | None:
  """The sharding of a ``[V]`` array whose rows sit with ``p``'s rows."""
  if isinstance(p, jax.Array) and not isinstance(p, jax.core.Tracer):
    sharding = p.sharding  # a concrete array: any mesh, eager or not
  else:
    if not row_axes(p):
      return None
    sharding = jax.typeof(p).sharding
  if not isinstance(sharding, NamedSharding) or not len(sharding.spec):
    return None
  if sharding.spec[0] is None:
    return None
  return NamedSharding(sharding.mesh, P(sharding.spec[0]))


def per_row_full(
  p: Any, fill_value: Any, dtype: Any, trailing: tuple[int, ...] = ()
) -> jax.Array:
  """A fresh ``[V, *trailing]`` array (one value, or ``trailing`` values,
  per row of ``p``), split like its rows.

  Per-row optimizer state of a row-sharded table lives with the rows it
  belongs to, so a step never moves it; elsewhere a plain ``jnp.full``.
  """
  shape = tuple(jnp.shape(p)[:1]) + tuple(trailing)
  sharding = _owner_sharding(p)
  if sharding is None:
    return jnp.full(shape, fill_value, dtype)
  return jnp.full(shape, fill_value, dtype, device=sharding)


def unsplit(x: jax.Array) -> jax.Array:
  """``x`` replicated over the mesh: resharded if its type splits it over
  Explicit mesh axes, constrained to replicated under a mesh with Auto axes
  (``jax.set_mesh``), where XLA's partitioner would otherwise be free to
  keep it split and then all-reduce a whole table shard to write it.

  For the ``n`` ids and rows of a sparse gradient, which deduplication
  needs whole on every device; a no-op without a mesh.
  """
  spec = _spec(x, jnp.ndim(x)) if hasattr(x, "shape") else None
  if spec is None or all(e is None for e in spec):
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.auto_axes and hasattr(x, "shape"):
      return jax.lax.with_sharding_constraint(x, P())
    return x
  mesh = _mesh_of(x)
  explicit = _explicit_axes(mesh)
  if not any(a in explicit for e in spec for a in _names(e)):
    return x
  return jax.sharding.reshard(x, NamedSharding(mesh, P()))


def sharded_init(tx: Any, params: Any) -> Any:
  """``tx.init(params)`` under ``jit``, each state leaf sharded like its param.

  ``jax.jit(tx.init)(params)`` on a mesh with ``AxisType.Auto`` axes lets
  the compiler place the state, and it puts the moments of a row-sharded
  table on one device (the next step then replicates them on every
  device). This runs ``init`` on a twin of the params' mesh whose axes are
  Explicit, where a sharding is part of an array's type and every
  transformation's ``init`` keeps it (``zeros_like`` keeps the param's
  sharding, per-row state follows the rows), then places the state back on
  the params' mesh. On an Explicit mesh it is ``jax.jit(tx.init)`` under
  ``jax.set_mesh``; without a mesh, plain ``jax.jit(tx.init)``.

  Args:
    tx: an optax transformation.
    params: the params, placed (a mesh's ``NamedSharding`` or one device).

  Returns:
    The state; ``[V, ...]`` and ``[V]`` leaves of a row-sharded table are
    row-sharded on the same mesh, other leaves replicated or sharded like
    their params.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> import gradtx as gtx
    >>> mesh = jax.make_mesh((jax.device_count(),), ("d",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> table = jax.device_put(jnp.zeros((64, 4)),
    ...                        NamedSharding(mesh, P("d", None)))
    >>> state = gtx.sharded_init(gtx.lazy_adam(1e-3), {"emb": table})
    >>> state[0].mu["emb"].sharding.spec
    P('d', None)
  """
  meshes = {
    x.sharding.mesh
    for x in jax.tree.leaves(params)
    if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding)
  }
  if not meshes:
    return jax.jit(tx.init)(params)
  if len(meshes) > 1:
    raise ValueError(
      "gradtx.sharded_init: the params are placed on "
      f"{len(meshes)} different meshes; place every leaf on one mesh (or on "
      "a single device)."
    )
  (mesh,) = meshes
  explicit = jax.sharding.Mesh(
    mesh.devices,
    mesh.axis_names,
    axis_types=(AxisType.Explicit,) * len(mesh.axis_names),
  )

  def move(x: Any, to: Any) -> Any:
    if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding):
      return jax.device_put(x, NamedSharding(to, x.sharding.spec))
    return x

  with jax.set_mesh(explicit):
    state = jax.jit(tx.init)(jax.tree.map(lambda x: move(x, explicit), params))
  return jax.tree.map(lambda x: move(x, mesh), state)
