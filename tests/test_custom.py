"""Your own sparse optimizer: gtx.row_transformation.

Lazy Lion (Chen et al. 2023) and row-wise Adagrad written with it, checked
against numpy re-implementations of the published formulas (Lion's below,
row-wise Adagrad's in ``references_optimizers``) and, for dense leaves,
against ``optax.lion`` bit for bit; then composition, the validation errors
and an 8-bit state. The guarantees every row optimizer keeps (untouched
rows, in place, drop_stale, inject_hyperparams, Mirrored, row-sharded
tables) are the conformance suite's, run on a user's rule too
(tests/conformance.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references_optimizers as ref
from conformance import (
  SHAPES,
  SPARSE,
  make_grads,
  make_params,
  step_fn,
  together,
)

import gradtx as gtx

B1, B2 = 0.9, 0.99


def lazy_lion(learning_rate, b1=B1, b2=B2, weight_decay=0.0):
  """The guide's lazy Lion."""

  def init(p):
    return (jnp.zeros_like(p),)

  def rule(g, p, m):
    c = b1 * m + (1 - b1) * g
    update = -learning_rate * (jnp.sign(c) + weight_decay * p)
    return update, (1 - b2) * g + b2 * m

  return gtx.row_transformation(rule, init, needs_params=True)


def rowwise_adagrad(learning_rate, eps=1e-8):
  """FBGEMM's EXACT_ROWWISE_ADAGRAD: one float32 accumulator per table row
  (``[V]``), per element for leaves of ndim < 2."""

  def init(p):
    return (jnp.zeros(p.shape[:1], jnp.float32),)

  def rule(g, p, acc):
    del p
    if acc.ndim < g.ndim:  # a table: acc is [n] rows
      acc = acc + jnp.mean(g * g, axis=tuple(range(1, g.ndim)))
      scale = jnp.sqrt(acc).reshape(acc.shape + (1,) * (g.ndim - 1))
    else:
      acc = acc + g * g
      scale = jnp.sqrt(acc)
    return -learning_rate * g / (scale + eps), acc

  return gtx.row_transformation(rule, init)


class NumpyLazyLion:
  """Lion from the paper (Algorithm 2, decoupled weight decay), float64, one
  row at a time; a sparse gradient ``(ids, values, num_rows)`` is summed per
  valid id first and only those rows (parameter and moment) change."""

  def __init__(self, params, lr, wd):
    self.p = {k: np.asarray(v, np.float64).copy() for k, v in params.items()}
    self.m = {k: np.zeros_like(v) for k, v in self.p.items()}
    self.lr, self.wd = lr, wd

  def row(self, k, r, g):
    p, m = self.p[k], self.m[k]
    c = B1 * m[r] + (1 - B1) * g
    p[r] = p[r] - self.lr * (np.sign(c) + self.wd * p[r])
    m[r] = B2 * m[r] + (1 - B2) * g

  def step(self, grads):
    for k, g in grads.items():
      if isinstance(g, gtx.SparseRows):
        rows = ref.summed_rows(g.indices, g.values, g.num_rows)
      elif self.p[k].ndim == 0:
        rows = {(): np.asarray(g, np.float64)}
      else:
        rows = dict(enumerate(np.asarray(g, np.float64)))
      for r, gr in rows.items():
        self.row(k, r, gr)


# ----------------------------------------------------------------------------
# Against independent references


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_lazy_lion_matches_numpy(jit):
  tx = lazy_lion(0.01, weight_decay=0.1)
  params = make_params()
  state = tx.init(params)
  want = NumpyLazyLion(params, 0.01, 0.1)
  step = jax.jit(step_fn(tx)) if jit else step_fn(tx)
  for i in range(4):
    grads = make_grads(i)
    params, state = step(params, state, grads)
    want.step(grads)
  for k in SHAPES:
    np.testing.assert_allclose(params[k], want.p[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
      state.states[0][k], want.m[k], rtol=1e-5, atol=1e-7
    )


def test_update_is_sparse_on_deduplicated_ids():
  tx = lazy_lion(1.0)
  ids = np.array([5, 2, 5, -1, 9, 2], np.int32)
  g = gtx.SparseRows(ids, np.ones((6, 2), np.float32), 9)
  unique = []  # a static flag, lost at the jit boundary: read while tracing

  @jax.jit
  def update(g, table):
    u, _ = tx.update(g, tx.init(table), table)
    unique.append(isinstance(u, gtx.SparseRows) and u.unique)
    return u, u.to_dense()

  u, dense = update(g, jnp.asarray(np.zeros((9, 2), np.float32)))
  assert isinstance(u, gtx.SparseRows) and unique == [True]
  valid = np.asarray(u.indices)[np.asarray(u.indices) < 9]
  assert sorted(valid.tolist()) == [2, 5]
  dense = np.asarray(dense)
  np.testing.assert_array_equal(dense[np.array([2, 5])], -np.ones((2, 2)))
  assert float(np.abs(dense).sum()) == 4.0


def test_dense_leaves_equal_optax_lion_bitwise():
  ours = lazy_lion(0.01, weight_decay=0.1)
  theirs = optax.lion(0.01, b1=B1, b2=B2, weight_decay=0.1)
  dense = {k: v for k, v in make_params().items() if k not in SPARSE}
  p, s = dense, ours.init(dense)
  pt, st = dense, theirs.init(dense)
  for i in range(3):
    g = {k: make_grads(i)[k] for k in dense}
    u, s = ours.update(g, s, p)
    ut, st = theirs.update(g, st, pt)
    p, pt = optax.apply_updates(p, u), optax.apply_updates(pt, ut)
    for k in dense:
      assert np.asarray(p[k]).tobytes() == np.asarray(pt[k]).tobytes()
      assert (
        np.asarray(s.states[0][k]).tobytes()
        == np.asarray(st[0].mu[k]).tobytes()
      )


def test_per_row_state_matches_numpy_and_rowwise_adagrad():
  tx = rowwise_adagrad(0.1)
  builtin = gtx.rowwise_adagrad(0.1)
  params = make_params()
  state, sb = jax.jit(lambda p: (tx.init(p), builtin.init(p)))(params)
  assert state.states[0]["emb"].shape == (40,)
  assert state.states[0]["tab"].shape == (25,)
  assert state.states[0]["w"].shape == (3,)
  assert state.states[0]["b"].shape == ()
  want = ref.RowwiseAdagrad(
    {k: np.asarray(v) for k, v in params.items()}, lambda _: 0.1
  )
  carries = [(params, state), (params, sb)]
  # both optimizers' steps in one program
  step = jax.jit(
    together(["custom", "builtin"], [step_fn(tx), step_fn(builtin)])
  )
  for i in range(3):
    grads = make_grads(i)
    carries = step(carries, [(grads,), (grads,)])
    want.step(
      {
        k: (np.asarray(g.indices), np.asarray(g.values, np.float64), g.num_rows)
        if isinstance(g, gtx.SparseRows)
        else np.asarray(g, np.float64)
        for k, g in grads.items()
      }
    )
  (p, state), (pb, sb) = carries
  for k in SHAPES:
    np.testing.assert_allclose(p[k], want.p[k], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
      state.states[0][k], want.state[k], rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(p[k], pb[k], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(
      state.states[0][k], sb[0].sum_of_squares[k], rtol=1e-6
    )


def test_needs_params_passes_the_parameter_rows():
  seen = {}

  def rule(g, p, hits):
    seen["p"] = p
    return jnp.zeros_like(g), hits + 1

  def init(p):
    return (jnp.zeros(p.shape[:1], jnp.int32),)

  table = jnp.asarray(np.arange(12.0, dtype=np.float32).reshape(6, 2))
  g = gtx.SparseRows(
    np.array([4, 1, 4, 6], np.int32), np.ones((4, 2), np.float32), 6
  )
  tx = gtx.row_transformation(rule, init, needs_params=True)
  _, state = tx.update(g, tx.init(table), table)
  rows = np.asarray(seen["p"])
  assert rows.shape[1:] == (2,)
  got = {tuple(r) for r in rows[: len(rows)]} & {
    tuple(r) for r in np.asarray(table)
  }
  assert got == {(2.0, 3.0), (8.0, 9.0)}
  np.testing.assert_array_equal(state.states[0], [0, 1, 0, 0, 1, 0])
  # dense: the whole parameter
  tx.update(jnp.asarray(np.ones((6, 2), np.float32)), tx.init(table), table)
  np.testing.assert_array_equal(seen["p"], table)
  # without needs_params the rule gets None and params are optional
  plain = gtx.row_transformation(rule, init)
  plain.update(g, plain.init(table))
  assert seen["p"] is None
  with pytest.raises(ValueError, match="needs `params`"):
    tx.update(g, tx.init(table))


def test_init_may_return_the_parameter_and_no_state():
  """A state initialised to the parameter itself (e.g. slow weights) is a
  copy, so a donated step can donate both; an empty tuple is no state."""
  ema = gtx.row_transformation(
    lambda g, p, fast, slow: (jnp.zeros_like(g), fast, slow + g),
    lambda p: (p, p),
  )
  params = {"emb": jnp.asarray(np.ones((8, 2), np.float32))}
  state = jax.jit(ema.init)(params)
  bufs = {x.unsafe_buffer_pointer() for x in jax.tree.leaves((params, state))}
  assert len(bufs) == 3
  step = jax.jit(step_fn(ema), donate_argnums=(0, 1))
  g = {
    "emb": gtx.SparseRows(
      np.array([1], np.int32), np.ones((1, 2), np.float32), 8
    )
  }
  params, state = step(params, ema.init(params), g)
  slow = np.asarray(state.states[1]["emb"])
  np.testing.assert_array_equal(slow[:, 0], [1, 2] + [1] * 6)
  sgd = gtx.row_transformation(lambda g, p: (-g,), lambda p: ())
  state = sgd.init(params)
  assert state == gtx.RowTransformationState(())
  dense = jax.jit(lambda g: sgd.update(g, state)[0]["emb"].to_dense())(g)
  np.testing.assert_array_equal(np.asarray(dense)[1], [-1, -1])


def test_none_leaves_and_eval_shape():
  tx = rowwise_adagrad(0.1)
  params = {"emb": jnp.asarray(np.zeros((10, 4), np.float32)), "frozen": None}
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
  )
  shapes = jax.eval_shape(tx.init, abstract)
  assert shapes.states[0]["frozen"] is None
  assert shapes.states[0]["emb"].shape == (10,)
  g = {
    "emb": gtx.SparseRows(
      np.array([3], np.int32), np.ones((1, 4), np.float32), 10
    ),
    "frozen": None,
  }
  u, state = jax.jit(lambda g, p: tx.update(g, tx.init(p)))(g, params)
  assert u["frozen"] is None and state.states[0]["frozen"] is None


# ----------------------------------------------------------------------------
# Composition


def test_accumulate_every_2_equals_inner_on_concatenated_window():
  rows = {"emb": 9, "tab": 9, "w": None, "b": None}
  tx = gtx.accumulate(lazy_lion(0.01, weight_decay=0.1), 2, rows_per_step=rows)
  inner = lazy_lion(0.01, weight_decay=0.1)
  params = make_params()
  s, rs = jax.jit(lambda p: (tx.init(p), inner.init(p)))(params)
  p, rp = params, params
  step, inner_step = jax.jit(step_fn(tx)), step_fn(inner)

  @jax.jit
  def inner_on_mean(rp, rs, window):
    # the inner step on the mean of the window's gradients (the ids and
    # rows concatenated), in one program
    mean = {
      k: gtx.SparseRows(
        jnp.concatenate([g[k].indices for g in window]),
        jnp.concatenate([g[k].values for g in window]) / 2,
        window[0][k].num_rows,
      )
      if k in SPARSE
      else (window[0][k] + window[1][k]) / 2
      for k in SHAPES
    }
    return inner_step(rp, rs, mean)

  for w in range(2):
    window = [make_grads(2 * w + j) for j in range(2)]
    p, s = step(p, s, window[0])
    assert int(s.num_accumulated) == 1
    p, s = step(p, s, window[1])
    rp, rs = inner_on_mean(rp, rs, window)
    for k in SHAPES:
      np.testing.assert_allclose(p[k], rp[k], rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(
        s.inner_state.states[0][k], rs.states[0][k], rtol=1e-5, atol=1e-7
      )


def test_optax_chain_with_clipping_and_a_schedule():
  """The rule gives a direction; gtx transforms chain around it."""
  schedule = optax.linear_schedule(0.1, 0.0, 4)
  direction = gtx.row_transformation(
    lambda g, p, m: (jnp.sign(B1 * m + (1 - B1) * g), B2 * m + (1 - B2) * g),
    lambda p: (jnp.zeros_like(p),),
  )
  tx = optax.chain(
    gtx.clip_by_global_norm(1.0),
    direction,
    gtx.scale_by_learning_rate(schedule),
  )
  params = make_params()
  state = jax.jit(tx.init)(params)
  step = jax.jit(step_fn(tx))
  rate = jax.jit(schedule)  # one program for every step's rate
  for i in range(5):
    new, state = step(params, state, make_grads(i))
    moved = np.abs(np.asarray(new["w"]) - np.asarray(params["w"])).max()
    np.testing.assert_allclose(float(moved), float(rate(i)), rtol=1e-5)
    params = new


# ----------------------------------------------------------------------------
# Validation


def test_bad_arguments_raise():
  with pytest.raises(TypeError, match="`rule` must be a function"):
    gtx.row_transformation(None, lambda p: ())
  with pytest.raises(TypeError, match="`init` must be a function"):
    gtx.row_transformation(lambda g, p: (g,), (jnp.zeros(3),))


def test_bad_init_results_raise():
  def rule(g, p, *states):
    return (g, *states)

  table = {"a": jnp.zeros((6, 2)), "b": jnp.zeros(3)}
  cases = [
    (
      lambda p: jnp.zeros_like(p),
      TypeError,
      r"tuple of arrays.*`return \(x,\)`",
    ),
    (lambda p: (None,), TypeError, "returned NoneType at position 0"),
    (lambda p: (0.0,), TypeError, "returned float at position 0"),
    (
      lambda p: (jnp.zeros_like(p), jnp.zeros((*p.shape, 2))),
      ValueError,
      r"shape \(6, 2, 2\) at position 1 .* shaped like its parameter",
    ),
    (
      lambda p: (jnp.zeros(p.shape[1:]),),
      ValueError,
      r"shape \(2,\) at position 0 for a parameter of shape \(6, 2\)",
    ),
    (
      lambda p: (jnp.zeros_like(p),) * (p.ndim),
      ValueError,
      "returned 1 arrays for one parameter and 2 for another",
    ),
  ]
  for init, error, match in cases:
    tx = gtx.row_transformation(rule, init)
    with pytest.raises(error, match=match):
      tx.init(table)
    with pytest.raises(error, match=match):
      jax.eval_shape(tx.init, table)


def test_bad_rule_results_raise():
  table = jnp.asarray(np.zeros((6, 2), np.float32))
  g = gtx.SparseRows(np.array([1, 1], np.int32), np.ones((2, 2), np.float32), 6)
  two = lambda p: (jnp.zeros_like(p), jnp.zeros(p.shape[:1]))  # noqa: E731
  cases = [
    (
      lambda g, p, m, a: g,
      TypeError,
      "must return a tuple.*got one array of shape",
    ),
    (
      lambda g, p, m, a: (g, m),
      ValueError,
      r"got 2 states and returned 2 values.*3 values",
    ),
    (
      lambda g, p, m, a: (g, m, a[:, None] + m),
      ValueError,
      r"new state 1 of shape \(\d, 2\) for input of shape \(\d,\)",
    ),
    (
      lambda g, p, m, a: (g[:, 0], m, a),
      ValueError,
      r"the update of shape \(\d,\) for input of shape \(\d, 2\)",
    ),
  ]
  for rule, error, match in cases:
    tx = gtx.row_transformation(rule, two)
    state = tx.init(table)
    for grad in (g, jnp.asarray(np.ones((6, 2), np.float32))):
      with pytest.raises(error, match=match):
        tx.update(grad, state)
      with pytest.raises(error, match=match):
        jax.jit(tx.update)(grad, state)
  tx = gtx.row_transformation(lambda g, p, m, a: (g, m, a), two)
  bad = gtx.SparseRows(g.indices, g.values, 7)
  with pytest.raises(ValueError, match="num_rows=7"):
    tx.update(bad, tx.init(table))


# ----------------------------------------------------------------------------
# 8-bit state


def test_an_8_bit_state_from_init_runs_dequantized_through_the_rule():
  def lion(int8):
    def init(p):
      if int8 and p.ndim >= 2:
        return (gtx.QuantizedRows.zeros_like(p),)
      return (jnp.zeros_like(p),)

    def rule(g, p, m):
      assert m.dtype == jnp.float32  # dequantized rows
      c = 0.9 * m + 0.1 * g
      return -0.01 * jnp.sign(c), 0.01 * g + 0.99 * m

    return gtx.row_transformation(rule, init)

  params = make_params()
  exact, quantized = lion(False), lion(True)
  s8, s32 = jax.jit(lambda p: (quantized.init(p), exact.init(p)))(params)
  assert isinstance(s8.states[0]["emb"], gtx.QuantizedRows)
  assert not isinstance(s8.states[0]["b"], gtx.QuantizedRows)

  @jax.jit
  def both(g, s32, s8):  # both updates and the dequantized 8-bit moment
    u32, s32 = exact.update(g, s32)
    u8, s8 = quantized.update(g, s8)
    return u32, s32, u8, s8, s8.states[0]["emb"].dequantize()

  for i in range(3):
    g = make_grads(i)
    u32, s32, u8, s8, m8 = both(g, s32, s8)
    m32 = np.asarray(s32.states[0]["emb"])
    m8 = np.asarray(m8)
    np.testing.assert_allclose(m8, m32, rtol=1 / 16, atol=1e-6)
  with pytest.raises(ValueError, match="at least 2 dimensions"):
    gtx.QuantizedRows.zeros_like(jnp.zeros(3))
