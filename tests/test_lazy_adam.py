"""Lazy Adam: scale_by_lazy_adam, lazy_adam, lazy_adamw (and catch_up)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references_lazy_adam as ref
from conformance import (
  SHAPES,
  SPARSE,
  each,
  make_grads,
  make_params,
  run_with_references,
  step_fn,
  together,
)

import gradtx as gtx


def lazy_state(state):
  """The ScaleByLazyAdam(CatchUp)State inside a chain's state."""
  return state[0]


SCHEDULE = optax.linear_schedule(0.1, 0.01, 30)
CONFIGS = {
  "adam_schedule": (
    lambda cu: gtx.lazy_adam(SCHEDULE, catch_up=cu),
    dict(lr=SCHEDULE),
  ),
  "adamw_mask": (
    lambda cu: gtx.lazy_adamw(
      0.05,
      weight_decay=0.1,
      catch_up=cu,
      mask={"emb": True, "tab": False, "w": True, "b": False},
    ),
    dict(
      lr=0.05,
      weight_decay=0.1,
      decay_mask={"emb": True, "tab": False, "w": True, "b": False},
    ),
  ),
  "betas_eps_root": (
    lambda cu: gtx.lazy_adam(
      0.05, b1=0.8, b2=0.99, eps=1e-7, eps_root=1e-14, catch_up=cu
    ),
    dict(lr=0.05, b1=0.8, b2=0.99, eps=1e-7, eps_root=1e-14),
  ),
}


# ----------------------------------------------------------------------------
# Against the numpy reference


def _with_reference(make_tx, kw, catch_up):
  kw = dict(kw)
  lr = kw.pop("lr")
  lr_fn = lr if callable(lr) else (lambda _: lr)
  return (
    lambda: make_tx(catch_up),
    lambda p: ref.LazyAdam(p, lr_fn, catch_up=catch_up, **kw),
  )


def test_matches_numpy_reference():
  configs = {
    (name, catch_up): _with_reference(*CONFIGS[name], catch_up)
    for name in CONFIGS
    for catch_up in (False, True)
  }
  runs = run_with_references(configs, steps=20)

  def check(_, config):
    params, state, r = runs[config]
    s = lazy_state(state)
    for k in SHAPES:
      np.testing.assert_allclose(params[k], r.p[k], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(s.mu[k], r.m[k], rtol=2e-5, atol=1e-7)
      np.testing.assert_allclose(s.nu[k], r.v[k], rtol=2e-5, atol=1e-9)
      if config[1]:  # catch_up
        np.testing.assert_array_equal(s.last_step[k], r.last[k])
    assert int(s.count) == 20

  each(list(configs), check)


# ----------------------------------------------------------------------------
# Equal to optax when every row is touched


def all_rows_grads(step, dtype=jnp.float32):
  """Dense grads, and the same as SparseRows that touch every row exactly
  once (in a shuffled order) plus padding."""
  rng = np.random.RandomState(2000 + step)
  dense, sparse = {}, {}
  for k, s in SHAPES.items():
    g = rng.normal(size=s).astype(np.float32)
    dense[k] = jnp.asarray(g, dtype)
    if k in SPARSE:
      perm = rng.permutation(s[0])
      ids = np.concatenate([perm, [s[0], -1]])
      vals = np.concatenate([g[perm], np.ones((2, *s[1:]), np.float32)])
      sparse[k] = gtx.SparseRows(
        jnp.asarray(ids, jnp.int32), jnp.asarray(vals, dtype), s[0]
      )
    else:
      sparse[k] = dense[k]
  return dense, sparse


OPTAX_PAIRS = {
  "adam": (lambda: gtx.lazy_adam(0.05), lambda: optax.adam(0.05)),
  "adamw_schedule_eps_root": (
    lambda: gtx.lazy_adamw(SCHEDULE, eps_root=1e-6, weight_decay=0.1),
    lambda: optax.adamw(SCHEDULE, eps_root=1e-6, weight_decay=0.1),
  ),
  "adam_catch_up": (
    lambda: gtx.lazy_adam(0.05, catch_up=True),
    lambda: optax.adam(0.05),
  ),
  "mu_bf16": (
    lambda: gtx.lazy_adam(0.05, mu_dtype=jnp.bfloat16),
    lambda: optax.adam(0.05, mu_dtype=jnp.bfloat16),
  ),
}


def _run_pair(ours, theirs, steps=4, dtype=jnp.float32):
  """ours and optax, op by op, on the same gradients (sparse and dense)."""
  params = make_params(dtype=dtype)
  s_ours, s_theirs = ours.init(params), theirs.init(params)
  f_ours, f_theirs = step_fn(ours), step_fn(theirs, optax.apply_updates)
  p_ours = p_theirs = params
  for i in range(steps):
    dense, sparse = all_rows_grads(i, dtype)
    p_ours, s_ours = f_ours(p_ours, s_ours, sparse)
    p_theirs, s_theirs = f_theirs(p_theirs, s_theirs, dense)
  return p_ours, s_ours, p_theirs, s_theirs


def _run_pairs(pairs, steps=4, dtype=jnp.float32):
  """``_run_pair(ours, theirs)``, jitted, of every ``name: (ours,
  theirs)`` of ``pairs``: every pair's two steps in one jitted program
  (XLA compiles the kernels they share once). ``{name: (p_ours, s_ours,
  p_theirs, s_theirs)}``."""
  names = list(pairs)
  txs = [tx for n in names for tx in pairs[n]]
  params = make_params(dtype=dtype)
  carries = [(params, tx.init(params)) for tx in txs]

  fs = []
  for n in names:
    ours, theirs = pairs[n]
    fs += [step_fn(ours), step_fn(theirs, optax.apply_updates)]
  labels = [f"{n} {side}" for n in names for side in ("ours", "optax")]
  step = jax.jit(together(labels, fs))
  for i in range(steps):
    dense, sparse = all_rows_grads(i, dtype)
    carries = step(carries, [(sparse,), (dense,)] * len(names))
  return {
    n: (*carries[2 * j], *carries[2 * j + 1]) for j, n in enumerate(names)
  }


def test_all_rows_touched_equals_optax():
  """Every pair of OPTAX_PAIRS; a failure names its pair."""
  # Jitted: the moments of every leaf and the dense params are still
  # optax's bits. Sparse params may differ in the last bit or two: XLA's CPU
  # fusion contracts a*b+c into an FMA differently when the final add is a
  # scatter rather than an elementwise add.
  runs = _run_pairs({n: (o(), t()) for n, (o, t) in OPTAX_PAIRS.items()})

  def check(_, pair):
    p_ours, s_ours, p_theirs, s_theirs = runs[pair]
    for k in SHAPES:
      np.testing.assert_array_equal(
        s_ours[0].mu[k], s_theirs[0].mu[k], err_msg=f"mu {k}"
      )
      np.testing.assert_array_equal(
        s_ours[0].nu[k], s_theirs[0].nu[k], err_msg=f"nu {k}"
      )
      if k in SPARSE:  # |params| < 4: an f32 ulp is at most 2.4e-7
        np.testing.assert_allclose(
          p_ours[k], p_theirs[k], rtol=0, atol=5e-7, err_msg=k
        )
      else:
        np.testing.assert_array_equal(p_ours[k], p_theirs[k], err_msg=k)

  each(list(OPTAX_PAIRS), check)


def test_all_rows_touched_equals_optax_bitwise_op_by_op():
  # Op by op (no jit): the moments of every leaf and the dense params are
  # optax's bits. Sparse params may differ in the last bit: optax divides
  # every leaf by the bias correction in one compiled call, where XLA turns
  # a division shared by several leaves into a multiply by its reciprocal;
  # the rows of a group of tables are divided once, in their own pass.
  p_ours, s_ours, p_theirs, s_theirs = _run_pair(
    gtx.lazy_adam(0.05), optax.adam(0.05), steps=2
  )
  for k in SHAPES:
    np.testing.assert_array_equal(s_ours[0].mu[k], s_theirs[0].mu[k])
    np.testing.assert_array_equal(s_ours[0].nu[k], s_theirs[0].nu[k])
    if k in SPARSE:  # |params| < 4: an f32 ulp is at most 2.4e-7
      np.testing.assert_allclose(p_ours[k], p_theirs[k], rtol=0, atol=5e-7)
    else:
      np.testing.assert_array_equal(p_ours[k], p_theirs[k], err_msg=k)


def test_bf16_params_stay_bf16_and_match_optax():
  """mu in bf16 (mu_dtype None) and in float32: both runs in one jitted
  program; a failure names its mu_dtype."""
  mu_dtypes = {"bf16": None, "f32": jnp.float32}
  runs = _run_pairs(
    {
      name: (
        gtx.lazy_adam(0.05, mu_dtype=mu_dtype),
        optax.adam(0.05, mu_dtype=mu_dtype),
      )
      for name, mu_dtype in mu_dtypes.items()
    },
    dtype=jnp.bfloat16,
  )

  def check(_, name):
    mu_dtype = mu_dtypes[name]
    p_ours, s_ours, p_theirs, s_theirs = runs[name]
    for k in SHAPES:
      assert p_ours[k].dtype == jnp.bfloat16, k
      assert s_ours[0].mu[k].dtype == (mu_dtype or jnp.bfloat16), k
      assert s_ours[0].nu[k].dtype == jnp.bfloat16, k
      np.testing.assert_array_equal(
        s_ours[0].mu[k], s_theirs[0].mu[k], err_msg=f"mu {k}"
      )
      np.testing.assert_array_equal(
        s_ours[0].nu[k], s_theirs[0].nu[k], err_msg=f"nu {k}"
      )
      ours = np.asarray(p_ours[k], np.float32)
      theirs = np.asarray(p_theirs[k], np.float32)
      if k in SPARSE and mu_dtype is not None:
        # float32 updates: gtx.apply_updates rounds a SparseRows update to
        # bf16 before its in-place scatter-add, optax adds in float32 and
        # rounds once. |params| < 4, so a bf16 ulp is at most 2**-6.
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=2**-5, err_msg=k)
      else:
        np.testing.assert_array_equal(ours, theirs, err_msg=k)

  each(list(mu_dtypes), check)


# ----------------------------------------------------------------------------
# Determinism (untouched rows, in place, inject_hyperparams, Mirrored,
# row-sharded tables: the conformance suite)


def test_deterministic_with_duplicates():
  def run():
    tx = gtx.lazy_adam(0.05, catch_up=True)
    params = {"emb": make_params()["emb"]}
    state = tx.init(params)
    # A fresh function object each run: compiled anew.
    step = jax.jit(lambda p, s, g: step_fn(tx)(p, s, g))
    for i in range(4):
      g = make_grads(i, n=32)["emb"]
      # many duplicates of a few rows
      g = {"emb": gtx.SparseRows(g.indices % 5, g.values, 40)}
      params, state = step(params, state, g)
    return [np.asarray(x) for x in jax.tree.leaves((params, state))]

  first, second = run(), run()
  for a, b in zip(first, second, strict=True):
    assert a.tobytes() == b.tobytes()


# ----------------------------------------------------------------------------
# Catch-up


def _densify_first(tx, densify):
  """``(params, state, grads) -> (params, state)``: one update of ``tx``,
  its SparseRows gradient densified first with ``densify``."""

  def step(p, s, g):
    u, s = tx.update(g.to_dense() if densify else g, s, p)
    return gtx.apply_updates(p, u), s

  return step


def test_catch_up_equals_dense_adam_on_fixed_gradients():
  """A gradient sequence that is zero on the rows it does not list: dense
  Adam on it, and lazy Adam with catch-up, agree once every row has been
  touched again (the last step lists every row)."""
  num_rows, dim, steps = 64, 4, 40
  rng = np.random.RandomState(5)
  seq = []
  for i in range(steps):
    ids = np.arange(num_rows)  # the last step lists every row
    if i < steps - 1:  # the others 6 (uneven) rows, the rest padding
      ids = np.full(num_rows, -1)
      ids[:6] = rng.randint(0, num_rows, size=6) ** 2 % num_rows
    vals = rng.normal(size=(len(ids), dim)).astype(np.float32)
    seq.append(gtx.SparseRows(jnp.asarray(ids, jnp.int32), vals, num_rows))
  p0 = jnp.asarray(rng.normal(size=(num_rows, dim)), jnp.float32)

  # the three runs in one jitted program
  runs = {
    "dense": (optax.adam(0.01), True),
    "catch_up": (gtx.lazy_adam(0.01, catch_up=True), False),
    "lazy": (gtx.lazy_adam(0.01), False),
  }
  carries = [(p0, tx.init(p0)) for tx, _ in runs.values()]
  step = jax.jit(
    together(list(runs), [_densify_first(*r) for r in runs.values()])
  )
  for g in seq:
    carries = step(carries, [(g,)] * len(runs))
  dense, caught, lazy = (np.asarray(p) for p, _ in carries)
  np.testing.assert_allclose(caught, dense, rtol=1e-5, atol=1e-6)
  # ... and the check can fail: plain lazy is far off.
  assert np.abs(lazy - dense).max() > 1e-2


def test_catch_up_epsilon_error_within_documented_bound():
  """Tiny gradients, where eps matters: the closed-form drift is within
  the docstring's bound of the exact step-by-step drift, and errs on the
  documented side."""
  eps, eps_root, b1, b2 = 1e-8, 1e-18, 0.9, 0.999
  num_rows, dim, k = 2, 16, 25
  rng = np.random.RandomState(3)
  g0 = (rng.lognormal(size=(1, dim)) * 1e-8).astype(np.float32)
  tx = gtx.scale_by_lazy_adam(b1, b2, eps, eps_root, catch_up=True)
  state = tx.init(jnp.zeros((num_rows, dim)))
  update = jax.jit(tx.update)

  def rows(i, v):
    return gtx.SparseRows(jnp.array([i]), jnp.asarray(v, jnp.float32), 2)

  _, state = update(rows(0, g0), state)  # row 0 at step 1
  for _ in range(k):  # row 0 skips k steps
    _, state = update(rows(1, np.ones((1, dim))), state)
  u, _ = update(rows(0, np.zeros((1, dim))), state)  # step k + 2
  # Exact: moments after step 1, k skipped steps, then step k + 2.
  m = (1 - b1) * g0[0].astype(np.float64)
  v = (1 - b2) * m**2 / (1 - b1) ** 2
  drift, m_k, v_k = ref.skipped_drift(m, v, 1, k, b1, b2, eps, eps_root)
  d_now = ref.adam_direction(b1 * m_k, b2 * v_k, k + 2, b1, b2, eps, eps_root)
  ours = np.asarray(u.values[0], np.float64) - d_now
  rel = (ours - drift) / ours
  delta = eps + np.sqrt(eps_root)
  v_hat_k = b2**k * v / (1 - b2 ** (k + 1))
  bound = delta / (np.sqrt(v_hat_k) + delta)
  assert np.all(rel >= -1e-4), rel
  assert np.all(rel <= bound + 1e-4), (rel, bound)
  assert rel.max() > 0.01  # eps does matter here: the check can fail


def _trajectories(kinds, lr, steps=300, num_rows=200, dim=4):
  """Embedding regression with Zipf-distributed ids, then one batch of
  every row (which applies any catch-up still pending): the params of each
  of ``kinds`` ("dense" Adam, "lazy", "catch_up"), all in one jitted
  program."""
  rng = np.random.RandomState(0)
  target = jnp.asarray(rng.normal(size=(num_rows,)), jnp.float32)
  prob = 1.0 / np.arange(1, num_rows + 1) ** 1.2
  batches = rng.choice(num_rows, size=(steps, 16), p=prob / prob.sum())
  params = {
    "emb": jnp.asarray(rng.normal(size=(num_rows, dim)) * 0.1, jnp.float32),
    "w": jnp.asarray(rng.normal(size=(dim,)), jnp.float32),
  }

  def loss(p, ids):
    pred = gtx.lookup(p["emb"], ids) @ p["w"]
    return jnp.mean((pred - target[ids]) ** 2)

  def one_run(kind):
    if kind == "dense":
      tx, grad = optax.adam(lr), jax.grad(loss)
    else:
      tx = gtx.lazy_adam(lr, catch_up=kind == "catch_up")
      grad = gtx.sparse_grad(loss)

    def step(carry, ids):
      p, s = carry
      u, s = tx.update(grad(p, ids), s, p)
      return (gtx.apply_updates(p, u), s), None

    def run(params, batches, last):
      carry, _ = jax.lax.scan(step, (params, tx.init(params)), batches)
      return step(carry, last)[0][0]

    return run

  runs = [one_run(kind) for kind in kinds]
  return jax.jit(lambda *args: [run(*args) for run in runs])(
    params,
    jnp.asarray(batches, jnp.int32),
    jnp.arange(num_rows, dtype=jnp.int32),
  )


def test_catch_up_tracks_dense_adam_trajectory():
  # The catch-up error left is that a row's gradient is taken before its
  # pending drift is applied: it shrinks like lr**2, the lazy error like lr.
  dense, lazy, caught = _trajectories(("dense", "lazy", "catch_up"), 1e-3)

  def dist(p):  # numpy: no eager op compiled
    return float(
      np.sqrt(
        sum(
          np.sum((np.asarray(p[k]) - np.asarray(dense[k])) ** 2)
          for k in ("emb", "w")
        )
      )
    )

  d_lazy, d_caught = dist(lazy), dist(caught)
  print(f"distance to dense Adam: lazy {d_lazy:.4g}, catch_up {d_caught:.4g}")
  assert d_caught < 0.1 * d_lazy, (d_lazy, d_caught)


# ----------------------------------------------------------------------------
# Chains


def test_clip_then_lazy_adam_in_optax_chain():
  tx = optax.chain(gtx.clip_by_global_norm(1.0), gtx.lazy_adam(0.1))
  params = make_params()
  state = tx.init(params)
  params, state = jax.jit(step_fn(tx))(params, state, make_grads(0))
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


# ----------------------------------------------------------------------------
# Bad input


# Errors are raised at trace time: jax.eval_shape traces without compiling.


def test_bad_sparse_rows_raise():
  params = make_params()
  tx = gtx.lazy_adam(0.1)
  state = tx.init(params)
  g = make_grads(0)
  bad_rows = dict(g, emb=gtx.SparseRows(g["emb"].indices, g["emb"].values, 41))
  with pytest.raises(ValueError, match="num_rows=41.*shape"):
    jax.eval_shape(tx.update, bad_rows, state, params)
  bad_row_shape = dict(
    g, emb=gtx.SparseRows(g["emb"].indices, jnp.ones((9, 4)), 40)
  )
  with pytest.raises(ValueError, match=r"row shape \(4,\)"):
    jax.eval_shape(tx.update, bad_row_shape, state, params)
  # Without params, the state's shapes are checked.
  with pytest.raises(ValueError, match="optimizer state"):
    jax.eval_shape(tx.update, bad_rows, state)


def test_sparse_rows_where_state_has_no_moments_raises():
  params = dict(make_params(), emb=None)
  tx = gtx.scale_by_lazy_adam()
  state = tx.init(params)
  g = dict(make_grads(0))
  with pytest.raises(ValueError, match="holds no moments"):
    jax.eval_shape(tx.update, g, state)


def test_sparse_rows_at_dense_only_catch_up_state_raises():
  params = make_params()
  tx = gtx.scale_by_lazy_adam(catch_up=True)
  state = tx.init(params)
  # a state whose catch-up entry for "emb" belongs to another leaf
  state = state._replace(
    last_step=dict(state.last_step, emb=jnp.zeros([], jnp.int32))
  )
  with pytest.raises(ValueError, match="catch-up state"):
    jax.eval_shape(tx.update, make_grads(0), state)


def test_tree_mismatch_and_bad_betas_raise():
  tx = gtx.lazy_adam(0.1)
  state = tx.init(make_params())
  with pytest.raises(ValueError, match="tree structure"):
    jax.eval_shape(tx.update, {"emb": jnp.ones((40, 3))}, state)
  with pytest.raises(ValueError, match="b1 < sqrt\\(b2\\)"):
    gtx.lazy_adam(0.1, b1=0.99, b2=0.9, catch_up=True)


def test_dense_optax_transform_after_lazy_adam_raises():
  tx = optax.chain(gtx.scale_by_lazy_adam(), optax.scale(-0.1))
  params = make_params()
  with pytest.raises(TypeError, match="SparseRows"):
    jax.eval_shape(tx.update, make_grads(0), tx.init(params), params)


def test_dense_gradient_of_wrong_shape_is_an_error():
  tx = gtx.lazy_adam(0.1)
  p = jnp.ones(3)
  with pytest.raises(ValueError, match=r"shape \(3, 1\).*shape \(3,\)"):
    tx.update(jnp.ones((3, 1)), tx.init(p), p)
