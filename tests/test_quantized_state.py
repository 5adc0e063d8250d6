"""8-bit optimizer state ("int8" state dtypes, QuantizedRows), against numpy.

The code is checked against a numpy code book (every representable value,
nearest chosen by search, not by bit tricks); the optimizers with quantized
state against numpy re-implementations of their published formulas that
dequantize, update in float64 and requantize with that code book. In place,
drop_stale, Mirrored and row-sharded tables with 8-bit state: the
conformance suite's int8 cases (tests/conformance.py); orbax resume:
tests/test_checkpoint.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conformance import (
  SHAPES,
  SPARSE,
  make_grads,
  make_params,
  step_fn,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradtx as gtx
from gradtx._precision import dequantize_rows, num_blocks, quantize_rows

INT8_ADAM = dict(mu_dtype="int8", nu_dtype="int8")

# Compiled once per shape (eager, every op of the code compiles for each new
# shape); eager agrees with jit: test_quantize_under_jit_vmap_and_sharding.
_quantize = jax.jit(quantize_rows, static_argnums=1, static_argnames="signed")
_dequantize = jax.jit(dequantize_rows, static_argnums=1)


@functools.partial(
  jax.jit, static_argnums=1, static_argnames=("signed", "dtype")
)
def _round_trip(x, block_size, signed=True, dtype=jnp.float32):
  """``_quantize`` and ``_dequantize`` of it, in one program."""
  q = quantize_rows(x, block_size, signed=signed)
  return q, dequantize_rows(q, dtype)


# ----------------------------------------------------------------------------
# The code, against a numpy code book


def _magnitudes(signed):
  """Every non-negative value of the code, by code (0 first), float64."""
  lowest, count = (15, 127) if signed else (31, 255)
  k = np.arange(count)
  return np.concatenate([[0.0], 2.0 ** ((k >> 3) - lowest) * (1 + (k & 7) / 8)])


def _np_quantize(x, block_size, signed, scales_like=None):
  """numpy: codes and scales of ``x`` [n, *row] (see QuantizedRows). With
  ``scales_like``, codes are computed with those float32 scales when they
  are within an ulp of numpy's (XLA may divide by 1.75 as a product)."""
  x = np.asarray(x, np.float32)
  n = x.shape[0]
  row = int(np.prod(x.shape[1:]))
  nb = -(-row // block_size)
  length = -(-row // nb) if nb else 0
  flat = x.reshape(n, row)
  if not signed:
    flat = np.maximum(flat, 0)
  codes = np.zeros((n, row), np.int64)
  scales = np.zeros((n, nb), np.float32)
  mags = _magnitudes(signed)
  for b in range(nb):
    block = flat[:, b * length : (b + 1) * length]
    scale = np.abs(block).max(axis=1) / np.float32(1.75)
    if scales_like is not None:
      theirs = np.asarray(scales_like, np.float32)[:, b]
      np.testing.assert_allclose(theirs, scale, rtol=2.5e-7)
      scale = theirs
    scales[:, b] = scale
    safe = np.where(scale > 0, scale, np.float32(1))[:, None]
    a = (np.abs(block) / safe).astype(np.float64)  # float32 division
    # nearest magnitude, ties to the larger one; a non-zero one is never 0
    dist = np.abs(a[..., None] - mags)
    dist[..., 0] = np.where(a > 0, np.inf, dist[..., 0])
    code = mags.size - 1 - np.argmin(dist[..., ::-1], axis=-1)
    codes[:, b * length : (b + 1) * length] = np.where(block < 0, -code, code)
  return codes.reshape(x.shape), scales


def _np_dequantize(codes, scales):
  codes = np.asarray(codes).astype(np.int64)
  n = codes.shape[0]
  row = int(np.prod(codes.shape[1:]))
  nb = scales.shape[1]
  length = -(-row // nb) if nb else 0
  mags = _magnitudes(bool(codes.dtype == np.int8) or np.any(codes < 0))
  flat = codes.reshape(n, row)
  values = np.sign(flat) * mags[np.abs(flat)]
  per_element = np.repeat(np.asarray(scales, np.float64), length, axis=1)
  return (values * per_element[:, :row]).reshape(codes.shape)


def _data(shape, seed):
  rng = np.random.default_rng(seed)
  scale = rng.lognormal(0, 3, size=shape[:1] + (1,) * (len(shape) - 1))
  return (rng.normal(size=shape) * scale).astype(np.float32)


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize(
  "shape,block_size",
  [
    ((5, 64), 16),  # whole blocks
    ((4, 3, 7), 8),  # 21 per row: blocks of 7, 7 and 7
    ((3, 100), 64),  # two blocks of 50, not 64 and 36
    ((3, 10), 64),  # one block, shorter than block_size
    ((2, 9), 1),
    ((0, 6), 4),  # no rows
  ],
)
def test_codes_equal_the_numpy_code_book(shape, block_size, signed):
  x = _data(shape, 1)
  q, y = _round_trip(x, block_size, signed=signed)
  want_codes, want_scales = _np_quantize(x, block_size, signed, q.scales)
  assert q.codes.dtype == (jnp.int8 if signed else jnp.uint8)
  assert q.codes.shape == shape and q.shape == shape
  nb = num_blocks(math.prod(shape[1:]), block_size)
  assert q.scales.dtype == jnp.float32 and q.scales.shape == (shape[0], nb)
  np.testing.assert_array_equal(np.asarray(q.codes), want_codes)
  np.testing.assert_array_equal(np.asarray(q.scales), want_scales)
  y = np.asarray(y)
  np.testing.assert_allclose(
    y, _np_dequantize(want_codes, want_scales), rtol=1e-6
  )
  assert y.dtype == np.float32


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_round_trip_error_bound(signed):
  x = _data((64, 48), 2)
  x[::3, 5] *= 1e-12  # below the lowest binade of any code
  if not signed:
    x = np.abs(x)
  q, y = _round_trip(x, 16, signed=signed)
  y = np.asarray(y, np.float64)
  x64 = x.astype(np.float64)
  lowest = 2.0 ** -(15 if signed else 31)
  scale = np.repeat(np.asarray(q.scales, np.float64), 16, axis=1)
  in_range = np.abs(x64) >= lowest * scale
  assert in_range.mean() > 0.9 and (~in_range).any()
  # Half the gap between neighbours: at most 1/16 of the value (float32
  # rounding of the scale adds a few ulps).
  bound = np.abs(x64) / 16 * (1 + 1e-6)
  assert np.all(np.abs(y - x64)[in_range] <= bound[in_range])
  # Below the lowest binade: the smallest code, never zero, same sign.
  small = (~in_range) & (x64 != 0)
  np.testing.assert_allclose(np.abs(y[small]), lowest * scale[small], rtol=1e-6)
  assert np.all(np.sign(y[small]) == np.sign(x64[small]))
  # A block's largest element is exact up to the scale's rounding.
  top = np.abs(x64).reshape(64, 3, 16).max(axis=2)
  np.testing.assert_allclose(
    np.abs(y).reshape(64, 3, 16).max(axis=2), top, rtol=1e-6
  )


def test_zeros_and_signed_zeros_are_exact():
  x = np.zeros((3, 10), np.float32)
  x[1, :4] = [0.5, -2.0, 0.0, 1.0]
  x[2, 5] = -0.0
  for signed in (True, False):
    q, y = _round_trip(x, 4, signed=signed)
    y = np.asarray(y)
    np.testing.assert_array_equal(np.asarray(q.scales)[0], 0.0)
    np.testing.assert_array_equal(y[0], 0.0)
    np.testing.assert_array_equal(y[1, 4:], 0.0)
    np.testing.assert_array_equal(y[2], 0.0)
    assert np.all(np.isfinite(y))
  # unsigned codes store negative values as 0
  y = np.asarray(_round_trip(x, 4, signed=False)[1])
  np.testing.assert_array_equal(y[1, :4], [0.5, 0.0, 0.0, 1.0])


def test_blocks_never_cross_rows():
  x = _data((4, 5), 3)
  q = _quantize(x, 4)  # blocks of 3 and 2 (balanced)
  assert q.block_size == 3
  x2 = x.copy()
  x2[1, -1] = 1e6  # with blocks over the flat array, shares row 2's block
  q2 = _quantize(x2, 4)
  others = [0, 2, 3]
  np.testing.assert_array_equal(
    np.asarray(q2.codes)[others], np.asarray(q.codes)[others]
  )
  np.testing.assert_array_equal(
    np.asarray(q2.scales)[others], np.asarray(q.scales)[others]
  )
  assert float(np.asarray(q2.scales)[1, 1]) == pytest.approx(1e6 / 1.75)


def test_quantize_under_jit_vmap_and_sharding():
  x = _data((16, 3, 10), 4)
  q = jax.jit(functools.partial(quantize_rows, block_size=8))
  eager = quantize_rows(jnp.asarray(x), 8)
  jitted = q(jnp.asarray(x))
  jax.tree.map(np.testing.assert_array_equal, jitted, eager)
  np.testing.assert_array_equal(
    jax.jit(dequantize_rows)(jitted), eager.dequantize()
  )
  v = jax.vmap(q)(jnp.asarray(x))  # each slice [3, 10]: 3 rows of 10
  assert v.codes.shape == (16, 3, 10) and v.scales.shape == (16, 3, 2)
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  put = jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("d")))
  sharded = q(put)
  for out, ref in zip(sharded, eager, strict=True):
    assert out.sharding.spec[0] == "d"  # blocks stay within a device's rows
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_num_blocks_and_bfloat16_input():
  assert [num_blocks(r, 4) for r in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
  assert num_blocks(7, 1) == 7 and num_blocks(7, 100) == 1
  with pytest.raises(ValueError, match="row's size must be a Python int >= 0"):
    num_blocks(-1, 4)
  with pytest.raises(TypeError, match="`block_size` must be a Python int"):
    num_blocks(7, 4.0)
  x = np.linspace(-1, 1, 24, dtype=np.float32).reshape(2, 12)
  x16 = x.astype(jnp.bfloat16)  # numpy's cast: XLA's bits
  q, y = _round_trip(jax.device_put(x16), 5, dtype=jnp.bfloat16)
  assert y.dtype == jnp.bfloat16 and y.shape == (2, 12)
  x16 = x16.astype(np.float32)
  np.testing.assert_array_equal(
    np.asarray(q.codes), _np_quantize(x16, 5, True, q.scales)[0]
  )


def test_quantize_bad_arguments():
  # the arrays put from numpy (jnp.ones compiles a broadcast per shape)
  ones = jax.device_put(np.ones((2, 3), np.float32))
  with pytest.raises(TypeError, match="must be floating-point"):
    quantize_rows(jax.device_put(np.ones((2, 3), np.int32)), 4)
  with pytest.raises(ValueError, match="leading row axis"):
    quantize_rows(jnp.float32(1.0), 4)
  with pytest.raises(ValueError, match="`block_size` must be >= 1"):
    quantize_rows(ones, 0)
  with pytest.raises(TypeError, match="must be a QuantizedRows"):
    dequantize_rows(ones)
  q = _quantize(ones, 2)  # jitted: eagerly, each op compiles
  with pytest.raises(ValueError, match="`scales` must have shape"):
    dequantize_rows(
      q._replace(scales=jax.device_put(np.ones((2, 4), np.float32)))
    )


# ----------------------------------------------------------------------------
# Optimizers with 8-bit state, against numpy references
#
# Each step is checked from gtx's own state before it: the reference
# dequantizes it, applies the published formula in float64 and requantizes
# with the code book. Codes may differ from the reference's by one where the
# float32 and float64 values straddle a rounding boundary; the update, which
# comes from the unrounded new state, agrees to float32 precision.


def _dense(state_leaf):
  """A state leaf's values, float32 (inside a jitted program: a dequantize
  per leaf would be a program of its own)."""
  if isinstance(state_leaf, gtx.QuantizedRows):
    return dequantize_rows(state_leaf)
  return state_leaf


def _is_q(x):
  return isinstance(x, gtx.QuantizedRows)


def _check_stored(got, want, name):
  """A state leaf against the reference's new value (float64)."""
  if not isinstance(got, gtx.QuantizedRows):
    rtol = 2**-8 if got.dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(
      np.asarray(got, np.float64), want, rtol=rtol, atol=1e-7
    )
    return
  codes, scales = _np_quantize(
    want.astype(np.float32), got.block_size, got.signed
  )
  np.testing.assert_allclose(
    np.asarray(got.scales), scales, rtol=1e-5, atol=1e-30, err_msg=name
  )
  diff = np.abs(np.asarray(got.codes).astype(np.int64) - codes)
  assert diff.max() <= 1, name
  assert (diff == 0).mean() > 0.97, name


def _rows_and_sums(g):
  """(unique valid ids, summed rows) of a SparseRows, or None for dense."""
  if not isinstance(g, gtx.SparseRows):
    return None
  idx = np.asarray(g.indices)
  vals = np.asarray(g.values, np.float64)
  keep = (idx >= 0) & (idx < g.num_rows)
  ids = np.unique(idx[keep])
  sums = np.stack([vals[keep][idx[keep] == i].sum(0) for i in ids])
  return ids, sums


def _np_adam_step(g, m, v, t, b1=0.9, b2=0.999, eps=1e-8):
  m = b1 * m + (1 - b1) * g
  v = b2 * v + (1 - b2) * g * g
  u = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
  return u, m, v


def _np_adagrad_step(g, acc, eps=1e-7):
  acc = acc + g * g
  return np.where(acc > 0, g / np.sqrt(acc + eps), 0.0), acc


def _np_trace_step(g, t, decay=0.9):
  t = g + decay * t
  return t, t


def _reference_step(rule, grads, states, lr):
  """numpy: the updates and new states of a lazy rule on make_grads' tree
  (``states``: the old states' dense values, see :func:`_dense`)."""
  updates, new_states = {}, [dict() for _ in states]
  for k, g in grads.items():
    olds = [np.asarray(s[k], np.float64) for s in states]
    rows = _rows_and_sums(g)
    if rows is None:
      u, *news = rule(np.asarray(g, np.float64), *olds)
      updates[k] = -lr * u
    else:
      ids, sums = rows
      u, *news_rows = rule(sums, *[o[ids] for o in olds])
      full = np.zeros(SHAPES[k])
      full[ids] = -lr * u
      updates[k] = full
      news = [o.copy() for o in olds]
      for n, r in zip(news, news_rows, strict=True):
        n[ids] = r
    for acc, n in zip(new_states, news, strict=True):
      acc[k] = n
  return updates, new_states


QUANTIZED = [
  (
    "lazy_adam",
    lambda: gtx.lazy_adam(0.05, **INT8_ADAM),
    lambda s: [s[0].mu, s[0].nu],
    _np_adam_step,
    True,
  ),
  (
    "lazy_adam_int8_nu_only",
    lambda: gtx.lazy_adam(0.05, nu_dtype="int8"),
    lambda s: [s[0].mu, s[0].nu],
    _np_adam_step,
    True,
  ),
  (
    "adagrad",
    lambda: gtx.adagrad(0.1, accumulator_dtype="int8", block_size=2),
    lambda s: [s[0].sum_of_squares],
    _np_adagrad_step,
    False,
  ),
  (
    "lazy_sgd_momentum",
    lambda: gtx.lazy_sgd(0.1, momentum=0.9, accumulator_dtype="int8"),
    lambda s: [s[0].trace],
    _np_trace_step,
    False,
  ),
]


@pytest.mark.parametrize(
  "make_tx,states_of,rule,counted",
  [q[1:] for q in QUANTIZED],
  ids=[q[0] for q in QUANTIZED],
)
def test_matches_numpy_reference(make_tx, states_of, rule, counted):
  tx = make_tx()
  lr = 0.05 if counted else 0.1

  def dense_states(state):
    return [jax.tree.map(_dense, s, is_leaf=_is_q) for s in states_of(state)]

  @jax.jit
  def init(params):  # eagerly, every op of init compiles
    state = tx.init(params)
    return state, dense_states(state)

  @jax.jit
  def update(grads, state, params):
    u, state = tx.update(grads, state, params)
    updates = {k: u[k].to_dense() if k in SPARSE else u[k] for k in u}
    params = gtx.apply_updates(params, u)
    return updates, state, dense_states(state), params

  params = make_params()
  state, dense = init(params)
  for k in ("emb", "tab", "w"):  # tables and 2-D leaves are quantized
    assert any(isinstance(s[k], gtx.QuantizedRows) for s in states_of(state))
  assert all(
    not isinstance(s["b"], gtx.QuantizedRows) for s in states_of(state)
  )

  for step in range(4):
    grads = make_grads(step)
    step_rule = functools.partial(rule, t=step + 1) if counted else rule
    want_u, want_states = _reference_step(step_rule, grads, dense, lr)
    u, state, dense, params = update(grads, state, params)
    for k in grads:
      np.testing.assert_allclose(u[k], want_u[k], rtol=2e-5, atol=1e-7)
      for name, s, w in zip("abc", states_of(state), want_states, strict=False):
        _check_stored(s[k], w[k], f"{k} state {name}")


def test_sparse_equals_dense_on_touched_rows():
  """A SparseRows touching every row and its dense twin: one rule, one
  quantization per row, so the same bits."""
  tx = gtx.lazy_adam(0.05, **INT8_ADAM)
  params = {"emb": np.random.RandomState(0).normal(size=(16, 8))}
  params = jax.device_put(jax.tree.map(lambda x: x.astype(np.float32), params))
  state = jax.jit(tx.init)(params)  # eagerly, every op of init compiles
  sparse_p, sparse_s = params, state
  dense_p, dense_s = params, state
  step = step_fn(tx)

  @jax.jit
  def both(sparse_p, sparse_s, dense_p, dense_s, g):
    """The sparse step and the dense one (densified inside), one program."""
    return (
      step(sparse_p, sparse_s, {"emb": g}),
      step(dense_p, dense_s, {"emb": g.to_dense()}),
    )

  rng = np.random.RandomState(1)
  for _ in range(4):
    ids = rng.permutation(16).astype(np.int32)
    vals = rng.normal(size=(16, 8)).astype(np.float32)
    g = gtx.SparseRows(*jax.device_put((ids, vals)), 16)
    (sparse_p, sparse_s), (dense_p, dense_s) = both(
      sparse_p, sparse_s, dense_p, dense_s, g
    )
  np.testing.assert_allclose(sparse_p["emb"], dense_p["emb"], rtol=1e-6)
  for a, b in zip(
    jax.tree.leaves(sparse_s), jax.tree.leaves(dense_s), strict=True
  ):
    np.testing.assert_allclose(
      np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-6, atol=1
    )


def test_dense_leaves_track_optax_within_quantization_error():
  """int8 moments on a dense, ill-conditioned quadratic: the loss follows
  optax.adam's along the way within the error quantization adds (measured:
  at most 7% apart; bfloat16 moments are 18% apart at the end)."""
  rng = np.random.RandomState(2)
  target = rng.normal(size=(32, 16)).astype(np.float32)
  params = np.zeros((32, 16), np.float32)

  def loss(p):
    return jnp.sum((p - target) ** 2 * jnp.linspace(0.1, 10, 16)[None])

  # optax.adam, int8 lazy_adam and float32 lazy_adam: the three runs side
  # by side in one program (a step each, and the loss after it)
  txs = [
    optax.adam(0.01),
    gtx.lazy_adam(0.01, **INT8_ADAM),
    gtx.lazy_adam(0.01),
  ]
  start = jax.jit(lambda p: ([(p, tx.init(p)) for tx in txs], loss(p)))

  @jax.jit
  def step(carries):
    out = []
    for tx, (p, s) in zip(txs, carries, strict=True):
      u, s = tx.update(jax.grad(loss)(p), s, p)
      p = optax.apply_updates(p, u)
      out.append(((p, s), loss(p)))
    return out

  carries, loss0 = start(params)
  out = [[] for _ in txs]
  for i in range(300):
    carries, step_losses = zip(*step(carries), strict=True)
    if i % 100 == 99:
      for o, v in zip(out, step_losses, strict=True):
        o.append(float(v))
  (ref, got, f32) = map(np.array, out)
  (ref_p, _), (got_p, _), _ = carries
  assert ref[-1] < float(loss0) / 50
  np.testing.assert_allclose(got, ref, rtol=0.12)
  # float32 state is optax bit for bit; int8 is not (the test can fail)
  assert not np.array_equal(np.asarray(got_p), np.asarray(ref_p))
  np.testing.assert_array_equal(f32, ref)


def test_nonzero_second_moment_never_rounds_to_zero():
  """A tiny v next to a huge one in the same block stays positive, so the
  update stays bounded (a linear code would round it to 0: m / eps)."""
  tx = gtx.scale_by_lazy_adam(nu_dtype="int8", mu_dtype="int8")

  @jax.jit
  def first_step(params, g):  # init, update and dequantize: one program
    u, state = tx.update(g, tx.init(params))
    return u, dequantize_rows(state.nu)

  params = np.zeros((1, 4), np.float32)
  g = np.array([[1e4, 1e-4, 0.0, -1.0]], np.float32)
  u, nu = first_step(params, g)
  nu = np.asarray(nu)
  assert np.all(nu[0, [0, 1, 3]] > 0) and nu[0, 2] == 0
  assert np.all(np.abs(np.asarray(u)) <= 1.01)  # Adam's first step: sign(g)


def test_state_dtype_options_and_bytes_per_row():
  # put from numpy (jnp.zeros compiles a broadcast per shape and dtype)
  table = jax.device_put(
    {"emb": np.zeros((1000, 64), jnp.bfloat16), "b": np.zeros(3, np.float32)}
  )
  f32 = jax.device_put({"emb": np.zeros((1000, 64), np.float32)})
  rowwise = gtx.rowwise_adagrad(0.1, accumulator_dtype=jnp.bfloat16)

  @jax.jit
  def inits(table):  # eagerly, every op of the inits compiles
    return gtx.lazy_adam(1e-3, **INT8_ADAM).init(table), rowwise.init(table)

  state, rowwise_state = inits(table)
  assert gtx.bytes_per_row(gtx.lazy_adam(1e-3), f32) == {"['emb']": 768.0}
  got = gtx.bytes_per_row(gtx.lazy_adam(1e-3, **INT8_ADAM), table)
  assert got == {"['emb']": 2 * 64 + 2 * (64 + 4)}  # 264 <= 0.36 * 768
  wide = gtx.bytes_per_row(
    gtx.lazy_adam(1e-3, **INT8_ADAM, block_size=16), table
  )
  assert wide == {"['emb']": 2 * 64 + 2 * (64 + 4 * 4)}
  bf16_nu = gtx.lazy_adam(1e-3, nu_dtype=jnp.bfloat16)
  assert gtx.bytes_per_row(bf16_nu, f32) == {"['emb']": 256 + 256 + 128}
  assert state[0].mu["b"].dtype == jnp.float32  # 1-D: float32, not int8
  assert state[0].nu["emb"].codes.dtype == jnp.uint8
  assert state[0].mu["emb"].codes.dtype == jnp.int8
  assert rowwise_state[0].sum_of_squares["emb"].dtype == jnp.bfloat16
  assert gtx.bytes_per_row(rowwise, table) == {"['emb']": 128 + 2}
  # an int8 accumulator with an initial value starts at it exactly (eager:
  # under jit, XLA folds the scale's division into another rounding)
  acc = gtx.adagrad(0.1, accumulator_dtype="int8").init(f32)[0]
  np.testing.assert_array_equal(
    acc.sum_of_squares["emb"].dequantize(), np.float32(0.1)
  )


def test_bf16_rowwise_accumulator_matches_numpy():
  tx = gtx.rowwise_adagrad(0.1, accumulator_dtype=jnp.bfloat16)

  @jax.jit
  def run(params, g):  # init, update and densify: one program
    state = tx.init(params)
    u, new = tx.update(g, state, params)
    return state, {**u, "emb": u["emb"].to_dense()}, new

  params = make_params()
  g = make_grads(0)
  state, u, new = run(params, g)
  ids, sums = _rows_and_sums(g["emb"])
  acc0 = np.asarray(state[0].sum_of_squares["emb"], np.float64)
  acc = acc0[ids] + (sums**2).mean(axis=1)
  got = np.asarray(new[0].sum_of_squares["emb"], np.float64)
  np.testing.assert_allclose(got[ids], acc, rtol=2**-8)
  assert new[0].sum_of_squares["emb"].dtype == jnp.bfloat16
  want = -0.1 * sums / (np.sqrt(acc)[:, None] + 1e-8)
  np.testing.assert_allclose(np.asarray(u["emb"])[ids], want, rtol=2**-7)


def test_bad_state_dtypes_raise():
  with pytest.raises(
    ValueError, match=r'ftrl `accumulator_dtype` cannot be "int8".*weight'
  ):
    gtx.ftrl(0.1, accumulator_dtype="int8")
  with pytest.raises(ValueError, match="one value per row"):
    gtx.rowwise_adagrad(0.1, accumulator_dtype="int8")
  with pytest.raises(TypeError, match="`nu_dtype` must be None, a floating"):
    gtx.lazy_adam(0.1, nu_dtype=jnp.int32)
  with pytest.raises(TypeError, match="`accumulator_dtype` must be None"):
    gtx.adagrad(0.1, accumulator_dtype="int4")
  with pytest.raises(ValueError, match="`block_size` must be >= 1"):
    gtx.lazy_adam(0.1, mu_dtype="int8", block_size=0)
  with pytest.raises(TypeError, match="`block_size` must be a Python int"):
    gtx.lazy_sgd(0.1, 0.9, accumulator_dtype="int8", block_size=8.0)


def test_inject_hyperparams_needs_a_static_block_size_for_int8():
  # put from numpy (jnp.zeros, jnp.ones compile a broadcast per shape)
  params = jax.device_put({"emb": np.zeros((10, 4), np.float32)})
  ids, vals = jax.device_put(
    (np.array([1], np.int32), np.ones((1, 4), np.float32))
  )
  g = {"emb": gtx.SparseRows(ids, vals, 10)}
  inject = optax.inject_hyperparams
  tx = inject(gtx.lazy_adam)(learning_rate=0.1, mu_dtype="int8")
  with pytest.raises(TypeError, match=r"static_args=\('block_size',\)"):
    jax.jit(tx.update)(g, tx.init(params), params)
  tx = inject(gtx.lazy_adam, static_args=("block_size",))(
    learning_rate=0.1, mu_dtype="int8"
  )
  _, state = jax.jit(tx.update)(g, tx.init(params), params)
  assert isinstance(state.inner_state[0].mu["emb"], gtx.QuantizedRows)
  # float state: block_size is unused and may be traced
  tx = inject(gtx.lazy_adam)(learning_rate=0.1)
  jax.jit(tx.update)(g, tx.init(params), params)
