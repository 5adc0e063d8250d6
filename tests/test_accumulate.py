"""k-step gradient accumulation: gradtx.accumulate."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references as ref
import references_accumulate as ref_acc
from conformance import cast
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradtx as gtx

INT32_MAX = np.iinfo(np.int32).max

# ----------------------------------------------------------------------------
# helpers


def _dense_params():
  rng = np.random.RandomState(0)
  return {
    "a": cast(rng.normal(size=(4, 3)), jnp.float32),
    "b": cast(rng.normal(size=(3,)), jnp.float32),
  }


def _dense_grads(step):
  rng = np.random.RandomState(1000 + step)
  return {
    "a": cast(rng.normal(size=(4, 3)), jnp.float32),
    "b": cast(rng.normal(size=(3,)), jnp.float32),
  }


NUM_ROWS, DIM, N = 20, 3, 5


def _table_params():
  rng = np.random.RandomState(1)
  return {
    "emb": cast(rng.normal(size=(NUM_ROWS, DIM)), jnp.float32),
    "w": cast(rng.normal(size=(DIM,)), jnp.float32),
  }


def _table_grads(step, n=N):
  rng = np.random.RandomState(2000 + step)
  ids = rng.randint(0, NUM_ROWS, size=n)
  ids[-1] = ids[0]  # a duplicate within the step
  if n > 2:
    ids[1] = -1  # padding
  return {
    "emb": gtx.SparseRows(
      cast(ids, jnp.int32),
      cast(rng.normal(size=(n, DIM)), jnp.float32),
      NUM_ROWS,
    ),
    "w": cast(rng.normal(size=(DIM,)), jnp.float32),
  }


def _np_tree(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _assert_tree_close(a, b, rtol=1e-6, atol=1e-7):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb, strict=True):
    np.testing.assert_allclose(
      np.asarray(x, np.float64), np.asarray(y, np.float64), rtol, atol
    )


def _is_sparse(x):
  return isinstance(x, gtx.SparseRows)


def _is_zero_update(u):
  for leaf in jax.tree.leaves(u, is_leaf=_is_sparse):
    if isinstance(leaf, gtx.SparseRows):
      if np.any(np.asarray(leaf.valid_indices()) < leaf.num_rows):
        return False
    elif np.any(np.asarray(leaf) != 0):
      return False
  return True


# ----------------------------------------------------------------------------
# dense: identical to optax.MultiSteps


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize("inner", ["adam", "sgd"])
def test_matches_multisteps(k, mean, inner):
  make = {"adam": lambda: optax.adam(0.1), "sgd": lambda: optax.sgd(0.1)}
  tx = gtx.accumulate(make[inner](), k, mean=mean)
  ms = optax.MultiSteps(make[inner](), k, use_grad_mean=mean)
  ours = jax.jit(tx.update)
  theirs = jax.jit(ms.update)
  p1 = p2 = _dense_params()
  s1, s2 = tx.init(p1), ms.init(p2)
  for t in range(11):
    g = _dense_grads(t)
    u1, s1 = ours(g, s1, p1)
    u2, s2 = theirs(g, s2, p2)
    # MultiSteps takes a Welford mean; ours sums and divides once.
    _assert_tree_close(u1, u2, rtol=2e-6, atol=1e-7)
    p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    assert int(s1.num_updates) == int(s2.gradient_step)
  _assert_tree_close(s1.inner_state, s2.inner_opt_state, 2e-6, 1e-7)


@pytest.mark.parametrize("mean", [True, False])
def test_schedule_matches_multisteps(mean):
  def schedule(n):
    return jnp.where(n < 2, 2, 3).astype(jnp.int32)

  tx = gtx.accumulate(optax.adam(0.1), schedule, mean=mean)
  ms = optax.MultiSteps(optax.adam(0.1), schedule, use_grad_mean=mean)
  ours, theirs = jax.jit(tx.update), jax.jit(ms.update)
  p1 = p2 = _dense_params()
  s1, s2 = tx.init(p1), ms.init(p2)
  emitted = []
  for t in range(13):
    g = _dense_grads(t)
    u1, s1 = ours(g, s1, p1)
    u2, s2 = theirs(g, s2, p2)
    _assert_tree_close(u1, u2, rtol=2e-6, atol=1e-7)
    p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    emitted.append(int(s1.num_accumulated) == 0)
  # windows of 2, 2, 3, 3, 3
  want = ref_acc.window_ends(lambda w: 2 if w < 2 else 3, 13)
  assert emitted == want


def test_dense_matches_numpy_reference():
  params = _dense_params()["a"]
  grads = [_dense_grads(t)["a"] for t in range(9)]
  tx = gtx.accumulate(gtx.scale_by_learning_rate(0.5), 4, mean=True)
  state = tx.init(params)
  want = ref_acc.accumulated_sgd(params, grads, lambda w: 4, 0.5, mean=True)
  step = jax.jit(_step_and_apply(tx))
  p = params
  for g, w in zip(grads, want, strict=True):
    _, p, state = step(p, state, g)
    np.testing.assert_allclose(np.asarray(p), w, rtol=1e-6, atol=1e-6)


def _step_and_apply(tx):
  """``(p, s, g) -> (u, apply_updates(p, u), s)``, for one jitted program."""

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return u, gtx.apply_updates(p, u), s

  return step


# ----------------------------------------------------------------------------
# the inner transformation is not computed on silent calls


def _counting(calls):
  """An identity transformation that records, from the device, each time its
  update actually runs."""

  def update(updates, state, params=None):
    del params
    jax.debug.callback(lambda: calls.append(1))
    return updates, state

  return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


def test_inner_not_computed_on_silent_calls():
  ours, theirs = [], []
  p = cast(np.zeros(3), np.float32)
  for tx in [
    gtx.accumulate(_counting(ours), 3),
    optax.MultiSteps(_counting(theirs), 3),
  ]:
    step = jax.jit(lambda g, s, tx=tx: tx.update(g, s, p))
    state = tx.init(p)
    for t in range(7):
      _, state = step(cast(np.full(3, float(t)), np.float32), state)
    jax.block_until_ready(state)
    jax.effects_barrier()
  assert len(ours) == 2  # calls 3 and 6 only
  assert len(theirs) == 7  # MultiSteps computes (and discards) every call


def test_compiled_step_has_a_conditional():
  tx = gtx.accumulate(optax.adam(0.1), 4)
  p = _dense_params()
  hlo = (
    jax.jit(lambda g, s: tx.update(g, s, p))
    .lower(_dense_grads(0), tx.init(p))
    .compile()
    .as_text()
  )
  assert "conditional(" in hlo


def test_no_extra_gradient_sized_buffer():
  # optax#528: beyond the accumulator in the state, a donated step needs
  # only the updates it returns (one params-sized temporary), less than
  # MultiSteps.
  params = {
    "w": cast(np.ones((256, 512)), np.float32),
    "b": cast(np.ones((512,)), np.float32),
  }
  size = sum(x.nbytes for x in jax.tree.leaves(params))

  def temp_bytes(tx):
    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s

    compiled = (
      jax.jit(step, donate_argnums=(0, 1))
      .lower(params, jax.eval_shape(tx.init, params), params)
      .compile()
    )
    return compiled.memory_analysis().temp_size_in_bytes

  ours = temp_bytes(gtx.accumulate(optax.adam(0.1), 4))
  theirs = temp_bytes(optax.MultiSteps(optax.adam(0.1), 4))
  assert ours <= 1.1 * size
  assert ours < theirs


# ----------------------------------------------------------------------------
# every_k = 1 is exactly the inner transformation


def test_k1_is_the_inner_transformation():
  params = _dense_params()
  tx = gtx.accumulate(optax.adam(0.1), 1)
  inner = optax.adam(0.1)
  s1, s2 = tx.init(params), inner.init(params)
  assert all(x is None for x in jax.tree.leaves(s1.accumulator))
  jaxpr = str(jax.make_jaxpr(tx.update)(_dense_grads(0), s1, params))
  assert "cond[" not in jaxpr
  p1 = p2 = params
  for t in range(4):
    u1, s1 = jax.jit(tx.update)(_dense_grads(t), s1, p1)
    u2, s2 = jax.jit(inner.update)(_dense_grads(t), s2, p2)
    jax.tree.map(np.testing.assert_array_equal, u1, u2)
    jax.tree.map(np.testing.assert_array_equal, s1.inner_state, s2)
    p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
    assert int(s1.num_updates) == t + 1
    assert int(s1.num_accumulated) == 0


def test_k1_passes_sparse_rows_through():
  tx = gtx.accumulate(gtx.scale_by_learning_rate(0.1), 1)
  params = _table_params()
  g = _table_grads(0)
  inner = gtx.scale_by_learning_rate(0.1)
  u, want = jax.jit(  # both in one program
    lambda g, p: (
      tx.update(g, tx.init(p), p)[0],
      inner.update(g, optax.EmptyState())[0],
    )
  )(g, params)
  np.testing.assert_array_equal(u["emb"].indices, want["emb"].indices)
  np.testing.assert_array_equal(u["emb"].values, want["emb"].values)


# ----------------------------------------------------------------------------
# state counters: "did this call apply an update"


def test_counters_tell_when_an_update_was_applied():
  tx = gtx.accumulate(optax.sgd(1.0), 3)
  p = cast(np.ones(2), np.float32)
  state = tx.init(p)
  step = jax.jit(tx.update)
  for t in range(8):
    before = int(state.num_updates)
    u, state = step(cast(np.full(2, t + 1.0), np.float32), state)
    applied = int(state.num_accumulated) == 0
    assert applied == (int(state.num_updates) == before + 1)
    assert applied == (not _is_zero_update(u))
    assert applied == ((t + 1) % 3 == 0)
    assert int(state.num_micro_steps) == t + 1
  for leaf in (state.num_micro_steps, state.num_updates, state.num_accumulated):
    assert leaf.dtype == jnp.int32 and leaf.shape == ()


def test_counters_saturate():
  tx = gtx.accumulate(optax.sgd(1.0), 2)
  state = tx.init(cast(np.ones(2), np.float32))._replace(
    num_micro_steps=cast(INT32_MAX, np.int32),
    num_updates=cast(INT32_MAX, np.int32),
    num_accumulated=cast(1, np.int32),
  )
  _, state = jax.jit(tx.update)(cast(np.ones(2), np.float32), state)
  assert int(state.num_micro_steps) == INT32_MAX
  assert int(state.num_updates) == INT32_MAX


# ----------------------------------------------------------------------------
# extra args


def _scale_by_factor():
  def update(updates, state, params=None, *, factor, **extra):
    del params, extra
    return jax.tree.map(lambda u: u * factor, updates), state

  return optax.GradientTransformationExtraArgs(
    lambda p: optax.EmptyState(), update
  )


def test_extra_args_reach_the_inner_on_the_emitting_call():
  tx = gtx.accumulate(_scale_by_factor(), 2, mean=False)
  state = tx.init(cast(np.zeros(2), np.float32))
  u, state = tx.update(cast([1.0, 2.0], np.float32), state, factor=10.0)
  np.testing.assert_array_equal(u, [0.0, 0.0])
  u, state = tx.update(
    cast([3.0, 4.0], np.float32), state, factor=cast(3.0, np.float32)
  )
  np.testing.assert_allclose(u, [12.0, 18.0])


def test_plain_inner_ignores_extra_args():
  plain = optax.GradientTransformation(
    lambda p: optax.EmptyState(), lambda u, s, p=None: (u, s)
  )
  tx = gtx.accumulate(plain, 2)
  state = tx.init(cast(np.zeros(2), np.float32))
  _, state = tx.update(cast(np.ones(2), np.float32), state, grad_step=3)
  u, state = tx.update(cast(np.full(2, 3.0), np.float32), state, grad_step=4)
  np.testing.assert_allclose(u, [2.0, 2.0])


# ----------------------------------------------------------------------------
# sparse accumulation


def _sparse_inners():
  return {
    "sgd": lambda: gtx.scale_by_learning_rate(0.1),
    # Global-norm clipping coalesces: the window's duplicates must be summed.
    "clip_sgd": lambda: optax.chain(
      gtx.clip_by_global_norm(0.5), gtx.scale_by_learning_rate(0.1)
    ),
    "lazy_adam": lambda: gtx.lazy_adam(0.1),
  }


@pytest.mark.parametrize(
  "inner, k, mean",
  [
    ("sgd", 3, False),
    ("clip_sgd", 2, True),
    ("lazy_adam", 2, True),
    ("lazy_adam", 3, False),
  ],
)
def test_sparse_equals_inner_on_concatenation(inner, k, mean):
  make = _sparse_inners()[inner]
  tx = gtx.accumulate(make(), k, mean=mean, rows_per_step={"emb": N, "w": None})
  params = _table_params()
  state = tx.init(params)
  buf = state.accumulator["emb"]
  # O(k * n * dim), not O(num_rows * dim)
  assert buf.indices.shape == (k * N,) and buf.values.shape == (k * N, DIM)

  ref_tx = make()
  ref_params, ref_state = params, ref_tx.init(params)
  step = jax.jit(_step_and_apply(tx))

  @jax.jit
  def ref_step(ref_params, ref_state, window):
    # the window's gradients concatenated, the update and apply: one program
    c = k if mean else 1
    cat = {
      "emb": gtx.SparseRows(
        jnp.concatenate([w["emb"].valid_indices() for w in window]),
        jnp.concatenate([w["emb"].values for w in window]) / c,
        NUM_ROWS,
      ),
      "w": sum(w["w"] for w in window) / c,
    }
    ru, ref_state = ref_tx.update(cat, ref_state, ref_params)
    return gtx.apply_updates(ref_params, ru), ref_state

  window = []
  for t in range(2 * k + 1):
    g = _table_grads(t)
    u, params, state = step(params, state, g)
    window.append(g)
    if len(window) == k:
      ref_params, ref_state = ref_step(ref_params, ref_state, window)
      window = []
    else:
      assert _is_zero_update(u)
    _assert_tree_close(params, ref_params, rtol=1e-6, atol=1e-6)
  _assert_tree_close(state.inner_state, ref_state, rtol=1e-6, atol=1e-6)


def test_sparse_matches_numpy_reference_with_fewer_rows():
  # Some steps carry fewer rows than declared: they are padded up.
  rows = [5, 3, 5, 2, 4, 5, 1]
  grads = [_table_grads(t, n=n)["emb"] for t, n in enumerate(rows)]
  params = _table_params()["emb"]
  tx = gtx.accumulate(gtx.scale_by_learning_rate(0.1), 3, rows_per_step=N)
  state = tx.init(params)
  dense = [ref.to_dense(g.indices, g.values, NUM_ROWS) for g in grads]
  want = ref_acc.accumulated_sgd(params, dense, lambda w: 3, 0.1, mean=True)
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  p = params
  for g, w in zip(grads, want, strict=True):
    u, state = step(p, state, g)
    p = gtx.apply_updates(p, u)
    np.testing.assert_allclose(np.asarray(p), w, rtol=1e-5, atol=1e-6)


def test_sparse_schedule_with_max_every_k():
  ks = [1, 3, 2]

  def schedule(n):
    return jnp.asarray(ks, jnp.int32)[n % 3]

  params = _table_params()["emb"]
  tx = gtx.accumulate(
    gtx.scale_by_learning_rate(0.1),
    schedule,
    mean=False,
    rows_per_step=N,
    max_every_k=3,
  )
  state = tx.init(params)
  assert state.accumulator.indices.shape == (3 * N,)
  grads = [_table_grads(t)["emb"] for t in range(10)]
  dense = [ref.to_dense(g.indices, g.values, NUM_ROWS) for g in grads]
  want = ref_acc.accumulated_sgd(
    params, dense, lambda w: ks[w % 3], 0.1, mean=False
  )
  step = jax.jit(_step_and_apply(tx))
  p = params
  for g, w in zip(grads, want, strict=True):
    _, p, state = step(p, state, g)
    np.testing.assert_allclose(np.asarray(p), w, rtol=1e-5, atol=1e-6)


def test_schedule_out_of_bounds_fails_at_run_time():
  tx = gtx.accumulate(
    gtx.scale(1.0), lambda n: n + 2, rows_per_step=2, max_every_k=2
  )
  table = cast(np.zeros((4, 1)), np.float32)
  g = gtx.SparseRows(
    cast([0, 1], np.int32), cast(np.ones((2, 1)), np.float32), 4
  )
  state = tx.init(table)
  step = jax.jit(lambda g, s: tx.update(g, s, table))
  _, state = step(g, state)
  _, state = step(g, state)  # window 0 (k=2) ends; window 1 asks for k=3
  with pytest.raises(Exception, match="returned 3; it must be >= 1 and <= "):
    jax.block_until_ready(step(g, state))
    jax.effects_barrier()


# ----------------------------------------------------------------------------
# dtypes


def test_float32_accumulator_for_bf16_gradients():
  # bf16 cannot hold 256 + 1: a bf16 running sum loses the small terms.
  grads = [cast([256.0, 8.0], jnp.bfloat16)] + [
    cast([1.0, 0.125], jnp.bfloat16)
  ] * 3
  p = cast(np.zeros(2), jnp.bfloat16)
  results = {}
  for acc_dtype in [jnp.float32, None]:
    tx = gtx.accumulate(
      optax.sgd(1.0), 4, mean=False, accumulator_dtype=acc_dtype
    )
    state = tx.init(p)
    assert state.accumulator.dtype == (acc_dtype or jnp.bfloat16)
    for g in grads:
      u, state = jax.jit(tx.update)(g, state)
    assert u.dtype == jnp.bfloat16
    assert state.accumulator.dtype == (acc_dtype or jnp.bfloat16)
    results[acc_dtype] = np.asarray(u, np.float64)
  exact = -np.sum([np.asarray(g, np.float64) for g in grads], axis=0)
  want = np.asarray(cast(exact, jnp.bfloat16), np.float64)
  np.testing.assert_array_equal(results[jnp.float32], want)
  assert results[None][0] != want[0]


def test_bf16_inner_state_dtype_is_kept():
  # optax.adam on bf16 params (optax#377, #1038): the cond must not fail.
  params = jax.tree.map(lambda x: cast(x, jnp.bfloat16), _dense_params())
  tx = gtx.accumulate(optax.adam(0.1), 2, accumulator_dtype=jnp.float32)
  state = tx.init(params)
  kinds = jax.tree.map(lambda x: x.dtype, state)

  @jax.jit
  def step(p, s, g):  # the update and optax's apply in one program
    u, s = tx.update(g, s, p)
    return u, s, optax.apply_updates(p, u)

  for t in range(4):
    g = jax.tree.map(lambda x: cast(x, jnp.bfloat16), _dense_grads(t))
    u, state, params = step(params, state, g)
  assert jax.tree.map(lambda x: x.dtype, state) == kinds
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))


# ----------------------------------------------------------------------------
# shard_map with vma checking: each device accumulates its own gradients


def test_shard_map_with_varying_gradients():
  mesh = jax.make_mesh((8,), ("d",))
  tx = gtx.accumulate(optax.adam(0.1), 2)
  grads = cast(np.random.RandomState(3).normal(size=(3, 8, 2)), np.float32)

  def body(p, gs):
    state = tx.init(p)
    out = []
    for t in range(3):
      u, state = tx.update(gs[t], state, p)
      p = optax.apply_updates(p, u)
      out.append(p)
    return jnp.stack(out), state.num_updates

  f = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(), P(None, "d")),
      out_specs=(P(None, "d"), P()),
      check_vma=True,
    )
  )
  p0 = jax.device_put(np.ones((1, 2), np.float32), NamedSharding(mesh, P()))
  gs = jax.device_put(grads, NamedSharding(mesh, P(None, "d")))
  got, num_updates = f(p0, gs)
  got = np.asarray(got)
  assert int(num_updates) == 1
  # Per device: call 1 silent, call 2 one Adam step on the mean of the
  # two gradients (first step: -lr * g / (|g| + eps)), call 3 silent.
  g = np.asarray(grads, np.float64)
  mean = (g[0] + g[1]) / 2
  after = 1.0 - 0.1 * mean / (np.abs(mean) + 1e-8)
  np.testing.assert_allclose(got[0], np.ones((8, 2)))
  np.testing.assert_allclose(got[1], after, rtol=1e-6)
  np.testing.assert_allclose(got[2], after, rtol=1e-6)


# ----------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("k", [0, -2])
def test_every_k_below_one(k):
  with pytest.raises(ValueError, match="`every_k` must be >= 1"):
    gtx.accumulate(optax.sgd(1.0), k)


@pytest.mark.parametrize("k", [2.0, "3", True, jnp.asarray(2), None])
def test_every_k_not_an_int(k):
  with pytest.raises(TypeError, match="`every_k` must be a Python int"):
    gtx.accumulate(optax.sgd(1.0), k)


def test_max_every_k_needs_a_schedule():
  with pytest.raises(ValueError, match="`max_every_k` only bounds"):
    gtx.accumulate(optax.sgd(1.0), 2, max_every_k=4)


def test_schedule_with_sparse_leaves_needs_max_every_k():
  tx = gtx.accumulate(optax.sgd(1.0), lambda n: 2, rows_per_step=4)
  with pytest.raises(ValueError, match="Pass `max_every_k=`"):
    tx.init(jnp.zeros((8, 2)))


def test_schedule_must_return_an_integer():
  tx = gtx.accumulate(optax.sgd(1.0), lambda n: 2.0 + 0 * n)
  state = tx.init(jnp.zeros(2))
  with pytest.raises(TypeError, match="must return an integer scalar"):
    tx.update(jnp.ones(2), state)


def test_accumulator_dtype_must_be_float():
  with pytest.raises(ValueError, match="`accumulator_dtype` must be"):
    gtx.accumulate(optax.sgd(1.0), 2, accumulator_dtype=jnp.int32)


def test_gradient_tree_must_match_the_state():
  tx = gtx.accumulate(optax.sgd(1.0), 2)
  state = tx.init(_dense_params())
  with pytest.raises(ValueError, match="`updates` does not have the tree"):
    tx.update({"a": jnp.zeros((4, 3))}, state)


def test_gradient_shape_must_match_the_state():
  tx = gtx.accumulate(optax.sgd(1.0), 2)
  state = tx.init(_dense_params())
  g = {"a": jnp.zeros((4, 3)), "b": jnp.zeros((4,))}
  with pytest.raises(ValueError, match=r"gradient at \['b'\] has shape"):
    tx.update(g, state)


def test_sparse_rows_without_rows_per_step():
  tx = gtx.accumulate(optax.sgd(1.0), 2)
  params = _table_params()
  with pytest.raises(
    ValueError, match=r"gradient at \['emb'\] is a SparseRows.*rows_per_step"
  ):
    tx.update(_table_grads(0), tx.init(params), params)


def test_sparse_rows_with_more_rows_than_declared():
  tx = gtx.accumulate(optax.sgd(1.0), 2, rows_per_step={"emb": 4, "w": None})
  params = _table_params()
  with pytest.raises(
    ValueError, match=r"\['emb'\] carries 5 rows but `rows_per_step` declares 4"
  ):
    tx.update(_table_grads(0), tx.init(params), params)


def test_dense_gradient_at_a_sparse_leaf():
  tx = gtx.accumulate(optax.sgd(1.0), 2, rows_per_step={"emb": 4, "w": None})
  params = _table_params()
  g = {"emb": jnp.zeros((NUM_ROWS, DIM)), "w": jnp.zeros(DIM)}
  with pytest.raises(ValueError, match=r"\['emb'\] is a dense"):
    tx.update(g, tx.init(params), params)


def test_sparse_rows_of_the_wrong_table():
  tx = gtx.accumulate(optax.sgd(1.0), 2, rows_per_step=2)
  g = gtx.SparseRows(jnp.array([0, 1]), jnp.ones((2, 2)), 8)
  with pytest.raises(ValueError, match="stands for shape"):
    tx.update(g, tx.init(jnp.zeros((4, 2))))


@pytest.mark.parametrize(
  "rows", [{"emb": 4}, {"emb": 0, "w": None}, {"emb": 2.5, "w": None}]
)
def test_bad_rows_per_step(rows):
  tx = gtx.accumulate(optax.sgd(1.0), 2, rows_per_step=rows)
  with pytest.raises(ValueError, match="`rows_per_step`"):
    tx.init(_table_params())


def test_rows_per_step_on_a_scalar_leaf():
  tx = gtx.accumulate(optax.sgd(1.0), 2, rows_per_step=3)
  with pytest.raises(ValueError, match="scalar"):
    tx.init({"s": jnp.zeros(())})


# ----------------------------------------------------------------------------
# rows_per_step from gtx.sparsity_report


def _report_params():
  rng = np.random.RandomState(3)
  return {
    "emb": cast(rng.normal(size=(NUM_ROWS, DIM)), jnp.float32),
    "frozen": cast(rng.normal(size=(NUM_ROWS, DIM)), jnp.float32),
    "w": cast(rng.normal(size=(DIM,)), jnp.float32),
  }


def _report_loss(p, ids):
  h = p["emb"][ids] + jax.lax.stop_gradient(p["frozen"])[ids]
  return jnp.sum(jnp.tanh(h @ p["w"]) * jnp.arange(1.0, 1 + ids.size))


REPORT_BATCHES = [
  np.array([3, 7, 3, 0], np.int32),
  np.array([7, 19, 5, 5], np.int32),
]


def test_rows_per_step_from_a_sparsity_report():
  params, lr = _report_params(), 0.5
  ids = jnp.asarray(REPORT_BATCHES[0])
  report = gtx.sparsity_report(_report_loss)(params, ids)
  tx = gtx.accumulate(gtx.lazy_sgd(lr), 2, rows_per_step=report)
  state = jax.jit(tx.init)(params)
  acc = state.accumulator
  # k slots of the report's rows: 4 ids, 1 for the frozen table's empty one
  assert acc["emb"].indices.shape == (8,) and acc["frozen"].nnz == 2
  assert not isinstance(acc["w"], gtx.SparseRows) and acc["w"].shape == (DIM,)

  @jax.jit
  def step(p, s, ids):
    g = gtx.sparse_grad(_report_loss)(p, ids)
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s

  p, s = params, state
  for batch in REPORT_BATCHES:
    p, s = step(p, s, jnp.asarray(batch))
  assert int(s.num_updates) == 1
  # SGD on the mean of jax.grad's dense gradients at the same params
  grad = jax.jit(jax.grad(_report_loss))  # one program for both batches
  grads = [grad(params, jnp.asarray(b)) for b in REPORT_BATCHES]
  for k in params:
    mean = (np.asarray(grads[0][k], np.float64) + np.asarray(grads[1][k])) / 2
    want = np.asarray(params[k], np.float64) - lr * mean
    np.testing.assert_allclose(p[k], want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(p["frozen"], params["frozen"])


def test_rows_per_step_from_a_report_inside_multi_transform():
  params = _report_params()
  ids = jnp.asarray(REPORT_BATCHES[0])
  report = gtx.sparsity_report(_report_loss)(params, ids)
  labels = gtx.sparse_labels(_report_loss)(params, ids)
  tx = optax.multi_transform(
    {
      "sparse": gtx.accumulate(gtx.lazy_adam(0.1), 2, rows_per_step=report),
      "dense": gtx.accumulate(optax.adam(0.1), 2),
    },
    labels,
  )

  @jax.jit
  def step(p, s, ids):
    g = gtx.sparse_grad(_report_loss)(p, ids)
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s

  p, s = params, tx.init(params)
  for batch in REPORT_BATCHES:
    p, s = step(p, s, jnp.asarray(batch))
  touched = np.unique(np.concatenate(REPORT_BATCHES))
  p, params = jax.device_get((p, params))
  moved = np.flatnonzero(np.any(p["emb"] != params["emb"], 1))
  np.testing.assert_array_equal(moved, touched)
  assert np.all(p["w"] != params["w"])


def test_rows_per_step_report_of_other_params():
  params = _report_params()
  report = gtx.sparsity_report(_report_loss)(
    params, jnp.asarray(REPORT_BATCHES[0])
  )
  tx = gtx.accumulate(gtx.lazy_sgd(0.1), 2, rows_per_step=report)
  renamed = {"table": params["emb"], "frozen": params["frozen"], "w": 1.0}
  with pytest.raises(
    ValueError,
    match=r"SparsityReport with no record for the params leaves \['table'\] "
    r"\(its records: \['emb'\], \['frozen'\], \['w'\]\).*"
    r"`gtx.sparsity_report\(loss\)\(params, batch\)`",
  ):
    tx.init(renamed)
  # a report of two arguments names its leaves [0]..., [1]...
  two = gtx.sparsity_report(lambda a, b, i: _report_loss(a, i), (0, 1))(
    params, params, jnp.asarray(REPORT_BATCHES[0])
  )
  tx = gtx.accumulate(gtx.lazy_sgd(0.1), 2, rows_per_step=two)
  with pytest.raises(ValueError, match="no record for the params leaves"):
    tx.init(params)
