"""gtx.partial_rowwise_adam: FBGEMM's PARTIAL_ROWWISE_ADAM (a first moment
per element, a second moment per row), against the numpy reference of
FBGEMM's formula (references_partial_rowwise_adam) and FBGEMM's own test
cases where they port.

The contract pinned down here (FBGEMM defines tables only; the rest is
this project's choice, see the reference's notes):

* ``gtx.partial_rowwise_adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8, *,
  weight_decay=0.0)``; its state holds ``mu`` like the params and ``nu``
  with one float32 per row (``[V]`` for a ``[V, *row]`` table); 516 B/row
  at 64 wide float32 (Adam: 768).
* Duplicate ids are summed before the row's one update (EXACT); padding
  ids (negative or >= num_rows) never write; untouched rows keep params,
  ``mu`` and ``nu`` bit for bit. The bias correction uses the global step
  count, as FBGEMM's ``iter``.
* Dense leaves: a 2-D (or higher) leaf is a table whose every row is
  touched; a 1-D leaf has rows of one element (``nu`` per element, plain
  Adam with FBGEMM's weight decay), a scalar is one such row.

Untouched and padding rows bit for bit, inject_hyperparams, row-sharded
tables and the in-place compiled step are test_optimizers.py's shared
checks, parametrized with this optimizer too. Until the optimizer exists
the tests that call it skip; the reference's own checks run.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references_partial_rowwise_adam as ref
from conformance import (
  SHAPES,
  each,
  make_grads,
  make_params,
  run_with_references,
  step_fn,
)

import gradtx as gtx

needs_impl = pytest.mark.skipif(
  not hasattr(gtx, "partial_rowwise_adam"),
  reason="gtx.partial_rowwise_adam is not implemented yet (issue 29, item 4)",
)
SCHEDULE = optax.linear_schedule(0.1, 0.01, 30)
# FBGEMM's test hyperparameters (backward_optimizers_test.py)
FBGEMM_HP = dict(lr=0.5, eps=1e-4, b1=0.9, b2=0.99, wd=0.01)


def _tx(lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
  return gtx.partial_rowwise_adam(lr, b1, b2, eps, weight_decay=wd)


def _moments(state):
  """``(mu, nu)`` trees of the state (the NamedTuple that has both)."""
  found = []

  def visit(x):
    if hasattr(x, "mu") and hasattr(x, "nu"):
      found.append((x.mu, x.nu))
    elif isinstance(x, (tuple, list)):
      for y in x:
        visit(y)
    elif isinstance(x, dict):
      for y in x.values():
        visit(y)

  visit(state)
  assert len(found) == 1, f"expected one state with mu and nu: {state}"
  return found[0]


def _const(x):
  return lambda _: x


# ----------------------------------------------------------------------------
# The reference itself, by hand


def test_reference_by_hand():
  # one row g = [3, 4] (mean square 12.5) from zero state, lr 0.1, eps 0:
  # v = 0.01 * 12.5, m = 0.1 * g, so v_hat = 12.5 and m_hat = g; the step
  # is lr * g / sqrt(12.5) = [0.0848528, 0.1131371]
  r = ref.PartialRowwiseAdam(
    {"e": np.ones((2, 2))}, _const(0.1), b2=0.99, eps=0.0
  )
  # ids 1, 1 and a padding id: [1, 2] + [2, 2] = [3, 4] on row 1 only
  r.step({"e": ([1, 1, 2], np.array([[1.0, 2], [2, 2], [9, 9]]), 2)})
  np.testing.assert_allclose(r.state["e"]["nu"], [0, 0.125])
  np.testing.assert_allclose(r.state["e"]["mu"], [[0, 0], [0.3, 0.4]])
  np.testing.assert_allclose(
    r.p["e"], [[1, 1], [1 - 0.0848528, 1 - 0.1131371]], rtol=1e-6
  )
  # the same gradient again: v_hat and m_hat stay 12.5 and g, the same step
  r.step({"e": ([1], np.array([[3.0, 4]]), 2)})
  np.testing.assert_allclose(
    r.p["e"][1], [1 - 2 * 0.0848528, 1 - 2 * 0.1131371], rtol=1e-6
  )
  # row 0 first touched at step 3 is corrected with t = 3 (the global count):
  # v = 0.01 * 12.5 / (1 - 0.99^3), m = 0.1 * g / (1 - 0.9^3)
  r.step({"e": ([0], np.array([[3.0, 4]]), 2)})
  v_hat = 0.125 / (1 - 0.99**3)
  m_hat = np.array([0.3, 0.4]) / (1 - 0.9**3)
  np.testing.assert_allclose(r.p["e"][0], 1 - 0.1 * m_hat / np.sqrt(v_hat))


def test_reference_weight_decay_and_leaf_shapes_by_hand():
  # decoupled decay on the row before the step: an extra -lr * wd * theta
  r = ref.PartialRowwiseAdam(
    {"e": np.ones((2, 2)), "v": np.ones(3), "s": np.float64(2.0)},
    _const(0.1),
    b2=0.99,
    eps=1e-12,  # 0 / eps on the row whose gradient is 0
    wd=0.5,
  )
  assert r.state["e"]["nu"].shape == (2,)
  assert r.state["v"]["nu"].shape == (3,)  # rows of one element
  assert r.state["s"]["nu"].shape == ()
  r.step(
    {
      "e": ([1], np.array([[3.0, 4]]), 2),
      "v": np.array([3.0, -4.0, 0.0]),  # dense: every row touched
      "s": np.float64(-5.0),
    }
  )
  np.testing.assert_allclose(
    r.p["e"], [[1, 1], [0.95 - 0.0848528, 0.95 - 0.1131371]], rtol=1e-6
  )
  # a row of one element: m_hat / sqrt(v_hat) = sign(g); a zero gradient
  # still decays (its row is touched)
  np.testing.assert_allclose(r.p["v"], [0.95 - 0.1, 0.95 + 0.1, 0.95])
  np.testing.assert_allclose(r.p["s"], 2 - 0.1 * (-1 + 0.5 * 2))


def test_reference_matches_fbgemm_test_expectation():
  rng = np.random.RandomState(0)
  w = rng.normal(size=(30, 8))
  g = np.zeros_like(w)
  g[[2, 5, 7]] = rng.normal(size=(3, 8))
  hp = FBGEMM_HP
  r = ref.PartialRowwiseAdam(
    {"e": w}, _const(hp["lr"]), hp["b1"], hp["b2"], hp["eps"], hp["wd"]
  )
  r.step({"e": ([2, 5, 7], g[[2, 5, 7]], 30)})
  m1, m2, new = ref.fbgemm_one_step(
    w, g, hp["lr"], hp["b1"], hp["b2"], hp["eps"], hp["wd"]
  )
  np.testing.assert_allclose(r.state["e"]["mu"], m1)
  np.testing.assert_allclose(r.state["e"]["nu"], m2)
  np.testing.assert_allclose(r.p["e"][[2, 5, 7]], new[[2, 5, 7]])


# ----------------------------------------------------------------------------
# Against the numpy reference

CONFIGS = {
  "defaults": (
    lambda: _tx(0.05),
    lambda p: ref.PartialRowwiseAdam(p, _const(0.05)),
  ),
  "fbgemm_test_hyperparameters": (
    lambda: _tx(**FBGEMM_HP),
    lambda p: ref.PartialRowwiseAdam(
      p,
      _const(FBGEMM_HP["lr"]),
      FBGEMM_HP["b1"],
      FBGEMM_HP["b2"],
      FBGEMM_HP["eps"],
      FBGEMM_HP["wd"],
    ),
  ),
  "schedule_decay": (
    lambda: _tx(SCHEDULE, b1=0.8, b2=0.95, eps=1e-3, wd=0.1),
    lambda p: ref.PartialRowwiseAdam(p, SCHEDULE, 0.8, 0.95, 1e-3, 0.1),
  ),
}


@needs_impl
def test_matches_numpy_reference():
  runs = run_with_references(CONFIGS)

  def check(_, config):
    params, state, r = runs[config]
    mu, nu = _moments(state)
    for k in SHAPES:
      np.testing.assert_allclose(params[k], r.p[k], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(
        mu[k], r.state[k]["mu"], rtol=1e-5, atol=1e-6, err_msg=f"mu {k}"
      )
      np.testing.assert_allclose(
        nu[k], r.state[k]["nu"], rtol=1e-5, atol=1e-7, err_msg=f"nu {k}"
      )
    moved = np.abs(np.asarray(params["emb"]) - make_params()["emb"]).max()
    assert moved > 1e-2

  each(list(CONFIGS), check)


# ----------------------------------------------------------------------------
# FBGEMM's test cases (backward_optimizers_test.py, PARTIAL_ROWWISE_ADAM):
# T tables of E rows x D, B bags of L ids each, pooled (SUM, MEAN, or NONE:
# one output per id), optionally weighted per id, "long segments" (every
# bag's first id the same row); one step from zero state with FBGEMM's
# hyperparameters; m2, m1 over all rows and the touched rows' weights
# against the expectation computed from the dense gradient.

FBGEMM_CASES = {
  # name: (T, D, B, L, E, pooling, weighted, mixed, long_segments)
  "one_table_one_id": (1, 8, 1, 1, 1000, "sum", False, False, False),
  "mean_pooling": (3, 64, 16, 4, 1000, "mean", False, False, False),
  "long_segments": (5, 12, 32, 20, 1000, "sum", False, False, True),
  "no_pooling": (2, 32, 8, 3, 10_000, "none", False, False, False),
  "weighted_mixed_sizes": (4, 16, 12, 5, 1000, "sum", True, True, False),
}


def _fbgemm_case(T, D, B, L, E, pooling, weighted, mixed, long_segments):
  rng = np.random.RandomState(7)
  if mixed:  # FBGEMM's mixed: D rounded to 4 in [D/4, D), E in [E/2, 2E)
    Ds = [(rng.randint(D // 4, D) + 3) // 4 * 4 for _ in range(T)]
    Es = [int(rng.randint(E // 2, 2 * E)) for _ in range(T)]
  else:
    Ds, Es = [D] * T, [E] * T
  weights = [
    rng.normal(size=(e, d)).astype(np.float32)
    for e, d in zip(Es, Ds, strict=True)
  ]
  xs = [rng.randint(0, e, size=(B, L)) for e in Es]
  if long_segments:
    for x, e in zip(xs, Es, strict=True):
      x[:, 0] = rng.randint(0, e)
  xws = [rng.normal(size=(B, L)).astype(np.float32) for _ in range(T)]
  out_rows = B * L if pooling == "none" else B
  gos = [rng.normal(size=(out_rows, d)).astype(np.float32) for d in Ds]
  return weights, xs, xws, gos


@needs_impl
@pytest.mark.parametrize("case", list(FBGEMM_CASES))
def test_fbgemm_backward_optimizers_case(case):
  T, D, B, L, E, pooling, weighted, mixed, long_segments = FBGEMM_CASES[case]
  weights, xs, xws, gos = _fbgemm_case(*FBGEMM_CASES[case])

  def loss(p, xs, xws, gos):
    total = 0.0
    for t in range(T):
      rows = p[f"t{t}"][xs[t]]  # [B, L, D]
      if weighted:
        rows = rows * xws[t][..., None]
      if pooling == "sum":
        out = rows.sum(1)
      elif pooling == "mean":
        out = rows.mean(1)
      else:
        out = rows.reshape(B * L, -1)
      total = total + jnp.sum(out * gos[t])
    return total

  params = {f"t{t}": w for t, w in enumerate(weights)}  # numpy, into jit
  tx = _tx(**FBGEMM_HP)

  @jax.jit  # one program: op by op, every op would compile on its own
  def step(params, xs, xws, gos):
    grads = gtx.sparse_grad(loss)(params, xs, xws, gos)
    u, state = tx.update(grads, tx.init(params), params)
    return grads, state, gtx.apply_updates(params, u)

  grads, state, new = step(params, xs, xws, gos)
  assert all(isinstance(grads[k], gtx.SparseRows) for k in params)
  mu, nu = _moments(state)
  for t in range(T):
    # the dense gradient, as FBGEMM's test takes it from torch's EmbeddingBag
    per_id = np.repeat(gos[t], L, axis=0) if pooling != "none" else gos[t]
    scale = np.ones((B, L)) if pooling != "mean" else np.full((B, L), 1 / L)
    if weighted:
      scale = scale * xws[t]
    dense = np.zeros(weights[t].shape)
    np.add.at(dense, xs[t].reshape(-1), per_id * scale.reshape(-1, 1))
    m1, m2, want = ref.fbgemm_one_step(
      weights[t].astype(np.float64),
      dense,
      FBGEMM_HP["lr"],
      FBGEMM_HP["b1"],
      FBGEMM_HP["b2"],
      FBGEMM_HP["eps"],
      FBGEMM_HP["wd"],
    )
    k = f"t{t}"
    np.testing.assert_allclose(nu[k], m2, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(mu[k], m1, rtol=1e-5, atol=1e-6)
    touched = np.unique(xs[t])
    np.testing.assert_allclose(
      np.asarray(new[k])[touched], want[touched], rtol=1e-5, atol=1e-5
    )
    untouched = np.setdiff1d(np.arange(weights[t].shape[0]), touched)
    assert np.asarray(new[k])[untouched].tobytes() == (
      weights[t][untouched].tobytes()
    )


# ----------------------------------------------------------------------------
# State, semantics


@needs_impl
def test_state_is_mu_per_element_and_nu_per_row():
  # jitted: eagerly, every op of init compiles
  mu, nu = _moments(jax.jit(_tx(0.1).init)(make_params()))
  for k, shape in SHAPES.items():
    assert mu[k].shape == shape
    assert nu[k].shape == shape[:1], k
    assert nu[k].dtype == jnp.float32
  # put from numpy (jnp.zeros compiles a broadcast per shape)
  tables = jax.device_put(
    {"emb": np.zeros((1000, 64), np.float32), "w": np.zeros(64, np.float32)}
  )
  assert gtx.bytes_per_row(_tx(1e-3), tables) == {"['emb']": 516.0}
  assert gtx.bytes_per_row(gtx.lazy_adam(1e-3), tables) == {"['emb']": 768.0}


@needs_impl
def test_duplicates_are_summed_before_the_update():
  tx = _tx(0.1, wd=0.01)
  # built in numpy (the duplicates summed there, in float32)
  p = {"emb": np.random.RandomState(2).normal(size=(6, 4)).astype(np.float32)}
  vals = np.random.RandomState(3).normal(size=(3, 4)).astype(np.float32)
  dup = (np.array([4, 1, 4], np.int32), vals)
  summed = (np.array([4, 1], np.int32), np.stack([vals[0] + vals[2], vals[1]]))

  @jax.jit
  def run(p, dup, summed):  # both runs in one program
    runs = []
    for ids, rows in (dup, summed):
      g = {"emb": gtx.SparseRows(ids, rows, 6)}
      u, s = tx.update(g, tx.init(p), p)
      runs.append((gtx.apply_updates(p, u), s))
    return runs

  runs = run(p, dup, summed)
  for a, b in zip(*(jax.tree.leaves(r) for r in runs), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@needs_impl
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_rows_of_equal_squares_equal_optax_adamw(jit):
  """Where every element of a row has the same square, the row's mean
  square is each element's, so the step is Adam's: optax.adamw (decoupled
  decay scaled by the rate, as FBGEMM) on dense leaves of every shape."""
  rng = np.random.RandomState(5)
  shapes = {"col": (7, 1), "vec": (5,), "s": (), "tab": (6, 4)}
  # cast and put by numpy (jnp.asarray(x, float32) of float64 compiles a
  # convert per shape; the same bits)
  params = {
    k: jax.device_put(rng.normal(size=s).astype(np.float32))
    for k, s in shapes.items()
  }
  ours, theirs = (
    _tx(0.03, 0.8, 0.9, 1e-6, 0.05),
    optax.adamw(0.03, 0.8, 0.9, 1e-6, weight_decay=0.05),
  )
  f_ours = step_fn(ours)

  def f_theirs(p, s, g):
    u, s = theirs.update(g, s, p)
    return optax.apply_updates(p, u), s

  def f_both(po, so, pt, st, g):
    return f_ours(po, so, g), f_theirs(pt, st, g)

  if jit:  # both steps in one program
    f_both = jax.jit(f_both)
  po, so, pt, st = params, ours.init(params), params, theirs.init(params)
  for _ in range(5):
    g = {k: rng.normal(size=s) for k, s in shapes.items()}
    # a row of +-c: each row's elements share one square
    g["tab"] = np.abs(g["tab"][:, :1]) * np.sign(rng.normal(size=(6, 4)))
    g = {k: jax.device_put(v.astype(np.float32)) for k, v in g.items()}
    (po, so), (pt, st) = f_both(po, so, pt, st, g)
  for k in shapes:
    np.testing.assert_allclose(po[k], pt[k], rtol=1e-5, atol=1e-6, err_msg=k)
  assert np.abs(np.asarray(po["tab"]) - np.asarray(params["tab"])).max() > 1e-2


@needs_impl
def test_bad_input_raises():
  with pytest.raises(ValueError, match="weight_decay.*>= 0"):
    _tx(0.1, wd=-0.1)
  with pytest.raises(ValueError, match="eps.*>= 0"):
    _tx(0.1, eps=-1.0)
  params = make_params()
  tx = _tx(0.1, wd=0.1)
  with pytest.raises(ValueError, match="needs `params`"):
    # (the state abstract too: eagerly, init's ops would compile)
    jax.eval_shape(tx.update, make_grads(0), jax.eval_shape(tx.init, params))
