"""Where arrays live on a mesh: what the row engine and ``init`` need to know.

A ``[V, ...]`` table placed ``NamedSharding(mesh, P(axis, ...))`` on a mesh
with ``AxisType.Explicit`` axes carries its sharding in its type. This
module reads such types (:func:`row_axes`, :func:`is_split`, and the spec,
mesh and Explicit axes of an array), places optimizer state with the rows
it belongs to (:func:`owner_sharding`, :func:`per_row_full`), replicates
the ids and rows of a sparse gradient where they are needed whole
(deduplication, accumulation: :func:`unsplit`, and back:
:func:`split_like`), builds a sharded state (:func:`gradtx.sharded_init`),
and is the one place a table stack's rows are mapped over its shards and
back (:func:`spread_row`, :func:`gathered_row`; the plan's ``StackSpec``
and the id map's layout ask it). The owner-local reads and writes of
row-sharded tables are in :mod:`gradtx._rowio`.

On ``AxisType.Auto`` meshes the sharding is not in the type and XLA's
partitioner already reads row-sharded tables locally: the helpers here see
no row axes there.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def entry_axes(entry: Any) -> tuple[str, ...]:
  """The mesh axis names of one entry of a PartitionSpec (None: none)."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def explicit_spec(x: Any, ndim: int) -> tuple[Any, ...] | None:
  """The explicit sharding spec of ``x``'s type, padded to ``ndim``."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  if not isinstance(sharding, NamedSharding):
    return None
  spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
  return spec


def explicit_axes(mesh: Any) -> frozenset:
  """The names of ``mesh``'s axes of type ``AxisType.Explicit``."""
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
  axes = entry_axes(sharding.spec[0])
  explicit = explicit_axes(sharding.mesh)
  return axes if axes and all(a in explicit for a in axes) else ()


def is_row_sharded(table: Any) -> bool:
  """Whether ``table``'s rows are split over Explicit mesh axes."""
  return bool(row_axes(table))


def mesh_of(x: Any) -> Any:
  """The mesh of the sharding in ``x``'s type."""
  return jax.typeof(x).sharding.mesh


def is_split(x: Any) -> bool:
  """Whether ``x``'s type splits it over Explicit mesh axes."""
  if not hasattr(x, "shape"):
    return False
  spec = explicit_spec(x, jnp.ndim(x))
  if spec is None:
    return False
  explicit = explicit_axes(mesh_of(x))
  return any(a in explicit for e in spec for a in entry_axes(e))


def owner_sharding(p: Any, per_row: bool = True) -> NamedSharding | None:
  """Where a state leaf of ``p`` lives when ``p``'s rows are split over a
  mesh: split like its rows (``per_row``, a ``[V]`` leaf) or like ``p``.
  None when ``p``'s rows are not split."""
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
  spec = P(sharding.spec[0]) if per_row else sharding.spec
  return NamedSharding(sharding.mesh, spec)


def per_row_full(
  p: Any, fill_value: Any, dtype: Any, trailing: tuple[int, ...] = ()
) -> jax.Array:
  """A fresh ``[V, *trailing]`` array (one value, or ``trailing`` values,
  per row of ``p``), split like its rows.

  Per-row optimizer state of a row-sharded table lives with the rows it
  belongs to, so a step never moves it; elsewhere a plain ``jnp.full``.
  """
  shape = tuple(jnp.shape(p)[:1]) + tuple(trailing)
  sharding = owner_sharding(p)
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
  spec = explicit_spec(x, jnp.ndim(x)) if hasattr(x, "shape") else None
  if spec is None or all(e is None for e in spec):
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.auto_axes and hasattr(x, "shape"):
      return jax.lax.with_sharding_constraint(x, P())
    return x
  mesh = mesh_of(x)
  explicit = explicit_axes(mesh)
  if not any(a in explicit for e in spec for a in entry_axes(e)):
    return x
  return jax.sharding.reshard(x, NamedSharding(mesh, P()))


def split_like(x: jax.Array, like: Any) -> jax.Array:
  """``x`` with its leading axis split as ``like``'s type splits its
  leading axis over Explicit mesh axes (the way back of :func:`unsplit`
  for an array computed whole, by example, from a split batch); ``x``
  itself otherwise."""
  if not is_split(like):
    return x
  lead = explicit_spec(like, jnp.ndim(like))[0]
  spec = P(lead, *([None] * (jnp.ndim(x) - 1)))
  return jax.sharding.reshard(x, NamedSharding(mesh_of(like), spec))


def spread_row(p: Any, size: int, shards: int) -> Any:
  """The array row of logical row ``p`` (numpy or jax ints) of a table
  stack of ``size`` rows split over ``shards`` devices: round robin, so
  every table's rows spread evenly over the shards (the plan's
  ``StackSpec.physical`` and the id map's ``Layout.physical``)."""
  if shards == 1:
    return p
  return (p % shards) * (size // shards) + p // shards


def gathered_row(r: Any, size: int, shards: int) -> Any:
  """The logical row of array row ``r`` (numpy or jax ints): the inverse
  of :func:`spread_row`."""
  if shards == 1:
    return r
  per = size // shards
  return (r % per) * shards + r // per


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
