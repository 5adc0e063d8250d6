"""Low precision: stochastic rounding (with a key, or with per-row hashed
bits), 8-bit optimizer state (row-aligned block-wise dynamic quantization,
:class:`QuantizedRows`), and the optimizers' state dtype arguments and
state leaves (:func:`state_dtype`, :func:`state_full`). Reading and writing
state rows, quantized or not, is in :mod:`gradtx._rowio`."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from gradtx import _sharded
from gradtx._static import concrete, is_int

# The dtypes stochastic rounding writes.
ROUNDED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The end of a message for a check that only gradtx's own calls can fail.
_INTERNAL = " (an internal error of gradtx: please report it)"


def _dtype_of(x: Any) -> np.dtype:
  # Read the dtype before any conversion: jnp.asarray would silently narrow a
  # float64 numpy array to float32 without x64.
  if hasattr(x, "dtype"):
    return np.dtype(x.dtype)
  return jnp.asarray(x).dtype


def check_key(key: Any, what: str) -> Any:
  """``key`` if it is one JAX PRNG key (new-style or legacy uint32), else
  an error naming ``what``'s `key` argument."""
  dtype = getattr(key, "dtype", None)
  shape = getattr(key, "shape", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if shape != ():
      raise ValueError(
        f"{what} `key` must be a single PRNG key; got a key array of "
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
    f"{what} `key` must be a JAX PRNG key, from `jax.random.key(seed)` "
    f"(or a legacy uint32 key from `jax.random.PRNGKey(seed)`); got "
    f"{type(key).__name__} with dtype {dtype} and shape {shape}."
  )


def _check_block_size(block_size: Any, what: str) -> int:
  if not is_int(block_size):
    raise TypeError(
      f"{what} `block_size` must be a Python int (static under jit); "
      f"got {block_size!r} of type {type(block_size).__name__}."
    )
  if block_size < 1:
    raise ValueError(
      f"{what} `block_size` must be >= 1; got {block_size}. Typical "
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
  ``x``. :func:`gradtx.apply_updates` with a ``key`` rounds with per-row
  hashed bits instead, so that its results do not depend on how rows are
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
  if target not in ROUNDED_DTYPES:
    raise TypeError(
      "gradtx.stochastic_round `dtype` must be jnp.bfloat16 or jnp.float16; "
      f"got {dtype!r}. For other dtypes use a plain `x.astype(dtype)`."
    )
  key = check_key(key, "gradtx.stochastic_round")
  x = jnp.asarray(x, jnp.float32)
  return round_with_bits(x, target, jax.random.bits(key, x.shape, jnp.uint32))


def round_with_bits(x: jax.Array, dtype: Any, bits: jax.Array) -> jax.Array:
  """:func:`stochastic_round` of float32 ``x`` with the uniform uint32
  ``bits`` (one per element) given instead of drawn from a key."""
  target = jnp.dtype(dtype)
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


def _mix32(x: jax.Array) -> jax.Array:
  """A bijective 32-bit integer hash with full avalanche (Wellons'
  "lowbias32": two multiply-xorshift rounds)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def row_bits(key: Any, row_ids: ArrayLike, row_size: int) -> jax.Array:
  """Uniform random bits for the elements of some rows, from their ids alone.

  Element ``j`` of row ``i`` gets ``h(h(i ^ s0) + j * 0x9E3779B9 + s1)``,
  with ``h`` a bijective 32-bit hash (:func:`_mix32`) and ``s0, s1`` two
  words drawn from ``key``. So a row's bits do not depend on which other
  rows are in the batch, on their order, or on how rows are sharded; and
  they cost a few integer ops per element instead of a threefry key per
  row.

  Args:
    key: a JAX PRNG key, from ``jax.random.key`` or (legacy) a uint32
      ``jax.random.PRNGKey``; fold in the step for fresh bits each step.
    row_ids: integer array ``[n]`` of row ids.
    row_size: elements per row.

  Returns:
    uint32 ``[n, row_size]``.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from gradtx._precision import row_bits
    >>> key = jax.random.key(0)
    >>> a = row_bits(key, jnp.array([7, 3, 5]), 4)
    >>> b = row_bits(key, jnp.array([5, 7]), 4)  # another batch
    >>> bool((a[0] == b[1]).all() and (a[2] == b[0]).all())
    True
    >>> a.shape, a.dtype
    ((3, 4), dtype('uint32'))
  """
  key = check_key(key, "gradtx.apply_updates")
  ids_dtype = _dtype_of(row_ids)
  if not jnp.issubdtype(ids_dtype, jnp.integer):
    raise TypeError(
      f"gradtx: the row ids of stochastic rounding must be an integer "
      f"array; got dtype {ids_dtype}.{_INTERNAL}"
    )
  row_ids = jnp.asarray(row_ids)
  if row_ids.ndim != 1:
    raise ValueError(
      f"gradtx: the row ids of stochastic rounding must be 1-D, one id per "
      f"row; got shape {row_ids.shape}.{_INTERNAL}"
    )
  seed = jax.random.bits(key, (2,), jnp.uint32)
  rows = _mix32(row_ids.astype(jnp.uint32) ^ seed[0])
  cols = lax.iota(jnp.uint32, row_size) * jnp.uint32(0x9E3779B9)
  return _mix32(rows[:, None] + cols[None, :] + seed[1])


# ---------------------------------------------------------------------------
# 8-bit optimizer state: block-wise dynamic quantization.
#
# Each block of a row is divided by its absolute maximum (times 1 / _TOP) and
# every element is stored as a tiny float: a sign bit for signed states, an
# exponent and 3 mantissa bits. A float code keeps the relative error of
# every element at most 1/16 over many binades, where a linear code would
# round an element 300 times smaller than its block's maximum to zero (for a
# second moment v, that makes m / sqrt(v) explode). The code is built from a
# float32's bits with integer ops (round, shift, offset), so encoding is a
# few elementwise ops, not a search in a code book.

_MANTISSA_BITS = 3
# The largest code's value (exponent 0, mantissa 0b110): a block's maximum
# maps there. 1.875 (0b111) is left free so that 254 / 126 codes, not 255 /
# 127, span the binades.
_TOP = 1.75
# Binades below the top one: value(k) = 2 ** ((k >> 3) - E) * (1 + (k & 7) / 8)
# for k = code - 1. Signed codes have 7 bits of magnitude (16 binades),
# unsigned ones 8 (32 binades).
_LOWEST_EXPONENT = {True: 15, False: 31}
_TOP_CODE = {True: 127, False: 255}
_SHIFT = 23 - _MANTISSA_BITS  # float32 mantissa bits dropped


def _offset(signed: bool) -> int:
  return (127 - _LOWEST_EXPONENT[signed]) << _MANTISSA_BITS


def _encode(a: jax.Array, signed: bool) -> jax.Array:
  """Codes (int32 ``0 .. top``) of magnitudes ``a`` in ``[0, _TOP]``.

  Rounds to nearest (ties up: adding half of the dropped bits to the
  float32 bit pattern carries into the exponent where it should). A
  non-zero magnitude below the lowest binade gets the smallest non-zero
  code, never zero.
  """
  bits = lax.bitcast_convert_type(a, jnp.uint32)
  rounded = (bits + jnp.uint32(1 << (_SHIFT - 1))) >> _SHIFT
  k = rounded.astype(jnp.int32) - _offset(signed)
  code = jnp.clip(k + 1, 1, _TOP_CODE[signed])
  return jnp.where(a > 0, code, 0)


def _decode(code: jax.Array, signed: bool) -> jax.Array:
  """float32 magnitudes of int32 codes ``0 .. top`` (0 is zero)."""
  bits = (code - 1 + _offset(signed)) << _SHIFT
  value = lax.bitcast_convert_type(bits.astype(jnp.uint32), jnp.float32)
  return jnp.where(code > 0, value, 0)


def num_blocks(row_size: int, block_size: int) -> int:
  """Number of quantization blocks in a row of ``row_size`` elements.

  Args:
    row_size: elements per row, ``>= 0``.
    block_size: the most elements per block, ``>= 1``.

  Returns:
    ``ceil(row_size / block_size)``.

  Examples:
    >>> from gradtx._precision import num_blocks
    >>> num_blocks(10, 4), num_blocks(8, 4), num_blocks(0, 4)
    (3, 2, 0)
  """
  block_size = _check_block_size(block_size, "gradtx:")
  if not is_int(row_size) or row_size < 0:
    raise ValueError(
      f"gradtx: a row's size must be a Python int >= 0; got {row_size!r}."
      f"{_INTERNAL}"
    )
  return -(-int(row_size) // block_size)


def _block_length(row_size: int, blocks: int) -> int:
  """Elements in each block but the last: the row cut as evenly as possible
  into ``blocks`` blocks (a 100-wide row in blocks of at most 64: two of
  50). The layout follows from the shapes alone."""
  return -(-row_size // blocks) if blocks else 0


class QuantizedRows(NamedTuple):
  r"""An optimizer state stored in 8 bits: codes plus one scale per block.

  What ``"int8"`` state dtypes (``gtx.lazy_adam(..., nu_dtype="int8")``,
  ``accumulator_dtype="int8"``) put in the state in place of an array
  ``[V, *row]``. Each row is flattened and cut into blocks of at most
  ``block_size`` elements, as evenly as possible; no block spans two rows,
  so a sparse update reads and writes only its rows' codes and scales
  (row-sharded tables keep both split like their rows). Within a block of
  absolute maximum :math:`M`, an element :math:`x` is stored as the nearest
  value of an 8-bit floating-point code times :math:`M / 1.75`:

  * signed (int8 codes, e.g. a first moment): sign, 4-bit exponent, 3-bit
    mantissa: magnitudes :math:`2^{e-15}(1 + f/8)` down to
    :math:`2^{-15}` of the block's scale;
  * unsigned (uint8 codes, e.g. a second moment or a sum of squares):
    5-bit exponent, 3-bit mantissa, down to :math:`2^{-31}`.

  So :math:`|x - \hat x| \le |x| / 16`, except that a non-zero element
  below the lowest binade becomes the smallest non-zero code (never zero:
  a second moment that is not zero stays positive). Zero blocks are exact
  zeros; a NaN or inf makes its block non-finite. This is the block-wise
  *dynamic* quantization of Dettmers et al. (exponent plus linear fraction,
  normalized per block), with a fixed 3-bit fraction so that encoding is a
  few integer ops on a float32's bits instead of a search of a code book.

  A pytree of two arrays: checkpoint, shard and ``jax.device_put`` it like
  any state.

  Attributes:
    codes: int8 (signed) or uint8 (unsigned) ``[V, *row]``.
    scales: float32 ``[V, num_blocks]``, each block's maximum over 1.75.

  Examples:
    >>> import jax.numpy as jnp
    >>> from gradtx._precision import quantize_rows
    >>> q = quantize_rows(jnp.array([[0.5, -1.0, 0.3], [1e-3, 0.0, 2.0]]),
    ...                   block_size=4)
    >>> q.codes, q.shape, q.block_size
    (Array([[ 119, -127,  113],
           [  39,    0,  127]], dtype=int8), (2, 3), 3)
    >>> q.dequantize()  # 0.3 and 1e-3 within 1/16 (4.8% and 2.3%)
    Array([[ 5.000000e-01, -1.000000e+00,  2.857143e-01],
           [ 9.765625e-04,  0.000000e+00,  2.000000e+00]], dtype=float32)

  References:
    Dettmers, Lewis, Shleifer and Zettlemoyer, `8-bit Optimizers via
    Block-wise Quantization <https://arxiv.org/abs/2110.02861>`_, 2022.
  """

  codes: Any
  scales: Any

  @property
  def shape(self) -> tuple[int, ...]:
    """The shape of the array stored, ``[V, *row]``."""
    return tuple(self.codes.shape)

  @property
  def signed(self) -> bool:
    """Whether the code has a sign (int8 codes) or not (uint8)."""
    return jnp.dtype(self.codes.dtype) == jnp.int8

  @property
  def block_size(self) -> int:
    """Elements in each block but a row's last."""
    return _block_length(math.prod(self.shape[1:]), self.scales.shape[-1])

  def dequantize(self, dtype: DTypeLike = jnp.float32) -> jax.Array:
    """The stored array, ``[V, *row]`` of ``dtype``."""
    return dequantize_rows(self, dtype)

  @classmethod
  def zeros_like(
    cls, p: Any, *, signed: bool = True, block_size: int = 64
  ) -> QuantizedRows:
    """An 8-bit state of zeros for parameter ``p`` (at least 2-D): codes
    shaped and placed like ``p``, scales split like its rows. For the
    ``init`` of :func:`gradtx.row_transformation`.

    Args:
      p: the parameter, ``[V, *row]`` with ``row`` non-empty.
      signed: int8 codes (a state with a sign, e.g. a momentum); False:
        uint8 codes for a state that is never negative.
      block_size: the most elements per block.

    Examples:
      >>> import jax.numpy as jnp
      >>> import gradtx as gtx
      >>> m = gtx.QuantizedRows.zeros_like(jnp.ones((100, 8)), block_size=4)
      >>> m.codes.shape, m.scales.shape, float(m.dequantize().sum())
      ((100, 8), (100, 2), 0.0)
    """
    if jnp.ndim(p) < 2:
      raise ValueError(
        "gradtx.QuantizedRows.zeros_like `p` must have at least 2 "
        f"dimensions, [V, *row]; got shape {jnp.shape(p)}. Keep 1-D and "
        "scalar leaves' state in float32 (`jnp.zeros_like(p)`): a scale "
        "per row would cost more than 8 bits save."
      )
    block_size = _check_block_size(
      block_size, "gradtx.QuantizedRows.zeros_like"
    )
    return state_full(p, 0, INT8, signed=signed, block_size=block_size)


def quantize_rows(
  x: ArrayLike, block_size: int, *, signed: bool = True
) -> QuantizedRows:
  """Quantizes each row of ``x`` to 8 bits (see :class:`QuantizedRows`).

  Args:
    x: floating-point array ``[n, *row]``; ``n`` may be 0.
    block_size: the most elements per block, a Python int ``>= 1``.
    signed: int8 codes with a sign; ``False``: uint8 codes for values
      ``>= 0`` (negative ones are stored as 0), with twice the range.

  Returns:
    A :class:`QuantizedRows` with codes ``[n, *row]`` and float32 scales
    ``[n, num_blocks(prod(row), block_size)]``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from gradtx._precision import quantize_rows
    >>> q = quantize_rows(jnp.array([[4.0, 1e-6, 0.0]]), 8, signed=False)
    >>> q.codes, q.scales * 1.75
    (Array([[255,  80,   0]], dtype=uint8), Array([[4.]], dtype=float32))
    >>> q.dequantize()  # 1e-6 is 22 binades below 4, 2.2% off
    Array([[4.000000e+00, 1.021794e-06, 0.000000e+00]], dtype=float32)
  """
  block_size = _check_block_size(block_size, "gradtx:")
  x_dtype = _dtype_of(x)
  if not jnp.issubdtype(x_dtype, jnp.floating):
    raise TypeError(
      f"gradtx: the rows of an 8-bit state must be floating-point; got "
      f"dtype {x_dtype}.{_INTERNAL}"
    )
  x = jnp.asarray(x)
  if x.ndim < 1:
    raise ValueError(
      "gradtx: the rows of an 8-bit state need a leading row axis, shape "
      f"[n, *row]; got a scalar.{_INTERNAL}"
    )
  n = x.shape[0]
  row_size = math.prod(x.shape[1:])
  blocks = num_blocks(row_size, block_size)
  length = _block_length(row_size, blocks)
  flat = x.reshape(n, row_size).astype(jnp.float32)
  # Pad each row on its own so that the last block of a row never borrows
  # elements from the next row; zeros do not change a block's maximum.
  padded = jnp.pad(flat, ((0, 0), (0, blocks * length - row_size)))
  padded = padded.reshape(n, blocks, length)
  # Unsigned: negative values are stored as 0, and the maximum of the raw
  # values (from 0) is the block's scale, with no |x| pass before it.
  magnitude = jnp.abs(padded) if signed else jnp.maximum(padded, 0)
  absmax = jnp.max(padded, axis=2, initial=0.0)
  if signed:
    absmax = jnp.maximum(absmax, -jnp.min(padded, axis=2, initial=0.0))
  scales = absmax / _TOP
  safe = jnp.where(scales > 0, scales, 1)[:, :, None]
  code = _encode(magnitude / safe, signed)
  if signed:
    code = jnp.where(padded < 0, -code, code)
  code = code.reshape(n, blocks * length)[:, :row_size]
  code_dtype = jnp.int8 if signed else jnp.uint8
  return QuantizedRows(code.astype(code_dtype).reshape(x.shape), scales)


def dequantize_rows(q: QuantizedRows, dtype: DTypeLike = jnp.float32):
  """Inverts :func:`quantize_rows`: each code's value times its scale.

  Args:
    q: a :class:`QuantizedRows`.
    dtype: floating-point dtype of the result.

  Returns:
    An array ``[n, *row]`` of ``dtype``.

  Examples:
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from gradtx._precision import dequantize_rows, quantize_rows
    >>> x = jax.random.normal(jax.random.key(0), (4, 3, 5))
    >>> q = quantize_rows(x, block_size=8)
    >>> q.codes.shape, q.scales.shape  # 15 elements per row: 8 and 7
    ((4, 3, 5), (4, 2))
    >>> y = dequantize_rows(q)
    >>> bool(jnp.all(jnp.abs(x - y) <= jnp.abs(x) / 16))
    True
  """
  what = "gradtx.QuantizedRows.dequantize"
  if not isinstance(q, QuantizedRows):
    raise TypeError(
      f"{what}: the state must be a QuantizedRows; got "
      f"{type(q).__name__}.{_INTERNAL}"
    )
  out_dtype = jnp.dtype(dtype)
  if not jnp.issubdtype(out_dtype, jnp.floating):
    raise TypeError(
      f"{what} `dtype` must be a floating-point dtype; got {dtype!r}."
    )
  codes, scales = jnp.asarray(q.codes), jnp.asarray(q.scales)
  if codes.dtype not in (jnp.int8, jnp.uint8) or codes.ndim < 1:
    raise TypeError(
      f"{what}: `codes` must be int8 or uint8 [n, *row], as "
      "`gtx.QuantizedRows.zeros_like` and the int8 optimizer states make "
      f"them; got dtype {codes.dtype} and shape {codes.shape}."
    )
  n = codes.shape[0]
  row_size = math.prod(codes.shape[1:])
  blocks = scales.shape[-1] if scales.ndim == 2 else -1
  if (
    scales.shape[:1] != (n,) or blocks < min(row_size, 1) or (blocks > row_size)
  ):
    raise ValueError(
      f"{what}: `scales` must have shape [{n}, blocks] "
      f"with 1 <= blocks <= {row_size} for codes of shape {codes.shape}; "
      f"got {scales.shape}."
    )
  length = _block_length(row_size, blocks)
  signed = codes.dtype == jnp.int8
  code = codes.reshape(n, row_size).astype(jnp.int32)
  values = _decode(jnp.abs(code), signed)
  if signed:
    values = jnp.where(code < 0, -values, values)
  values = jnp.pad(values, ((0, 0), (0, blocks * length - row_size)))
  values = values.reshape(n, blocks, length) * scales[:, :, None]
  values = values.reshape(n, blocks * length)[:, :row_size]
  return values.reshape(codes.shape).astype(out_dtype)


# ---------------------------------------------------------------------------
# State leaves as the optimizers' init builds them: an array
# of a float dtype or a QuantizedRows.

INT8 = "int8"
StateDtype = Any  # None (the param's dtype), a float dtype, or INT8


def state_dtype(
  dtype: Any, fn: str, arg: str, *, complex_ok: bool = False
) -> StateDtype:
  """Parses a state dtype argument: ``None``, a float dtype, ``"int8"`` or,
  where the optax twin takes one (``complex_ok``), a complex dtype."""
  if dtype is None:
    return None
  try:
    canonical = jnp.dtype(dtype)
  except TypeError:
    canonical = None
  if canonical == jnp.int8:  # "int8", jnp.int8 or np.int8
    return INT8
  kinds = (jnp.floating, jnp.complexfloating) if complex_ok else (jnp.floating,)
  if canonical is None or not any(jnp.issubdtype(canonical, k) for k in kinds):
    also = ", a complex dtype" if complex_ok else ""
    raise TypeError(
      f"gradtx.{fn} `{arg}` must be None, a floating-point dtype (e.g. "
      f'jnp.bfloat16){also} or "int8" (8-bit block-wise quantized); got '
      f"{dtype!r}."
    )
  return jax.dtypes.canonicalize_dtype(canonical)


def check_block_size(block_size: Any, fn: str, *dtypes: StateDtype) -> int:
  """``block_size`` of an optimizer whose state ``dtypes`` may be ``"int8"``,
  checked where one is (elsewhere unused: ``optax.inject_hyperparams`` may
  pass it traced)."""
  if INT8 not in dtypes:
    return 64
  if isinstance(block_size, jax.Array | np.ndarray | np.integer):
    value = concrete(block_size, int)
    if value is None:
      raise TypeError(
        f"gradtx.{fn} `block_size` must be static: it fixes the shape of "
        "the int8 state. Under optax.inject_hyperparams pass "
        "static_args=('block_size',)."
      )
    block_size = value
  return _check_block_size(block_size, f"gradtx.{fn}")


def state_full(
  p: Any, value: Any, dtype: StateDtype, *, signed: bool, block_size: int
) -> Any:
  """A state leaf for param ``p`` filled with ``value``: an array of
  ``dtype`` (``None``: ``p``'s) shaped and sharded like ``p``, or for
  ``"int8"`` a :class:`QuantizedRows` whose codes are like ``p`` and whose
  scales are split like its rows. Leaves with fewer than 2 dimensions keep a
  float32 state: a scale per row would cost more than 8 bits save."""
  if p is None:
    return None
  if dtype != INT8:
    return jnp.full_like(p, value, dtype=dtype)
  if jnp.issubdtype(p.dtype, jnp.complexfloating):
    raise TypeError(
      f'an "int8" optimizer state is for real parameters; got a parameter '
      f"of dtype {p.dtype}. Keep the state in a complex dtype (None, the "
      "parameter's, or e.g. jnp.complex64) for complex parameters."
    )
  if jnp.ndim(p) < 2:
    return jnp.full_like(p, value, dtype=jnp.float32)
  row_shape = tuple(jnp.shape(p)[1:])
  one = quantize_rows(
    jnp.full((1,) + row_shape, value, jnp.float32), block_size, signed=signed
  )
  code = one.codes.reshape(-1)[0] if one.codes.size else 0
  scale = one.scales.reshape(-1)[0] if one.scales.size else 0.0
  codes = jnp.full_like(p, code, dtype=one.codes.dtype)
  scales = _sharded.per_row_full(p, scale, jnp.float32, one.scales.shape[1:])
  return QuantizedRows(codes, scales)
