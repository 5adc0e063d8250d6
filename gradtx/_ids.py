"""Raw ids, the one place they change form: 64-bit ids as two uint32 words.

:class:`Words` is the public form of 64-bit ids for JAX without
``jax_enable_x64``; :class:`HostWords` holds ids split on the host
(:func:`host_words`), padding kept, so a compiled program can take numpy
64-bit ids split before it runs; :func:`split_on_host` says which ids must
be; :func:`raw_words` turns any raw ids (Words, host words, numpy or JAX
integers) into the ``(hi, lo, padding)`` the id map reads; :func:`row_ids`
narrows ids or words to the int32 row ids a read takes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradtx._sparse_rows import MAX_ROWS, narrow_ids

_U32 = np.uint32


class Words(NamedTuple):
  """64-bit raw ids as two uint32 words, for JAX without ``jax_enable_x64``:
  ``id = hi * 2**32 + lo``. Every value is an id (mark padding with a
  weight 0, or a :class:`gradtx.Jagged`'s lengths).

  A jitted step receives a numpy ``int64`` or ``uint64`` argument as a
  32-bit array (JAX narrows it before the step's code runs), so split
  64-bit ids on the host, in the data pipeline: ``Words.of(ids)``.

  Attributes:
    hi: uint32 high words, any shape.
    lo: uint32 low words, the shape of ``hi``.

  Examples:
    >>> import numpy as np
    >>> import gradtx as gtx
    >>> w = gtx.Words.of(np.array([2**40 + 7, 2**64 - 1], np.uint64))
    >>> w.hi
    array([       256, 4294967295], dtype=uint32)
    >>> w.lo
    array([         7, 4294967295], dtype=uint32)
  """

  hi: Any
  lo: Any

  @classmethod
  def of(cls, ids: Any) -> Words:
    """Integer ids (numpy, any integer dtype: ``int64``, ``uint64``, ...)
    as Words, split on the host: the same rows as the ids themselves
    under ``jax_enable_x64``. A negative id is refused: Words has no
    padding value."""
    hi, lo, pad = host_words(ids, "gradtx.Words.of `ids`")
    if pad.any():
      raise ValueError(
        "gradtx.Words.of `ids` has negative ids, and every value of a "
        "gradtx.Words is an id: mark padding with a weight 0 (`weights=` of "
        "a [B, L] feature, `gtx.Jagged(..., weights=)`) and give it any "
        "non-negative id."
      )
    return cls(hi, lo)


class HostWords(NamedTuple):
  """Raw ids split into words on the host (:func:`host_words`): uint32
  ``hi`` and ``lo`` and bool ``pad`` (a negative value of a signed type),
  one shape. Unlike :class:`Words` it keeps the padding of signed ids, so
  a compiled program can take numpy 64-bit ids split before it runs."""

  hi: Any
  lo: Any
  pad: Any


def host_words(x: Any, what: str) -> HostWords:
  """Integer ids on the host -> numpy words: the uint32 words of each id
  as a 64-bit integer (two's complement) and where it is padding."""
  a = np.asarray(x)
  if not np.issubdtype(a.dtype, np.integer):
    raise TypeError(_not_int(what, a.dtype))
  v = a.astype(np.int64).view(np.uint64) if a.dtype.kind == "i" else a
  v = v.astype(np.uint64)
  pad = a < 0 if a.dtype.kind == "i" else np.zeros(a.shape, bool)
  hi = (v >> np.uint64(32)).astype(np.uint32)
  return HostWords(hi, v.astype(np.uint32), pad)


def _not_int(what: str, dtype: Any) -> str:
  return (
    f"gradtx: {what} has ids of dtype {dtype}; raw ids of a hashed table "
    "are integers (int32, uint32, int64 or uint64) or gradtx.Words."
  )


def split_on_host(dtype: Any) -> bool:
  """Whether ids of ``dtype`` are 64-bit integers that JAX, with
  ``jax_enable_x64`` off, cannot hold: a host (numpy) array of them is
  split into words on the host (:func:`raw_words`), and ``jax.jit`` would
  narrow it."""
  dtype = np.dtype(dtype)
  wide = np.issubdtype(dtype, np.integer) and dtype.itemsize == 8
  return wide and not jax.config.jax_enable_x64


def raw_words(x: Any, what: str) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Raw ids -> ``(hi, lo, padding)``: uint32 words of the 64-bit id and
  where it is padding (a negative value of a signed type; every value of
  an unsigned type or of :class:`Words` is an id).

  64-bit ids while ``jax_enable_x64`` is off: a host array (numpy) is
  split on the host, exactly; a traced one cannot be, and is refused."""
  if isinstance(x, Words):
    hi, lo = jnp.asarray(x.hi), jnp.asarray(x.lo)
    if hi.shape != lo.shape or any(v.dtype != jnp.uint32 for v in (hi, lo)):
      raise TypeError(
        f"gradtx.Words for {what}: `hi` and `lo` must be uint32 arrays of one "
        f"shape; got {hi.dtype}{list(hi.shape)} and {lo.dtype}{list(lo.shape)}."
      )
    return hi, lo, jnp.zeros(hi.shape, bool)
  if not isinstance(x, HostWords):
    dtype = np.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype)
    if split_on_host(dtype):
      if isinstance(x, jax.core.Tracer):
        raise TypeError(
          f"gradtx: {what} has traced 64-bit ids while jax_enable_x64 is "
          "off, which JAX cannot hold: pass them as gradtx.Words (`gtx."
          "Words.of(ids)` on the host), or turn jax_enable_x64 on."
        )
      x = host_words(x, what)
  if isinstance(x, HostWords):  # split on the host, here or before a program
    return tuple(jnp.asarray(v) for v in x)
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(_not_int(what, x.dtype))
  if x.dtype.itemsize == 8:
    lo = (x & 0xFFFFFFFF).astype(jnp.uint32)
    hi = ((x >> 32) & 0xFFFFFFFF).astype(jnp.uint32)
    signed = jnp.issubdtype(x.dtype, jnp.signedinteger)
    return hi, lo, (x < 0) if signed else jnp.zeros(x.shape, bool)
  signed = jnp.issubdtype(x.dtype, jnp.signedinteger)
  wide = x.astype(jnp.int32 if signed else jnp.uint32)
  lo = lax.bitcast_convert_type(wide, jnp.uint32) if signed else wide
  if signed:  # sign-extended, so int32 -> int64 keeps an id's value
    hi = jnp.where(wide < 0, _U32(0xFFFFFFFF), _U32(0))
    return hi, lo, wide < 0
  return jnp.zeros_like(lo), lo, jnp.zeros(lo.shape, bool)


def row_ids(x: Any, what: str) -> jax.Array:
  """Row ids as int32: integer ids by :func:`narrow_ids` (an id no int32
  holds is out of range), or words (a keyed input's 64-bit ids,
  :class:`Words` or :class:`HostWords`): a negative id of a signed type is
  -1 (padding), an id past int32 ``MAX_ROWS`` (out of every table's
  range). ``what`` names the ids in errors."""
  if not isinstance(x, (Words, HostWords)):
    return narrow_ids(x, MAX_ROWS, what)
  hi, lo, pad = raw_words(x, what)
  fits = (hi == 0) & (lo <= np.uint32(MAX_ROWS))
  rows = jnp.where(fits, lax.bitcast_convert_type(lo, jnp.int32), MAX_ROWS)
  return jnp.where(pad, -1, rows)
