"""drop_stale, staleness_stats and the threaded async trainer."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references as ref
import references_staleness as rs
from conformance import (
  CASES,
  IDS_PER_STEP,
  NUM_ROWS,
  lagging,
  standard_grads,
  standard_params,
)

import gradtx as gtx
from examples import async_trainer as at

INT32_MAX = 2**31 - 1

# A scripted arrival sequence for max_staleness=2. The global step starts at 0
# and grows by one per accepted gradient:
#   grad_step   0  0  0  0  1  4  1  2  3  6
#   staleness   0  1  2  3  2  0  4  3  2  0
#   outcome     A  A  A  D  A  A  D  D  A  A
SCRIPT_GRAD_STEPS = [0, 0, 0, 0, 1, 4, 1, 2, 3, 6]
SCRIPT_STALENESS = [0, 1, 2, 3, 2, 0, 4, 3, 2, 0]
SCRIPT_ACCEPT = [1, 1, 1, 0, 1, 1, 0, 0, 1, 1]


def _dense_params():
  rng = np.random.RandomState(0)
  return {
    "w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
  }


def _dense_grads(i):
  rng = np.random.RandomState(10 + i)
  return {
    "w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
    "b": jnp.asarray(rng.normal(size=(4,)), jnp.float32),
  }


def _step_fn(tx):
  @jax.jit
  def step(params, state, grads, grad_step):
    updates, state = tx.update(grads, state, params, grad_step=grad_step)
    return gtx.apply_updates(params, updates), state, updates

  return step


def _np(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _assert_tree_close(a, b, rtol=1e-5, atol=1e-6):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(
      np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol
    )


def _assert_tree_equal(a, b):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------
# Semantics against the reference


def test_reference_agrees_with_script():
  r = rs.DropStaleReference(rs.NumpySGD(0.1), max_staleness=2)
  outcomes, taus = [], []
  for i, gs in enumerate(SCRIPT_GRAD_STEPS):
    ok, _ = r.receive(_np(_dense_grads(i)), gs)
    outcomes.append(int(ok))
    taus.append(r.last_staleness)
  assert outcomes == SCRIPT_ACCEPT
  assert taus == SCRIPT_STALENESS


def test_scripted_sequence_adam_matches_reference():
  lr = 0.05
  tx = gtx.drop_stale(optax.adam(lr), max_staleness=2)
  step = _step_fn(tx)
  params = _dense_params()
  state = tx.init(params)
  r = rs.DropStaleReference(rs.NumpyAdam(lr), max_staleness=2)
  ref_params = _np(params)
  # optax.adam alone, fed only the gradients that are accepted.
  plain = optax.adam(lr)
  plain_params, plain_state = params, plain.init(params)
  plain_update = jax.jit(plain.update)
  for i, gs in enumerate(SCRIPT_GRAD_STEPS):
    grads = _dense_grads(i)
    prev_inner = state.inner_state
    prev_params = params
    params, state, updates = step(params, state, grads, jnp.int32(gs))
    accepted, ref_updates = r.receive(_np(grads), gs)
    assert accepted == bool(SCRIPT_ACCEPT[i])
    ref_params = {k: ref_params[k] + ref_updates[k] for k in ref_params}
    _assert_tree_close(params, ref_params, atol=1e-5)  # float32 vs float64
    assert int(state.step) == r.global_step == sum(SCRIPT_ACCEPT[: i + 1])
    assert int(state.num_dropped) == r.stale_counter
    assert int(state.last_staleness) == r.last_staleness == SCRIPT_STALENESS[i]
    if accepted:
      u, plain_state = plain_update(grads, plain_state, plain_params)
      plain_params = optax.apply_updates(plain_params, u)
    else:
      _assert_tree_equal(state.inner_state, prev_inner)
      _assert_tree_equal(params, prev_params)
      assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))
    _assert_tree_close(params, plain_params, rtol=1e-6, atol=1e-7)
    _assert_tree_close(state.inner_state, plain_state, rtol=1e-6, atol=1e-7)


def test_eager_matches_jit():
  tx = gtx.drop_stale(optax.adam(0.05), max_staleness=2)
  params_e = params_j = _dense_params()
  state_e = state_j = tx.init(params_e)
  step = _step_fn(tx)
  for i, gs in enumerate(SCRIPT_GRAD_STEPS[:5]):  # eager is slow; one drop
    u, state_e = tx.update(_dense_grads(i), state_e, params_e, grad_step=gs)
    params_e = gtx.apply_updates(params_e, u)
    params_j, state_j, _ = step(params_j, state_j, _dense_grads(i), gs)
  _assert_tree_close(params_e, params_j, rtol=1e-6, atol=1e-7)
  _assert_tree_equal(
    (state_e.step, state_e.num_dropped), (state_j.step, state_j.num_dropped)
  )


def test_max_staleness_zero_and_none():
  # limit 0: grad_step 4 and 6 arrive at steps 2 and 4 (ahead: dropped).
  for limit, want in [(0, [1, 0, 0, 0, 1, 0, 0, 1, 1, 0]), (None, [1] * 10)]:
    tx = gtx.drop_stale(gtx.scale_by_learning_rate(0.1), limit)
    step = _step_fn(tx)
    params = _dense_params()
    state = tx.init(params)
    r = rs.DropStaleReference(rs.NumpySGD(0.1), limit)
    got, expected = [], []
    for i, gs in enumerate(SCRIPT_GRAD_STEPS):
      before = int(state.step)
      params, state, _ = step(params, state, _dense_grads(i), gs)
      got.append(int(state.step) - before)
      expected.append(int(r.receive(_np(_dense_grads(i)), gs)[0]))
    assert got == expected == want


# ----------------------------------------------------------------------------
# Dropped gradients: zeros, and the inner is not computed


def test_drop_gives_zeros_of_the_inner_output_types():
  grads = standard_grads(0)
  params = standard_params()
  for inner in [
    gtx.scale_by_learning_rate(0.1),
    optax.chain(gtx.densify(), optax.sgd(0.1)),
  ]:
    tx = gtx.drop_stale(inner, 0)
    state = tx.init(params)
    state = state._replace(step=jnp.int32(5))
    updates, new_state = jax.jit(
      lambda g, s, p, tx=tx: tx.update(g, s, p, grad_step=jnp.int32(3))
    )(grads, state, params)
    accepted, _ = jax.jit(
      lambda g, s, p, tx=tx: tx.update(g, s, p, grad_step=jnp.int32(5))
    )(grads, state, params)
    assert jax.tree.structure(updates) == jax.tree.structure(accepted)
    assert int(new_state.num_dropped) == 1 and int(new_state.step) == 5
    emb = updates["emb"]
    if isinstance(accepted["emb"], gtx.SparseRows):
      assert isinstance(emb, gtx.SparseRows)
      np.testing.assert_array_equal(emb.indices, np.full(emb.nnz, NUM_ROWS))
      assert not np.any(np.asarray(emb.values))
      assert emb.values.shape == grads["emb"].values.shape
    else:
      assert emb.shape == (NUM_ROWS, 4)
      assert not np.any(np.asarray(emb))
    for k in ("w", "b"):
      assert not np.any(np.asarray(updates[k]))


def _counting_inner(calls):
  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None):
    del params
    leaf = jax.tree.leaves(updates)[0]
    jax.debug.callback(lambda x: calls.append(float(x)), jnp.sum(leaf))
    return gtx.scale(-0.1).update(updates, state)

  return optax.GradientTransformation(init_fn, update_fn)


def test_inner_not_computed_for_dropped_gradients():
  calls = []
  tx = gtx.drop_stale(_counting_inner(calls), 2)
  step = _step_fn(tx)
  params = _dense_params()
  state = tx.init(params)
  for i, gs in enumerate(SCRIPT_GRAD_STEPS):
    params, state, _ = step(params, state, _dense_grads(i), jnp.int32(gs))
  jax.effects_barrier()
  assert len(calls) == sum(SCRIPT_ACCEPT)
  accepted = [i for i, a in enumerate(SCRIPT_ACCEPT) if a]
  np.testing.assert_allclose(
    calls, [float(np.sum(_dense_grads(i)["b"])) for i in accepted], rtol=1e-6
  )
  # Eager calls too.
  calls.clear()
  state = tx.init(params)
  for i, gs in enumerate(SCRIPT_GRAD_STEPS[:5]):
    _, state = tx.update(_dense_grads(i), state, params, grad_step=gs)
  jax.effects_barrier()
  assert len(calls) == sum(SCRIPT_ACCEPT[:5])


def test_compiled_update_branches():
  # The compiled update holds a conditional, with the inner's work inside it.
  tx = gtx.drop_stale(optax.adam(0.1), 1)
  params = _dense_params()
  state = tx.init(params)
  hlo = (
    jax.jit(lambda g, s, p, gs: tx.update(g, s, p, grad_step=gs))
    .lower(_dense_grads(0), state, params, jnp.int32(0))
    .compile()
    .as_text()
  )
  assert "conditional" in hlo
  # Adam's work (its sqrt) lives only in the accepted branch of the cond.
  sqrt_ops = [line for line in hlo.splitlines() if " sqrt(" in line]
  assert sqrt_ops
  assert all("cond/branch_1_fun" in line for line in sqrt_ops), sqrt_ops


# ----------------------------------------------------------------------------
# rescale


def test_rescale_matches_reference_sparse_and_dense():
  lr = 0.3
  tx = gtx.drop_stale(gtx.scale_by_learning_rate(lr), 3, rescale=True)
  step = _step_fn(tx)
  params = standard_params()
  state = tx.init(params)
  r = rs.DropStaleReference(rs.NumpySGD(lr), 3, rescale=True)
  ref_params = _np(params)
  for i, gs in enumerate(SCRIPT_GRAD_STEPS):
    grads = standard_grads(i)
    params, state, updates = step(params, state, grads, jnp.int32(gs))
    dense = {
      "emb": ref.to_dense(grads["emb"].indices, grads["emb"].values, NUM_ROWS),
      "w": np.asarray(grads["w"], np.float64),
      "b": np.asarray(grads["b"], np.float64),
    }
    accepted, ref_updates = r.receive(dense, gs)
    assert isinstance(updates["emb"], gtx.SparseRows)
    np.testing.assert_allclose(
      updates["emb"].to_dense(), ref_updates["emb"], rtol=1e-6, atol=1e-7
    )
    tau = r.last_staleness
    if accepted:
      factor = -lr / max(1, tau)
      np.testing.assert_allclose(
        updates["w"], factor * dense["w"], rtol=1e-6, atol=1e-7
      )
    ref_params = {k: ref_params[k] + ref_updates[k] for k in ref_params}
    _assert_tree_close(params, ref_params)
  assert int(state.num_dropped) == r.stale_counter == 2  # staleness 5, 4


def test_rescale_with_adam_scales_before_inner():
  # Adam is nearly scale invariant, so check on the first moment instead.
  tx = gtx.drop_stale(optax.adam(0.1), None, rescale=True)
  params = _dense_params()
  state = tx.init(params)._replace(step=jnp.int32(4))
  g = _dense_grads(0)
  _, state = tx.update(g, state, params, grad_step=0)
  mu = state.inner_state[0].mu
  np.testing.assert_allclose(mu["w"], 0.1 * np.asarray(g["w"]) / 4, rtol=1e-6)


# ----------------------------------------------------------------------------
# Errors and edge cases


def test_missing_grad_step_raises():
  tx = gtx.drop_stale(gtx.scale(1.0), 1)
  params = _dense_params()
  with pytest.raises(TypeError, match="grad_step"):
    tx.update(_dense_grads(0), tx.init(params), params)
  chained = optax.chain(gtx.scale(1.0), tx)
  with pytest.raises(TypeError, match="grad_step"):
    jax.jit(chained.update)(_dense_grads(0), chained.init(params), params)


@pytest.mark.parametrize(
  "bad, err",
  [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError)],
)
def test_bad_max_staleness(bad, err):
  with pytest.raises(err, match="max_staleness"):
    gtx.drop_stale(gtx.scale(1.0), bad)
  with pytest.raises(ValueError, match="max_staleness"):
    gtx.drop_stale(gtx.scale(1.0), jnp.int32(-2))


def test_bad_arguments():
  with pytest.raises(TypeError, match="inner"):
    gtx.drop_stale(lambda g: g, 1)
  with pytest.raises(TypeError, match="rescale"):
    gtx.drop_stale(gtx.scale(1.0), 1, rescale=1)
  tx = gtx.drop_stale(gtx.scale(1.0), 1)
  state = tx.init(jnp.ones(2))
  with pytest.raises(TypeError, match="grad_step"):
    tx.update(jnp.ones(2), state, grad_step=0.0)
  with pytest.raises(ValueError, match="grad_step"):
    tx.update(jnp.ones(2), state, grad_step=jnp.zeros(2, jnp.int32))


def test_negative_staleness_raises_when_concrete():
  tx = gtx.drop_stale(gtx.scale(1.0), None)
  state = tx.init(jnp.ones(2))
  with pytest.raises(ValueError, match="ahead of the global step"):
    tx.update(jnp.ones(2), state, grad_step=1)


@pytest.mark.parametrize("limit", [None, 3])
def test_negative_staleness_under_jit_is_dropped(limit):
  tx = gtx.drop_stale(optax.adam(0.1), limit)
  step = _step_fn(tx)
  params = _dense_params()
  state = tx.init(params)
  params, state, _ = step(params, state, _dense_grads(0), jnp.int32(0))
  inner = state.inner_state
  new_params, state, updates = step(
    params, state, _dense_grads(1), jnp.int32(3)
  )
  assert int(state.step) == 1
  assert int(state.num_dropped) == 1
  assert int(state.last_staleness) == -2
  _assert_tree_equal(state.inner_state, inner)
  _assert_tree_equal(new_params, params)
  assert all(not np.any(np.asarray(u)) for u in jax.tree.leaves(updates))


def test_counters_saturate():
  tx = gtx.drop_stale(gtx.scale(1.0), 0)
  step = _step_fn(tx)
  params = jnp.ones(2)
  state = tx.init(params)._replace(
    step=jnp.int32(INT32_MAX), num_dropped=jnp.int32(INT32_MAX)
  )
  _, state, u = step(params, state, jnp.ones(2), jnp.int32(INT32_MAX))
  assert int(state.step) == INT32_MAX and np.all(np.asarray(u) == 1)
  _, state, u = step(params, state, jnp.ones(2), jnp.int32(0))
  assert int(state.num_dropped) == INT32_MAX and not np.any(np.asarray(u))
  assert state.step.dtype == state.num_dropped.dtype == jnp.int32
  stats = gtx.staleness_stats(state)
  assert float(stats["dropped_fraction"]) == 0.5


def test_state_types():
  tx = gtx.drop_stale(optax.adam(0.1), 1)
  state = tx.init(_dense_params())
  assert isinstance(state, gtx.DropStaleState)
  assert state._fields == (
    "step",
    "num_dropped",
    "last_staleness",
    "inner_state",
  )
  for x in state[:3]:
    assert x.dtype == jnp.int32 and x.shape == ()


def test_inner_that_changes_state_types_is_rejected():
  def init_fn(params):
    del params
    return jnp.zeros([], jnp.int32)

  def update_fn(updates, state, params=None):
    del params
    return updates, state.astype(jnp.float32)

  tx = gtx.drop_stale(optax.GradientTransformation(init_fn, update_fn), 1)
  with pytest.raises(TypeError, match="changes the structure"):
    tx.update(jnp.ones(2), tx.init(jnp.ones(2)), grad_step=0)


def test_extra_args_are_forwarded_to_inner():
  seen = {}

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, **extra):
    seen.update(extra)
    return updates, state

  tx = gtx.drop_stale(
    optax.GradientTransformationExtraArgs(init_fn, update_fn), 1
  )
  tx.update(jnp.ones(2), tx.init(jnp.ones(2)), grad_step=0, foo=3)
  assert set(seen) == {"grad_step", "foo"} and seen["foo"] == 3


# ----------------------------------------------------------------------------
# staleness_stats


def _feed(tx, grad_steps, params):
  state = tx.init(params)

  @jax.jit
  def upd(s, g, gs):
    return tx.update(g, s, params, grad_step=gs)[1]

  for gs in grad_steps:
    state = upd(state, jax.tree.map(jnp.ones_like, params), jnp.int32(gs))
  return state


def test_staleness_stats_in_chain_and_values():
  params = _dense_params()
  tx = optax.chain(
    gtx.clip_by_global_norm(1.0),
    gtx.drop_stale(optax.adam(0.1), 2),
    gtx.scale(1.0),
  )
  state = _feed(tx, SCRIPT_GRAD_STEPS, params)
  stats = gtx.staleness_stats(state)
  assert set(stats) == {
    "step",
    "num_dropped",
    "dropped_fraction",
    "last_staleness",
  }
  assert int(stats["step"]) == 7
  assert int(stats["num_dropped"]) == 3
  assert float(stats["dropped_fraction"]) == pytest.approx(0.3)
  assert int(stats["last_staleness"]) == 0
  assert stats["dropped_fraction"].dtype == jnp.float32
  # jittable
  jitted = jax.jit(gtx.staleness_stats)(state)
  assert float(jitted["dropped_fraction"]) == pytest.approx(0.3)


def test_staleness_stats_nothing_received():
  tx = gtx.drop_stale(gtx.scale(1.0), 1)
  stats = gtx.staleness_stats(tx.init(jnp.ones(2)))
  assert float(stats["dropped_fraction"]) == 0.0
  assert int(stats["step"]) == 0


def test_staleness_stats_inject_hyperparams_and_runtime_limit():
  params = _dense_params()
  tx = optax.inject_hyperparams(gtx.drop_stale)(
    inner=optax.adam(0.1), max_staleness=1
  )
  step = _step_fn(tx)
  state = tx.init(params)
  assert state.hyperparams["max_staleness"].dtype == jnp.int32
  for gs in [0, 0, 0]:  # staleness 0, 1, 2: the last is dropped
    params, state, _ = step(params, state, _dense_grads(0), jnp.int32(gs))
  stats = gtx.staleness_stats(state)
  assert (int(stats["step"]), int(stats["num_dropped"])) == (2, 1)
  # Raise the limit at run time: staleness 2 is now accepted.
  state.hyperparams["max_staleness"] = jnp.int32(2)
  params, state, _ = step(params, state, _dense_grads(0), jnp.int32(0))
  stats = gtx.staleness_stats(state)
  assert (int(stats["step"]), int(stats["num_dropped"])) == (3, 1)


def test_staleness_stats_inner_inject_hyperparams():
  tx = gtx.drop_stale(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), 0)
  state = _feed(tx, [0, 0, 1], _dense_params())
  assert int(gtx.staleness_stats(state)["num_dropped"]) == 1


def test_staleness_stats_errors_and_which():
  params = _dense_params()
  with pytest.raises(ValueError, match="no DropStaleState"):
    gtx.staleness_stats(optax.adam(0.1).init(params))
  outer = gtx.drop_stale(gtx.drop_stale(gtx.scale(1.0), 0), 5)
  state = _feed(outer, [0, 0, 0], params)
  # outer: staleness 0, 1, 2, all accepted; the inner (same grad_step,
  # its own step) sees 0, 1, 2 and accepts only the first.
  with pytest.raises(ValueError, match="which"):
    gtx.staleness_stats(state)
  assert int(gtx.staleness_stats(state, which=0)["step"]) == 3
  inner = gtx.staleness_stats(state, which=1)
  assert (int(inner["step"]), int(inner["num_dropped"])) == (1, 2)
  assert int(gtx.staleness_stats(state, which=-1)["step"]) == 1
  with pytest.raises(IndexError, match="which"):
    gtx.staleness_stats(state, which=2)
  with pytest.raises(TypeError, match="which"):
    gtx.staleness_stats(state, which="0")


# ----------------------------------------------------------------------------
# Nesting with sparse transforms, SparseRows, traced grad_step


def _dense_of(grads):
  return {
    "emb": ref.to_dense(grads["emb"].indices, grads["emb"].values, NUM_ROWS),
    "w": np.asarray(grads["w"], np.float64),
    "b": np.asarray(grads["b"], np.float64),
  }


@pytest.mark.parametrize(
  "make_inner, make_ref",
  [
    (lambda: gtx.scale_by_learning_rate(0.1), lambda: rs.NumpySGD(0.1)),
    (
      lambda: optax.chain(gtx.densify(), optax.adam(0.1)),
      lambda: rs.NumpyAdam(0.1),
    ),
  ],
  ids=["sparse_sgd", "densify_adam"],
)
def test_nested_sparse_under_jit(make_inner, make_ref):
  tx = optax.chain(gtx.drop_stale(make_inner(), 2), gtx.scale(1.0))
  step = _step_fn(tx)
  params = standard_params()
  state = tx.init(params)
  r = rs.DropStaleReference(make_ref(), 2)
  ref_params = _np(params)
  for i, gs in enumerate(SCRIPT_GRAD_STEPS):
    grads = standard_grads(i)
    params, state, _ = step(params, state, grads, jnp.int32(gs))
    _, ref_updates = r.receive(_dense_of(grads), gs)
    ref_params = {k: ref_params[k] + ref_updates[k] for k in ref_params}
    _assert_tree_close(params, ref_params, atol=1e-5)
  assert step._cache_size() == 1
  stats = gtx.staleness_stats(state)
  assert int(stats["num_dropped"]) == r.stale_counter == 3


ROWS_PER_STEP = {"emb": IDS_PER_STEP, "w": None, "b": None}


def _ref_grads(grads):
  e = grads["emb"]
  return {
    "emb": rs.Rows(np.asarray(e.indices), np.asarray(e.values), NUM_ROWS),
    "w": np.asarray(grads["w"], np.float64),
    "b": np.asarray(grads["b"], np.float64),
  }


def test_nested_accumulate_lazy_adam_sparse_under_jit():
  # rescale=True: the conformance case drop_stale_accumulate_sgd_rescale.
  rescale = False
  lr, k = 0.1, 2
  tx = optax.chain(
    gtx.drop_stale(
      gtx.accumulate(gtx.lazy_adam(lr), k, rows_per_step=ROWS_PER_STEP),
      2,
      rescale=rescale,
    ),
    gtx.scale(1.0),
  )
  step = _step_fn(tx)
  params = standard_params()
  state = tx.init(params)
  r = rs.DropStaleReference(
    rs.NumpyAccumulate(rs.NumpyLazyAdam(lr), k), 2, rescale=rescale
  )
  ref_params = _np(params)
  for i, gs in enumerate(SCRIPT_GRAD_STEPS):
    grads = standard_grads(i)
    before = state[0].inner_state
    params, state, updates = step(params, state, grads, jnp.int32(gs))
    accepted, ref_updates = r.receive(_ref_grads(grads), gs)
    assert isinstance(updates["emb"], gtx.SparseRows)
    if not accepted:
      _assert_tree_equal(state[0].inner_state, before)
    ref_params = {key: ref_params[key] + ref_updates[key] for key in ref_params}
    _assert_tree_close(params, ref_params, atol=1e-5)
  assert step._cache_size() == 1
  stats = gtx.staleness_stats(state)
  assert int(stats["num_dropped"]) == r.stale_counter == 3
  acc = state[0].inner_state
  assert isinstance(acc, gtx.AccumulateState)
  assert int(acc.num_updates) == 7 // k  # 7 accepted gradients


# ----------------------------------------------------------------------------
# The conformance suite's drop_stale cases (tests/conformance.py)


def test_cases_mix_accepts_and_drops():
  # The conformance cases (max_staleness=1) must exercise both branches.
  cases = [c for c in CASES if c.extra_args is lagging]
  assert cases
  for case in cases:
    r = rs.DropStaleReference(rs.NumpySGD(0.1), max_staleness=1)
    outcomes = [
      r.receive({}, case.extra_args(i)["grad_step"])[0]
      for i in range(case.steps)
    ]
    assert outcomes == [True, True, False], case.name


# ----------------------------------------------------------------------------
# The threaded async trainer


@pytest.fixture(scope="module")
def task():
  return at.make_task(seed=0, num_rows=200, num_train=512, num_eval=128)


def _no_worker_threads():
  return not any(t.name.startswith("worker-") for t in threading.enumerate())


def test_async_two_workers_produce_stale_gradients(task):
  r = at.run_async(
    task,
    workers=2,
    max_staleness=0,
    num_steps=30,
    time_limit=60.0,
    delay=0.003,
  )
  assert _no_worker_threads()
  assert r.stopped_by == "steps" and r.applied == 30
  assert r.dropped >= 1
  assert r.received == r.applied + r.dropped == sum(r.staleness_hist.values())
  # max_staleness=0: exactly the gradients with staleness > 0 are dropped.
  assert sum(v for k, v in r.staleness_hist.items() if k > 0) == r.dropped
  assert min(r.staleness_hist) >= 0
  assert r.dropped_fraction == pytest.approx(r.dropped / r.received)
  assert np.isfinite(r.final_loss)
  assert r.curve[0][0] == 0 and r.curve[-1][0] == 30


def test_async_one_worker_is_synchronous_sgd(task):
  # One worker waits for its gradient to be applied before reading again,
  # so every gradient is fresh and the run equals plain sequential SGD on
  # the same batches.
  lr, batch, steps, seed = 0.5, 32, 12, 3
  r = at.run_async(
    task,
    workers=1,
    max_staleness=0,
    num_steps=steps,
    learning_rate=lr,
    batch_size=batch,
    seed=seed,
  )
  assert _no_worker_threads()
  assert r.staleness_hist == {0: steps} and r.dropped == 0
  params = at.init_params(task, seed=seed)
  rng = np.random.default_rng([seed, 0])
  grad = jax.jit(jax.grad(at.loss_fn))
  for _ in range(steps):
    pick = rng.integers(0, len(task.train_ids), size=batch)
    g = grad(params, task.train_ids[pick], task.train_labels[pick])
    params = jax.tree.map(lambda p, g: p - lr * g, params, g)
  _assert_tree_close(r.params, params, rtol=1e-4, atol=1e-5)
  assert r.final_loss < r.curve[0][1]


def test_async_time_limit_stops_and_joins(task):
  r = at.run_async(
    task, workers=2, max_staleness=None, num_steps=10**6, time_limit=0.2
  )
  assert r.stopped_by == "time"
  assert _no_worker_threads()
  assert r.applied < 10**6
  assert r.received == r.applied + r.dropped


def test_async_rejects_bad_arguments(task):
  with pytest.raises(ValueError, match="workers"):
    at.run_async(task, workers=0, max_staleness=1)
  with pytest.raises(ValueError, match="num_steps"):
    at.run_async(task, workers=1, max_staleness=1, num_steps=0)
