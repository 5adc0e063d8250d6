"""SparseRows updates applied where users apply them: ``array + SparseRows``,
``optax.apply_updates``, Flax ``TrainState.apply_gradients`` and
``nnx.Optimizer.update``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references as ref
from conformance import cast, to_dense
from flax import nnx
from flax.training import train_state
from hlo import whole_table_ops, written_in_place
from jax import lax
from references_lazy_adam import LazyAdam

import gradtx as gtx

V, D = 23, 3
IDS = np.array([4, 1, 4, -1, V, 9, 4], np.int32)  # duplicates and padding


def sparse_update(dtype=jnp.float32):
  vals = np.arange(len(IDS) * D, dtype=np.float32).reshape(-1, D) / 8 - 1
  return gtx.SparseRows(jnp.asarray(IDS), cast(vals, dtype), V)


def table(dtype=jnp.float32):
  t = np.linspace(-2, 2, V * D, dtype=np.float32).reshape(V, D)
  return cast(t, dtype)


# A SparseRows densified by one jitted program per shape (eagerly, every op
# of to_dense compiles on its own).


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
  np.testing.assert_array_equal(
    np.asarray(p + u)[untouched], np.asarray(p)[untouched]
  )


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
  p = jnp.asarray(np.ones((4, 2), jnp.bfloat16))
  u = gtx.SparseRows(
    np.array([1, 1, 1], np.int32), np.full((3, 2), 2.0**-9, np.float32), 4
  )
  dense_u = ref.to_dense(u.indices, u.values, 4).astype(np.float32)
  # rounded to bfloat16 once by numpy (round to nearest even, as XLA)
  want = (np.asarray(p, np.float32) + dense_u).astype(jnp.bfloat16)
  assert float(want[1, 0]) == 1 + 2.0**-7  # the check can fail
  u16 = sparse_update(jnp.bfloat16)

  @jax.jit
  def updated(p, u, p32, u16):  # every way in, one program
    ways = (p + u, u + p, optax.apply_updates(p, u), gtx.apply_updates(p, u))
    return ways, p32 + u16

  ways, got = updated(p, u, table(), u16)
  for got_bf16 in ways:
    assert got_bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(got_bf16, want)
  # a narrower update into a wider table stays wide
  p32 = table()
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(
    got,
    np.asarray(p32) + ref.to_dense(u16.indices, u16.values, V),
    rtol=1e-6,
  )


def test_arithmetic_bad_input():
  p, u = table(), sparse_update()
  with pytest.raises(ValueError, match=r"array \+ SparseRows.*\(5, 3\)"):
    jnp.asarray(np.asarray(p)[:5]) + u
  with pytest.raises(ValueError, match=r"SparseRows \+ array.*row shape"):
    u + jnp.asarray(np.ones((V, 4), np.float32))
  with pytest.raises(TypeError, match="Python scalar.*with_values"):
    u + 1.0
  with pytest.raises(TypeError, match="Python scalar"):
    1 - u
  with pytest.raises(TypeError, match="scalar x only.*to_dense"):
    u * jnp.asarray(np.ones((V, D), np.float32))
  with pytest.raises(ValueError, match="SparseRows \\+ SparseRows.*differ"):
    u + gtx.SparseRows(np.array([0]), np.ones((1, D), np.float32), V + 1)
  with pytest.raises(TypeError):
    u + "row"


# ----------------------------------------------------------------------------
# optax.apply_updates


def test_optax_apply_updates_mixed_tree_under_jit():
  params = {
    "emb": table(),
    "w": np.ones(D, np.float32),
    "b16": table(jnp.bfloat16),
  }
  updates = {
    "emb": sparse_update(),
    "w": np.full(D, 0.5, np.float32),
    "b16": sparse_update(),
  }
  # optax's and gtx's, one program
  got, want_gtx = jax.jit(
    lambda p, u: (optax.apply_updates(p, u), gtx.apply_updates(p, u))
  )(params, updates)
  dense_u = ref.to_dense(IDS, updates["emb"].values, V)
  np.testing.assert_allclose(got["emb"], np.asarray(table()) + dense_u, 1e-6)
  np.testing.assert_array_equal(got["w"], np.full(D, 1.5))
  assert got["b16"].dtype == jnp.bfloat16
  for k in params:
    np.testing.assert_array_equal(got[k], want_gtx[k])


@pytest.mark.parametrize("apply", [optax.apply_updates, gtx.apply_updates])
def test_both_apply_functions_update_in_place_under_donation(apply):
  rows = 5003
  params = {
    "emb": np.zeros((rows, 8), np.float32),
    "w": np.zeros(8, np.float32),
  }
  tx = gtx.lazy_adam(0.1)
  grads = {
    "emb": gtx.SparseRows(
      np.arange(16, dtype=np.int32) * 7, np.ones((16, 8), np.float32), rows
    ),
    "w": np.ones(8, np.float32),
  }

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return apply(params, updates), state

  compiled = (
    jax.jit(step, donate_argnums=(0, 1))
    .lower(params, jax.eval_shape(tx.init, params), grads)  # compiled only
    .compile()
  )
  whole = whole_table_ops(compiled, rows)
  assert whole, "the check can fail: the table updates must show up"
  for line in whole:
    assert written_in_place(line), line
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
    "emb": cast(rng.normal(size=(V, D)), jnp.float32),
    "w": cast(rng.normal(size=(D,)), jnp.float32),
  }


BATCHES = [
  np.array([3, 7, 3, 0]),
  np.array([7, 22, 5, 5]),
  np.array([1, 2, 3, 4]),
]


_lookup_grad = jax.jit(jax.grad(lookup_loss))  # one program for every test


def reference_run(params, lr):
  """Lazy Adam in float64 on jax.grad's dense gradient, rows read only."""
  opt = LazyAdam({k: np.asarray(v) for k, v in params.items()}, lambda t: lr)
  for ids in BATCHES:
    now = {k: cast(v, jnp.float32) for k, v in opt.p.items()}
    g = _lookup_grad(now, ids)
    rows = np.unique(ids)
    opt.step({"emb": (rows, np.asarray(g["emb"])[rows], V), "w": g["w"]})
  return opt.p


def test_flax_train_state_apply_gradients_with_sparse_grads():
  lr = 0.05
  params = make_params()
  state = jax.jit(  # the optimizer's init, one program
    lambda p: train_state.TrainState.create(
      apply_fn=lookup_loss, params=p, tx=gtx.lazy_adam(lr)
    )
  )(params)

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
    np.asarray(state.params["emb"])[untouched],
    np.asarray(params["emb"])[untouched],
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


def test_train_state_and_nnx_steps_donated_update_in_place():
  lr = 0.05
  want = reference_run(make_params(), lr)
  state = train_state.TrainState.create(
    apply_fn=lookup_loss, params=make_params(), tx=gtx.lazy_adam(lr)
  )

  def step(state, ids):
    return state.apply_gradients(
      grads=gtx.sparse_grad(lookup_loss)(state.params, ids)
    )

  jitted = jax.jit(step, donate_argnums=0)
  compiled = jitted.lower(state, jnp.asarray(BATCHES[0])).compile()
  for line in whole_table_ops(compiled, V, D):
    assert written_in_place(line), line
  for ids in BATCHES:
    state = jitted(state, jnp.asarray(ids))
  np.testing.assert_allclose(
    state.params["emb"], want["emb"], rtol=2e-5, atol=1e-6
  )

  model = NnxModel(make_params())  # the first params were donated
  optimizer = nnx.Optimizer(model, gtx.lazy_adam(lr), wrt=nnx.Param)
  nnx_steps(model, optimizer, nnx.jit(donate_argnums=(0, 1)))
  np.testing.assert_allclose(model.emb[...], want["emb"], rtol=2e-5, atol=1e-6)


def nnx_steps(model, optimizer, jit=nnx.jit):
  """``BATCHES`` through an nnx step: split, sparse_grad, update."""

  @jit
  def step(model, optimizer, ids):
    graphdef, st = nnx.split(model)
    grads = gtx.sparse_grad(lambda s: nnx.merge(graphdef, s)(ids))(st)
    optimizer.update(model, grads)

  for ids in BATCHES:
    step(model, optimizer, jnp.asarray(ids))


# ----------------------------------------------------------------------------
# A frozen dense layer beside a table (issue 27): optax.adam on the frozen
# kernel and bias through multi_transform gets jax's zeros, as without gtx


def frozen_layer_loss(params, ids):
  h = params["emb"][ids] @ lax.stop_gradient(params["frozen_w"])
  h = h + lax.stop_gradient(params["frozen_b"])[None]
  return jnp.sum((jnp.tanh(h) @ params["w"]) * jnp.arange(1.0, 1 + ids.size))


def frozen_layer_params():
  rng = np.random.RandomState(1)
  return {
    **make_params(),
    "frozen_w": cast(rng.normal(size=(D, D)), jnp.float32),
    "frozen_b": cast(rng.normal(size=(D,)), jnp.float32),
  }


def _label(path, _):
  return "t" if "emb" in jax.tree_util.keystr(path) else "d"


def frozen_layer_tx(lr, params):
  # labels by path, as a user writes them: the table "t", the layers "d"
  labels = jax.tree_util.tree_map_with_path(_label, params)
  return optax.multi_transform(
    {"t": gtx.lazy_adam(lr), "d": optax.adam(lr)}, labels
  )


_frozen_layer_grad = jax.jit(jax.grad(frozen_layer_loss))


def frozen_layer_reference(params, lr):
  """Lazy Adam on the table, Adam on the rest (one formula, float64), on
  jax.grad's dense gradients."""
  opt = LazyAdam({k: np.asarray(v) for k, v in params.items()}, lambda t: lr)
  for ids in BATCHES:
    now = {k: cast(v, jnp.float32) for k, v in opt.p.items()}
    g = _frozen_layer_grad(now, ids)
    rows = np.unique(ids)
    g = {k: np.asarray(v) for k, v in g.items()}
    opt.step({**g, "emb": (rows, g["emb"][rows], V)})
  return opt.p


def _check_frozen_layer(got, params, lr):
  want = frozen_layer_reference(params, lr)
  for k in params:
    np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-6)
  for k in ("frozen_w", "frozen_b"):
    np.testing.assert_array_equal(got[k], params[k])


def test_optax_adam_on_a_frozen_layer_through_multi_transform():
  lr = 0.05
  params = frozen_layer_params()
  labels = gtx.sparse_labels(
    frozen_layer_loss, sparse_label="t", dense_label="d"
  )(params, jnp.asarray(BATCHES[0]))
  assert labels == jax.tree_util.tree_map_with_path(_label, params)
  for tx in (frozen_layer_tx(lr, params), frozen_layer_tx(lr, labels)):

    @jax.jit
    def step(p, s, ids, tx=tx):
      g = gtx.sparse_grad(frozen_layer_loss)(p, ids)
      for k in ("frozen_w", "frozen_b"):
        assert not isinstance(g[k], gtx.SparseRows)
      u, s = tx.update(g, s, p)
      return gtx.apply_updates(p, u), s

    p, s = params, jax.jit(tx.init)(params)
    for ids in BATCHES:
      p, s = step(p, s, jnp.asarray(ids))
    _check_frozen_layer(p, params, lr)


def test_a_frozen_layer_in_train_state_and_nnx_optimizer():
  lr = 0.05
  params = frozen_layer_params()
  state = train_state.TrainState.create(
    apply_fn=frozen_layer_loss, params=params, tx=frozen_layer_tx(lr, params)
  )

  @jax.jit
  def step(state, ids):
    grads = gtx.sparse_grad(state.apply_fn)(state.params, ids)
    return state.apply_gradients(grads=grads)

  for ids in BATCHES:
    state = step(state, jnp.asarray(ids))
  _check_frozen_layer(state.params, params, lr)

  class Model(nnx.Module):
    def __init__(self, params):
      for k, v in params.items():
        setattr(self, k, nnx.Param(v))

    def __call__(self, ids):
      return frozen_layer_loss({k: getattr(self, k)[...] for k in params}, ids)

  model = Model(params)
  # sparse_labels on the module: labels nnx.Optimizer takes as they are
  labels = gtx.sparse_labels(
    lambda m, ids: m(ids), sparse_label="t", dense_label="d"
  )(model, jnp.asarray(BATCHES[0]))
  tx = frozen_layer_tx(lr, labels)
  nnx_steps(model, nnx.Optimizer(model, tx, wrt=nnx.Param))
  _check_frozen_layer({k: getattr(model, k)[...] for k in params}, params, lr)


# ----------------------------------------------------------------------------
# Equinox: eqx.apply_updates maps over the updates first


def _eqx_model():
  import equinox as eqx

  class Bag(eqx.Module):
    embed: eqx.nn.Embedding
    head: eqx.nn.Linear
    act: object = jax.nn.tanh  # a non-array leaf, as real models have

    def __call__(self, ids):
      return self.head(self.act(jax.vmap(self.embed)(ids).mean(0)))

  k1, k2 = jax.random.split(jax.random.key(0))
  return Bag(eqx.nn.Embedding(V, D, key=k1), eqx.nn.Linear(D, 2, key=k2))


def test_equinox_models_take_sparse_updates_through_gtx_apply_updates():
  import equinox as eqx

  model = _eqx_model()
  params, static = eqx.partition(model, eqx.is_inexact_array)
  tx = gtx.lazy_adam(0.05)

  def loss(params, ids):
    return jnp.sum(eqx.combine(params, static)(ids) ** 2)

  @eqx.filter_jit(donate="all-except-first")
  def step(ids, model, opt_state):
    params, static = eqx.partition(model, eqx.is_inexact_array)
    grads = gtx.sparse_grad(loss)(params, ids)
    assert isinstance(grads.embed.weight, gtx.SparseRows)
    updates, opt_state = tx.update(grads, opt_state, params)
    # the whole model, non-array leaves included (their update is None)
    return gtx.apply_updates(model, updates), opt_state, grads

  ids = jnp.asarray(BATCHES[0])

  @jax.jit
  def reference(params, ids):
    # before the donated step: optax.apply_updates on the array part
    grads = gtx.sparse_grad(loss)(params, ids)
    updates, _ = tx.update(grads, tx.init(params), params)
    return updates, optax.apply_updates(params, updates).embed.weight

  updates, want = reference(params, ids)
  before = np.array(model.embed.weight)
  # eqx.apply_updates itself would split the SparseRows: a clear error
  with pytest.raises(TypeError, match=r"gtx.apply_updates\(model, updates\)"):
    eqx.apply_updates(params, updates)
  model = jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, model)
  opt_state = jax.jit(tx.init)(eqx.filter(model, eqx.is_inexact_array))
  model, _, _ = step(ids, model, opt_state)
  np.testing.assert_allclose(model.embed.weight, want, rtol=1e-6)
  untouched = np.setdiff1d(np.arange(V), BATCHES[0])
  np.testing.assert_array_equal(
    np.asarray(model.embed.weight)[untouched], before[untouched]
  )


# ----------------------------------------------------------------------------
# split optimizers: sparse tables and dense layers, one line


def _dlrm_params():
  rng = np.random.RandomState(7)
  return {
    "emb": cast(rng.normal(size=(V, D)), jnp.float32),
    "mlp": {
      "w1": cast(rng.normal(size=(D, 4)), jnp.float32),
      "b1": cast(np.zeros(4), jnp.float32),
      "w2": cast(rng.normal(size=(4,)), jnp.float32),
    },
  }


def _dlrm_loss(p, ids, y):
  h = jnp.tanh(p["emb"][ids].sum(1) @ p["mlp"]["w1"] + p["mlp"]["b1"][None])
  return jnp.mean((h @ p["mlp"]["w2"] - y) ** 2)


def test_sparse_labels_split_the_optimizer_and_its_state():
  params = _dlrm_params()
  ids = cast(np.random.RandomState(8).randint(0, V, (6, 3)), jnp.int32)
  y = cast(np.ones(6), jnp.float32)
  labels = gtx.sparse_labels(_dlrm_loss)(params, ids, y)
  assert labels == {
    "emb": "sparse",
    "mlp": {"w1": "dense", "b1": "dense", "w2": "dense"},
  }
  tx = optax.multi_transform(
    {"sparse": gtx.rowwise_adagrad(0.1), "dense": optax.adam(1e-2)}, labels
  )
  state = jax.jit(tx.init)(params)
  # no Adam state for the table, no row-wise state for the MLP
  adam_shapes = {x.shape for x in jax.tree.leaves(state.inner_states["dense"])}
  row_shapes = {x.shape for x in jax.tree.leaves(state.inner_states["sparse"])}
  assert (V, D) not in adam_shapes
  assert row_shapes <= {(V,), ()}

  def step(p, s):
    g = gtx.sparse_grad(_dlrm_loss)(p, ids, y)
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s

  def separately(p):
    # each part as its own optimizer would do it
    g = gtx.sparse_grad(_dlrm_loss)(p, ids, y)
    row = gtx.rowwise_adagrad(0.1)
    u, _ = row.update(g["emb"], row.init(p["emb"]), p["emb"])
    adam = optax.adam(1e-2)
    v, _ = adam.update(g["mlp"], adam.init(p["mlp"]), p["mlp"])
    return {
      "emb": gtx.apply_updates(p["emb"], u),
      "mlp": optax.apply_updates(p["mlp"], v),
    }

  # the split step and its parts separately, one program
  (got, _), want = jax.jit(lambda p, s: (step(p, s), separately(p)))(
    params, state
  )
  np.testing.assert_allclose(got["emb"], want["emb"], rtol=1e-5, atol=1e-7)
  for k in want["mlp"]:
    np.testing.assert_allclose(
      got["mlp"][k], want["mlp"][k], rtol=1e-5, atol=1e-7
    )


# ----------------------------------------------------------------------------
# Flax NNX: labels for nnx.Optimizer, the module passed directly, and
# gradients with respect to nnx.Param only (Dropout RNG, BatchNorm stats)


def _sparse_to_dense(tree):
  # each SparseRows by one jitted program (conformance.to_dense)
  return jax.tree.map(
    lambda x: to_dense(x) if isinstance(x, gtx.SparseRows) else x,
    tree,
    is_leaf=lambda x: isinstance(x, gtx.SparseRows),
  )


def _assert_states_close(got, want, rtol=1e-6, atol=1e-7):
  got, want = nnx.as_pure(got), nnx.as_pure(want)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    if jnp.issubdtype(g.dtype, jax.dtypes.prng_key):
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


class Bag(nnx.Module):
  """A plain model: nnx.Param only."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.head = nnx.Linear(D, 1, rngs=rngs)

  def __call__(self, ids):
    return self.head(jnp.tanh(self.embed(ids).mean(1)))[:, 0]


class DropoutBatchNormBag(nnx.Module):
  """nnx.Param beside Dropout's RNG state and BatchNorm's statistics."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.bn = nnx.BatchNorm(D, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)
    self.head = nnx.Linear(D, 1, rngs=rngs)

  def __call__(self, ids):
    return self.head(self.drop(self.bn(self.embed(ids).mean(1))))[:, 0]


def mse(model, ids, y):
  return jnp.mean((model(ids) - y) ** 2)


def param_loss(model, ids, y):
  """docs/guides/bring_your_model.md's pattern: a loss of the nnx.Param
  state alone, with the rest (RNG, batch statistics) merged back in
  (copied: the loss updates it under its own trace) and returned as aux;
  and the Param state to differentiate."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss(params):
    m = nnx.merge(graphdef, params, rest, copy=True)
    return mse(m, ids, y), nnx.state(m, nnx.Not(nnx.Param))

  return loss, params


def param_only_value_and_grad(model, ids, y):
  loss, params = param_loss(model, ids, y)
  (value, rest), grads = gtx.sparse_value_and_grad(loss, has_aux=True)(params)
  nnx.update(model, rest)
  return value, grads


@nnx.jit
def reference_step(model, optimizer, ids, y):
  """nnx's own step: the nnx.Param gradients of ``mse``, then the update."""
  diff = nnx.DiffState(0, nnx.Param)
  value, grads = nnx.value_and_grad(mse, argnums=diff)(model, ids, y)
  optimizer.update(model, grads)
  return value, grads


BAGS = [
  np.array([[3, 7], [3, 0], [9, 22]]),
  np.array([[7, 22], [5, 5], [1, 2]]),
]
Y = np.array([1.0, -1.0, 0.5])


def test_sparse_labels_of_nnx_state_and_module_fit_nnx_optimizer():
  ids, y = jnp.asarray(BAGS[0]), jnp.asarray(Y)
  model = Bag(nnx.Rngs(0))
  _, params = nnx.split(model, nnx.Param)
  from_state = gtx.sparse_labels(
    lambda p, ids, y: mse(nnx.merge(nnx.graphdef(model), p), ids, y)
  )(params, ids, y)
  from_module = gtx.sparse_labels(mse)(model, ids, y)
  for labels in (from_state, from_module):
    # the pure state nnx.Optimizer hands its tx: no nnx.Param wrappers
    assert isinstance(labels, nnx.State)
    assert labels["embed"]["embedding"] == "sparse"
    assert dict(labels["head"]) == {"bias": "dense", "kernel": "dense"}
    assert not any(isinstance(x, nnx.Variable) for x in jax.tree.leaves(labels))

  def make(labels):
    model = Bag(nnx.Rngs(0))
    tx = optax.multi_transform(
      {"sparse": gtx.lazy_sgd(0.1), "dense": optax.sgd(0.1)}, labels
    )
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  runs = [make(labels) for labels in (from_state, from_module)]
  # reference: optax.sgd on nnx's dense gradients
  want = Bag(nnx.Rngs(0))
  reference = nnx.Optimizer(want, optax.sgd(0.1), wrt=nnx.Param)

  @nnx.jit(donate_argnums=0)
  def step(runs, want, reference, ids, y):
    # both labelled runs and the reference, one program
    for model, optimizer in runs:
      grads = gtx.sparse_grad(mse)(model, ids, y)
      optimizer.update(model, grads)
    reference.update(want, nnx.grad(mse)(want, ids, y))

  for bag in BAGS:
    step(runs, want, reference, jnp.asarray(bag), y)
  for model, _ in runs:
    _assert_states_close(
      nnx.state(model, nnx.Param), nnx.state(want, nnx.Param)
    )


def test_a_plain_nnx_module_passed_straight_in():
  ids, y = jnp.asarray(BAGS[0]), jnp.asarray(Y)
  model = Bag(nnx.Rngs(0))

  @nnx.jit
  def both(model, ids, y):  # gtx's and nnx's, one program
    return (
      gtx.sparse_value_and_grad(mse)(model, ids, y),
      nnx.value_and_grad(mse)(model, ids, y),
    )

  (value, grads), (want_value, want) = both(model, ids, y)
  assert isinstance(grads.embed.embedding.get_value(), gtx.SparseRows)
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  _assert_states_close(
    nnx.state(_sparse_to_dense(grads)), nnx.state(want), atol=1e-7
  )


def test_param_only_gradients_with_dropout_and_batch_norm():
  ids, y = jnp.asarray(BAGS[0]), jnp.asarray(Y)
  ours, theirs = (
    DropoutBatchNormBag(nnx.Rngs(0)),
    DropoutBatchNormBag(nnx.Rngs(0)),
  )
  value, grads = nnx.jit(param_only_value_and_grad)(ours, ids, y)
  assert isinstance(grads["embed"]["embedding"].get_value(), gtx.SparseRows)

  @nnx.jit
  def reference(model, ids, y):
    diff = nnx.DiffState(0, nnx.Param)
    return nnx.value_and_grad(mse, argnums=diff)(model, ids, y)

  want_value, want = reference(theirs, ids, y)
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  _assert_states_close(_sparse_to_dense(grads), want)
  # the same dropout mask was drawn, the same batch statistics kept
  rest = nnx.Not(nnx.Param)
  _assert_states_close(nnx.state(ours, rest), nnx.state(theirs, rest))
  assert not np.allclose(ours.bn.mean[...], 0)  # the check can fail


def test_param_only_training_step_under_jit_with_nnx_optimizer():
  lr, y = 0.1, jnp.asarray(Y)
  model = DropoutBatchNormBag(nnx.Rngs(1))
  loss, params = param_loss(model, jnp.asarray(BAGS[0]), y)
  labels = gtx.sparse_labels(loss, has_aux=True)(params)
  assert labels["embed"]["embedding"] == "sparse"
  assert labels["bn"]["scale"] == "dense" and "mean" not in labels["bn"]
  np.testing.assert_array_equal(model.bn.mean[...], 0)  # traced a copy
  tx = optax.multi_transform(
    {"sparse": gtx.lazy_sgd(lr), "dense": optax.sgd(lr)}, labels
  )
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit(donate_argnums=(0, 1))
  def step(model, optimizer, want, reference, ids, y):
    # the gtx step and nnx's (reference_step), one program
    value, grads = param_only_value_and_grad(model, ids, y)
    optimizer.update(model, grads)
    return value, reference_step(want, reference, ids, y)[0]

  want = DropoutBatchNormBag(nnx.Rngs(1))
  reference = nnx.Optimizer(want, optax.sgd(lr), wrt=nnx.Param)

  table = model.embed.embedding.get_value()
  for bag in BAGS + BAGS:
    got, want_value = step(
      model, optimizer, want, reference, jnp.asarray(bag), y
    )
    np.testing.assert_allclose(got, want_value, rtol=1e-5)
  assert table.is_deleted()  # donated: updated in place
  assert int(optimizer.step[...]) == 2 * len(BAGS)
  _assert_states_close(nnx.state(model), nnx.state(want), 1e-5, 1e-6)


def test_rows_per_step_from_a_report_of_an_nnx_module():
  ids, y = jnp.asarray(BAGS[0]), jnp.asarray(Y)
  model = Bag(nnx.Rngs(0))
  report = gtx.sparsity_report(mse)(model, ids, y)
  assert report.sparse_paths == (".embed.embedding.value",)
  tx = gtx.accumulate(gtx.lazy_sgd(0.1), 2, rows_per_step=report)
  # the Param state (as nnx.Optimizer passes it) and its pure form
  params = nnx.state(model, nnx.Param)
  for p in (params, nnx.as_pure(params)):
    acc = nnx.as_pure(tx.init(p).accumulator)
    assert acc["embed"]["embedding"].nnz == 2 * ids.size
    assert not isinstance(acc["head"]["kernel"], gtx.SparseRows)


def test_accumulate_trains_inside_nnx_optimizer():
  # nnx.Optimizer stores the state in nnx Variables and hands a SparseRows
  # buffer back as {0: ids, 1: rows} from the second update on
  y = jnp.asarray(Y)
  model = Bag(nnx.Rngs(0))
  report = gtx.sparsity_report(mse)(model, jnp.asarray(BAGS[0]), y)

  def make():
    return gtx.accumulate(gtx.lazy_adam(0.1), 2, rows_per_step=report)

  optimizer = nnx.Optimizer(model, make(), wrt=nnx.Param)
  graphdef, params = nnx.split(Bag(nnx.Rngs(0)), nnx.Param)
  params = nnx.as_pure(params)
  tx = make()
  state = tx.init(params)

  def reference_step(params, state, ids):
    loss = lambda p: mse(nnx.merge(graphdef, p), ids, y)  # noqa: E731
    value, grads = gtx.sparse_value_and_grad(loss)(params)
    updates, state = tx.update(grads, state, params)
    return gtx.apply_updates(params, updates), state, value

  @nnx.jit
  def step(model, optimizer, params, state, ids):
    # the nnx.Optimizer step and the reference on the pure state, one program
    value, grads = gtx.sparse_value_and_grad(mse)(model, ids, y)
    optimizer.update(model, grads)
    return value, reference_step(params, state, ids)

  for bag in BAGS * 3:  # three windows of two
    got, (params, state, want) = step(
      model, optimizer, params, state, jnp.asarray(bag)
    )
    np.testing.assert_allclose(got, want, rtol=1e-6)
  assert int(state.num_updates) == 3
  _assert_states_close(nnx.as_pure(nnx.state(model, nnx.Param)), params)


# ----------------------------------------------------------------------------
# NNX modules with Dropout and BatchNorm passed straight in, as to
# nnx.value_and_grad: the nnx.Param state differentiated, the RNG counts and
# batch statistics the loss updates written back


def _rest(model):
  """The state that is not differentiated: RNG keys and counts, BatchNorm's
  statistics."""
  return nnx.state(model, nnx.Not(nnx.Param))


def _assert_same_rest(got, want):
  _assert_states_close(_rest(got), _rest(want))
  assert not np.allclose(got.bn.mean[...], 0)  # the statistics moved
  assert int(got.drop.rngs.count[...]) > 0  # a dropout mask was drawn


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("argnums", ["int", "DiffState"])
def test_a_module_with_dropout_and_batch_norm_straight_in(argnums, jit):
  ids, y = jnp.asarray(BAGS[0]), jnp.asarray(Y)
  argnums = 0 if argnums == "int" else nnx.DiffState(0, nnx.Param)
  ours = DropoutBatchNormBag(nnx.Rngs(0))
  theirs = DropoutBatchNormBag(nnx.Rngs(0))
  vg = gtx.sparse_value_and_grad(mse, argnums=argnums)
  reference = nnx.value_and_grad(mse, argnums=argnums)
  if jit:
    vg, reference = nnx.jit(vg), nnx.jit(reference)
  for bag in BAGS:  # a second call draws the next dropout mask
    ids = jnp.asarray(bag)
    value, grads = vg(ours, ids, y)
    want_value, want = reference(theirs, ids, y)
    assert isinstance(grads, nnx.State)
    assert isinstance(grads["embed"]["embedding"].get_value(), gtx.SparseRows)
    assert "mean" not in grads["bn"] and "drop" not in grads
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    _assert_states_close(_sparse_to_dense(grads), want)
    _assert_same_rest(ours, theirs)
  assert int(ours.drop.rngs.count[...]) == len(BAGS)


@pytest.mark.parametrize("argnums", ["int", "DiffState"])
def test_sparse_grad_and_has_aux_with_a_module_straight_in(argnums):
  ids, y = jnp.asarray(BAGS[0]), jnp.asarray(Y)
  argnums = 0 if argnums == "int" else nnx.DiffState(0, nnx.Param)
  ours = DropoutBatchNormBag(nnx.Rngs(0))
  theirs = DropoutBatchNormBag(nnx.Rngs(0))

  def loss(model, ids, y):
    out = model(ids)
    return jnp.mean((out - y) ** 2), out

  grads, aux = gtx.sparse_grad(loss, argnums=argnums, has_aux=True)(
    ours, ids, y
  )
  want, want_aux = nnx.grad(loss, argnums=argnums, has_aux=True)(theirs, ids, y)
  np.testing.assert_allclose(aux, want_aux, rtol=1e-6)
  _assert_states_close(_sparse_to_dense(grads), want)
  _assert_same_rest(ours, theirs)


def test_labels_and_report_of_a_module_with_dropout_leave_it_as_it_was():
  ids, y = jnp.asarray(BAGS[0]), jnp.asarray(Y)
  model = DropoutBatchNormBag(nnx.Rngs(0))
  before = nnx.state(model)
  for argnums in (0, nnx.DiffState(0, nnx.Param)):
    labels = gtx.sparse_labels(mse, argnums=argnums)(model, ids, y)
    # the labels of nnx.state(model, nnx.Param), the tree
    # nnx.Optimizer(wrt=nnx.Param) hands its transformation
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    assert jax.tree.structure(labels) == jax.tree.structure(params)
    assert labels["embed"]["embedding"] == "sparse"
    assert labels["bn"]["scale"] == labels["head"]["kernel"] == "dense"
    report = gtx.sparsity_report(
      mse, argnums=argnums, require_sparse=".embed.embedding"
    )(model, ids, y)
    assert report.sparse_paths == (".embed.embedding.value",)
    assert len(report) == len(jax.tree.leaves(params))
  _assert_states_close(nnx.state(model), before, rtol=0, atol=0)


class RecsysModel(nnx.Module):
  """nnx.Embed, BatchNorm, Dropout, Linear: a small recommender tower."""

  def __init__(self, rows, rngs):
    self.embed = nnx.Embed(rows, 4, rngs=rngs)
    self.bn = nnx.BatchNorm(4, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)
    self.hidden = nnx.Linear(4, 8, rngs=rngs)
    self.head = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, ids):
    h = self.bn(self.embed(ids).mean(1))
    return self.head(jax.nn.relu(self.hidden(self.drop(h))))[:, 0]


def test_recsys_training_straight_through_matches_nnx_value_and_grad():
  lr, rows, steps = 0.05, 8, 4
  # every step reads every row (twice at most): lazy_adam then updates
  # every row, as optax.adam does, and the reference is optax.adam itself
  rng = np.random.default_rng(0)
  batches = [
    np.concatenate([rng.permutation(rows), rng.integers(0, rows, 4)])
    .reshape(4, 3)
    .astype(np.int32)
    for _ in range(steps)
  ]
  ys = rng.normal(size=(steps, 4)).astype(np.float32)
  model = RecsysModel(rows, nnx.Rngs(3))
  labels = gtx.sparse_labels(mse)(model, jnp.asarray(batches[0]), ys[0])
  tx = optax.multi_transform(
    {"sparse": gtx.lazy_adam(lr), "dense": optax.adam(lr)}, labels
  )
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit(donate_argnums=(0, 1))
  def step(model, optimizer, want, reference, ids, y):
    # the gtx step and nnx's (reference_step), one program
    value, grads = gtx.sparse_value_and_grad(mse)(model, ids, y)
    optimizer.update(model, grads)
    return (value, grads), reference_step(want, reference, ids, y)

  want = RecsysModel(rows, nnx.Rngs(3))
  reference = nnx.Optimizer(want, optax.adam(lr), wrt=nnx.Param)

  table = model.embed.embedding.get_value()
  for ids, y in zip(batches, ys, strict=True):
    (value, grads), (want_value, want_grads) = step(
      model, optimizer, want, reference, jnp.asarray(ids), jnp.asarray(y)
    )
    assert isinstance(grads["embed"]["embedding"].get_value(), gtx.SparseRows)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    _assert_states_close(_sparse_to_dense(grads), want_grads, 1e-5, 1e-6)
    _assert_same_rest(model, want)
  assert table.is_deleted()  # donated: the table updated in place
  assert int(model.drop.rngs.count[...]) == steps
  _assert_states_close(nnx.state(model), nnx.state(want), 1e-5, 1e-6)


class CallerRngs(nnx.Module):
  """Dropout whose RNG stream the caller passes in."""

  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.drop = nnx.Dropout(0.5)
    self.head = nnx.Linear(D, 1, rngs=rngs)

  def __call__(self, ids, rngs):
    return self.head(self.drop(self.embed(ids).mean(1), rngs=rngs))[:, 0]


def test_rngs_beside_the_module_advance_as_with_nnx_value_and_grad():
  y = jnp.asarray(Y)

  def positional(model, rngs, ids):
    return jnp.mean((model(ids, rngs) - y) ** 2)

  def keyword(model, ids, rngs):  # passed by keyword (nnx: by position)
    return positional(model, rngs, ids)

  for loss in (positional, keyword):
    ours, ours_rngs = CallerRngs(nnx.Rngs(0)), nnx.Rngs(dropout=7)
    theirs, their_rngs = CallerRngs(nnx.Rngs(0)), nnx.Rngs(dropout=7)
    for bag in BAGS:
      ids = jnp.asarray(bag)
      if loss is positional:
        value, grads = gtx.sparse_value_and_grad(loss)(ours, ours_rngs, ids)
        want_value, want = nnx.value_and_grad(loss)(theirs, their_rngs, ids)
      else:
        value, grads = gtx.sparse_value_and_grad(loss)(
          ours, ids, rngs=ours_rngs
        )
        want_value, want = nnx.value_and_grad(loss)(
          theirs, ids, rngs=their_rngs
        )
      np.testing.assert_allclose(value, want_value, rtol=1e-6)
      _assert_states_close(_sparse_to_dense(grads), want)
    assert int(ours_rngs.dropout.count[...]) == len(BAGS)
    _assert_states_close(nnx.state(ours_rngs), nnx.state(their_rngs))


def test_diff_state_filters_and_tuples_as_nnx_value_and_grad():
  ids, y = jnp.asarray(BAGS[0]), jnp.asarray(Y)
  scale = {"scale": jnp.asarray(2.0)}

  def loss(model, scale, ids, y):
    return scale["scale"] * mse(model, ids, y)

  embed_only = nnx.DiffState(0, nnx.All(nnx.Param, nnx.PathContains("embed")))
  for argnums in (embed_only, (nnx.DiffState(0, nnx.Param), 1)):
    ours = DropoutBatchNormBag(nnx.Rngs(0))
    theirs = DropoutBatchNormBag(nnx.Rngs(0))
    value, grads = gtx.sparse_value_and_grad(loss, argnums=argnums)(
      ours, scale, ids, y
    )
    want_value, want = nnx.value_and_grad(loss, argnums=argnums)(
      theirs, scale, ids, y
    )
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    if isinstance(argnums, tuple):
      np.testing.assert_allclose(grads[1]["scale"], want[1]["scale"], rtol=1e-6)
      grads, want = grads[0], want[0]
      report = gtx.sparsity_report(loss, argnums=argnums)(ours, scale, ids, y)
      # each argument's paths as it spells them: the module's attributes
      assert report.sparse_paths == ("[0].embed.embedding.value",)
      assert report[-1].path == "[1]['scale']"
    else:
      assert list(grads) == ["embed"]
    _assert_states_close(_sparse_to_dense(grads), want)
    _assert_same_rest(ours, theirs)


def test_diff_state_on_an_argument_that_is_no_module_is_refused():
  params = {"emb": jnp.ones((V, D))}
  loss = lambda p, ids: p["emb"][ids].sum()  # noqa: E731
  ids = jnp.asarray(BAGS[0])
  for make in (gtx.sparse_value_and_grad, gtx.sparse_grad, gtx.sparse_labels):
    with pytest.raises(TypeError, match=r"`argnums` nnx.DiffState\(0, ...\)"):
      make(loss, argnums=nnx.DiffState(0, nnx.Param))(params, ids)
  with pytest.raises(ValueError, match="`argnums` .* out of range"):
    gtx.sparse_grad(loss, argnums=nnx.DiffState(2, nnx.Param))(params, ids)


def test_labels_of_a_diff_state_filter_fit_nnx_optimizer_with_that_wrt():
  y, lr = jnp.asarray(Y), 0.1
  tables = nnx.All(nnx.Param, nnx.PathContains("embed"))
  argnums = nnx.DiffState(0, tables)

  def make(make_tx):
    model = DropoutBatchNormBag(nnx.Rngs(0))
    return model, nnx.Optimizer(model, make_tx(model), wrt=tables)

  def labelled(model):
    labels = gtx.sparse_labels(mse, argnums=argnums)(
      model, jnp.asarray(BAGS[0]), y
    )
    assert nnx.to_pure_dict(labels) == {"embed": {"embedding": "sparse"}}
    return optax.multi_transform({"sparse": gtx.lazy_sgd(lr)}, labels)

  got, got_optimizer = make(labelled)
  want, want_optimizer = make(lambda _: optax.sgd(lr))

  @nnx.jit
  def step(got, got_optimizer, want, want_optimizer, ids):
    # the labelled gtx run and the optax.sgd one on nnx.grad, one program
    grads = gtx.sparse_grad(mse, argnums=argnums)(got, ids, y)
    got_optimizer.update(got, grads)
    want_optimizer.update(want, nnx.grad(mse, argnums=argnums)(want, ids, y))

  for bag in BAGS:
    step(got, got_optimizer, want, want_optimizer, jnp.asarray(bag))
  _assert_states_close(nnx.state(got), nnx.state(want))
  assert not np.allclose(  # the table trained
    got.embed.embedding[...],
    DropoutBatchNormBag(nnx.Rngs(0)).embed.embedding[...],
  )
