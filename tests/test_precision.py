"""Stochastic rounding and the per-row bits apply_updates rounds with
(gradtx._precision), against numpy / ml_dtypes references. 8-bit state:
tests/test_quantized_state.py."""

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
  round_with_bits,
  row_bits,
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


# Compiled once per shape and dtype (eager, each of its ops would compile);
# eager agrees: test_stochastic_round_accepts_legacy_keys_and_jit_vmap.
_stochastic_round = jax.jit(stochastic_round, static_argnums=1)


def _round(x, dtype, seed=0):
  # x goes in as numpy (jnp.asarray would compile a program per shape)
  return np.asarray(_stochastic_round(x, dtype, jax.random.key(seed)))


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
  # the inputs put from numpy, the rows sliced there (the rounding itself
  # is eager on purpose: eager against jit and vmap)
  x_np = _sample_values(np.float16, size=64)
  x = jax.device_put(x_np)
  legacy = jax.random.PRNGKey(3)
  a = stochastic_round(x, jnp.float16, legacy)
  b = jax.jit(stochastic_round, static_argnums=1)(x, jnp.float16, legacy)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  keys = jax.random.split(jax.random.key(0), 4)
  rows = jax.device_put(x_np.reshape(4, 16))
  by_row = jax.vmap(lambda r, k: stochastic_round(r, jnp.bfloat16, k))
  out = jax.jit(by_row)(rows, keys)
  for i in range(4):
    row = jax.device_put(x_np.reshape(4, 16)[i])
    one = stochastic_round(row, jnp.bfloat16, keys[i])
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
  # put from numpy (jnp.ones compiles a broadcast per shape and dtype)
  x = jax.device_put(np.ones(3, np.float32))
  bf16 = jax.device_put(np.ones(3, jnp.bfloat16))
  with pytest.raises(TypeError, match="`x` must be float32"):
    stochastic_round(np.ones(3), jnp.bfloat16, key)  # float64
  with pytest.raises(TypeError, match="`x` must be float32"):
    stochastic_round(bf16, jnp.bfloat16, key)
  with pytest.raises(TypeError, match="`dtype` must be jnp.bfloat16"):
    stochastic_round(x, jnp.int8, key)
  with pytest.raises(TypeError, match="`dtype` must be jnp.bfloat16"):
    stochastic_round(x, "not a dtype", key)
  with pytest.raises(TypeError, match="`key` must be a JAX PRNG key"):
    stochastic_round(x, jnp.float16, 0)
  with pytest.raises(TypeError, match="`key` must be a JAX PRNG key"):
    stochastic_round(x, jnp.float16, jax.device_put(np.zeros(3, np.uint32)))
  with pytest.raises(ValueError, match="single PRNG key"):
    stochastic_round(x, jnp.float16, jax.random.split(key, 2))


def _np_mix32(x):
  """numpy: the lowbias32 hash, in uint32 arithmetic (wraps mod 2**32)."""
  x = np.asarray(x, np.uint32)
  x = x ^ (x >> np.uint32(16))
  x = x * np.uint32(0x7FEB352D)
  x = x ^ (x >> np.uint32(15))
  x = x * np.uint32(0x846CA68B)
  return x ^ (x >> np.uint32(16))


def _np_row_bits(key, ids, row_size):
  seed = np.asarray(jax.random.bits(key, (2,), jnp.uint32))
  rows = _np_mix32(np.asarray(ids).astype(np.uint32) ^ seed[0])
  cols = np.arange(row_size, dtype=np.uint32) * np.uint32(0x9E3779B9)
  return _np_mix32(rows[:, None] + cols[None, :] + seed[1])


@pytest.mark.parametrize("legacy", [False, True])
def test_row_bits_match_numpy_and_do_not_depend_on_the_batch(legacy):
  key = jax.random.PRNGKey(5) if legacy else jax.random.key(5)
  with np.errstate(over="ignore"):
    want = _np_row_bits(key, [4, 9, 1, 7], 6)

  @jax.jit
  def batches(key, ids, ids_b, empty, one):
    """Every batch but the eager one, in one program."""
    return (
      row_bits(key, ids, 6),
      row_bits(key, ids_b, 6),
      row_bits(key, empty, 6),
      row_bits(jax.random.fold_in(key, 1), one, 6),
    )

  ids_b = np.array([7, 4], np.int32)
  a, jitted, empty, other = jax.device_get(
    batches(
      key,
      np.array([4, 9, 1, 7], np.int32),
      ids_b,
      np.zeros((0,), np.int32),
      np.array([4], np.int32),
    )
  )
  np.testing.assert_array_equal(a, want)
  # eager (the same batch under jit is checked against it)
  b = np.asarray(row_bits(key, jax.device_put(ids_b), 6))
  np.testing.assert_array_equal(a[0], b[1])
  np.testing.assert_array_equal(a[3], b[0])
  assert empty.shape == (0, 6)
  np.testing.assert_array_equal(np.asarray(jitted), b)
  assert not np.array_equal(other[0], a[0])


def test_row_bits_are_uniform():
  """Every bit is a fair coin and the low 16 bits (bf16's rounding draw)
  are uniform: chi-square over 256 bins of their top byte, and the rows of
  consecutive ids are uncorrelated."""
  bits = np.asarray(
    jax.jit(row_bits, static_argnums=2)(
      jax.random.key(3), np.arange(4096, dtype=np.int32), 64
    )
  )
  n = bits.size
  ones = np.array([((bits >> np.uint32(k)) & 1).mean() for k in range(32)])
  # 5 standard deviations of a fair coin's mean over n draws
  assert np.all(np.abs(ones - 0.5) < 5 * 0.5 / np.sqrt(n))
  low = ((bits & np.uint32(0xFFFF)) >> np.uint32(8)).ravel()
  counts = np.bincount(low, minlength=256)
  chi2 = ((counts - n / 256) ** 2 / (n / 256)).sum()
  assert chi2 < 255 + 6 * np.sqrt(2 * 255)  # mean 255, sd sqrt(510)
  u = bits.astype(np.float64) / 2.0**32
  corr = np.corrcoef(u[:-1].ravel(), u[1:].ravel())[0, 1]
  assert abs(corr) < 5 / np.sqrt(u[1:].size)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rounding_does_not_depend_on_sharding(dtype):
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  rng = np.random.default_rng(6)
  # put from numpy (jnp.asarray, jnp.arange compile a program per shape)
  table = jax.device_put(rng.normal(size=(16, 12)).astype(np.float32))
  ids = jax.device_put(np.arange(16, dtype=np.int32))

  def round_rows(rows, ids):
    return round_with_bits(rows, dtype, row_bits(jax.random.key(4), ids, 12))

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


def test_row_bits_bad_arguments():
  # put from numpy (jnp.ones, jnp.arange compile a program per shape)
  put = jax.device_put
  with pytest.raises(TypeError, match="row ids .* must be an integer"):
    row_bits(jax.random.key(0), put(np.ones(3, np.float32)), 2)
  with pytest.raises(ValueError, match="row ids .* must be 1-D"):
    row_bits(jax.random.key(0), put(np.ones((2, 2), np.int32)), 2)
  with pytest.raises(TypeError, match="`key` must be a JAX PRNG key"):
    row_bits(np.zeros(2, np.int32), put(np.arange(3, dtype=np.int32)), 2)
  p = put(np.ones((3, 2), jnp.bfloat16))
  u = put(np.ones((3, 2), np.float32))
  with pytest.raises(TypeError, match=r"^gradtx\.apply_updates `key` must"):
    gtx.apply_updates(p, u, key=np.zeros(2, np.int32))


def _bf16_table(rows=11, dim=3):
  # cast and put by numpy (jnp.asarray(x, bfloat16) compiles a convert per
  # shape; numpy rounds float64 to bfloat16 the same way)
  rng = np.random.RandomState(9)
  return jax.device_put(rng.normal(size=(rows, dim)).astype(jnp.bfloat16))


def _tiny_update(ids, rows=11, dim=3, scale=1e-3):
  vals = np.random.RandomState(10).normal(size=(len(ids), dim)) * scale
  ids, vals = np.asarray(ids, np.int32), vals.astype(np.float32)
  return gtx.SparseRows(*jax.device_put((ids, vals)), rows)


def _np_dense(u):
  """numpy: ``u.to_dense()`` (float32; duplicates are pairs, so the sum's
  order does not matter)."""
  idx, vals = np.asarray(u.indices), np.asarray(u.values)
  out = np.zeros((u.num_rows, *vals.shape[1:]), vals.dtype)
  keep = (idx >= 0) & (idx < u.num_rows)
  np.add.at(out, idx[keep], vals[keep])
  return out


def test_apply_updates_without_a_key_rounds_to_nearest():
  p, u = _bf16_table(), _tiny_update([2, 5, 2, -1, 11])
  want = (np.asarray(p, np.float32) + _np_dense(u)).astype(ml_dtypes.bfloat16)
  np.testing.assert_array_equal(jax.jit(gtx.apply_updates)(p, u), want)


def test_apply_updates_with_a_key_rounds_touched_rows_stochastically():
  p, u = _bf16_table(), _tiny_update([2, 5, 2, -1, 11])
  exact = np.asarray(p, np.float32) + _np_dense(u)
  lo, hi = _neighbours(exact.astype(np.float64), jnp.bfloat16)
  key = jax.random.key(1)

  @jax.jit
  def run(p, u, key, other_key):
    """The key's, another key's and the float32 leaves' updates."""
    p32 = p.astype(jnp.float32)
    return (
      gtx.apply_updates(p, u, key=key),
      gtx.apply_updates(p, u, key=other_key),
      gtx.apply_updates(p32, u, key=key),
      gtx.apply_updates(p32, u),
    )

  out, other, p32_key, p32_no_key = run(p, u, key, jax.random.key(2))
  got = np.asarray(out, np.float32)
  touched = np.zeros(11, bool)
  touched[[2, 5]] = True
  ok = (got == lo.astype(np.float32)) | (got == hi.astype(np.float32))
  assert ok[touched].all()
  np.testing.assert_array_equal(
    got[~touched], np.asarray(p, np.float32)[~touched]
  )
  # deterministic per key (a second run), different for another key
  np.testing.assert_array_equal(run(p, u, key, jax.random.key(2))[0], out)
  assert not np.array_equal(
    other, got.astype(ml_dtypes.bfloat16)
  ) or np.array_equal(lo, hi)
  # float32 leaves ignore the key
  np.testing.assert_array_equal(p32_key, p32_no_key)


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
  # the halves sliced in numpy
  idx, vals = np.asarray(both.indices), np.asarray(both.values)
  first = gtx.SparseRows(*jax.device_put((idx[:1], vals[:1])), 16)
  second = gtx.SparseRows(*jax.device_put((idx[1:], vals[1:])), 16)
  dense = np.random.RandomState(11).normal(size=(16, 4)) * 1e-3
  dense = jax.device_put(dense.astype(np.float32))

  @jax.jit
  def unsharded(p, both, first, second, dense):
    """Both rows at once, one after the other, and the dense leaf."""
    together = gtx.apply_updates(p, both, key=key)
    apart = gtx.apply_updates(
      gtx.apply_updates(p, first, key=key), second, key=key
    )
    return together, apart, gtx.apply_updates(p, dense, key=key)

  together, apart, want = unsharded(p, both, first, second, dense)
  np.testing.assert_array_equal(together, apart)
  # a dense bf16 leaf, row-sharded over the 8 devices: the same bits
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  sharded = jax.device_put(p, NamedSharding(mesh, P("d", None)))
  got = jax.jit(lambda p, u: gtx.apply_updates(p, u, key=key))(sharded, dense)
  np.testing.assert_array_equal(got, want)
