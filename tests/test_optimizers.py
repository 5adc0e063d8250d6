"""Sparse optimizers on the row engine: adagrad, rowwise_adagrad, ftrl,
lazy_sgd (and scale_by_rss, scale_by_rowwise_rss, lazy_trace)."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references_optimizers as ref
from conformance import (
  SHAPES,
  SPARSE,
  cast,
  each,
  make_grads,
  make_params,
  run_with_references,
  step_fn,
  to_ref,
  together,
)

import gradtx as gtx

SCHEDULE = optax.linear_schedule(0.1, 0.01, 30)


def _lr(lr):
  return lr if callable(lr) else (lambda _: lr)


# name -> (gradtx transformation, numpy reference on params, state getter
# returning {name: (ours, theirs)} per leaf).
CONFIGS = {
  "adagrad_schedule": (
    lambda: gtx.adagrad(SCHEDULE),
    lambda p: ref.Adagrad(p, SCHEDULE),
    lambda s, r: {"G": (s[0].sum_of_squares, r.state)},
  ),
  "adagrad_init_eps": (
    lambda: gtx.adagrad(0.3, initial_accumulator_value=0.0, eps=1e-3),
    lambda p: ref.Adagrad(p, _lr(0.3), 0.0, 1e-3),
    lambda s, r: {"G": (s[0].sum_of_squares, r.state)},
  ),
  # eps = 0.1 next to G of order 1-10: the two forms differ far beyond the
  # tolerance (test_new_options_change_the_step)
  "adagrad_eps_outside_sqrt_schedule": (
    lambda: gtx.adagrad(SCHEDULE, eps=0.1, eps_outside_sqrt=True),
    lambda p: ref.Adagrad(p, SCHEDULE, 0.1, 0.1, eps_outside_sqrt=True),
    lambda s, r: {"G": (s[0].sum_of_squares, r.state)},
  ),
  "adagrad_eps_outside_sqrt_zero_init": (
    lambda: gtx.adagrad(
      0.3, initial_accumulator_value=0.0, eps=1e-3, eps_outside_sqrt=True
    ),
    lambda p: ref.Adagrad(p, _lr(0.3), 0.0, 1e-3, eps_outside_sqrt=True),
    lambda s, r: {"G": (s[0].sum_of_squares, r.state)},
  ),
  "rowwise_adagrad": (
    lambda: gtx.rowwise_adagrad(0.2),
    lambda p: ref.RowwiseAdagrad(p, _lr(0.2)),
    lambda s, r: {"G": (s[0].sum_of_squares, r.state)},
  ),
  "rowwise_adagrad_decay_schedule": (
    lambda: gtx.rowwise_adagrad(
      SCHEDULE, eps=1e-3, initial_accumulator_value=0.5, weight_decay=0.1
    ),
    lambda p: ref.RowwiseAdagrad(p, SCHEDULE, 1e-3, 0.5, 0.1),
    lambda s, r: {"G": (s[0].sum_of_squares, r.state)},
  ),
  "lazy_sgd": (
    lambda: gtx.lazy_sgd(0.1),
    lambda p: ref.LazyMomentumSGD(p, _lr(0.1)),
    lambda s, r: {},
  ),
  "lazy_sgd_momentum": (
    lambda: gtx.lazy_sgd(SCHEDULE, momentum=0.9),
    lambda p: ref.LazyMomentumSGD(p, SCHEDULE, 0.9),
    lambda s, r: {"trace": (s[0].trace, r.state)},
  ),
  "lazy_sgd_nesterov": (
    lambda: gtx.lazy_sgd(0.05, momentum=0.8, nesterov=True),
    lambda p: ref.LazyMomentumSGD(p, _lr(0.05), 0.8, nesterov=True),
    lambda s, r: {"trace": (s[0].trace, r.state)},
  ),
  "ftrl_l1_l2": (
    lambda: gtx.ftrl(
      0.5, l1_regularization_strength=0.2, l2_regularization_strength=0.1
    ),
    lambda p: ref.Ftrl(p, _lr(0.5), l1=0.2, l2=0.1),
    lambda s, r: {
      "n": (s.n, {k: v["n"] for k, v in r.state.items()}),
      "z": (s.z, {k: v["z"] for k, v in r.state.items()}),
    },
  ),
  "ftrl_power_beta_schedule": (
    lambda: gtx.ftrl(
      SCHEDULE,
      learning_rate_power=-0.3,
      initial_accumulator_value=0.5,
      l1_regularization_strength=0.05,
      beta=0.7,
    ),
    lambda p: ref.Ftrl(p, SCHEDULE, -0.3, 0.5, l1=0.05, beta=0.7),
    lambda s, r: {
      "n": (s.n, {k: v["n"] for k, v in r.state.items()}),
      "z": (s.z, {k: v["z"] for k, v in r.state.items()}),
    },
  ),
  "ftrl_l2_shrinkage": (
    lambda: gtx.ftrl(
      0.5,
      l1_regularization_strength=0.2,
      l2_regularization_strength=0.1,
      l2_shrinkage_regularization_strength=0.3,
    ),
    lambda p: ref.Ftrl(p, _lr(0.5), l1=0.2, l2=0.1, l2_shrinkage=0.3),
    lambda s, r: {
      "n": (s.n, {k: v["n"] for k, v in r.state.items()}),
      "z": (s.z, {k: v["z"] for k, v in r.state.items()}),
    },
  ),
  "ftrl_l2_shrinkage_power_beta_schedule": (
    lambda: gtx.ftrl(
      SCHEDULE,
      learning_rate_power=-0.3,
      initial_accumulator_value=0.5,
      l1_regularization_strength=0.05,
      beta=0.7,
      l2_shrinkage_regularization_strength=0.05,
    ),
    lambda p: ref.Ftrl(
      p, SCHEDULE, -0.3, 0.5, l1=0.05, beta=0.7, l2_shrinkage=0.05
    ),
    lambda s, r: {
      "n": (s.n, {k: v["n"] for k, v in r.state.items()}),
      "z": (s.z, {k: v["z"] for k, v in r.state.items()}),
    },
  ),
}


# ----------------------------------------------------------------------------
# Against the numpy references


def test_matches_numpy_reference():
  runs = run_with_references({n: c[:2] for n, c in CONFIGS.items()})

  def check(_, config):
    params, state, r = runs[config]
    for k in SHAPES:
      np.testing.assert_allclose(params[k], r.p[k], rtol=1e-5, atol=1e-5)
      for name, (ours, theirs) in CONFIGS[config][2](state, r).items():
        np.testing.assert_allclose(
          ours[k], theirs[k], rtol=1e-5, atol=1e-6, err_msg=f"{name} {k}"
        )
    # the run moved the tables: the comparison is not vacuous
    start = np.asarray(make_params()["emb"])  # numpy: no eager subtract
    moved = np.abs(np.asarray(params["emb"]) - start).max()
    assert moved > 1e-2

  each(list(CONFIGS), check)


# ----------------------------------------------------------------------------
# Equal to optax


@jax.jit
def _densified(g):
  """``g`` with its SparseRows dense: one program per structure and dtype
  (eagerly, each op of the set-up would compile for its shapes)."""
  return {
    k: v.to_dense() if isinstance(v, gtx.SparseRows) else v
    for k, v in g.items()
  }


def _run_pair(ours, theirs, grads, dtype=jnp.float32, zero=False, steps=4):
  """ours on ``grads(i)`` (sparse), optax on the densified gradients, the
  steps op by op (the inits and the densified gradients jitted)."""
  params = make_params(dtype=dtype, zero=zero)
  s_ours, s_theirs = jax.jit(lambda p: (ours.init(p), theirs.init(p)))(params)
  f_ours, f_theirs = step_fn(ours), step_fn(theirs, optax.apply_updates)
  p_ours = p_theirs = params
  for i in range(steps):
    g = grads(i)
    p_ours, s_ours = f_ours(p_ours, s_ours, g)
    p_theirs, s_theirs = f_theirs(p_theirs, s_theirs, _densified(g))
  return p_ours, s_ours, p_theirs, s_theirs


def _dense_grads(i):
  return make_grads(i, sparse=())


def _eps_outside_sqrt():
  return gtx.adagrad(0.1, eps=0.1, eps_outside_sqrt=True)


def _ftrl_l1_l2():
  return gtx.ftrl(
    0.3, l1_regularization_strength=0.1, l2_regularization_strength=0.01
  )


# name -> (ours, theirs, gradients, zero params): the jitted runs of
# _run_pair the tests below compare
JITTED_PAIRS = {
  "adagrad": (
    lambda: gtx.adagrad(0.1),
    lambda: optax.adagrad(0.1),
    make_grads,
    False,
  ),
  "adagrad_eps_outside_sqrt": (
    _eps_outside_sqrt,
    _eps_outside_sqrt,
    make_grads,
    False,
  ),
  "ftrl_from_zero": (_ftrl_l1_l2, _ftrl_l1_l2, make_grads, True),
  "dense adagrad": (
    lambda: gtx.adagrad(0.1),
    lambda: optax.adagrad(0.1),
    _dense_grads,
    False,
  ),
  "dense sgd": (
    lambda: gtx.lazy_sgd(0.1),
    lambda: optax.sgd(0.1),
    _dense_grads,
    False,
  ),
  "dense sgd_nesterov_schedule": (
    lambda: gtx.lazy_sgd(SCHEDULE, momentum=0.9, nesterov=True),
    lambda: optax.sgd(SCHEDULE, momentum=0.9, nesterov=True),
    _dense_grads,
    False,
  ),
}


@functools.cache
def _jitted_pairs(steps=4):
  """``_run_pair(ours, theirs, grads, zero=zero)``, jitted, of every
  JITTED_PAIRS: every pair's two steps in one jitted program (XLA compiles
  the kernels they share once), their inits in another. ``{name: (p_ours,
  s_ours, p_theirs, s_theirs)}``."""
  names = list(JITTED_PAIRS)
  pairs = [(ours(), theirs()) for ours, theirs, _, _ in JITTED_PAIRS.values()]
  grads = [g for _, _, g, _ in JITTED_PAIRS.values()]
  starts = {zero: make_params(zero=zero) for zero in (False, True)}
  params = [starts[zero] for _, _, _, zero in JITTED_PAIRS.values()]
  carries = jax.jit(
    lambda ps: [
      (p, tx.init(p)) for p, pair in zip(ps, pairs, strict=True) for tx in pair
    ]
  )(params)

  fs = []
  for ours, theirs in pairs:
    fs += [step_fn(ours), step_fn(theirs, optax.apply_updates)]
  step = jax.jit(
    together([f"{n} {side}" for n in names for side in ("ours", "optax")], fs)
  )
  for i in range(steps):
    inputs = []
    for g in (grads_of(i) for grads_of in grads):
      inputs += [(g,), (_densified(g),)]
    carries = step(carries, inputs)
  return {
    n: (*carries[2 * j], *carries[2 * j + 1]) for j, n in enumerate(names)
  }


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_adagrad_on_sparse_equals_optax_on_dense(jit):
  # Untouched rows have a zero gradient in optax: nothing changes there.
  if jit:
    p_ours, s_ours, p_theirs, s_theirs = _jitted_pairs()["adagrad"]
  else:
    p_ours, s_ours, p_theirs, s_theirs = _run_pair(
      gtx.adagrad(0.1), optax.adagrad(0.1), make_grads, steps=2
    )
  for k in SHAPES:
    np.testing.assert_array_equal(
      s_ours[0].sum_of_squares[k], s_theirs[0].sum_of_squares[k]
    )
    if jit and k in SPARSE:
      # XLA's CPU fusion rounds p - lr * u differently when the add is a
      # scatter (as for lazy_adam): one float32 ulp, |params| < 4.
      np.testing.assert_allclose(p_ours[k], p_theirs[k], rtol=0, atol=5e-7)
    else:
      np.testing.assert_array_equal(p_ours[k], p_theirs[k], err_msg=k)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_adagrad_eps_outside_sqrt_on_sparse_equals_dense(jit):
  # No optax twin: the touched rows of a SparseRows leaf must equal the dense
  # leaf's rule on the densified gradient, the others stay.
  if jit:
    runs = _jitted_pairs()["adagrad_eps_outside_sqrt"]
  else:
    tx = _eps_outside_sqrt
    runs = _run_pair(tx(), tx(), make_grads, steps=2)
  p_sparse, s_sparse, p_dense, s_dense = runs
  for k in SHAPES:
    np.testing.assert_array_equal(
      s_sparse[0].sum_of_squares[k], s_dense[0].sum_of_squares[k]
    )
    # one float32 ulp at most (a scatter-add under jit, as above)
    np.testing.assert_allclose(p_sparse[k], p_dense[k], rtol=0, atol=5e-7)


def test_new_options_are_off_by_default_and_change_the_step():
  """eps_outside_sqrt=False and l2_shrinkage_regularization_strength=0.0
  are the defaults and give the default step bit for bit (the default itself
  is checked against optax and the numpy references above); switched on,
  each changes the step by far more than the tolerances used."""
  pairs = {
    "adagrad": (
      lambda: gtx.adagrad(0.1, eps=0.1),
      lambda: gtx.adagrad(0.1, eps=0.1, eps_outside_sqrt=False),
      lambda: gtx.adagrad(0.1, eps=0.1, eps_outside_sqrt=True),
    ),
    "ftrl": (
      lambda: gtx.ftrl(0.5, l1_regularization_strength=0.2),
      lambda: gtx.ftrl(
        0.5,
        l1_regularization_strength=0.2,
        l2_shrinkage_regularization_strength=0.0,
      ),
      lambda: gtx.ftrl(
        0.5,
        l1_regularization_strength=0.2,
        l2_shrinkage_regularization_strength=0.3,
      ),
    ),
  }
  # the six runs in one jitted program
  names = [
    f"{name} {which}" for name in pairs for which in ("default", "off", "on")
  ]
  txs = [make_tx() for makes in pairs.values() for make_tx in makes]
  params = make_params()
  carries = [(params, tx.init(params)) for tx in txs]
  step = jax.jit(together(names, [step_fn(tx) for tx in txs]))
  for i in range(4):
    carries = step(carries, [(make_grads(i),)] * len(txs))
  for k, name in enumerate(pairs):
    runs = [jax.tree.leaves(c) for c in carries[3 * k : 3 * k + 3]]
    for a, b in zip(runs[0], runs[1], strict=True):
      assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), name
    moved = max(
      float(np.abs(np.asarray(a, np.float64) - np.asarray(c)).max())
      for a, c in zip(runs[0], runs[2], strict=True)
    )
    assert moved > 1e-3, name  # the references compare at 1e-5
  for factory, name, value in (
    (gtx.adagrad, "eps_outside_sqrt", False),
    (gtx.scale_by_rss, "eps_outside_sqrt", False),
    (gtx.ftrl, "l2_shrinkage_regularization_strength", 0.0),
  ):
    param = inspect.signature(factory).parameters[name]
    assert param.default == value and param.kind == param.KEYWORD_ONLY


@pytest.mark.parametrize("pair", ["adagrad", "sgd", "sgd_nesterov_schedule"])
def test_dense_leaves_equal_optax_bitwise(pair):
  p_ours, s_ours, p_theirs, s_theirs = _jitted_pairs()[f"dense {pair}"]
  for k in SHAPES:
    np.testing.assert_array_equal(p_ours[k], p_theirs[k], err_msg=k)
  for a, b in zip(
    jax.tree.leaves(s_ours), jax.tree.leaves(s_theirs), strict=True
  ):
    np.testing.assert_array_equal(a, b)


def test_lazy_sgd_momentum_differs_from_optax_on_untouched_rows():
  """The documented difference: optax's trace keeps moving a row after its
  last gradient, lazy momentum does not."""
  params = {"emb": jnp.zeros((4, 1))}
  touch = gtx.SparseRows(jnp.array([1]), jnp.ones((1, 1)), 4)
  other = gtx.SparseRows(jnp.array([2]), jnp.ones((1, 1)), 4)
  ours, theirs = gtx.lazy_sgd(0.1, 0.9), optax.sgd(0.1, 0.9)

  @jax.jit  # both runs in one program
  def run(params, grads):
    p1, s1, p2, s2 = params, ours.init(params), params, theirs.init(params)
    for g in grads:
      u, s1 = ours.update({"emb": g}, s1, p1)
      p1 = gtx.apply_updates(p1, u)
      u, s2 = theirs.update({"emb": g.to_dense()}, s2, p2)
      p2 = optax.apply_updates(p2, u)
    return p1, s1, p2, s2

  p1, s1, p2, s2 = run(params, [touch, other, other])
  # row 1: touched once; lazily it moved -0.1, optax also -0.09 - 0.081
  np.testing.assert_allclose(p1["emb"][1, 0], -0.1, rtol=1e-6)
  np.testing.assert_allclose(p2["emb"][1, 0], -0.1 - 0.09 - 0.081, rtol=1e-6)
  np.testing.assert_allclose(s1[0].trace["emb"][1, 0], 1.0)
  # rows touched every step (row 2 from step 2) agree
  np.testing.assert_allclose(p1["emb"][2], p2["emb"][2], rtol=1e-6)


# ----------------------------------------------------------------------------
# FTRL


def test_ftrl_l1_gives_exact_zeros():
  tx = gtx.ftrl(0.5, l1_regularization_strength=1.0)
  params = make_params()  # nonzero start: touched coordinates are reset
  state = tx.init(params)
  step = jax.jit(step_fn(tx))
  for i in range(6):
    params, state = step(params, state, make_grads(i, n=30))
  emb, z = np.asarray(params["emb"]), np.asarray(state.z["emb"])
  touched = np.asarray(state.n["emb"]) != np.float32(0.1)
  zero = touched & (np.abs(z) <= 1.0)
  assert zero.sum() > 5 and (touched & ~zero).sum() > 5
  assert np.all(emb[zero] == 0.0)  # exact zeros, not tiny values
  assert np.all(emb[touched & ~zero] != 0.0)
  # untouched coordinates keep their (nonzero) starting weights
  start = np.asarray(make_params()["emb"])  # numpy: no eager gather
  np.testing.assert_array_equal(emb[~touched], start[~touched])


def test_ftrl_sparse_equals_dense_ftrl_from_zero_weights():
  """From zero weights, dense FTRL on the densified gradient (a zero
  gradient recomputes w from an unchanged z) equals sparse FTRL."""
  p_sparse, s_sparse, p_dense, s_dense = _jitted_pairs()["ftrl_from_zero"]
  for k in SHAPES:
    np.testing.assert_allclose(p_sparse[k], p_dense[k], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(s_sparse.n[k], s_dense.n[k])


def test_ftrl_l2_shrinkage_on_sparse_moves_only_the_touched_rows():
  """Keras: with a sparse gradient "shrinkage will only happen on the active
  weights". A dense leaf (TensorFlow's dense kernel) shrinks every weight
  every step, so a row touched once keeps moving there; each equals the
  numpy reference on its own gradients."""
  tx = gtx.ftrl(
    0.5,
    l2_regularization_strength=0.1,
    l2_shrinkage_regularization_strength=0.5,
  )
  grads = [  # a duplicate and padding ids (4, -1)
    gtx.SparseRows(
      jnp.array([1, 1, 4]), jnp.array([[1.0, -2], [0.5, 1], [9, 9]]), 4
    ),
    gtx.SparseRows(jnp.array([2, -1]), jnp.array([[-1.0, 0.5], [9, 9]]), 4),
    gtx.SparseRows(jnp.array([2]), jnp.array([[2.0, 1]]), 4),
  ]
  p0 = jnp.zeros((4, 2))
  out = {}
  step = jax.jit(step_fn(tx))
  # the set-up in one program (eagerly, each op would compile)
  state0, dense = jax.jit(
    lambda: (tx.init(p0), [g.to_dense() for g in grads])
  )()
  for kind in ("sparse", "dense"):
    p, state = p0, state0
    r = ref.Ftrl({"emb": np.zeros((4, 2))}, _lr(0.5), l2=0.1, l2_shrinkage=0.5)
    history = []
    for g in grads if kind == "sparse" else dense:
      p, state = step(p, state, g)
      r.step(to_ref({"emb": g}))
      history.append(np.asarray(p))
    np.testing.assert_allclose(p, r.p["emb"], rtol=1e-5, atol=1e-6)
    out[kind] = history
  sparse, dense = out["sparse"], out["dense"]
  assert np.abs(sparse[0][1]).min() > 0.1  # row 1 moved on step 0
  # ... and stays put without a gradient in the sparse run only
  assert sparse[2][1].tobytes() == sparse[0][1].tobytes()
  assert np.abs(dense[2][1] - dense[0][1]).min() > 1e-3
  # rows never touched have zero weights: nothing to shrink in either run
  for h in (sparse[2], dense[2]):
    assert not h[[0, 3]].any()


# ----------------------------------------------------------------------------
# Row-wise Adagrad


def test_rowwise_adagrad_state_is_one_float_per_row():
  tx = gtx.rowwise_adagrad(0.1)
  state = tx.init(make_params())[0].sum_of_squares
  assert state["emb"].shape == (40,) and state["tab"].shape == (25,)
  assert state["w"].shape == (3,)  # a dense matrix: per row too
  assert state["b"].shape == ()  # ndim < 2: per element
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state))
  bf16 = gtx.rowwise_adagrad(0.1, accumulator_dtype=None)
  assert bf16.init(jnp.zeros((5, 2), jnp.bfloat16))[0].sum_of_squares.dtype == (
    jnp.bfloat16
  )


def test_rowwise_adagrad_on_a_vector_is_per_element():
  tx = gtx.rowwise_adagrad(1.0, eps=0.0)
  p = jnp.zeros(4)
  g = gtx.SparseRows(jnp.array([1, 3]), jnp.array([2.0, -3.0]), 4)
  new_p, state = jax.jit(lambda p, g: step_fn(tx)(p, tx.init(p), g))(p, g)
  np.testing.assert_allclose(state[0].sum_of_squares, [0, 4, 0, 9])
  np.testing.assert_allclose(new_p, [0, -1, 0, 1])


@pytest.mark.parametrize(
  "ours, theirs",
  [
    (lambda: gtx.lazy_sgd(0.01), lambda: optax.sgd(0.01)),
    (lambda: gtx.lazy_sgd(SCHEDULE), lambda: optax.sgd(SCHEDULE)),
    (lambda: gtx.adagrad(SCHEDULE), lambda: optax.adagrad(SCHEDULE)),
  ],
  ids=["sgd", "sgd_schedule", "adagrad_schedule"],
)
def test_bf16_sparse_and_dense_leaves_equal_optax_bitwise(ours, theirs):
  # Many duplicates (24 ids on 4 rows): summed before one rounding into the
  # bf16 table, as optax sums them in the dense gradient; a scatter-add of
  # each duplicate would round 24 times. A schedule's rate is rounded to
  # bf16 first, as in optax.
  def grads(i):
    rng = np.random.RandomState(2000 + i)
    g = make_grads(i, dtype=jnp.bfloat16)
    ids = rng.randint(0, 4, size=24)
    vals = rng.normal(size=(24, 3)) * 0.1
    g["emb"] = gtx.SparseRows(ids, cast(vals, jnp.bfloat16), 40)
    return g

  p_ours, s_ours, p_theirs, s_theirs = _run_pair(
    ours(), theirs(), grads, dtype=jnp.bfloat16
  )
  for k in SHAPES:
    assert p_ours[k].dtype == jnp.bfloat16
    np.testing.assert_array_equal(p_ours[k], p_theirs[k], err_msg=k)
  for a, b in zip(
    jax.tree.leaves(s_ours), jax.tree.leaves(s_theirs), strict=True
  ):
    np.testing.assert_array_equal(a, b)


def test_rowwise_weight_decay_is_added_at_the_accumulator_precision():
  # 1e-3 * 3 is below half a bf16 ulp of 1.0: added in bf16 it vanishes.
  tx = gtx.rowwise_adagrad(0.1, weight_decay=1e-3)
  # inputs built in numpy, the init jitted (eagerly each op compiles); the
  # update eager
  p = jnp.asarray(np.full((2, 4), 3.0, jnp.bfloat16))
  ones = jnp.asarray(np.ones((1, 4), jnp.bfloat16))
  g = gtx.SparseRows(jnp.asarray(np.array([0], np.int32)), ones, 2)
  _, state = tx.update(g, jax.jit(tx.init)(p), p)
  acc = state[0].sum_of_squares
  assert acc.dtype == jnp.float32
  np.testing.assert_allclose(acc, [(1 + 3e-3) ** 2, 0.0], rtol=1e-6)


def test_bf16_table_with_float32_accumulators():
  params = make_params(dtype=jnp.bfloat16)
  names = ["rowwise_adagrad", "ftrl"]
  txs = [gtx.rowwise_adagrad(0.1), gtx.ftrl(0.5, accumulator_dtype=jnp.float32)]
  refs = [
    make_ref({k: np.asarray(v, np.float32) for k, v in params.items()})
    for make_ref in (
      lambda p: ref.RowwiseAdagrad(p, _lr(0.1)),
      lambda p: ref.Ftrl(p, _lr(0.5)),
    )
  ]
  # both runs in one program, their inits in another
  carries = jax.jit(lambda p: [(p, tx.init(p)) for tx in txs])(params)
  step = jax.jit(together(names, [step_fn(tx) for tx in txs]))
  for i in range(3):
    g = make_grads(i, dtype=jnp.bfloat16)
    carries = step(carries, [(g,)] * len(txs))
    for r in refs:
      r.step(to_ref(g))
  for name, (p, state), r in zip(names, carries, refs, strict=True):
    for k in SHAPES:
      assert p[k].dtype == jnp.bfloat16, name
      # one bf16 rounding per step of |p| < 4: 2**-6 each
      np.testing.assert_allclose(
        np.asarray(p[k], np.float32),
        r.p[k],
        rtol=0,
        atol=3 * 2**-6,
        err_msg=f"{name} {k}",
      )
    for leaf in jax.tree.leaves(state):
      if jnp.issubdtype(leaf.dtype, jnp.floating):
        assert leaf.dtype == jnp.float32, name


# ----------------------------------------------------------------------------
# Determinism (untouched rows, in place, Mirrored, row-sharded tables,
# drop_stale, inject_hyperparams: the conformance suite)


def test_deterministic_with_many_duplicates():
  def run():
    tx = gtx.rowwise_adagrad(0.1)
    params = {"emb": make_params()["emb"]}
    state = tx.init(params)
    step = jax.jit(lambda p, s, g: step_fn(tx)(p, s, g))  # compiled anew
    for i in range(3):
      g = make_grads(i, n=64)["emb"]
      params, state = step(
        params, state, {"emb": gtx.SparseRows(g.indices % 5, g.values, 40)}
      )
    return [np.asarray(x) for x in jax.tree.leaves((params, state))]

  for a, b in zip(run(), run(), strict=True):
    assert a.tobytes() == b.tobytes()


# ----------------------------------------------------------------------------
# Schedules, composition


def test_schedule_count_saturates():
  tx = gtx.ftrl(SCHEDULE)
  state = tx.init(make_params())._replace(count=jnp.int32(2**31 - 1))
  _, state = tx.update(make_grads(0), state, make_params())
  assert int(state.count) == 2**31 - 1


ROWS = {"emb": 9, "tab": 9, "w": None, "b": None}


WINDOW_INNERS = {
  "ftrl": lambda: gtx.ftrl(0.2),
  "lazy_adam_int8": lambda: gtx.lazy_adam(
    0.05, mu_dtype="int8", nu_dtype="int8"
  ),
}


def test_accumulate_equals_inner_on_concatenated_window():
  # every inner at once: one program for the inits, one for the
  # accumulated steps, one for the inner's
  k, names = 2, list(WINDOW_INNERS)
  txs = [
    gtx.accumulate(WINDOW_INNERS[n](), k, mean=False, rows_per_step=ROWS)
    for n in names
  ]
  inners = [WINDOW_INNERS[n]() for n in names]
  params = make_params()
  carries, ref = jax.jit(
    lambda p: (
      [(p, tx.init(p)) for tx in txs],
      [(p, tx.init(p)) for tx in inners],
    )
  )(params)
  step = jax.jit(together(names, [step_fn(tx) for tx in txs]))
  inner_step = jax.jit(together(names, [step_fn(tx) for tx in inners]))
  for w in range(2):
    window = [make_grads(k * w + j) for j in range(k)]
    for g in window:
      carries = step(carries, [(g,)] * len(names))
    # built in numpy: eagerly each op would compile for its shapes
    cat = {
      key: gtx.SparseRows(
        np.concatenate([np.asarray(g[key].indices) for g in window]),
        np.concatenate([np.asarray(g[key].values) for g in window]),
        window[0][key].num_rows,
      )
      if key in SPARSE
      else sum(np.asarray(g[key]) for g in window)
      for key in SHAPES
    }
    ref = inner_step(ref, [(cat,)] * len(names))

    def equal(i, _, carries=carries, ref=ref):
      for key in SHAPES:
        np.testing.assert_allclose(
          carries[i][0][key], ref[i][0][key], rtol=1e-5, atol=1e-6
        )

    each(names, equal)


# ----------------------------------------------------------------------------
# Bad input


def test_bad_hyperparameters_raise():
  with pytest.raises(ValueError, match="learning_rate_power.*<= 0"):
    gtx.ftrl(0.1, learning_rate_power=0.5)
  with pytest.raises(ValueError, match="l1_regularization_strength.*>= 0"):
    gtx.ftrl(0.1, l1_regularization_strength=-1.0)
  with pytest.raises(ValueError, match="l2_shrinkage_regularization_strength"):
    gtx.ftrl(0.1, l2_shrinkage_regularization_strength=-0.1)
  with pytest.raises(ValueError, match="weight_decay.*>= 0"):
    gtx.rowwise_adagrad(0.1, weight_decay=-0.1)
  with pytest.raises(ValueError, match="initial_accumulator_value"):
    gtx.adagrad(0.1, initial_accumulator_value=-1.0)


def test_missing_params_raise():
  params = make_params()
  for tx in (gtx.ftrl(0.1), gtx.rowwise_adagrad(0.1, weight_decay=0.1)):
    with pytest.raises(ValueError, match="needs `params`"):
      jax.eval_shape(tx.update, make_grads(0), tx.init(params))


def test_mismatched_sparse_rows_and_state_raise():
  params = make_params()
  tx = gtx.rowwise_adagrad(0.1)
  state = tx.init(params)
  g = make_grads(0)
  bad = dict(g, emb=gtx.SparseRows(g["emb"].indices, g["emb"].values, 41))
  with pytest.raises(ValueError, match="num_rows=41"):
    jax.eval_shape(tx.update, bad, state, params)
  block = gtx.scale_by_rowwise_rss()
  wrong = block.init(params)
  wrong = wrong._replace(
    sum_of_squares=dict(wrong.sum_of_squares, emb=jnp.zeros(7))
  )
  with pytest.raises(ValueError, match=r"row-wise accumulator.*shape \(7,\)"):
    jax.eval_shape(block.update, g, wrong)
  none_state = gtx.scale_by_rss().init(dict(params, emb=None))
  with pytest.raises(ValueError, match="holds no moments or accumulators"):
    jax.eval_shape(gtx.scale_by_rss().update, g, none_state)
  with pytest.raises(ValueError, match=r"shape \(3, 1\).*shape \(3,\)"):
    p = jnp.ones(3)
    gtx.adagrad(0.1).update(jnp.ones((3, 1)), gtx.adagrad(0.1).init(p), p)
