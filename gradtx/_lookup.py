"""The explicit row read: :func:`lookup` (``gtx.lookup``), a ``jit`` the
jaxpr reader knows by name, with its padding rule and bounds check;
:func:`host_check`, the check of ids on the host that it and the table
stack's ``bounds_check`` share; and :data:`DENSE_READS_PER_ROW`, the reads
per row past which a table's gradient is one summed row per table row
(the sparse gradients and the stack's plan both decide by it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradtx import _jaxpr
from gradtx._rowio import gather_rows
from gradtx._sparse_rows import narrow_ids

# A table read at least this many times per row in one step gets one summed
# gradient row per table row (every row) instead of a row per read. At 4
# reads per row a step touches all but e**-4 (1.8%) of the rows for uniform
# ids, so a lazy optimizer updating every row behaves almost as it would on
# the touched ones (benchmarks/probes.py's dense_threshold measures the
# sparse and dense forms).
DENSE_READS_PER_ROW = 4.0


def _raise_bad_ids(bad: np.ndarray, num_rows: int) -> None:
  if np.any(bad):
    raise ValueError(
      f"gradtx.lookup: {int(np.sum(bad))} id(s) outside [0, {num_rows}) "
      "found with bounds_check=True. Fix the ids, or drop bounds_check to "
      "treat them as padding (zero rows, no gradient)."
    )


def _checked_zeros(check: Callable[..., None], *args: np.ndarray) -> np.ndarray:
  check(*(np.asarray(a) for a in args))
  return np.zeros(np.shape(args[0]), np.int32)


def host_check(
  check: Callable[..., None], checked: jax.Array, *args: Any
) -> jax.Array:
  """``checked`` (int32 ids), after ``check(*args)`` on the host, which
  raises for bad ids (``args[0]`` of ``checked``'s shape): at once when
  ``args`` are concrete (also where a trace closes over them), in the
  computation when traced."""
  try:
    concrete = [np.asarray(a) for a in args]
  except jax.errors.TracerArrayConversionError:
    pass
  else:
    check(*concrete)
    return checked
  # Traced ids: a host check whose zeros the read adds to its ids, so it
  # runs before the read and is never dropped. A pure callback, not
  # jax.debug.callback: an effect inside a differentiated loop (lax.map,
  # vmap under remat) makes JAX's partial evaluation keep its trace in a
  # reference cycle (trace -> effect handle -> tracers -> trace), which
  # jax.checking_leaks reports as a leaked trace.
  zeros = jax.pure_callback(
    functools.partial(_checked_zeros, check),
    jax.ShapeDtypeStruct(jnp.shape(args[0]), jnp.int32),
    *args,
    vmap_method="expand_dims",
  )
  return checked + zeros


def _bounds_check(ids: Any, checked: jax.Array, num_rows: int) -> jax.Array:
  """``checked`` (``ids`` as int32), after a check that raises for ids
  outside ``[0, num_rows)`` (:func:`host_check`; concrete ``ids`` are
  checked as given, 64-bit ones included)."""
  try:
    ids = np.asarray(ids).astype(np.int64)
  except jax.errors.TracerArrayConversionError:
    ids = checked
  bad = (ids < 0) | (ids >= num_rows)
  return host_check(
    functools.partial(_raise_bad_ids, num_rows=num_rows), checked, bad
  )


def gtx_lookup(table: jax.Array, ids: jax.Array) -> jax.Array:
  """The row read of :func:`lookup`, a ``jit`` that the jaxpr shows by name.

  :func:`sparse_value_and_grad` recognises it by this name and re-binds it
  with a sink added, so it never depends on how the rows are read.
  """
  return gather_rows(table, ids, what="gradtx.lookup")


_lookup_rows = jax.jit(gtx_lookup)
_jaxpr.register_lookup(_lookup_rows)


def lookup(
  table: jax.Array, ids: ArrayLike, *, bounds_check: bool = False
) -> jax.Array:
  """Reads rows of an embedding table: ``table[ids]`` with padding ids.

  :func:`sparse_value_and_grad` gives a table read by ``table[ids]``,
  ``jnp.take`` or an embedding layer a :class:`SparseRows` gradient already;
  ``lookup`` is the explicit form, for its padding rule and bounds check.
  Outside :func:`sparse_value_and_grad` it is an ordinary differentiable
  gather.

  Ids outside ``[0, num_rows)`` -- negative ones included, which do *not*
  wrap around -- are padding: they read a zero row and give no gradient.
  Use them for padded positions of variable-length batches.

  Args:
    table: ``[num_rows, *row_shape]`` array.
    ids: integer ids of any shape.
    bounds_check: raise a ValueError for ids outside ``[0, num_rows)``.
      With concrete ids it raises at once; under ``jit`` a host callback
      checks them before the read and fails the computation.

  Returns:
    ``ids.shape + table.shape[1:]`` rows.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> table = jnp.arange(6.0).reshape(3, 2)
    >>> gtx.lookup(table, jnp.array([[2, 0], [-1, 1]]))
    Array([[[4., 5.],
            [0., 1.]],
    <BLANKLINE>
           [[0., 0.],
            [2., 3.]]], dtype=float32)
  """
  if jnp.ndim(table) < 1:
    raise ValueError(
      "gradtx.lookup `table` must have at least one axis (rows); got a scalar."
    )
  checked = narrow_ids(ids, table.shape[0], "gradtx.lookup `ids`")
  if bounds_check:
    checked = _bounds_check(ids, checked, table.shape[0])
  return _lookup_rows(table, checked)
