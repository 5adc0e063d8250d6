"""The SparseRows type: a row-sparse array, the gradient of a table.

``SparseRows(indices, values, num_rows)`` stands for the dense
``(num_rows, *row_shape)`` array whose row ``indices[i]`` receives
``values[i]``, duplicates summed. Its deduplication kernels are in
:mod:`gradtx._dedup`; adding it to an array scatter-adds its rows through
the row I/O (:mod:`gradtx._rowio`), the same path as
:func:`gradtx.apply_updates`; flattening it inside a function that would
corrupt it raises (:mod:`gradtx._flatten_guard`). Beside the type:
:func:`narrow_ids` (any integer ids to int32), :func:`check_rows_match` (a
SparseRows against the array it is added to) and :data:`MAX_ROWS`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradtx._dedup import coalesce_rows, unique_rows
from gradtx._flatten_guard import flatten_hazard
from gradtx._rowio import scatter_add_rows
from gradtx._static import is_int

# The most rows a SparseRows stands for, and a group of tables deduplicated
# together holds: its ids, and the padding id ``num_rows``, are int32.
MAX_ROWS = 2**31 - 1


def _has_dtype(x: Any) -> bool:
  return hasattr(x, "dtype") and hasattr(x, "shape")


def _check_num_rows(num_rows: Any) -> int:
  if not is_int(num_rows):
    raise TypeError(
      "SparseRows `num_rows` must be a Python int (the table's row count, "
      f"static under jit); got {num_rows!r} of type "
      f"{type(num_rows).__name__}. Pass `table.shape[0]`."
    )
  if not 0 <= num_rows <= MAX_ROWS:
    raise ValueError(
      f"SparseRows `num_rows` must be in [0, 2**31) (ids are int32); got "
      f"{num_rows}. Split a bigger table into several tables."
    )
  return int(num_rows)


def narrow_ids(ids: Any, num_rows: int, what: str) -> jax.Array:
  """Integer row ids as an int32 array, the one narrowing of ids in gradtx.

  An id of a 64-bit dtype outside ``[0, num_rows)`` becomes ``num_rows``
  (padding): without x64, ``jnp.asarray`` would wrap a numpy int64 id such
  as ``2**32 + 1`` onto row 1. (An int64 argument of a jitted function is
  narrowed by JAX at the jit boundary, before gradtx sees it: pass int32
  ids to jitted steps.) A narrower dtype is cast (a uint8 id could not
  be compared with a row count of 256): a uint32 id past ``2**31 - 1``
  wraps to a negative id, padding too. ``what`` names the
  ids in the error for a dtype that is not an integer (``"gradtx.lookup
  `ids`"``).
  """
  if not isinstance(ids, jax.Array):
    try:  # lists, Python ints, torch tensors: their ids may be 64-bit too
      ids = np.asarray(ids)
    except Exception:  # jnp.asarray reports it
      pass
  ids = narrow_wide(ids, num_rows)
  ids = jnp.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(
      f"{what} must be integer row ids; got dtype {ids.dtype}. Cast them "
      "with `.astype(jnp.int32)`."
    )
  return ids.astype(jnp.int32)


def narrow_wide(ids: Any, num_rows: int) -> Any:
  """:func:`narrow_ids`' narrowing of 64-bit ids: int32, an id outside
  ``[0, num_rows)`` ``num_rows`` (padding); numpy ids stay numpy (on the
  host, no program), other ids and dtypes pass unchanged."""
  dtype = getattr(ids, "dtype", None)
  if (
    dtype is None
    or not jnp.issubdtype(dtype, jnp.integer)
    or jnp.dtype(dtype).itemsize <= 4
  ):
    return ids
  xp = jnp if isinstance(ids, jax.Array) else np
  in_range = (ids >= 0) & (ids < num_rows)
  return xp.where(in_range, ids, num_rows).astype(np.int32)


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
    indices = narrow_ids(indices, num_rows, "SparseRows `indices`")
    values = jnp.asarray(values)
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
    self._indices = indices
    self._values = values
    self._num_rows = num_rows
    self._unique = bool(unique)
    self._normalized = bool(normalized)

  # -- pytree ---------------------------------------------------------------
  def tree_flatten(self):
    hazard = flatten_hazard()
    if hazard is not None:
      raise TypeError(hazard)
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
    """Stored rows, padding included: the static length ``n`` of
    :attr:`indices` (not the number of distinct valid ids, which only the
    values of the ids tell)."""
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
    return scatter_add_rows(
      other, self.valid_indices(), self._values, unique=self._unique
    )

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
    :func:`gradtx._dedup.unique_rows`), sorted on accelerators."""
    if self._unique and self._normalized:
      return self
    idx, values = self.valid_indices(), self._values
    if not self._unique:
      idx, values = unique_rows(idx, values, self._num_rows)
    return SparseRows(idx, values, self._num_rows, unique=True, normalized=True)

  def to_dense(self) -> jax.Array:
    """The dense ``(num_rows, *row_shape)`` array (duplicates summed, the
    way :func:`gradtx.apply_updates` adds them: deterministic everywhere)."""
    out = jnp.zeros(self.shape, self.dtype)
    return scatter_add_rows(
      out, self.valid_indices(), self._values, unique=self._unique
    )

  def coalesce(self) -> SparseRows:
    """Sorted unique indices with duplicates summed, same static length.

    The unused tail holds the padding index ``num_rows`` with zero values,
    and so do ids that were padding on input. The sum of duplicates is
    deterministic on every backend (a sequential scatter on CPU, a
    segmented scan on accelerators, where a scatter-add is atomic).
    """
    n = self.nnz
    idx = self.valid_indices()
    if n == 0:
      return SparseRows(
        idx, self._values, self._num_rows, unique=True, normalized=True
      )
    uniq, summed = coalesce_rows(idx, self._values, self._num_rows)
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


def check_rows_match(
  u: SparseRows, p: Any, what: str, name: str = "parameter"
) -> None:
  """Raises a ValueError, naming ``what`` and ``name``, when ``u`` does not
  stand for an array of ``p``'s shape."""
  shape = tuple(jnp.shape(p))
  if not shape or u.shape != shape:
    raise ValueError(
      f"{what}: a SparseRows of dense shape {u.shape} (num_rows="
      f"{u.num_rows}, row shape {u.shape[1:]}) does not match its {name} "
      f"of shape {shape}. Build it with num_rows=table.shape[0] and values "
      "of shape [n, *table.shape[1:]]."
    )
