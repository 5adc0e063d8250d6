"""Row I/O: the one reader, the one writer and the one scatter-add of gradtx.

Every read or write of a table's rows goes through here (``gtx.lookup``,
the row engine, ``apply_updates`` and ``array + SparseRows``, weight
decay), so each kind of storage is handled once, behind the same calls on
ids and rows (the SparseRows type sits above this module):

- plain arrays: a gather of clamped ids and a per-row select, a scatter
  with ``mode="drop"`` for padding;
- tables whose rows are split over Explicit mesh axes: owner-local reads
  and writes. The ids (``n`` of them, small) travel to the row owners, each
  owner reads its rows with the others masked to zero, and a sum across the
  row axes puts every row where its id was (a reduce-scatter when the ids
  are split along the same axes). No collective moves table-sized data, and
  a row's update stays on the device that owns it. On ``AxisType.Auto``
  meshes XLA's partitioner already reads row-sharded tables locally, and
  plain gathers and scatters are used;
- 8-bit optimizer state (:class:`~gradtx.QuantizedRows`): the rows' codes
  and scales are read and dequantized, new rows quantized and written.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradtx import _platform
from gradtx._dedup import coalesce_rows, unique_rows
from gradtx._precision import QuantizedRows, dequantize_rows, quantize_rows
from gradtx._sharded import (
  entry_axes,
  explicit_axes,
  explicit_spec,
  is_row_sharded,
  is_split,
  mesh_of,
  row_axes,
)


def per_row(x: jax.Array, ndim: int) -> jax.Array:
  """``x`` (``[n]``, one value per row, e.g. a padding mask) reshaped to
  broadcast against rows ``[n, *row]`` of rank ``ndim``."""
  return x.reshape(x.shape + (1,) * (ndim - x.ndim))


# ----------------------------------------------------------------------------
# row-sharded tables: owner-local reads and writes


def _num_shards(mesh: Any, axes: tuple[str, ...]) -> int:
  return math.prod(mesh.shape[a] for a in axes)


def _check_divisible(table: Any, axes: tuple[str, ...], what: str) -> int:
  shards = _num_shards(mesh_of(table), axes)
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
  spec = explicit_spec(x, jnp.ndim(x))
  if spec is None or mesh_of(x) != mesh:
    return (None,) * jnp.ndim(x)
  return spec


def _reshard(x: jax.Array, mesh: Any, spec: tuple[Any, ...]) -> jax.Array:
  """``x`` with sharding ``spec`` on ``mesh`` (a no-op if it has it)."""
  if explicit_spec(x, jnp.ndim(x)) == tuple(spec) and mesh_of(x) == mesh:
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
    shared = tuple(a for a in entry_axes(entry) if a in axes)
    if shared:
      x = lax.all_gather(x, shared, axis=dim, tiled=True)
  return x


def _sum_back(
  x: jax.Array, spec: tuple[Any, ...], axes: tuple[str, ...]
) -> jax.Array:
  """Sums ``x`` over ``axes``, scattering dims split over them back."""
  done = set()
  for dim, entry in enumerate(spec):
    shared = tuple(a for a in entry_axes(entry) if a in axes)
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
    axis_names=explicit_axes(mesh),
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


def _read_whole(table: jax.Array, ids: jax.Array, unique: bool):
  """Rows of a table whose rows are not split; the output is split as the
  ids are (JAX asks for the output sharding of such a gather)."""
  num_rows = table.shape[0]
  ids = jnp.where(ids < 0, num_rows, ids.astype(jnp.int32))
  out = None
  if is_split(ids) and mesh_of(ids) == mesh_of(table):
    t_spec = explicit_spec(table, table.ndim)
    spec = P(*explicit_spec(ids, ids.ndim), *t_spec[1:])
    out = NamedSharding(mesh_of(ids), spec)
  return table.at[ids].get(
    mode="fill",
    fill_value=0,
    unique_indices=unique,
    out_sharding=out,
  )


def _read_owned(
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
  mesh = mesh_of(table)
  local_rows = _check_divisible(table, axes, what)
  num_rows = table.shape[0]
  t_spec = explicit_spec(table, table.ndim)
  row_spec = t_spec[1:]
  # Ids may not be split along an axis that also splits the row dims.
  taken = {a for e in row_spec for a in entry_axes(e)}
  i_spec = tuple(
    tuple(a for a in entry_axes(e) if a not in taken) or None
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


def _write_owned(
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
  mesh = mesh_of(table)
  local_rows = _check_divisible(table, axes, what)
  num_rows = table.shape[0]
  t_spec = P(*explicit_spec(table, table.ndim))
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


# ----------------------------------------------------------------------------
# plain and row-sharded arrays


def gather_rows(
  table: jax.Array,
  ids: jax.Array,
  *,
  unique: bool = False,
  what: str = "gradtx",
) -> jax.Array:
  """Rows ``table[ids]``; ids outside ``[0, num_rows)`` (negative ones
  included: no wrap-around) read zero rows.

  Owner-local when ``table``'s rows (or the ids) are split over Explicit
  mesh axes. Elsewhere a gather of clamped ids and a per-row select: XLA:CPU
  compiles a fill-mode gather's per-element bounds check into a slower loop.

  Examples:
    >>> import jax.numpy as jnp
    >>> from gradtx._rowio import gather_rows
    >>> gather_rows(jnp.arange(6.0).reshape(3, 2), jnp.array([2, -1, 3]))
    Array([[4., 5.],
           [0., 0.],
           [0., 0.]], dtype=float32)
  """
  ids = jnp.asarray(ids).astype(jnp.int32)
  if is_row_sharded(table) or is_split(ids):
    return _read_owned(table, ids, unique=unique, what=what)
  num_rows = table.shape[0]
  valid = (ids >= 0) & (ids < num_rows)
  rows = table.at[jnp.clip(ids, 0, num_rows - 1)].get(mode="promise_in_bounds")
  return jnp.where(per_row(valid, rows.ndim), rows, jnp.zeros((), rows.dtype))


def scatter_rows(
  x: jax.Array,
  idx: jax.Array,
  rows: jax.Array,
  *,
  add: bool = False,
  unique: bool = True,
) -> jax.Array:
  """``x[idx] = rows`` (or ``+=``) in place; ids outside ``[0, num_rows)``
  write nothing (pass a SparseRows' ``valid_indices()``: negative ids
  would wrap).

  A plain scatter, or an owner-local write (each device writes the rows it
  owns) when ``x``'s rows are split over Explicit mesh axes.
  """
  if is_row_sharded(x):
    return _write_owned(x, idx, rows, add=add, unique=unique)
  ref = x.at[idx]
  kwargs = dict(mode="drop", unique_indices=unique)
  rows = rows.astype(x.dtype)
  return ref.add(rows, **kwargs) if add else ref.set(rows, **kwargs)


def add_unique_rows(
  p: jax.Array, idx: jax.Array, values: jax.Array, *, unique: bool = False
) -> jax.Array:
  """``p`` with ``values`` added at rows ``idx`` (padding ``p.shape[0]``),
  each row written once: the duplicates are summed first (unless ``unique``
  says there are none), then each row is added in the wider dtype and
  rounded once (as ``optax.apply_updates`` does for dense leaves),
  deterministic everywhere."""
  if not unique:
    idx, values = unique_rows(idx, values, p.shape[0])
  rows = gather_rows(p, idx)
  new = (rows + values).astype(p.dtype)
  return scatter_rows(p, idx, new)


def scatter_add_rows(
  p: jax.Array, idx: jax.Array, values: jax.Array, *, unique: bool
) -> jax.Array:
  """``p`` with ``values`` added at rows ``idx`` (duplicates summed; the
  padding id ``p.shape[0]`` skipped): a SparseRows added to its table.

  ``idx`` are a SparseRows' ``valid_indices()``, ``unique`` its static fact.
  The result keeps ``p``'s dtype. With each id once (the update of every
  gradtx optimizer) it equals ``(p + u.to_dense()).astype(p.dtype)``, the
  rule of ``optax.apply_updates``. Shared by :func:`gradtx.apply_updates`
  and ``array + SparseRows``.

  A plain scatter-add on CPU, where it is deterministic (XLA:CPU scatters
  are sequential: duplicates are added in turn, each add rounded to ``p``'s
  dtype); on accelerators (a GPU's scatter-add is atomic), and for updates
  that promote the param (float32 rows into a bf16 table, which a
  cast-then-add would round twice), the rows are deduplicated and written
  once.
  """
  if jnp.result_type(p.dtype, values.dtype) != p.dtype:
    return add_unique_rows(p, idx, values, unique=unique)
  if unique:  # each id once (any gradtx optimizer's update): deterministic
    return scatter_rows(p, idx, values, add=True, unique=True)

  def direct(p, idx, vals):
    return scatter_rows(p, idx, vals, add=True, unique=False)

  def deduplicated(p, idx, vals):
    return add_unique_rows(p, idx, vals)

  return _platform.platform_dependent(
    p, idx, values, cpu=direct, accelerator=deduplicated
  )


def dense_sums(
  ids: list[jax.Array], rows: list[jax.Array], num_rows: int, modes: list
) -> jax.Array:
  """The dense ``[num_rows, *row]`` array whose row ``i`` is the sum of the
  rows ``rows[k][j]`` whose id ``ids[k][j]`` is ``i`` (ids outside
  ``[0, num_rows)`` dropped): a table's gradient from its reads, each read
  ``k`` in its own shape (``ids[k].shape + row``) and read as
  ``modes[k]`` (``"lookup"``: by :func:`gather_rows`; ``"clip"``: every id
  in range, JAX's clamping gather; ``"fill"``: padding reads zeros).

  On CPU, ``jax.grad``'s own: each read's transpose (a scatter-add in input
  order into zeros; the program ``jax.grad`` of the reads compiles to),
  summed. On accelerators no atomics: the reads' rows flattened and summed
  by
  :func:`~gradtx._dedup.coalesce_rows`' sorted, fixed-order segment sums,
  each row written once (a float scatter-add of many reads onto a few
  hundred rows is contended atomics on a GPU, whose sums change from run
  to run).
  """
  row = rows[0].shape[ids[0].ndim :]
  zeros = jax.ShapeDtypeStruct((num_rows, *row), rows[0].dtype)

  def cpu(ids, rows):
    sums = [
      jax.linear_transpose(functools.partial(_READS[m], i), zeros)(r)[0]
      for i, r, m in zip(ids, rows, modes, strict=True)
    ]
    return functools.reduce(jnp.add, sums)

  def accelerator(ids, rows):
    idx = jnp.concatenate([i.reshape(-1) for i in ids])
    idx = jnp.where((idx >= 0) & (idx < num_rows), idx, num_rows)
    flat = jnp.concatenate([r.reshape((-1, *row)) for r in rows])
    uniq, summed = coalesce_rows(idx.astype(jnp.int32), flat, num_rows)
    return (
      jnp.zeros(zeros.shape, zeros.dtype)
      .at[uniq]
      .set(summed, mode="drop", unique_indices=True, indices_are_sorted=True)
    )

  return _platform.platform_dependent(
    list(ids), list(rows), cpu=cpu, accelerator=accelerator
  )


# The reads dense_sums transposes on CPU, by mode.
_READS = {
  "lookup": lambda ids, table: gather_rows(table, ids),
  "clip": lambda ids, table: table[ids],
  "fill": lambda ids, table: table.at[ids].get(mode="fill", fill_value=0),
}


def read_param_rows(p: Any, idx: jax.Array) -> jax.Array:
  """Rows ``idx`` (unique; padding reads zeros) of a parameter."""
  return gather_rows(jnp.asarray(p), idx, unique=True)


# ----------------------------------------------------------------------------
# optimizer state leaves: an array of a float dtype or a QuantizedRows


def read_state(s: Any) -> Any:
  """A whole state leaf as an array (dequantized if quantized)."""
  return dequantize_rows(s) if isinstance(s, QuantizedRows) else s


def write_state(s: Any, new: jax.Array) -> Any:
  """``new`` stored the way ``s`` is: its dtype, or quantized like it."""
  if isinstance(s, QuantizedRows):
    return quantize_rows(new, s.block_size, signed=s.signed)
  return new.astype(s.dtype)


def read_state_rows(s: Any, idx: jax.Array) -> jax.Array:
  """Rows ``idx`` (unique; padding reads zeros) of a state leaf, as float
  rows if it is quantized."""
  if isinstance(s, QuantizedRows):
    return dequantize_rows(
      QuantizedRows(
        gather_rows(s.codes, idx, unique=True),
        gather_rows(s.scales, idx, unique=True),
      )
    )
  return gather_rows(s, idx, unique=True)


def write_state_rows(s: Any, idx: jax.Array, rows: jax.Array) -> Any:
  """``s`` with rows ``idx`` (unique; padding dropped) set to ``rows``."""
  if isinstance(s, QuantizedRows):
    q = quantize_rows(rows, s.block_size, signed=s.signed)
    return QuantizedRows(
      scatter_rows(s.codes, idx, q.codes),
      scatter_rows(s.scales, idx, q.scales),
    )
  return scatter_rows(s, idx, rows)


def state_array(s: Any) -> Any:
  """The array whose shape and placement stand for a state leaf's."""
  return s.codes if isinstance(s, QuantizedRows) else s
