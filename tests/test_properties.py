"""Property tests: random trees of dense leaves and SparseRows (random ids
with duplicates and padding, negative and >= num_rows), random k and random
staleness sequences, against the independent numpy references; and the
saturating int32 counters of every gradtx state.

Shapes come from a small fixed set and every jitted function is built once,
so hypothesis examples reuse compiled code.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references as ref
import references_lazy_adam as ref_adam
import references_staleness as ref_stale
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gradtx as gtx

NUM_ROWS = 6
DIM = 2
SIZES = (1, 4, 8)  # rows a SparseRows carries
INT32_MAX = 2**31 - 1

SETTINGS = settings(
  max_examples=12,
  deadline=None,
  derandomize=True,
  database=None,
  suppress_health_check=[HealthCheck.too_slow],
)


@st.composite
def sparse_rows(draw, sizes=SIZES):
  """(ids, values): ids in [-3, NUM_ROWS + 2], so duplicates and padding of
  both kinds are common; values from a drawn seed."""
  n = draw(st.sampled_from(sizes))
  ids = draw(st.lists(st.integers(-3, NUM_ROWS + 2), min_size=n, max_size=n))
  seed = draw(st.integers(0, 2**16))
  vals = np.random.RandomState(seed).normal(size=(n, DIM)).astype(np.float32)
  return np.asarray(ids, np.int32), vals


def _sparse(ids_vals):
  ids, vals = ids_vals
  return gtx.SparseRows(ids, vals, NUM_ROWS)


def _dense_np(x):
  if isinstance(x, gtx.SparseRows):
    return ref.to_dense(x.indices, x.values, x.num_rows)
  return np.asarray(x, np.float64)


def _rows(x):
  """The reference's row-sparse type for a SparseRows."""
  return ref_stale.Rows(np.asarray(x.indices), np.asarray(x.values), NUM_ROWS)


# ----------------------------------------------------------------------------
# coalesce and apply_updates


@functools.cache
def _coalesce(n):
  del n  # one compiled function per static size
  return jax.jit(lambda g: g.coalesce())


@SETTINGS
@given(sparse_rows())
def test_coalesce_matches_numpy(ids_vals):
  g = _sparse(ids_vals)
  got = _coalesce(g.nnz)(g)
  want_idx, want_val = ref.coalesce(*ids_vals, NUM_ROWS)
  np.testing.assert_array_equal(got.indices, want_idx)
  np.testing.assert_allclose(got.values, want_val, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
    got.to_dense(), ref.to_dense(*ids_vals, NUM_ROWS), rtol=1e-5, atol=1e-5
  )


@st.composite
def update_trees(draw):
  """A dict of 1-3 leaves, each a dense [NUM_ROWS, DIM] array or a
  SparseRows of the same dense shape; and params to match."""
  keys = draw(st.lists(st.sampled_from("abc"), min_size=1, unique=True))
  seed = draw(st.integers(0, 2**16))
  rng = np.random.RandomState(seed)
  params, updates = {}, {}
  for k in keys:
    params[k] = rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32)
    if draw(st.booleans()):
      updates[k] = _sparse(draw(sparse_rows()))
    else:
      updates[k] = rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32)
  return params, updates


@SETTINGS
@given(update_trees())
def test_apply_updates_matches_numpy(tree):
  params, updates = tree
  got = gtx.apply_updates(params, updates)
  assert jax.tree.structure(got) == jax.tree.structure(params)
  for k, p in params.items():
    assert got[k].dtype == jnp.float32
    want = p.astype(np.float64) + _dense_np(updates[k])
    np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# lazy_adam


LR = 0.05
TXS = {c: gtx.lazy_adam(LR, catch_up=c) for c in (False, True)}


@functools.cache
def _adam_step(catch_up, n):
  del n
  tx = TXS[catch_up]

  @jax.jit
  def step(params, state, grads):
    u, state = tx.update(grads, state, params)
    return gtx.apply_updates(params, u), state

  return step


@SETTINGS
@given(
  st.booleans(),
  st.lists(sparse_rows(sizes=(4, 8)), min_size=1, max_size=4),
  st.integers(0, 2**16),
)
def test_lazy_adam_matches_numpy(catch_up, sparse_grads, seed):
  rng = np.random.RandomState(seed)
  p0 = {
    "emb": rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32),
    "w": rng.normal(size=(DIM,)).astype(np.float32),
  }
  r = ref_adam.LazyAdam(p0, lambda t: LR, catch_up=catch_up)
  params, state = p0, TXS[catch_up].init(p0)
  for ids_vals in sparse_grads:
    g = {"emb": _sparse(ids_vals), "w": rng.normal(size=DIM).astype("f4")}
    params, state = _adam_step(catch_up, g["emb"].nnz)(params, state, g)
    r.step({"emb": (*ids_vals, NUM_ROWS), "w": g["w"]})
  for k in p0:
    np.testing.assert_allclose(params[k], r.p[k], rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(state[0].mu[k], r.m[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state[0].nu[k], r.v[k], rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------
# accumulate


ROWS_PER_STEP = 8


@functools.cache
def _acc_tx(k):
  return gtx.accumulate(
    gtx.lazy_adam(LR), k, rows_per_step={"emb": ROWS_PER_STEP, "w": None}
  )


@functools.cache
def _acc_step(k, n):
  del n
  tx = _acc_tx(k)

  @jax.jit
  def step(params, state, grads):
    u, state = tx.update(grads, state, params)
    return gtx.apply_updates(params, u), u, state

  return step


@SETTINGS
@given(
  st.sampled_from([1, 3]),
  st.lists(sparse_rows(sizes=(4, 8)), min_size=1, max_size=6),
  st.integers(0, 2**16),
)
def test_accumulate_matches_numpy(k, sparse_grads, seed):
  # Gradients with fewer rows than rows_per_step are padded up inside.
  rng = np.random.RandomState(seed)
  params = {
    "emb": rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32),
    "w": rng.normal(size=(DIM,)).astype(np.float32),
  }
  want_p = {key: p.astype(np.float64) for key, p in params.items()}
  r = ref_stale.NumpyAccumulate(ref_stale.NumpyLazyAdam(LR), k)
  state = _acc_tx(k).init(params)
  for i, ids_vals in enumerate(sparse_grads):
    g = {"emb": _sparse(ids_vals), "w": rng.normal(size=DIM).astype("f4")}
    params, u, state = _acc_step(k, g["emb"].nnz)(params, state, g)
    want_u = r.update({"emb": _rows(g["emb"]), "w": g["w"]})
    for key in want_p:
      want_p[key] = want_p[key] + want_u[key]
      np.testing.assert_allclose(
        _dense_np(u[key]), want_u[key], rtol=1e-4, atol=1e-6
      )
    assert int(state.num_accumulated) == (i + 1) % k
    assert int(state.num_updates) == (i + 1) // k
  for key in want_p:
    np.testing.assert_allclose(params[key], want_p[key], rtol=1e-5, atol=2e-5)


# ----------------------------------------------------------------------------
# drop_stale


@functools.cache
def _stale_step(rescale, limited):
  def step(params, state, grads, grad_step, limit):
    limit = limit if limited else None
    tx = gtx.drop_stale(gtx.scale_by_learning_rate(0.1), limit, rescale=rescale)
    u, state = tx.update(grads, state, params, grad_step=grad_step)
    return u, state

  return jax.jit(step)


@SETTINGS
@given(
  st.sampled_from([None, 0, 1, 2]),
  st.booleans(),
  st.lists(st.integers(-1, 4), min_size=1, max_size=8),
  st.integers(0, 2**16),
)
def test_drop_stale_matches_numpy(max_staleness, rescale, delays, seed):
  # delay = step - grad_step; a negative delay is a grad_step ahead of the
  # step, which under jit is dropped (and counted).
  rng = np.random.RandomState(seed)
  params = {"emb": np.zeros((NUM_ROWS, DIM), np.float32), "w": np.zeros(DIM)}
  params["w"] = params["w"].astype(np.float32)
  state = gtx.drop_stale(gtx.scale(1.0), 0).init(params)
  r = ref_stale.DropStaleReference(
    ref_stale.NumpySGD(0.1), max_staleness, rescale
  )
  step = _stale_step(rescale, max_staleness is not None)
  limit = jnp.int32(max_staleness or 0)
  for delay in delays:
    ids = rng.randint(-2, NUM_ROWS + 2, size=4).astype(np.int32)
    vals = rng.normal(size=(4, DIM)).astype(np.float32)
    g = {
      "emb": gtx.SparseRows(ids, vals, NUM_ROWS),
      "w": rng.normal(size=DIM).astype(np.float32),
    }
    grad_step = r.global_step - delay
    u, state = step(params, state, g, jnp.int32(grad_step), limit)
    _, want_u = r.receive({"emb": _rows(g["emb"]), "w": g["w"]}, grad_step)
    for key in params:
      np.testing.assert_allclose(
        _dense_np(u[key]), want_u[key], rtol=1e-5, atol=1e-6
      )
    stats = gtx.staleness_stats(state)
    assert int(stats["step"]) == r.global_step
    assert int(stats["num_dropped"]) == r.stale_counter
    assert int(stats["last_staleness"]) == r.last_staleness
    np.testing.assert_allclose(
      float(stats["dropped_fraction"]), r.dropped_fraction(), rtol=1e-6
    )


# ----------------------------------------------------------------------------
# Saturating counters


def _grad():
  return {
    "emb": gtx.SparseRows(jnp.array([1, 1, 7]), jnp.ones((3, DIM)), NUM_ROWS),
    "w": jnp.ones(DIM),
  }


def _params():
  return {"emb": jnp.zeros((NUM_ROWS, DIM)), "w": jnp.zeros(DIM)}


def _near_max(count):
  return jnp.asarray(INT32_MAX - 2, jnp.int32) + jnp.zeros_like(count)


def _steps(tx, state, calls=3, **extra):
  states = []
  step = jax.jit(lambda s: tx.update(_grad(), s, _params(), **extra))
  for _ in range(calls):
    u, state = step(state)
    for leaf in gtx._update_trees.tree_leaves(u):
      values = leaf.values if isinstance(leaf, gtx.SparseRows) else leaf
      assert np.all(np.isfinite(values))
    states.append(state)
  return states


def test_schedule_count_saturates():
  tx = gtx.scale_by_learning_rate(optax.linear_schedule(1.0, 0.0, 100))
  state = tx.init(_params())
  state = state._replace(count=_near_max(state.count))
  counts = [int(s.count) for s in _steps(tx, state)]
  assert counts == [INT32_MAX - 1, INT32_MAX, INT32_MAX]


def test_lazy_adam_count_saturates():
  tx = gtx.scale_by_lazy_adam()
  state = tx.init(_params())
  state = state._replace(count=_near_max(state.count))
  states = _steps(tx, state)
  counts = [int(s.count) for s in states]
  assert counts == [INT32_MAX - 1, INT32_MAX, INT32_MAX]
  # The moments keep updating once the count has stopped.
  assert float(states[2].mu["w"][0]) > float(states[1].mu["w"][0])


def test_lazy_adam_catch_up_saturates():
  tx = gtx.scale_by_lazy_adam(catch_up=True)
  params = _params()
  # Row 1 touched at step 1.
  _, state = jax.jit(tx.update)(_grad(), tx.init(params), params)
  state = state._replace(count=_near_max(state.count))
  # Row 1 catches up ~2**31 skipped steps, then the count saturates; the
  # updates stay finite (checked in _steps).
  states = _steps(tx, state)
  m = INT32_MAX
  assert [int(s.count) for s in states] == [m - 1, m, m]
  assert [int(s.last_step["emb"][1]) for s in states] == [m - 1, m, m]
  assert int(states[-1].last_step["emb"][0]) == 0  # never touched
  assert np.all(np.isfinite(states[-1].future_sum["emb"]))


def test_accumulate_counters_saturate():
  tx = gtx.accumulate(gtx.scale(1.0), 2, rows_per_step={"emb": 3, "w": None})
  state = tx.init(_params())
  state = state._replace(
    num_micro_steps=_near_max(state.num_micro_steps),
    num_updates=_near_max(state.num_updates),
  )
  states = _steps(tx, state, calls=6)
  m = INT32_MAX
  micro = [int(s.num_micro_steps) for s in states]
  assert micro == [m - 1, m, m, m, m, m]
  # num_updates goes up when a window ends (every second call).
  assert [int(s.num_updates) for s in states] == [m - 2, m - 1, m - 1, m, m, m]
  # The window keeps cycling after the counters stop.
  assert [int(s.num_accumulated) for s in states] == [1, 0] * 3


def test_drop_stale_counters_saturate():
  tx = gtx.drop_stale(gtx.scale(1.0), 1)
  state = tx.init(_params())
  big = _near_max(state.step)
  state = state._replace(step=big, num_dropped=big)
  step = jax.jit(lambda s, gs: tx.update(_grad(), s, _params(), grad_step=gs))
  got = []
  for delay in (0, 0, 0, 5, 5, 5):
    grad_step = jnp.int32(int(state.step) - delay)
    _, state = step(state, grad_step)
    got.append((int(state.step), int(state.num_dropped)))
  m = INT32_MAX
  assert got == [
    (m - 1, m - 2),
    (m, m - 2),
    (m, m - 2),
    (m, m - 1),
    (m, m),
    (m, m),
  ]
  assert int(gtx.staleness_stats(state)["last_staleness"]) == 5
  frac = float(gtx.staleness_stats(state)["dropped_fraction"])
  assert frac == pytest.approx(0.5)
