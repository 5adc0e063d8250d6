"""Low-precision building blocks: stochastic rounding, per-row keys and
row-aligned block-wise int8 quantization."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from gradtx._base import is_int

_ROUNDED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _dtype_of(x: Any) -> np.dtype:
  # Read the dtype before any conversion: jnp.asarray would silently narrow a
  # float64 numpy array to float32 without x64.
  if hasattr(x, "dtype"):
    return np.dtype(x.dtype)
  return jnp.asarray(x).dtype


def _check_key(key: Any, fn: str) -> Any:
  dtype = getattr(key, "dtype", None)
  shape = getattr(key, "shape", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if shape != ():
      raise ValueError(
        f"gradtx.{fn} `key` must be a single PRNG key; got a key array of "
        f"shape {shape}. Pass one key (e.g. `keys[0]`) or jax.vmap over them."
      )
    return key
  if dtype is not None and np.dtype(dtype) == np.uint32 and len(shape) == 1:
    try:  # checks the key length against the default PRNG implementation
      jax.random.wrap_key_data(key)
    except TypeError:
      pass
    else:
      return key
  raise TypeError(
    f"gradtx.{fn} `key` must be a JAX PRNG key, from `jax.random.key(seed)` "
    f"(or a legacy uint32 key from `jax.random.PRNGKey(seed)`); got "
    f"{type(key).__name__} with dtype {dtype} and shape {shape}."
  )


def _check_block_size(block_size: Any, fn: str) -> int:
  if not is_int(block_size):
    raise TypeError(
      f"gradtx.{fn} `block_size` must be a Python int (static under jit); "
      f"got {block_size!r} of type {type(block_size).__name__}."
    )
  if block_size < 1:
    raise ValueError(
      f"gradtx.{fn} `block_size` must be >= 1; got {block_size}. Typical "
      "values are 64 to 2048."
    )
  return int(block_size)


def stochastic_round(x: ArrayLike, dtype: DTypeLike, key: Any) -> jax.Array:
  r"""Rounds float32 ``x`` to ``dtype`` stochastically, without bias.

  Each element goes to one of its two neighbours in ``dtype``, the one above
  with probability proportional to how close ``x`` is to it:

  .. math::

    \operatorname{round}(x) = \begin{cases}
      \mathrm{hi} & \text{with probability } (x - \mathrm{lo}) /
        (\mathrm{hi} - \mathrm{lo}) \\
      \mathrm{lo} & \text{otherwise}
    \end{cases}
    \qquad \text{so} \qquad \mathbb{E}[\operatorname{round}(x)] = x.

  Small updates to a low-precision parameter then survive on average instead
  of always rounding away. Representable values (signed zeros included) come
  back unchanged; NaN stays NaN and +-inf stay +-inf; values beyond the
  largest finite value of ``dtype`` round to nearest, overflowing to inf as a
  plain ``x.astype(dtype)`` does. Rounding never changes the sign.

  For bfloat16 the rounding is exactly unbiased (random low 16 bits added to
  the float32 bit pattern, which is then truncated). For float16 the choice is
  made with a 24-bit uniform draw, exact for ``|x| >= 2**-25``; below, the
  probability of leaving zero is resolved to ``2**-24``.

  The result depends only on ``x`` and ``key``: the same key and shape give
  the same bits eagerly or under jit, on any device and with any sharding of
  ``x``. Use :func:`row_keys` for results that do not depend on how rows are
  batched.

  Args:
    x: float32 array of any shape.
    dtype: ``jnp.bfloat16`` or ``jnp.float16``.
    key: a JAX PRNG key, from ``jax.random.key`` or (legacy) a uint32
      ``jax.random.PRNGKey``.

  Returns:
    An array of ``x``'s shape and dtype ``dtype``.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from gradtx._precision import stochastic_round
    >>> x = jnp.full((10000,), 1.0 + 2.0**-9)  # 1/4 of a bfloat16 ulp above 1
    >>> y = stochastic_round(x, jnp.bfloat16, jax.random.key(0))
    >>> sorted(set(y.tolist()))  # the two neighbours 1 and 1 + 2**-7
    [1.0, 1.0078125]
    >>> bool(abs(jnp.mean(y == 1.0078125) - 0.25) < 0.02)  # 1/4 go up
    True
    >>> x.astype(jnp.bfloat16)[0]  # nearest rounding always goes down
    Array(1, dtype=bfloat16)
    >>> stochastic_round(jnp.array([0.5, jnp.inf]), jnp.float16,
    ...                  jax.random.key(1))
    Array([0.5, inf], dtype=float16)
  """
  x_dtype = _dtype_of(x)
  if x_dtype != np.float32:
    raise TypeError(
      f"gradtx.stochastic_round `x` must be float32; got dtype {x_dtype}. "
      "Cast it first with `x.astype(jnp.float32)`."
    )
  try:
    target = jnp.dtype(dtype)
  except TypeError:
    target = None
  if target not in _ROUNDED_DTYPES:
    raise TypeError(
      "gradtx.stochastic_round `dtype` must be jnp.bfloat16 or jnp.float16; "
      f"got {dtype!r}. For other dtypes use a plain `x.astype(dtype)`."
    )
  key = _check_key(key, "stochastic_round")
  x = jnp.asarray(x, jnp.float32)
  bits = jax.random.bits(key, x.shape, jnp.uint32)
  if target == jnp.bfloat16:
    rounded = _stochastic_round_bfloat16(x, bits)
  else:
    rounded = _stochastic_round_float16(x, bits)
  # NaN fails the comparison too, so it takes the plain cast and stays NaN.
  in_range = jnp.abs(x) <= float(jnp.finfo(target).max)
  return jnp.where(in_range, rounded, x.astype(target))


def _stochastic_round_bfloat16(x: jax.Array, bits: jax.Array) -> jax.Array:
  # bfloat16 is the top half of float32: adding a uniform 16-bit number to the
  # low half carries into the top half with probability low / 2**16, exactly
  # the distance to the lower neighbour in bfloat16 ulps. Sign-magnitude
  # bits make this round the magnitude, so negatives work the same way.
  x_bits = lax.bitcast_convert_type(x, jnp.uint32)
  top = (x_bits + (bits & jnp.uint32(0xFFFF))) >> 16
  return lax.bitcast_convert_type(top.astype(jnp.uint16), jnp.bfloat16)


def _stochastic_round_float16(x: jax.Array, bits: jax.Array) -> jax.Array:
  nearest = x.astype(jnp.float16)
  above = x > nearest.astype(jnp.float32)
  # Both directions with scalar targets rather than one with a per-element
  # target: jax 0.12 fails to vmap jnp.nextafter over an explicitly sharded
  # axis when the target comes from jnp.where of two scalars.
  up = jnp.nextafter(nearest, jnp.float16(jnp.inf))
  down = jnp.nextafter(nearest, jnp.float16(-jnp.inf))
  # Keep the float16 neighbours themselves, not float32 copies, so that a
  # negative value rounding up to zero gives -0.
  lo = jnp.where(above, nearest, down)
  hi = jnp.where(above, up, nearest)
  lo32 = lo.astype(jnp.float32)
  # hi - lo is a power of two and x - lo is exact (Sterbenz), so p is exact.
  p = (x - lo32) / (hi.astype(jnp.float32) - lo32)
  u = (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
  chosen = jnp.where(u < p, hi, lo)
  # A representable x is its own nearest value; there down may be -inf (at
  # the most negative finite value), which would make p NaN.
  return jnp.where(x == nearest.astype(jnp.float32), nearest, chosen)


def row_keys(key: Any, row_ids: ArrayLike) -> jax.Array:
  """One PRNG key per row, derived from the row's id alone.

  Row ``i`` gets ``jax.random.fold_in(key, i)``, so its random numbers do not
  depend on which other rows are in the batch, on their order, or on how the
  rows are sharded across devices.

  Args:
    key: a JAX PRNG key, from ``jax.random.key`` or (legacy) a uint32
      ``jax.random.PRNGKey``; fold in the step first for fresh randomness at
      each step.
    row_ids: integer array ``[n]`` of row ids.

  Returns:
    ``n`` keys of ``key``'s kind: a key array ``[n]``, or uint32 ``[n, 2]``
    for a legacy key.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from gradtx._precision import row_keys, stochastic_round
    >>> key = jax.random.key(0)
    >>> rows = jnp.full((3, 4), 1.0 + 2.0**-9)
    >>> def round_rows(rows, ids):
    ...   keys = row_keys(key, ids)
    ...   rnd = lambda r, k: stochastic_round(r, jnp.bfloat16, k)
    ...   return jax.vmap(rnd)(rows, keys)
    >>> a = round_rows(rows, jnp.array([7, 3, 5]))
    >>> b = round_rows(rows[:2], jnp.array([5, 7]))  # another batch
    >>> bool((a[0] == b[1]).all() and (a[2] == b[0]).all())
    True
    >>> row_keys(key, jnp.arange(3)).shape
    (3,)
  """
  key = _check_key(key, "row_keys")
  ids_dtype = _dtype_of(row_ids)
  if not jnp.issubdtype(ids_dtype, jnp.integer):
    raise TypeError(
      f"gradtx.row_keys `row_ids` must be an integer array; got dtype "
      f"{ids_dtype}. Pass the rows' int32 ids."
    )
  row_ids = jnp.asarray(row_ids)
  if row_ids.ndim != 1:
    raise ValueError(
      f"gradtx.row_keys `row_ids` must be 1-D, one id per row; got shape "
      f"{row_ids.shape}. Flatten it with `row_ids.reshape(-1)`."
    )
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(row_ids)


def num_blocks(row_size: int, block_size: int) -> int:
  """Number of quantization blocks in a row of ``row_size`` elements.

  Args:
    row_size: elements per row, ``>= 0``.
    block_size: elements per block, ``>= 1``.

  Returns:
    ``ceil(row_size / block_size)``: the last block may be shorter.

  Examples:
    >>> from gradtx._precision import num_blocks
    >>> num_blocks(10, 4), num_blocks(8, 4), num_blocks(0, 4)
    (3, 2, 0)
  """
  block_size = _check_block_size(block_size, "num_blocks")
  if not is_int(row_size):
    raise TypeError(
      f"gradtx.num_blocks `row_size` must be a Python int; got {row_size!r} "
      f"of type {type(row_size).__name__}."
    )
  if row_size < 0:
    raise ValueError(
      f"gradtx.num_blocks `row_size` must be >= 0; got {row_size}."
    )
  return -(-int(row_size) // block_size)


def quantize_rows(x: ArrayLike, block_size: int) -> tuple[jax.Array, jax.Array]:
  r"""Quantizes each row of ``x`` to int8 with one absmax scale per block.

  Every row is flattened and cut into blocks of ``block_size`` elements (the
  last block of a row may be shorter); no block spans two rows, so a row's
  codes and scales depend on that row alone and rows can be gathered,
  updated and scattered independently. Within a block of absolute maximum
  :math:`m`:

  .. math::

    s = m / 127, \qquad q_i = \operatorname{round}(x_i / s) \in [-127, 127],
    \qquad |x_i - q_i s| \le s / 2 = m / 254,

  the bound holding up to float32 rounding (a few ulps of :math:`m`). An
  all-zero block gets scale 0 and codes 0, and dequantizes to exact zeros.
  ``x`` should be finite: a NaN or inf makes its block's scale non-finite.

  Args:
    x: floating-point array ``[n, *row]``; ``n`` may be 0.
    block_size: elements per block, a Python int ``>= 1``.

  Returns:
    ``(codes, scales)``: int8 ``[n, R]`` with ``R = prod(row)``, and float32
    ``[n, num_blocks(R, block_size)]``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from gradtx._precision import dequantize_rows, quantize_rows
    >>> x = jnp.array([[0.5, -1.0, 0.25], [0.0, 0.0, 2.0]])
    >>> codes, scales = quantize_rows(x, block_size=2)
    >>> codes
    Array([[  64, -127,  127],
           [   0,    0,  127]], dtype=int8)
    >>> scales * 127
    Array([[1.  , 0.25],
           [0.  , 2.  ]], dtype=float32)
    >>> dequantize_rows(codes, scales, 2, (3,))
    Array([[ 0.503937, -1.      ,  0.25    ],
           [ 0.      ,  0.      ,  2.      ]], dtype=float32)

  References:
    Dettmers, Lewis, Shleifer and Zettlemoyer, `8-bit Optimizers via
    Block-wise Quantization <https://arxiv.org/abs/2110.02861>`_, 2022. (This
    is their block-wise absmax scheme with a linear code, not their dynamic
    tree code.)
  """
  block_size = _check_block_size(block_size, "quantize_rows")
  x_dtype = _dtype_of(x)
  if not jnp.issubdtype(x_dtype, jnp.floating):
    raise TypeError(
      f"gradtx.quantize_rows `x` must be a floating-point array; got dtype "
      f"{x_dtype}. Cast it with `x.astype(jnp.float32)`."
    )
  x = jnp.asarray(x)
  if x.ndim < 1:
    raise ValueError(
      "gradtx.quantize_rows `x` must have a leading row axis, shape "
      "[n, *row]; got a scalar. Use `x.reshape(1, -1)` for a single row."
    )
  n = x.shape[0]
  row_size = math.prod(x.shape[1:])
  blocks = num_blocks(row_size, block_size)
  flat = x.reshape(n, row_size).astype(jnp.float32)
  # Pad each row on its own so that the last block of a row never borrows
  # elements from the next row; zeros do not change a block's absmax.
  padded = jnp.pad(flat, ((0, 0), (0, blocks * block_size - row_size)))
  padded = padded.reshape(n, blocks, block_size)
  scales = jnp.max(jnp.abs(padded), axis=2, initial=0.0) / 127
  safe = jnp.where(scales > 0, scales, 1)[:, :, None]
  codes = jnp.clip(jnp.round(padded / safe), -127, 127)
  # NaN has no int8 code; its block's non-finite scale already marks it.
  codes = jnp.where(jnp.isfinite(codes), codes, 0).astype(jnp.int8)
  codes = codes.reshape(n, blocks * block_size)[:, :row_size]
  return codes, scales


def dequantize_rows(
  codes: ArrayLike,
  scales: ArrayLike,
  block_size: int,
  row_shape: Sequence[int],
  dtype: DTypeLike = jnp.float32,
) -> jax.Array:
  """Inverts :func:`quantize_rows`: codes times their block's scale.

  Args:
    codes: int8 ``[n, R]`` from :func:`quantize_rows`.
    scales: float32 ``[n, num_blocks(R, block_size)]`` from
      :func:`quantize_rows`.
    block_size: the ``block_size`` given to :func:`quantize_rows`.
    row_shape: the shape of one row of the original ``x``, with
      ``prod(row_shape) == R``.
    dtype: floating-point dtype of the result.

  Returns:
    An array ``[n, *row_shape]`` of ``dtype``, within ``scale / 2`` of the
    quantized values (see :func:`quantize_rows`).

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from gradtx._precision import dequantize_rows, quantize_rows
    >>> x = jax.random.normal(jax.random.key(0), (4, 3, 5))
    >>> codes, scales = quantize_rows(x, block_size=8)
    >>> codes.shape, scales.shape  # 15 elements per row: blocks of 8 and 7
    ((4, 15), (4, 2))
    >>> y = dequantize_rows(codes, scales, 8, (3, 5))
    >>> bool(jnp.all(jnp.abs(x - y) <= jnp.max(jnp.abs(x)) / 254 + 1e-6))
    True
  """
  block_size = _check_block_size(block_size, "dequantize_rows")
  try:
    row_shape = tuple(int(d) for d in row_shape)
  except TypeError:
    raise TypeError(
      "gradtx.dequantize_rows `row_shape` must be a tuple of ints, the shape "
      f"of one row of the quantized array; got {row_shape!r}."
    ) from None
  out_dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(out_dtype, jnp.floating):
    raise TypeError(
      f"gradtx.dequantize_rows `dtype` must be a floating-point dtype; got "
      f"{dtype!r}."
    )
  codes = jnp.asarray(codes)
  scales = jnp.asarray(scales)
  if codes.dtype != jnp.int8:
    raise TypeError(
      f"gradtx.dequantize_rows `codes` must be int8 from quantize_rows; got "
      f"dtype {codes.dtype}."
    )
  row_size = math.prod(row_shape)
  blocks = num_blocks(row_size, block_size)
  if codes.ndim != 2 or codes.shape[1] != row_size:
    raise ValueError(
      f"gradtx.dequantize_rows `codes` must have shape [n, {row_size}] for "
      f"row_shape {row_shape}; got {codes.shape}. Pass the row shape of the "
      "array given to quantize_rows."
    )
  expected = (codes.shape[0], blocks)
  if scales.shape != expected:
    raise ValueError(
      f"gradtx.dequantize_rows `scales` must have shape {expected} for "
      f"{row_size} elements per row in blocks of {block_size}; got "
      f"{scales.shape}. Pass the block_size given to quantize_rows."
    )
  per_element = jnp.repeat(
    scales.astype(jnp.float32),
    block_size,
    axis=1,
    total_repeat_length=blocks * block_size,
  )[:, :row_size]
  values = codes.astype(jnp.float32) * per_element
  return values.reshape(codes.shape[0], *row_shape).astype(out_dtype)
