"""SparseRows updates applied where users apply them: ``array + SparseRows``,
``optax.apply_updates``, Flax ``TrainState.apply_gradients`` and
``nnx.Optimizer.update``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references as ref
from flax import nnx
from flax.training import train_state
from hlo import whole_table_ops
from references_lazy_adam import LazyAdam

import gradtx as gtx

V, D = 23, 3
IDS = np.array([4, 1, 4, -1, V, 9, 4], np.int32)  # duplicates and padding


def sparse_update(dtype=jnp.float32):
  vals = np.arange(len(IDS) * D, dtype=np.float32).reshape(-1, D) / 8 - 1
  return gtx.SparseRows(jnp.asarray(IDS), jnp.asarray(vals, dtype), V)


def table(dtype=jnp.float32):
  t = np.linspace(-2, 2, V * D, dtype=np.float32).reshape(V, D)
  return jnp.asarray(t, dtype)


# ----------------------------------------------------------------------------
# the dunder


def test_array_plus_sparse_rows_is_a_row_scatter_add():
  p, u = table(), sparse_update()
  want = np.asarray(p, np.float64) + ref.to_dense(u.indices, u.values, V)
  for got in (p + u, u + p, np.asarray(p) + u, p - (-u)):
    assert isinstance(got, jax.Array)
    assert got.shape == (V, D) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(
    p - u, np.asarray(p) - ref.to_dense(u.indices, u.values, V), rtol=1e-6
  )
  np.testing.assert_allclose(
    u - p, ref.to_dense(u.indices, u.values, V) - np.asarray(p), rtol=1e-6
  )
  # untouched rows are bit-identical
  untouched = np.setdiff1d(np.arange(V), IDS)
  np.testing.assert_array_equal((p + u)[untouched], p[untouched])


def test_sparse_rows_scalar_and_sparse_arithmetic():
  u = sparse_update()
  dense = ref.to_dense(u.indices, u.values, V)
  for got, want in [
    (2.0 * u, 2 * dense),
    (u * jnp.float32(-0.5), -0.5 * dense),
    (u / 4, dense / 4),
    (-u, -dense),
    (u + u, 2 * dense),
    (u - u, 0 * dense),
  ]:
    assert isinstance(got, gtx.SparseRows) and got.num_rows == V
    np.testing.assert_allclose(
      ref.to_dense(got.indices, got.values, V), want, rtol=1e-6, atol=1e-7
    )


def test_dtype_rule_of_optax_apply_updates():
  # Three updates of 2**-9 to a bf16 1.0: added one at a time in bf16 each
  # rounds away (half an ulp is 2**-8); summed in float32 and rounded once,
  # they give 1 + 2**-7, which is what the dense rule computes.
  p = jnp.ones((4, 2), jnp.bfloat16)
  u = gtx.SparseRows(jnp.array([1, 1, 1]), jnp.full((3, 2), 2.0**-9), 4)
  dense_u = ref.to_dense(u.indices, u.values, 4).astype(np.float32)
  want = jnp.asarray(np.asarray(p, np.float32) + dense_u).astype(jnp.bfloat16)
  assert float(want[1, 0]) == 1 + 2.0**-7  # the check can fail
  for got in (p + u, u + p, optax.apply_updates(p, u), gtx.apply_updates(p, u)):
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got, want)
  # a narrower update into a wider table stays wide
  p32 = table()
  got = p32 + sparse_update(jnp.bfloat16)
  assert got.dtype == jnp.float32
  u16 = sparse_update(jnp.bfloat16)
  np.testing.assert_allclose(
    got,
    np.asarray(p32) + ref.to_dense(u16.indices, u16.values, V),
    rtol=1e-6,
  )


def test_arithmetic_bad_input():
  p, u = table(), sparse_update()
  with pytest.raises(ValueError, match=r"array \+ SparseRows.*\(5, 3\)"):
    p[:5] + u
  with pytest.raises(ValueError, match=r"SparseRows \+ array.*row shape"):
    u + jnp.ones((V, 4))
  with pytest.raises(TypeError, match="Python scalar.*with_values"):
    u + 1.0
  with pytest.raises(TypeError, match="Python scalar"):
    1 - u
  with pytest.raises(TypeError, match="scalar x only.*to_dense"):
    u * jnp.ones((V, D))
  with pytest.raises(ValueError, match="SparseRows \\+ SparseRows.*differ"):
    u + gtx.SparseRows(jnp.array([0]), jnp.ones((1, D)), V + 1)
  with pytest.raises(TypeError):
    u + "row"


# ----------------------------------------------------------------------------
# optax.apply_updates


def test_optax_apply_updates_mixed_tree_under_jit():
  params = {"emb": table(), "w": jnp.ones(D), "b16": table(jnp.bfloat16)}
  updates = {
    "emb": sparse_update(),
    "w": jnp.full(D, 0.5),
    "b16": sparse_update(),
  }
  got = jax.jit(optax.apply_updates)(params, updates)
  want_gtx = gtx.apply_updates(params, updates)
  dense_u = ref.to_dense(IDS, updates["emb"].values, V)
  np.testing.assert_allclose(got["emb"], np.asarray(table()) + dense_u, 1e-6)
  np.testing.assert_array_equal(got["w"], np.full(D, 1.5))
  assert got["b16"].dtype == jnp.bfloat16
  for k in params:
    np.testing.assert_array_equal(got[k], want_gtx[k])


@pytest.mark.parametrize("apply", [optax.apply_updates, gtx.apply_updates])
def test_both_apply_functions_update_in_place_under_donation(apply):
  rows = 5003
  params = {"emb": jnp.zeros((rows, 8)), "w": jnp.zeros(8)}
  tx = gtx.lazy_adam(0.1)
  grads = {
    "emb": gtx.SparseRows(jnp.arange(16) * 7, jnp.ones((16, 8)), rows),
    "w": jnp.ones(8),
  }

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return apply(params, updates), state

  compiled = (
    jax.jit(step, donate_argnums=(0, 1))
    .lower(params, tx.init(params), grads)
    .compile()
  )
  whole = whole_table_ops(compiled, rows)
  assert whole, "the check can fail: the table updates must show up"
  for line in whole:
    assert "scatter" in line, line
  mem = compiled.memory_analysis()
  table_bytes = rows * 8 * 4
  assert mem.temp_size_in_bytes < table_bytes / 20
  assert mem.alias_size_in_bytes >= 3 * table_bytes  # params, mu, nu


# ----------------------------------------------------------------------------
# Flax TrainState and nnx.Optimizer


def lookup_loss(params, ids):
  rows = gtx.lookup(params["emb"], ids)
  return jnp.sum(jnp.tanh(rows @ params["w"]) * jnp.arange(1.0, 1 + ids.size))


def make_params():
  rng = np.random.RandomState(0)
  return {
    "emb": jnp.asarray(rng.normal(size=(V, D)), jnp.float32),
    "w": jnp.asarray(rng.normal(size=(D,)), jnp.float32),
  }


BATCHES = [
  np.array([3, 7, 3, 0]),
  np.array([7, 22, 5, 5]),
  np.array([1, 2, 3, 4]),
]


def reference_run(params, lr):
  """Lazy Adam in float64 on jax.grad's dense gradient, rows read only."""
  opt = LazyAdam({k: np.asarray(v) for k, v in params.items()}, lambda t: lr)
  for ids in BATCHES:
    now = {k: jnp.asarray(v, jnp.float32) for k, v in opt.p.items()}
    g = jax.grad(lookup_loss)(now, jnp.asarray(ids))
    rows = np.unique(ids)
    opt.step({"emb": (rows, np.asarray(g["emb"])[rows], V), "w": g["w"]})
  return opt.p


def test_flax_train_state_apply_gradients_with_sparse_grads():
  lr = 0.05
  params = make_params()
  state = train_state.TrainState.create(
    apply_fn=lookup_loss, params=params, tx=gtx.lazy_adam(lr)
  )

  @jax.jit
  def step(state, ids):
    grads = gtx.sparse_grad(state.apply_fn)(state.params, ids)
    assert isinstance(grads["emb"], gtx.SparseRows)
    return state.apply_gradients(grads=grads)

  for ids in BATCHES:
    state = step(state, jnp.asarray(ids))
  want = reference_run(params, lr)
  assert int(state.step) == len(BATCHES)
  for k in params:
    np.testing.assert_allclose(state.params[k], want[k], rtol=2e-5, atol=1e-6)
  untouched = np.setdiff1d(np.arange(V), np.concatenate(BATCHES))
  np.testing.assert_array_equal(
    state.params["emb"][untouched], params["emb"][untouched]
  )


class NnxModel(nnx.Module):
  def __init__(self, params):
    self.emb = nnx.Param(params["emb"])
    self.w = nnx.Param(params["w"])

  def __call__(self, ids):
    return lookup_loss({"emb": self.emb[...], "w": self.w[...]}, ids)


def test_nnx_optimizer_update_with_sparse_grads():
  lr = 0.05
  params = make_params()
  model = NnxModel(params)
  optimizer = nnx.Optimizer(model, gtx.lazy_adam(lr), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, ids):
    graphdef, state = nnx.split(model)

    def loss(state):
      return nnx.merge(graphdef, state)(ids)

    grads = gtx.sparse_grad(loss)(state)
    assert isinstance(grads["emb"].get_value(), gtx.SparseRows)
    optimizer.update(model, grads)

  for ids in BATCHES:
    step(model, optimizer, jnp.asarray(ids))
  want = reference_run(params, lr)
  np.testing.assert_allclose(model.emb[...], want["emb"], rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(model.w[...], want["w"], rtol=2e-5, atol=1e-6)
  assert int(optimizer.step[...]) == len(BATCHES)
