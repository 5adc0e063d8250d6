"""Stochastic rounding, per-row keys and row-aligned int8 quantization
(gradtx._precision), against numpy / ml_dtypes references."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradtx as gtx
from gradtx._precision import (
  dequantize_rows,
  num_blocks,
  quantize_rows,
  row_keys,
  stochastic_round,
)

DTYPES = [ml_dtypes.bfloat16, np.float16]
F16_TINY = 2.0**-24  # smallest float16 subnormal
F16_NORMAL = 2.0**-14  # smallest float16 normal


def _neighbours(x, dtype):
  """The representable values of ``dtype`` just below and above float32
  ``x`` (equal when ``x`` is representable), from ml_dtypes / numpy."""
  near = x.astype(dtype)
  up_dir = np.full_like(near, np.inf)
  down_dir = np.full_like(near, -np.inf)
  exact = near.astype(np.float32) == x
  below = near.astype(np.float32) < x
  down = np.where(exact | below, near, np.nextafter(near, down_dir))
  up = np.where(exact | ~below, near, np.nextafter(near, up_dir))
  return down.astype(np.float32), up.astype(np.float32)


def _sample_values(dtype, size=4000):
  """float32 values over the dtype's range, both signs, mostly not
  representable: random mantissas at random exponents."""
  rng = np.random.default_rng(0)
  max_exp = 15 if dtype == np.float16 else 127
  min_exp = -26 if dtype == np.float16 else -133  # into the subnormals
  exps = rng.integers(min_exp, max_exp, size)
  mant = rng.uniform(1.0, 2.0, size)
  sign = rng.choice([-1.0, 1.0], size)
  x = (sign * mant * np.exp2(exps.astype(np.float64))).astype(np.float32)
  return x[np.abs(x) <= float(ml_dtypes.finfo(dtype).max)]


def _round(x, dtype, seed=0):
  return np.asarray(
    stochastic_round(jnp.asarray(x), dtype, jax.random.key(seed))
  )


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_round_gives_a_neighbour(dtype):
  x = _sample_values(dtype)
  if dtype == np.float16:  # plenty of subnormals too
    x = np.concatenate([x, np.linspace(-F16_NORMAL, F16_NORMAL, 999)])
    x = x.astype(np.float32)
  y = _round(x, dtype)
  assert y.dtype == dtype and y.shape == x.shape
  down, up = _neighbours(x, dtype)
  y32 = y.astype(np.float32)
  assert np.all((y32 == down) | (y32 == up))
  # Both neighbours occur: the rounding is not a disguised nearest cast.
  strict = down != up
  assert 0.2 < np.mean(y32[strict] == up[strict]) < 0.8
  nonzero = y32 != 0
  assert np.all(np.signbit(y32[nonzero]) == np.signbit(x[nonzero]))


def test_stochastic_round_keeps_the_sign_of_zero():
  x = np.array([-1e-30, -1e-9, 1e-30, 1e-9], np.float32)
  for dtype in DTYPES:
    y = _round(np.repeat(x, 50), dtype).astype(np.float32)
    zeros = y == 0
    assert np.all(np.signbit(y[zeros]) == np.signbit(np.repeat(x, 50)[zeros]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_round_keeps_representable_values(dtype):
  # Every finite bit pattern of the 16-bit dtype, subnormals and -0 included.
  patterns = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
  values = patterns.view(dtype)
  values = values[np.isfinite(values.astype(np.float32))]
  x = values.astype(np.float32)
  y = _round(x, dtype)
  np.testing.assert_array_equal(y.view(np.uint16), values.view(np.uint16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_round_non_finite_and_overflow(dtype):
  big = float(ml_dtypes.finfo(dtype).max)
  f32_max = float(np.finfo(np.float32).max)
  x = np.array(
    [np.nan, -np.nan, np.inf, -np.inf, f32_max, -f32_max, big, -big],
    np.float32,
  )
  if dtype == np.float16:  # both sides of max + half an ulp (65520)
    x = np.concatenate([x, [65510.0, -65519.0, 65520.0, 1e6]]).astype(
      np.float32
    )
  y = _round(np.repeat(x, 20), dtype).reshape(x.size, 20)
  assert np.all(np.isnan(y[:2].astype(np.float32)))
  # Beyond the finite range (and at its ends) it is the nearest cast.
  with np.errstate(over="ignore"):  # numpy warns where the cast gives inf
    nearest = x[2:, None].astype(dtype)
  expected = np.broadcast_to(nearest, y[2:].shape)
  np.testing.assert_array_equal(y[2:].view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_round_is_deterministic_per_key(dtype):
  x = _sample_values(dtype, size=500)
  a = _round(x, dtype, seed=1)
  b = _round(x, dtype, seed=1)
  c = _round(x, dtype, seed=2)
  np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))
  assert np.any(a.view(np.uint16) != c.view(np.uint16))


def test_stochastic_round_accepts_legacy_keys_and_jit_vmap():
  x = jnp.asarray(_sample_values(np.float16, size=64))
  legacy = jax.random.PRNGKey(3)
  a = stochastic_round(x, jnp.float16, legacy)
  b = jax.jit(stochastic_round, static_argnums=1)(x, jnp.float16, legacy)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  keys = jax.random.split(jax.random.key(0), 4)
  rows = x.reshape(4, 16)
  by_row = jax.vmap(lambda r, k: stochastic_round(r, jnp.bfloat16, k))
  out = jax.jit(by_row)(rows, keys)
  for i in range(4):
    one = stochastic_round(rows[i], jnp.bfloat16, keys[i])
    np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(one))


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_round_empty_and_scalar(dtype):
  empty = stochastic_round(jnp.zeros((0, 3)), dtype, jax.random.key(0))
  assert empty.shape == (0, 3) and empty.dtype == dtype
  scalar = stochastic_round(jnp.float32(0.5), dtype, jax.random.key(0))
  assert scalar.shape == () and float(scalar) == 0.5


# (lower neighbour, fraction of the gap above it) for each dtype: normal,
# negative, tiny and, for float16, subnormal values.
UNBIASED_CASES = {
  ml_dtypes.bfloat16: [
    (1.0, 0.1),
    (1.0, 0.3),
    (-3.0, 0.75),  # lower neighbour -3: x is just above it, towards 0
    (2.0**100, 0.5),
    (2.0**-130, 0.9),  # bfloat16 (and float32) subnormal
  ],
  np.float16: [
    (1.0, 0.1),
    (-1024.0, 0.3),
    (5 * F16_TINY, 0.75),  # subnormal
    (-7 * F16_TINY, 0.2),  # negative subnormal
    (0.0, 0.4),  # between 0 and the smallest subnormal
  ],
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_stochastic_round_is_unbiased(dtype):
  # Each draw is lo + gap * B with B ~ Bernoulli(p), p = (x - lo) / gap, so
  # its error against x has mean 0 when the rounding is unbiased and variance
  # gap**2 * p * (1 - p) <= gap**2 / 4. The mean error of N independent draws
  # therefore has standard error at most gap / (2 sqrt(N)); we allow 5 of
  # them (a false alarm has probability below 1e-6, and the seed is fixed
  # anyway). Rounding to nearest would be off by min(p, 1 - p) * gap, far
  # more than the tolerance, so the test can tell the two apart.
  n = 100_000
  cases = UNBIASED_CASES[dtype]
  lo = np.array([c[0] for c in cases], np.float32).astype(dtype)
  hi = np.nextafter(lo, np.full_like(lo, np.inf))
  lo64 = lo.astype(np.float64)
  gap = hi.astype(np.float64) - lo64
  frac = np.array([c[1] for c in cases])
  x = (lo64 + frac * gap).astype(np.float32)
  assert np.all((x > lo64) & (x < hi.astype(np.float64)))
  y = _round(np.repeat(x, n), dtype, seed=7).reshape(len(cases), n)
  error = y.astype(np.float64).mean(axis=1) - x.astype(np.float64)
  tolerance = 5 * gap / (2 * np.sqrt(n))
  assert np.all(tolerance < np.minimum(frac, 1 - frac) * gap)
  assert np.all(np.abs(error) <= tolerance), (error / gap, tolerance / gap)


def test_stochastic_round_bad_arguments():
  key = jax.random.key(0)
  x = jnp.ones(3)
  with pytest.raises(TypeError, match="`x` must be float32"):
    stochastic_round(np.ones(3), jnp.bfloat16, key)  # float64
  with pytest.raises(TypeError, match="`x` must be float32"):
    stochastic_round(jnp.ones(3, jnp.bfloat16), jnp.bfloat16, key)
  with pytest.raises(TypeError, match="`dtype` must be jnp.bfloat16"):
    stochastic_round(x, jnp.int8, key)
  with pytest.raises(TypeError, match="`dtype` must be jnp.bfloat16"):
    stochastic_round(x, "not a dtype", key)
  with pytest.raises(TypeError, match="`key` must be a JAX PRNG key"):
    stochastic_round(x, jnp.float16, 0)
  with pytest.raises(TypeError, match="`key` must be a JAX PRNG key"):
    stochastic_round(x, jnp.float16, jnp.zeros(3, jnp.uint32))
  with pytest.raises(ValueError, match="single PRNG key"):
    stochastic_round(x, jnp.float16, jax.random.split(key, 2))


@pytest.mark.parametrize("legacy", [False, True])
def test_row_keys_do_not_depend_on_the_batch(legacy):
  key = jax.random.PRNGKey(5) if legacy else jax.random.key(5)
  data = jax.random.key_data if not legacy else np.asarray

  def as_bits(keys):
    return np.asarray(data(keys))

  a = as_bits(row_keys(key, jnp.array([4, 9, 1, 7], jnp.int32)))
  b = as_bits(row_keys(key, jnp.array([7, 4], jnp.int32)))
  np.testing.assert_array_equal(a[0], b[1])
  np.testing.assert_array_equal(a[3], b[0])
  # Same as folding the id in directly, row by row.
  np.testing.assert_array_equal(a[1], as_bits(jax.random.fold_in(key, 9)))
  assert len({tuple(np.ravel(k)) for k in a}) == 4
  assert as_bits(row_keys(key, jnp.zeros((0,), jnp.int32))).shape[0] == 0
  jitted = jax.jit(row_keys)(key, jnp.array([7, 4], jnp.int32))
  np.testing.assert_array_equal(as_bits(jitted), b)


def test_row_keys_make_rounding_independent_of_the_batch():
  key = jax.random.key(11)
  rng = np.random.default_rng(3)
  table = rng.normal(size=(6, 33)).astype(np.float32)

  def round_rows(ids):
    keys = row_keys(key, jnp.asarray(ids, jnp.int32))
    rnd = jax.vmap(lambda r, k: stochastic_round(r, jnp.float16, k))
    return np.asarray(rnd(jnp.asarray(table[ids]), keys))

  whole = round_rows(np.arange(6))
  part = round_rows(np.array([5, 2]))
  np.testing.assert_array_equal(
    part[0].view(np.uint16), whole[5].view(np.uint16)
  )
  np.testing.assert_array_equal(
    part[1].view(np.uint16), whole[2].view(np.uint16)
  )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_does_not_depend_on_sharding(dtype):
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  rng = np.random.default_rng(6)
  table = jnp.asarray(rng.normal(size=(16, 12)).astype(np.float32))
  ids = jnp.arange(16, dtype=jnp.int32)

  def round_rows(rows, ids):
    keys = row_keys(jax.random.key(4), ids)
    return jax.vmap(lambda r, k: stochastic_round(r, dtype, k))(rows, keys)

  single = np.asarray(jax.jit(round_rows)(table, ids))
  put = functools.partial(jax.device_put, device=NamedSharding(mesh, P("d")))
  sharded = jax.jit(round_rows)(put(table), put(ids))
  assert len(sharded.sharding.device_set) == 8
  np.testing.assert_array_equal(
    np.asarray(sharded).view(np.uint16), single.view(np.uint16)
  )
  # The whole table in one call, with one key, is sharding-invariant too.
  whole = functools.partial(
    stochastic_round, dtype=dtype, key=jax.random.key(9)
  )
  np.testing.assert_array_equal(
    np.asarray(jax.jit(whole)(put(table))).view(np.uint16),
    np.asarray(whole(table)).view(np.uint16),
  )


def test_row_keys_bad_arguments():
  with pytest.raises(TypeError, match="`row_ids` must be an integer"):
    row_keys(jax.random.key(0), jnp.ones(3))
  with pytest.raises(ValueError, match="`row_ids` must be 1-D"):
    row_keys(jax.random.key(0), jnp.ones((2, 2), jnp.int32))
  with pytest.raises(TypeError, match="`key` must be a JAX PRNG key"):
    row_keys(np.zeros(2, np.int32), jnp.arange(3))


def _block_absmax(x, block_size):
  """numpy: absmax of every block of every flattened row, [n, num_blocks]."""
  row_size = int(np.prod(x.shape[1:]))
  flat = np.abs(x.reshape(x.shape[0], row_size).astype(np.float64))
  starts = range(0, row_size, block_size)
  cols = [flat[:, s : s + block_size].max(axis=1) for s in starts]
  return np.stack(cols, axis=1) if cols else np.zeros((x.shape[0], 0))


def _check_round_trip(x, block_size):
  codes, scales = quantize_rows(jnp.asarray(x), block_size)
  n = x.shape[0]
  row_size = int(np.prod(x.shape[1:]))
  nb = -(-row_size // block_size)
  assert codes.dtype == jnp.int8 and codes.shape == (n, row_size)
  assert scales.dtype == jnp.float32 and scales.shape == (n, nb)
  absmax = _block_absmax(x, block_size)
  np.testing.assert_allclose(np.asarray(scales), absmax / 127, rtol=1e-6)
  y = np.asarray(dequantize_rows(codes, scales, block_size, x.shape[1:]))
  assert y.shape == x.shape and y.dtype == np.float32
  # |x - deq(q(x))| <= absmax / 254 per block, plus float32 rounding of the
  # division and the product (a few ulps of absmax).
  per_element = np.repeat(absmax, block_size, axis=1)[:, :row_size]
  bound = per_element / 254 + 4 * np.finfo(np.float32).eps * per_element
  err = np.abs(
    x.reshape(n, row_size).astype(np.float64) - y.reshape(n, row_size)
  )
  assert np.all(err <= bound)
  codes = np.asarray(codes).astype(np.int32)
  assert np.all(np.abs(codes) <= 127)
  # The largest element of every non-zero block gets code +-127.
  for b in range(nb):
    block = codes[:, b * block_size : (b + 1) * block_size]
    top = np.abs(block).max(axis=1) if block.size else np.zeros(n)
    np.testing.assert_array_equal(top[absmax[:, b] > 0], 127)
  return codes, np.asarray(scales), y


@pytest.mark.parametrize(
  "shape,block_size",
  [
    ((5, 64), 16),  # whole blocks
    ((4, 3, 7), 8),  # 21 per row: blocks of 8, 8 and 5
    ((3, 10), 64),  # one block, shorter than block_size
    ((2, 9), 1),
    ((0, 6), 4),  # no rows
    ((3, 0), 4),  # empty rows
  ],
)
def test_quantize_round_trip_within_the_bound(shape, block_size):
  rng = np.random.default_rng(1)
  x = (
    rng.normal(size=shape)
    * rng.lognormal(0, 3, size=shape[:1] + (1,) * (len(shape) - 1))
  ).astype(np.float32)
  _check_round_trip(x, block_size)


def test_quantize_blocks_never_cross_rows():
  rng = np.random.default_rng(2)
  x = rng.uniform(-1, 1, size=(4, 5)).astype(np.float32)  # blocks of 4 and 1
  codes, scales = quantize_rows(jnp.asarray(x), 4)
  # A huge value at the end of row 1: with blocks over the flattened array it
  # would share a block with the start of row 2.
  x2 = x.copy()
  x2[1, -1] = 1e6
  codes2, scales2 = quantize_rows(jnp.asarray(x2), 4)
  others = [0, 2, 3]
  np.testing.assert_array_equal(
    np.asarray(codes2)[others], np.asarray(codes)[others]
  )
  np.testing.assert_array_equal(
    np.asarray(scales2)[others], np.asarray(scales)[others]
  )
  # The last, one-element block of each row is scaled by that element alone.
  np.testing.assert_allclose(
    np.asarray(scales)[:, 1], np.abs(x[:, 4]) / 127, rtol=1e-6
  )
  assert float(np.asarray(scales2)[1, 1]) == pytest.approx(1e6 / 127)
  np.testing.assert_array_equal(np.asarray(codes)[:, 4], np.sign(x[:, 4]) * 127)
  _check_round_trip(x2, 4)


def test_quantize_zeros_are_exact():
  x = np.zeros((3, 10), np.float32)
  x[1, :4] = [0.5, -2.0, 0.0, 1.0]  # row 1: first block non-zero, rest zero
  codes, scales, y = _check_round_trip(x, 4)
  np.testing.assert_array_equal(scales[0], 0.0)
  np.testing.assert_array_equal(scales[1, 1:], 0.0)
  np.testing.assert_array_equal(codes[0], 0)
  assert np.all(np.isfinite(y))
  np.testing.assert_array_equal(y[0], 0.0)
  np.testing.assert_array_equal(y[1, 4:], 0.0)
  assert y[1, 2] == 0.0 and not np.signbit(y[1, 2])


def test_quantize_under_jit_and_vmap():
  rng = np.random.default_rng(4)
  x = rng.normal(size=(3, 2, 11)).astype(np.float32)
  q = jax.jit(functools.partial(quantize_rows, block_size=8))
  dq = jax.jit(dequantize_rows, static_argnums=(2, 3))
  codes, scales = q(jnp.asarray(x))
  y = np.asarray(dq(codes, scales, 8, (2, 11)))
  eager_codes, eager_scales, eager_y = _check_round_trip(x, 8)
  np.testing.assert_array_equal(np.asarray(codes), eager_codes)
  np.testing.assert_array_equal(y, eager_y)
  # vmap over a leading batch axis: each slice [2, 11] is two rows of 11.
  v_codes, v_scales = jax.vmap(q)(jnp.asarray(x))
  assert v_codes.shape == (3, 2, 11) and v_scales.shape == (3, 2, 2)
  per_slice = _block_absmax(x.reshape(6, 11), 8).reshape(3, 2, 2)
  np.testing.assert_allclose(np.asarray(v_scales), per_slice / 127, rtol=1e-6)
  empty = q(jnp.zeros((0, 5)))
  assert empty[0].shape == (0, 5) and empty[1].shape == (0, 1)


def test_dequantize_dtype_and_bfloat16_input():
  x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 12)
  codes, scales = quantize_rows(jnp.asarray(x, jnp.bfloat16), 5)
  y = dequantize_rows(codes, scales, 5, (12,), dtype=jnp.bfloat16)
  assert y.dtype == jnp.bfloat16 and y.shape == (2, 12)
  x_bf16 = x.astype(ml_dtypes.bfloat16).astype(np.float32)
  _check_round_trip(x_bf16, 5)


def test_quantize_keeps_rows_sharded():
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  put = functools.partial(jax.device_put, device=NamedSharding(mesh, P("d")))
  x = np.random.default_rng(7).normal(size=(16, 3, 10)).astype(np.float32)

  def round_trip(a):
    codes, scales = quantize_rows(a, 4)
    return codes, scales, dequantize_rows(codes, scales, 4, a.shape[1:])

  for fn in (round_trip, jax.vmap(round_trip)):
    sharded = jax.jit(fn)(put(jnp.asarray(x)))
    for out, ref in zip(sharded, fn(jnp.asarray(x)), strict=True):
      assert out.sharding.spec[0] == "d"  # blocks stay within a device's rows
      np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_num_blocks():
  assert [num_blocks(r, 4) for r in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
  assert num_blocks(7, 1) == 7 and num_blocks(7, 100) == 1
  with pytest.raises(ValueError, match="`block_size` must be >= 1"):
    num_blocks(7, 0)
  with pytest.raises(ValueError, match="`row_size` must be >= 0"):
    num_blocks(-1, 4)
  with pytest.raises(TypeError, match="`block_size` must be a Python int"):
    num_blocks(7, 4.0)


def test_quantize_bad_arguments():
  with pytest.raises(TypeError, match="`x` must be a floating-point"):
    quantize_rows(jnp.ones((2, 3), jnp.int32), 4)
  with pytest.raises(ValueError, match="leading row axis"):
    quantize_rows(jnp.float32(1.0), 4)
  with pytest.raises(TypeError, match="`block_size` must be a Python int"):
    quantize_rows(jnp.ones((2, 3)), True)
  codes, scales = quantize_rows(jnp.ones((2, 6)), 4)
  with pytest.raises(ValueError, match="`codes` must have shape"):
    dequantize_rows(codes, scales, 4, (5,))
  with pytest.raises(ValueError, match="`scales` must have shape"):
    dequantize_rows(codes, scales, 2, (6,))
  with pytest.raises(TypeError, match="`codes` must be int8"):
    dequantize_rows(codes.astype(jnp.int32), scales, 4, (6,))
  with pytest.raises(TypeError, match="`dtype` must be a floating-point"):
    dequantize_rows(codes, scales, 4, (6,), dtype=jnp.int8)


# ----------------------------------------------------------------------------
# gtx.apply_updates(..., key=): stochastic rounding of low-precision tables


def _bf16_table(rows=11, dim=3):
  return jnp.asarray(
    np.random.RandomState(9).normal(size=(rows, dim)), jnp.bfloat16
  )


def _tiny_update(ids, rows=11, dim=3, scale=1e-3):
  vals = np.random.RandomState(10).normal(size=(len(ids), dim)) * scale
  return gtx.SparseRows(jnp.asarray(ids), jnp.asarray(vals, jnp.float32), rows)


def test_apply_updates_without_a_key_rounds_to_nearest():
  p, u = _bf16_table(), _tiny_update([2, 5, 2, -1, 11])
  want = (np.asarray(p, np.float32) + np.asarray(u.to_dense())).astype(
    ml_dtypes.bfloat16
  )
  np.testing.assert_array_equal(gtx.apply_updates(p, u), want)


def test_apply_updates_with_a_key_rounds_touched_rows_stochastically():
  p, u = _bf16_table(), _tiny_update([2, 5, 2, -1, 11])
  exact = np.asarray(p, np.float32) + np.asarray(u.to_dense(), np.float32)
  lo, hi = _neighbours(exact.astype(np.float64), jnp.bfloat16)
  key = jax.random.key(1)
  got = np.asarray(gtx.apply_updates(p, u, key=key), np.float32)
  touched = np.zeros(11, bool)
  touched[[2, 5]] = True
  ok = (got == lo.astype(np.float32)) | (got == hi.astype(np.float32))
  assert ok[touched].all()
  np.testing.assert_array_equal(
    got[~touched], np.asarray(p, np.float32)[~touched]
  )
  # deterministic per key, different for another key
  np.testing.assert_array_equal(
    gtx.apply_updates(p, u, key=key), gtx.apply_updates(p, u, key=key)
  )
  assert not np.array_equal(
    gtx.apply_updates(p, u, key=jax.random.key(2)),
    got.astype(ml_dtypes.bfloat16),
  ) or np.array_equal(lo, hi)
  # float32 leaves ignore the key
  p32 = jnp.asarray(p, jnp.float32)
  np.testing.assert_array_equal(
    gtx.apply_updates(p32, u, key=key), gtx.apply_updates(p32, u)
  )


def test_apply_updates_with_a_key_is_unbiased():
  # 4,000 keys: the mean of each element must be the exact float32 sum
  # within 5 standard errors (each draw is lo or hi: SE <= gap / 2 / sqrt(N))
  p, u = _bf16_table(3, 2), _tiny_update([1], rows=3, dim=2)
  n = 4000
  keys = jax.random.split(jax.random.key(3), n)
  draws = jax.jit(jax.vmap(lambda k: gtx.apply_updates(p, u, key=k)[1]))(keys)
  mean = np.asarray(draws, np.float64).mean(0)
  exact = np.asarray(p, np.float64)[1] + np.asarray(u.values, np.float64)[0]
  lo, hi = _neighbours(exact, jnp.bfloat16)
  gap = np.asarray(hi, np.float64) - np.asarray(lo, np.float64)
  assert (np.abs(mean - exact) <= 5 * gap / 2 / np.sqrt(n)).all()
  nearest = np.asarray(exact.astype(ml_dtypes.bfloat16), np.float64)
  assert (np.abs(nearest - exact) > 5 * gap / 2 / np.sqrt(n)).any()


def test_apply_updates_rounding_does_not_depend_on_batching_or_sharding():
  p, key = _bf16_table(16, 4), jax.random.key(4)
  both = _tiny_update([3, 9], rows=16, dim=4)
  first = gtx.SparseRows(both.indices[:1], both.values[:1], 16)
  second = gtx.SparseRows(both.indices[1:], both.values[1:], 16)
  together = gtx.apply_updates(p, both, key=key)
  apart = gtx.apply_updates(
    gtx.apply_updates(p, first, key=key), second, key=key
  )
  np.testing.assert_array_equal(together, apart)
  # a dense bf16 leaf, row-sharded over the 8 devices: the same bits
  dense = jnp.asarray(np.random.RandomState(11).normal(size=(16, 4)) * 1e-3)
  dense = dense.astype(jnp.float32)
  want = gtx.apply_updates(p, dense, key=key)
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  sharded = jax.device_put(p, NamedSharding(mesh, P("d", None)))
  got = jax.jit(lambda p, u: gtx.apply_updates(p, u, key=key))(sharded, dense)
  np.testing.assert_array_equal(got, want)
