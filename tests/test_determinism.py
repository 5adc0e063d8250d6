"""Determinism: the same inputs give the same bits across repeated runs and
across recompilations, duplicate ids in SparseRows included."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import references as ref

import gradtx as gtx
from gradtx._dedup import _segment_sum_scan, _segment_sum_scatter

NUM_ROWS = 16
DIM = 3
N = 12  # rows per SparseRows gradient; many duplicates
STEPS = 3


def _params():
  rng = np.random.RandomState(0)
  return {
    "emb": jnp.asarray(rng.normal(size=(NUM_ROWS, DIM)), jnp.float32),
    "w": jnp.asarray(rng.normal(size=(DIM,)), jnp.float32),
  }


def _grads(step, n=N):
  """Ids from a few rows (every id repeats) plus padding; values chosen so
  that the order of a sum changes its rounding."""
  rng = np.random.RandomState(step)
  ids = rng.randint(0, 4, size=n)
  ids[-1] = -1
  vals = rng.normal(size=(n, DIM)) * 10.0 ** rng.randint(-4, 4, size=(n, 1))
  return {
    "emb": gtx.SparseRows(
      ids.astype(np.int32), vals.astype(np.float32), NUM_ROWS
    ),
    "w": jnp.asarray(rng.normal(size=(DIM,)), jnp.float32),
  }


def _train(tx, jit_step):
  params = _params()
  state = tx.init(params)
  for t in range(STEPS):
    params, state = jit_step(params, state, _grads(t))
  return jax.tree.map(np.asarray, (params, state))


def _fresh_step(tx):
  # A new function object each call, so jax.jit traces and compiles anew.
  def step(params, state, grads):
    u, state = tx.update(grads, state, params)
    return gtx.apply_updates(params, u), state

  return jax.jit(step)


def _assert_identical(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def _check_deterministic(tx, clear_caches=False):
  step = _fresh_step(tx)
  first = _train(tx, step)
  _assert_identical(_train(tx, step), first)  # the same executable again
  if clear_caches:
    jax.clear_caches()
  _assert_identical(_train(tx, _fresh_step(tx)), first)  # recompiled
  return first


def test_lazy_adam_is_deterministic():
  tx = optax.chain(
    gtx.lazy_adam(0.1), gtx.scale(1.0)
  )  # a chain, as users write it
  (params, _) = _check_deterministic(tx, clear_caches=True)
  assert np.abs(params["emb"] - np.asarray(_params()["emb"])).max() > 0.1


def test_lazy_adam_catch_up_is_deterministic():
  _check_deterministic(gtx.lazy_adamw(0.1, catch_up=True))


def test_accumulate_with_sparse_buffers_is_deterministic():
  tx = gtx.accumulate(
    gtx.lazy_adam(0.1), 2, rows_per_step={"emb": N, "w": None}
  )
  (_, state) = _check_deterministic(tx)
  assert int(state.num_accumulated) == 1  # ended mid-window (3 calls, k=2)


def test_mirrored_step_is_deterministic():
  m = gtx.Mirrored()
  tx = optax.chain(gtx.all_reduce(m.axis_name), gtx.lazy_adam(0.1))

  def loss(params, ids):
    return jnp.sum(jnp.sin(gtx.lookup(params["emb"], ids) @ params["w"]))

  def make_step():
    def train_step(params, opt_state, ids):
      grads = gtx.sparse_grad(loss)(params, ids)
      u, opt_state = tx.update(grads, opt_state, params)
      return gtx.apply_updates(params, u), opt_state

    return m.step(train_step, donate_argnums=(0, 1))

  def run(step):
    params = m.replicate(_params())
    state = m.replicate(tx.init(_params()))
    for t in range(STEPS):
      ids = np.random.RandomState(t).randint(0, 4, size=(m.num_replicas, 2))
      params, state = step(params, state, m.shard_batch(ids))
    return jax.tree.map(np.asarray, (params, state))

  step = make_step()
  first = run(step)
  _assert_identical(run(step), first)
  _assert_identical(run(make_step()), first)  # recompiled


def test_coalesce_is_deterministic_on_both_code_paths():
  # The default path (a sorted segment-sum scatter, used on CPU and TPU)
  # and the segmented scan used on GPUs, whose scatter-add is atomic: each
  # gives the same bits every time and agrees with numpy.
  g = _grads(0, n=64)["emb"]
  want_idx, want_val = ref.coalesce(g.indices, g.values, NUM_ROWS)
  # Two function objects: two traces and compilations.
  c1 = jax.jit(lambda g: g.coalesce())(g)
  c2 = jax.jit(lambda g: g.coalesce())(g)
  _assert_identical(c1, c2)
  np.testing.assert_array_equal(c1.indices, want_idx)
  np.testing.assert_allclose(c1.values, want_val, rtol=1e-5, atol=1e-6)

  idx = g.valid_indices()
  order = jnp.argsort(idx, stable=True)
  sidx = idx[order]
  first = jnp.concatenate([jnp.ones([1], bool), sidx[1:] != sidx[:-1]])
  seg = jnp.cumsum(first, dtype=jnp.int32) - 1
  for fn in (_segment_sum_scan, _segment_sum_scatter):
    a = jax.jit(fn)(g.values, idx, sidx, seg)
    b = jax.jit(lambda *x, fn=fn: fn(*x))(g.values, idx, sidx, seg)
    np.testing.assert_array_equal(a, b)
    # Row j of the result is segment j; segment of the padding is last.
    np.testing.assert_allclose(
      a[: int(seg[-1])], want_val[: int(seg[-1])], rtol=1e-5, atol=1e-6
    )
