"""Shared types and helpers: saturating counters, SparseRows-aware tree maps."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.typing import ArrayLike

from gradtx import _jaxpr, _sharded

INT32_MAX = 2**31 - 1
# The name scope of a deduplication's hash loop (CPU) in compiled HLO.
DEDUP_SCOPE = "gtx_dedup"


def _has_dtype(x: Any) -> bool:
  return hasattr(x, "dtype") and hasattr(x, "shape")


def is_int(x: Any) -> bool:
  """A Python or numpy integer, not a bool: what an int argument accepts."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_num_rows(num_rows: Any) -> int:
  if not is_int(num_rows):
    raise TypeError(
      "SparseRows `num_rows` must be a Python int (the table's row count, "
      f"static under jit); got {num_rows!r} of type "
      f"{type(num_rows).__name__}. Pass `table.shape[0]`."
    )
  if not 0 <= num_rows < 2**31:
    raise ValueError(
      f"SparseRows `num_rows` must be in [0, 2**31) (ids are int32); got "
      f"{num_rows}. Split a bigger table into several tables."
    )
  return int(num_rows)


def narrow_ids(ids: Any, num_rows: int) -> Any:
  """Row ids of a 64-bit integer dtype as int32, those outside
  ``[0, num_rows)`` replaced by ``num_rows`` (padding); other ids as given.

  Without x64, ``jnp.asarray`` would wrap a numpy int64 id such as
  ``2**32 + 1`` onto row 1; row ids are int32 everywhere in gradtx. (An
  int64 argument of a jitted function is narrowed by JAX at the jit
  boundary, before gradtx sees it: pass int32 ids to jitted steps.)
  """
  if not isinstance(ids, jax.Array):
    try:  # lists, Python ints, torch tensors: their ids may be 64-bit too
      ids = np.asarray(ids)
    except Exception:  # jnp.asarray reports it
      return ids
  if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.dtype.itemsize <= 4:
    return ids
  xp = jnp if isinstance(ids, jax.Array) else np
  in_range = (ids >= 0) & (ids < num_rows)
  return xp.where(in_range, ids, num_rows).astype(np.int32)


def _reduction_error(name: str, where: str) -> TypeError:
  at = f" at {where}" if where else ""
  return TypeError(
    f"`jax.lax.{name}` was applied to a tree holding a gradtx.SparseRows"
    f"{at}. It would combine the replicas' row ids elementwise and corrupt "
    "the gradient. For a cross-replica mean use "
    "`gtx.all_reduce(axis_name)(grads)` in place of "
    "`lax.pmean(grads, axis_name)`, for a sum "
    "`gtx.all_reduce(axis_name, 'sum')(grads)` in place of `lax.psum` (or "
    "put `gtx.all_reduce(axis_name)` first in the optax chain): it "
    "all-gathers the rows. A max, min or reduce-scatter has no row-sparse "
    "form: `gtx.densify()` the gradient first."
  )


@jax.tree_util.register_pytree_node_class
class SparseRows:
  """A row-sparse array: rows ``indices[i]`` receive ``values[i]``.

  Stands for the dense array of shape ``(num_rows, *values.shape[1:])``
  whose row ``indices[i]`` is the sum of every ``values[j]`` with
  ``indices[j] == indices[i]`` (duplicates add up, like TensorFlow's
  ``IndexedSlices``). An index outside ``[0, num_rows)`` (negative ones
  included) is *padding*: it stands for nothing and no consumer writes it.

  It is a pytree whose children are ``indices`` and ``values``; ``num_rows``
  is static, so it passes through ``jit``, ``shard_map`` and ``pmap``.

  Two static facts about the indices let consumers skip work: ``unique``
  (no valid id appears twice: nothing to deduplicate) and ``normalized``
  (every padding id is ``num_rows``: nothing to remap). The gradtx
  optimizers, :meth:`coalesce` and :meth:`deduplicated` set both on what
  they return, and :meth:`with_values` keeps them, so they hold along an
  optax chain and into ``apply_updates`` within one traced step. They are
  not part of the pytree structure (an optimizer's update keeps the
  gradient's structure, as optax expects): whatever rebuilds a SparseRows
  from its leaves -- a ``jit`` boundary, ``lax.cond``, ``lax.scan``, a
  collective, ``jax.tree.map`` into the children -- gets one without them,
  which only costs a deduplication, never a wrong result.

  Args:
    indices: integer ``[n]`` row ids; stored as int32.
    values: ``[n, *row_shape]`` rows.
    num_rows: the number of rows of the dense array (a Python int).
    unique: a promise that no id in ``[0, num_rows)`` appears twice.
    normalized: a promise that every id outside ``[0, num_rows)`` is
      exactly ``num_rows``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> g = gtx.SparseRows(jnp.array([2, 0, 2]), jnp.ones((3, 2)), 4)
    >>> g.shape
    (4, 2)
    >>> g.to_dense()
    Array([[1., 1.],
           [0., 0.],
           [2., 2.],
           [0., 0.]], dtype=float32)
  """

  __slots__ = ("_indices", "_values", "_num_rows", "_unique", "_normalized")

  def __init__(
    self,
    indices: ArrayLike,
    values: ArrayLike,
    num_rows: int,
    *,
    unique: bool = False,
    normalized: bool = False,
  ):
    num_rows = _check_num_rows(num_rows)
    indices = jnp.asarray(narrow_ids(indices, num_rows))
    values = jnp.asarray(values)
    if not jnp.issubdtype(indices.dtype, jnp.integer):
      raise TypeError(
        "SparseRows `indices` must have an integer dtype; got "
        f"{indices.dtype}. Cast ids with `.astype(jnp.int32)`."
      )
    if indices.ndim != 1:
      raise ValueError(
        f"SparseRows `indices` must be 1-D `[n]`; got shape {indices.shape}."
        " Flatten ids with `ids.reshape(-1)` and values to `[n, *row]`."
      )
    if values.ndim < 1 or values.shape[0] != indices.shape[0]:
      raise ValueError(
        "SparseRows `values` must have shape `[n, *row_shape]` with n = "
        f"len(indices) = {indices.shape[0]}; got values of shape "
        f"{values.shape}."
      )
    self._indices = indices.astype(jnp.int32)
    self._values = values
    self._num_rows = num_rows
    self._unique = bool(unique)
    self._normalized = bool(normalized)

  # -- pytree ---------------------------------------------------------------
  def tree_flatten(self):
    hazard = _jaxpr.flatten_hazard()
    if isinstance(hazard, str):
      raise TypeError(hazard)
    if hazard is not None:
      raise _reduction_error(*hazard)
    return (self._indices, self._values), self._num_rows

  @classmethod
  def tree_unflatten(cls, num_rows, children):
    indices, values = children
    if (
      _has_dtype(indices)
      and indices.dtype != jax.dtypes.float0
      and not jnp.issubdtype(indices.dtype, jnp.integer)
    ):
      raise TypeError(
        "A transformation turned the integer `indices` of a gradtx.SparseRows"
        f" into {indices.dtype}: it treated the row-sparse gradient as a "
        "dense array and would corrupt it (a `jax.tree.map` over a gradient "
        "tree maps the ids and the rows of a SparseRows alike). For a "
        "cross-replica mean, `jax.tree.map(lambda g: lax.pmean(g, "
        "axis_name), grads)`, use `gtx.all_reduce(axis_name)(grads)` (and "
        "`gtx.all_reduce(axis_name, 'sum')(grads)` for a sum): it all-gathers"
        " the rows. For a dense optax transformation, use its gradtx twin "
        "(`gtx.scale`, `gtx.scale_by_learning_rate`, "
        "`gtx.clip_by_global_norm`, `gtx.add_decayed_weights`, "
        "`gtx.lazy_adam`, `gtx.lazy_sgd`, `gtx.adagrad`) or put "
        "`gtx.densify()` in front of it."
      )
    obj = object.__new__(cls)
    obj._indices = indices
    obj._values = values
    obj._num_rows = num_rows
    obj._unique = False  # rebuilt from leaves: nothing is known
    obj._normalized = False
    return obj

  # -- properties -----------------------------------------------------------
  @property
  def indices(self) -> jax.Array:
    """int32 ``[n]`` row ids; ids outside ``[0, num_rows)`` are padding."""
    return self._indices

  @property
  def values(self) -> jax.Array:
    """``[n, *row_shape]`` rows."""
    return self._values

  @property
  def num_rows(self) -> int:
    """Rows of the dense array this stands for (static)."""
    return self._num_rows

  @property
  def unique(self) -> bool:
    """Static: no id in ``[0, num_rows)`` appears twice."""
    return self._unique

  @property
  def normalized(self) -> bool:
    """Static: every padding id is exactly ``num_rows``."""
    return self._normalized

  @property
  def shape(self) -> tuple[int, ...]:
    """Shape of the dense array: ``(num_rows, *row_shape)``."""
    return (self._num_rows, *self._values.shape[1:])

  @property
  def dtype(self) -> Any:
    """dtype of the values (and of the dense array)."""
    return self._values.dtype

  @property
  def nnz(self) -> int:
    """Static number of stored rows ``n`` (padding included)."""
    return self._indices.shape[0]

  def __repr__(self) -> str:
    return (
      f"SparseRows(num_rows={self._num_rows}, indices={self._indices!r}, "
      f"values={self._values!r})"
    )

  # -- arithmetic -----------------------------------------------------------
  # numpy must defer to __radd__ instead of broadcasting over the object.
  __array_ufunc__ = None

  def __add__(self, other: Any) -> Any:
    """``self + other``: see :meth:`__radd__` (addition commutes)."""
    if isinstance(other, SparseRows):
      return self._concat(other)
    return self._add_to_dense(other, "SparseRows + array")

  def __radd__(self, other: Any) -> Any:
    """``array + SparseRows``: the array with the rows scatter-added.

    This is what ``optax.apply_updates`` computes for a SparseRows update,
    so Flax's ``TrainState.apply_gradients`` and ``nnx.Optimizer.update``
    take gradtx updates. The result keeps the array's dtype and equals
    ``(array + self.to_dense()).astype(array.dtype)`` (each row summed in
    the wider dtype and rounded once), without a dense copy of ``self``.
    Two SparseRows add up to one holding both sets of rows.
    """
    if isinstance(other, SparseRows):
      return other._concat(self)
    return self._add_to_dense(other, "array + SparseRows")

  def __neg__(self) -> SparseRows:
    return self.with_values(-self._values)

  def __sub__(self, other: Any) -> Any:
    """``self - other``: ``self + (-other)`` (``other`` dense or sparse)."""
    if isinstance(other, SparseRows):
      return self._concat(-other)
    if _is_dense_operand(other):
      other = -jnp.asarray(other)
    return self._add_to_dense(other, "SparseRows - array")

  def __rsub__(self, other: Any) -> Any:
    """``array - SparseRows``: the array with the rows scatter-subtracted."""
    return (-self)._add_to_dense(other, "array - SparseRows")

  def __mul__(self, other: Any) -> SparseRows:
    """``self * scalar``: the values scaled (a dense factor is refused)."""
    return self.with_values(self._values * self._scalar(other, "*"))

  __rmul__ = __mul__

  def __truediv__(self, other: Any) -> SparseRows:
    """``self / scalar``: the values divided."""
    return self.with_values(self._values / self._scalar(other, "/"))

  def _scalar(self, other: Any, op: str) -> Any:
    if isinstance(other, SparseRows) or jnp.ndim(other) != 0:
      raise TypeError(
        f"SparseRows {op} x takes a scalar x only; got "
        f"{type(other).__name__} of shape {jnp.shape(other)}. For a "
        "row-wise product use `g.with_values(g.values * w[g.indices])`, "
        "or densify first with `g.to_dense()`."
      )
    return other

  def _concat(self, other: SparseRows) -> SparseRows:
    if other.shape != self.shape:
      raise ValueError(
        f"SparseRows + SparseRows: dense shapes {self.shape} and "
        f"{other.shape} differ. Both must stand for arrays of the same "
        "shape (same num_rows and row shape)."
      )
    return SparseRows(
      jnp.concatenate([self._indices, other.indices]),
      jnp.concatenate([self._values, other.values]),
      self._num_rows,
    )

  def _add_to_dense(self, other: Any, what: str) -> Any:
    if not _is_dense_operand(other):
      if isinstance(other, (int, float, complex)):
        raise TypeError(
          f"{what}: adding a Python scalar to a SparseRows would make every "
          "row dense. Add it to `g.values` (`g.with_values(g.values + x)`) "
          "for the stored rows, or to `g.to_dense()`."
        )
      return NotImplemented
    # One row-scatter code path for this and gradtx.apply_updates.
    other = jnp.asarray(other)
    check_rows_match(self, other, what, name="array operand")
    from gradtx._rowio import scatter_add_rows  # row I/O sits above

    return scatter_add_rows(other, self)

  # -- operations -----------------------------------------------------------
  def valid_indices(self) -> jax.Array:
    """Indices with every padding id replaced by ``num_rows``.

    ``num_rows`` is out of bounds, so a scatter with ``mode="drop"`` skips
    it; negative ids never wrap around to the end of the table.
    """
    idx = self._indices
    if self._normalized:
      return idx
    ok = (idx >= 0) & (idx < self._num_rows)
    return jnp.where(ok, idx, self._num_rows).astype(jnp.int32)

  def with_values(self, values: jax.Array) -> SparseRows:
    """The same indices (and facts) with new ``[n, *row_shape]`` values."""
    return SparseRows(
      self._indices,
      values,
      self._num_rows,
      unique=self._unique,
      normalized=self._normalized,
    )

  def deduplicated(self) -> SparseRows:
    """Each id once, duplicates summed (itself when :attr:`unique`): the
    form the row engine needs, in input order on CPU (see
    :func:`unique_rows`), sorted on GPUs."""
    if self._unique and self._normalized:
      return self
    idx, values = unique_rows(self)
    return SparseRows(idx, values, self._num_rows, unique=True, normalized=True)

  def to_dense(self) -> jax.Array:
    """The dense ``(num_rows, *row_shape)`` array (duplicates summed)."""
    out = jnp.zeros(self.shape, self.dtype)
    return out.at[self.valid_indices()].add(self._values, mode="drop")

  def coalesce(self) -> SparseRows:
    """Sorted unique indices with duplicates summed, same static length.

    The unused tail holds the padding index ``num_rows`` with zero values,
    and so do ids that were padding on input. The sum of duplicates is
    deterministic on every backend (a sequential scatter on CPU/TPU, a
    segmented scan on GPUs, whose scatter-add is atomic).
    """
    n = self.nnz
    idx = self.valid_indices()
    if n == 0:
      return SparseRows(
        idx, self._values, self._num_rows, unique=True, normalized=True
      )
    # Ids split over Explicit mesh axes are sorted whole on every device.
    idx, values = _sharded.unsplit(idx), _sharded.unsplit(self._values)
    # A lone int32 sort is several times faster on CPU than an argsort.
    sidx = jnp.sort(idx)
    first = jnp.concatenate([jnp.ones([1], bool), sidx[1:] != sidx[:-1]])
    seg = (jnp.cumsum(first, dtype=jnp.int32) - 1).astype(jnp.int32)
    uniq = jnp.full([n], self._num_rows, jnp.int32)
    uniq = uniq.at[jnp.where(first, seg, n)].set(
      sidx, mode="drop", unique_indices=True
    )
    summed = _jaxpr.platform_dependent(
      values,
      idx,
      sidx,
      seg,
      gpu=_segment_sum_scan,
      default=_segment_sum_scatter,
    )
    keep = (uniq < self._num_rows).reshape((n,) + (1,) * (summed.ndim - 1))
    summed = jnp.where(keep, summed, jnp.zeros_like(summed))
    return SparseRows(
      uniq, summed, self._num_rows, unique=True, normalized=True
    )

  @classmethod
  def padding_like(cls, x: SparseRows) -> SparseRows:
    """An all-padding SparseRows of ``x``'s static shapes (stands for 0;
    ``x`` may be abstract, as from ``jax.eval_shape``)."""
    return cls(
      jnp.full(x.indices.shape, x.num_rows, jnp.int32),
      jnp.zeros(x.values.shape, x.values.dtype),
      x.num_rows,
      unique=True,
      normalized=True,
    )


def _is_dense_operand(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _segment_sum_scatter(
  values: jax.Array, idx: jax.Array, sidx: jax.Array, seg: jax.Array
) -> jax.Array:
  """Sums rows into their segments, in input order, without a zero pass.

  ``seg`` is the segment of each position of the sorted ids ``sidx``; a
  binary search finds each input row's segment, so the rows are never
  sorted. Each segment starts as a copy of its first input row (one gather)
  and a scatter-add adds the segment's other rows, skipping the first ones
  (most ids are unique, so it writes little). A scatter on CPU/TPU is
  sequential: each sum runs in input order, the same additions as summing
  into zeros (except that a lone ``-0.0`` stays ``-0.0``; ``0 + x`` made it
  ``0.0``, which no optimizer can tell apart).
  """
  n = values.shape[0]
  seg_of_input = seg[jnp.searchsorted(sidx, idx, method="scan")]
  pos = lax.iota(jnp.int32, n)
  first = jnp.full([n], n, jnp.int32).at[seg_of_input].min(pos)
  sums = values.at[first].get(mode="fill", fill_value=0)
  rest = jnp.where(first[seg_of_input] == pos, n, seg_of_input)
  return sums.at[rest].add(values, mode="drop")


def _segment_sum_scan(
  values: jax.Array, idx: jax.Array, sidx: jax.Array, seg: jax.Array
) -> jax.Array:
  """Sums rows into their segments by a segmented associative scan over the
  stably sorted rows: no atomics, so the order of additions is fixed on
  GPUs."""
  del sidx
  n = values.shape[0]
  svals = values[jnp.argsort(idx, stable=True)]
  first = jnp.concatenate([jnp.ones([1], bool), seg[1:] != seg[:-1]])

  def combine(a, b):
    fa, va = a
    fb, vb = b
    fb_rows = fb.reshape(fb.shape + (1,) * (vb.ndim - fb.ndim))
    return fa | fb, jnp.where(fb_rows, vb, va + vb)

  _, sums = lax.associative_scan(combine, (first, svals))
  last = jnp.concatenate([first[1:], jnp.ones([1], bool)])
  target = jnp.where(last, seg, n)
  return (
    jnp.zeros_like(svals).at[target].set(sums, mode="drop", unique_indices=True)
  )


def _unique_by_hash(idx: jax.Array, values: jax.Array, num_rows: int):
  """:func:`unique_rows` on CPU and TPU: hashing, no sort."""
  n = idx.shape[0]
  first = _first_positions(idx, num_rows)
  pos = lax.iota(jnp.int32, n)
  is_first = first == pos
  uniq = jnp.where(is_first, idx, num_rows)
  return uniq, _add_duplicates(values, first, (~is_first) & (idx < num_rows))


def _unique_by_sort(idx: jax.Array, values: jax.Array, num_rows: int):
  """:func:`unique_rows` on GPUs: coalesce's fixed-order sums (a stable sort
  and a segmented scan), each placed at its id's first position, the layout
  of :func:`_unique_by_hash` (a group's tables keep their ids' slices)."""
  n = idx.shape[0]
  order = jnp.argsort(idx, stable=True)
  sidx = idx[order]
  first = jnp.concatenate([jnp.ones([1], bool), sidx[1:] != sidx[:-1]])
  seg = (jnp.cumsum(first, dtype=jnp.int32) - 1).astype(jnp.int32)
  sums = _segment_sum_scan(values, idx, sidx, seg)  # segment k's sum at k
  start = jnp.where(first, seg, n)
  at = jnp.full([n], n, jnp.int32).at[start].set(order, mode="drop")
  ids = jnp.full([n], num_rows, jnp.int32).at[start].set(sidx, mode="drop")
  uniq = jnp.full([n], num_rows, jnp.int32).at[at].set(ids, mode="drop")
  return uniq, values.at[at].set(sums.astype(values.dtype), mode="drop")


def unique_rows(x: SparseRows) -> tuple[jax.Array, jax.Array]:
  """``x`` deduplicated for the row engine: ``(indices, values)``, each id
  once with its duplicates summed, static length ``n``.

  On CPU (and TPU) the ids stay in input order: an id's first position holds
  its sum and every later duplicate (and every padding id) becomes the
  padding index ``num_rows``, its value left as it was (consumers skip
  padding rows). No sort: :func:`_first_positions` finds each id's first
  position by hashing into a ``4n`` scratch, and :func:`_add_duplicates`
  adds the later duplicates into it in input order, the same additions as
  :meth:`SparseRows.coalesce` (sequential scatter). On GPUs, whose
  scatter-add is atomic, the sums are ``coalesce()``'s (a stable sort and a
  segmented scan, fixed order), placed in the same layout.
  """
  n = x.nnz
  idx = x.valid_indices()
  if n == 0 or x.unique:
    return idx, x.values
  idx, values = _sharded.unsplit(idx), _sharded.unsplit(x.values)
  num_rows = x.num_rows

  by_hash = functools.partial(_unique_by_hash, num_rows=num_rows)
  by_sort = functools.partial(_unique_by_sort, num_rows=num_rows)
  return _jaxpr.platform_dependent(idx, values, gpu=by_sort, default=by_hash)


def _add_duplicates(
  values: jax.Array, first: jax.Array, dup: jax.Array, chunk: int = 1024
) -> jax.Array:
  """``values`` with each duplicate row (``dup``) added into the row at its
  id's ``first`` position, in input order, at a cost proportional to the
  duplicates: ``chunk`` of them per loop trip, gathered and scatter-added
  in place (one scatter-add of all ``n`` rows onto a copy of ``values``
  would read and write every row, most ids being unique)."""
  n = values.shape[0]
  chunk = min(chunk, n)
  pos = lax.iota(jnp.int32, n)
  count = jnp.sum(dup, dtype=jnp.int32)
  # The duplicates' positions, in input order, then n (gathers zeros).
  slot = jnp.where(dup, jnp.cumsum(dup, dtype=jnp.int32) - 1, n)
  dups = (
    jnp.full([n + chunk], n, jnp.int32)
    .at[slot]
    .set(pos, mode="drop", unique_indices=True)
  )

  def add_chunk(k, vals):
    src = lax.dynamic_slice(dups, (k * chunk,), (chunk,))
    dst = first.at[src].get(mode="fill", fill_value=n)
    rows = vals.at[src].get(mode="fill", fill_value=0)
    return vals.at[dst].add(rows, mode="drop")

  trips = (count + chunk - 1) // chunk
  return lax.fori_loop(0, trips, add_chunk, values)


def _first_positions(idx: jax.Array, num_rows: int) -> jax.Array:
  """For each position, the first position holding the same id (padding:
  itself), in ``O(n)`` expected time and ``O(n)`` memory, deterministic.

  Rounds of multiplicative hashing into ``4n`` slots: each unresolved
  position scatters its position into its slot with ``min``; a position
  whose slot's winner holds the same id takes the winner (all positions of
  one id share a slot, so the winner is the id's first position). Positions
  whose slot was won by another id retry with a new multiplier. Each round
  resolves at least the winner of every slot, so the loop ends; at 8,192
  ids it takes 2 to 3 rounds. Integer ``min`` gives the same result in any
  order, on every backend.
  """
  n = idx.shape[0]
  bits = min(max(int(np.ceil(np.log2(4 * n))), 1), 31)
  size = 1 << bits
  pos = lax.iota(jnp.int32, n)
  key = idx.astype(jnp.uint32)

  def unresolved(carry):
    return jnp.any(carry[1] < 0)

  def round_(carry):
    r, first = carry
    todo = first < 0
    mult = (jnp.uint32(0x9E3779B1) + r * jnp.uint32(0x6C8E9CF6)) | 1
    slot = ((key * mult) >> (32 - bits)).astype(jnp.int32)
    slot = jnp.where(todo, slot, size)  # resolved positions sit out
    winner = jnp.full([size], n, jnp.int32).at[slot].min(pos, mode="drop")
    cand = winner.at[slot].get(mode="fill", fill_value=n)
    same = idx.at[cand].get(mode="fill", fill_value=-1) == idx
    return r + 1, jnp.where(todo & same, cand, first)

  first = jnp.where(idx < num_rows, -1, pos)
  with jax.named_scope(DEDUP_SCOPE):  # tests count the dedups of a step
    _, first = lax.while_loop(unresolved, round_, (jnp.uint32(0), first))
  return first


def is_sparse(x: Any) -> bool:
  """Whether ``x`` is a :class:`SparseRows` (a leaf for gradtx tree maps)."""
  return isinstance(x, SparseRows)


def concrete(x: Any, cast: Callable[[Any], Any] = float) -> Any:
  """``cast(x)`` for a concrete value, None for a traced one (under ``jit``
  or ``optax.inject_hyperparams``)."""
  try:
    return cast(np.asarray(x))
  except (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
  ):
    return None


def is_update_leaf(x: Any) -> bool:
  """``is_leaf`` for update trees: None and SparseRows are leaves."""
  return x is None or isinstance(x, SparseRows)


def tree_map(f: Callable[..., Any], tree: Any, *rest: Any) -> Any:
  """``jax.tree.map`` that stops at SparseRows and None."""
  return jax.tree.map(f, tree, *rest, is_leaf=is_update_leaf)


def map_updates(
  dense: Callable[..., Any],
  tree: Any,
  *rest: Any,
  sparse: Callable[..., Any] | None = None,
) -> Any:
  """The sparse twin of ``jax.tree.map`` for update trees (optax's
  ``stateless_with_tree_map`` maps arrays only): None stays None; a
  SparseRows gets ``sparse(u, *rest_leaves)`` when given, else its values
  are mapped, ``u.with_values(dense(u.values, *rest_leaves))`` (facts kept);
  every other leaf is ``dense(jnp.asarray(x), *rest_leaves)``."""

  def f(u, *r):
    if u is None:
      return None
    if isinstance(u, SparseRows):
      if sparse is not None:
        return sparse(u, *r)
      return u.with_values(dense(u.values, *r))
    return dense(jnp.asarray(u), *r)

  return tree_map(f, tree, *rest)


def tree_leaves(tree: Any) -> list[Any]:
  """Leaves of ``tree``, with SparseRows kept whole and None dropped."""
  return [
    x for x in jax.tree.leaves(tree, is_leaf=is_update_leaf) if x is not None
  ]


def varying_axes(x: Any) -> frozenset:
  """Mesh axes along which shard_map's type checks see ``x`` vary.

  ``x`` is a value or a ``jax.ShapeDtypeStruct`` (from ``jax.eval_shape``).
  """
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  return _jaxpr.vma_of(aval)


def zero_counter() -> jax.Array:
  """A fresh int32 scalar counter (a new buffer each call)."""
  return jnp.zeros([], jnp.int32)


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
  :func:`gradtx._jaxpr.trace_once`). The skip branch gives zeros of the
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
  """
  decided = concrete(pred, bool)
  if decided and check is None:
    return run()
  replay, (u_types, s_types) = _jaxpr.trace_once(run)
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
    return jax.tree.map(_jaxpr.cast_varying, tree, varying)

  return lax.cond(pred, lambda: cast(replay()), lambda: cast(skip()))


def check_tree_match(
  tree: Any, reference: Any, *, name: str, reference_name: str
) -> None:
  """Raises a ValueError naming both arguments when the structures differ.

  SparseRows in ``tree`` count as leaves, so a SparseRows update at an array
  parameter's position matches.
  """
  got = jax.tree.structure(tree, is_leaf=is_update_leaf)
  want = jax.tree.structure(reference, is_leaf=is_update_leaf)
  try:
    jax.tree.map(lambda *_: None, tree, reference, is_leaf=is_update_leaf)
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"`{name}` does not have the tree structure of `{reference_name}`: "
      f"got {got}, expected {want}. Pass a `{name}` with the same "
      f"nesting and keys as `{reference_name}`."
    ) from e


def stateless(
  update_fn: Callable[..., Any],
) -> optax.GradientTransformationExtraArgs:
  """A transformation with an empty state around ``update_fn``."""

  def init_fn(params):
    del params
    return optax.EmptyState()

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def check_rows_match(
  u: SparseRows, p: Any, what: str, name: str = "parameter"
) -> None:
  shape = tuple(jnp.shape(p))
  if not shape or u.shape != shape:
    raise ValueError(
      f"{what}: a SparseRows of dense shape {u.shape} (num_rows="
      f"{u.num_rows}, row shape {u.shape[1:]}) does not match its {name} "
      f"of shape {shape}. Build it with num_rows=table.shape[0] and values "
      "of shape [n, *table.shape[1:]]."
    )
