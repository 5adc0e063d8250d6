"""The bad-input sweep: one test per row of the table in
docs/guides/reliability.md, asserting exactly what the row says; and
optax.apply_if_finite around gradtx transforms with SparseRows gradients.

Each row is ``Row(number, trigger, error=(type, key words))`` for a row
whose outcome is an exception, or ``Row(number, trigger, check=fn)`` for a
row whose outcome is a documented behaviour (``fn`` asserts it). A final
test checks that the guide's table lists the same rows with the same error
types and key words.
"""

import re
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtx as gtx

GUIDE = Path(__file__).resolve().parent.parent / "docs/guides/reliability.md"
NUM_ROWS = 4
TABLE = jnp.arange(8.0).reshape(NUM_ROWS, 2)


def _rows(ids, values=None, num_rows=NUM_ROWS):
  ids = jnp.asarray(ids, jnp.int32)
  if values is None:
    values = jnp.ones((ids.shape[0], 2))
  return gtx.SparseRows(ids, values, num_rows)


def _params():
  return {"emb": TABLE, "w": jnp.ones(2)}


def _grads(ids=(0, 2, 2), values=None):
  return {"emb": _rows(ids, values), "w": jnp.ones(2)}


class Row(NamedTuple):
  number: int
  trigger: Any  # () -> result
  error: tuple[type, str] | None = None  # (exception type, key words)
  check: Any = None  # result -> None, asserts the documented behaviour


def _update(tx, grads, params=None, **extra):
  params = _params() if params is None else params
  return tx.update(grads, tx.init(params), params, **extra)


def _jit_update(tx, grads, **extra):
  params = _params()
  fn = jax.jit(lambda g, s: tx.update(g, s, params, **extra))
  return jax.block_until_ready(fn(grads, tx.init(params)))


# --- behaviour checks ------------------------------------------------------


def _padding_stands_for_nothing(g):
  np.testing.assert_array_equal(g.to_dense(), np.zeros((NUM_ROWS, 2)))
  np.testing.assert_array_equal(g.coalesce().indices, [NUM_ROWS] * 2)


def _reads_zero_rows(out):
  np.testing.assert_array_equal(out, [[0.0, 0.0], [6.0, 7.0], [0.0, 0.0]])


def _no_gradient_for_padding(g):
  np.testing.assert_array_equal(g.indices, [-1, 3, 9])  # as looked up
  np.testing.assert_array_equal(g.to_dense()[:3], 0.0)  # only row 3 gets one
  assert float(g.to_dense()[3].sum()) == 2.0


def _padding_writes_nowhere(out):
  np.testing.assert_array_equal(out, TABLE)


def _keeps_param_dtype(out):
  assert out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(out, jnp.full(3, 1.5, jnp.bfloat16))


def _nan_in_touched_rows_only(out):
  u, state = out
  emb = u["emb"].to_dense()
  assert np.isnan(emb[0]).all()  # touched row with the NaN
  assert np.isfinite(emb[1:]).all()  # other rows: untouched or finite
  assert not np.isfinite(state[0].mu["emb"][0]).any()  # inf moments
  assert np.isfinite(state[0].mu["emb"][1:]).all()


def _nan_emitted_at_window_end(out):
  u, state = out
  assert int(state.num_accumulated) == 0
  assert np.isnan(u["emb"].to_dense()[0]).all()
  assert np.isnan(np.asarray(u["w"])).all()  # the global norm is NaN


def _dropped_and_counted(out):
  u, state = out
  np.testing.assert_array_equal(u["w"], 0.0)
  np.testing.assert_array_equal(u["emb"].to_dense(), 0.0)
  assert int(state.step) == 0 and int(state.num_dropped) == 1
  assert int(state.last_staleness) == -3


def _nan_norm_clips_to_nan(out):
  assert np.isnan(np.asarray(out[0].values)).all()


# --- triggers -------------------------------------------------------------


def _bounds_checked_jit():
  fn = jax.jit(lambda i: gtx.lookup(TABLE, i, bounds_check=True))
  return jax.block_until_ready(fn(jnp.array([1, NUM_ROWS])))


def _accumulate_nan():
  tx = gtx.accumulate(
    optax.chain(gtx.clip_by_global_norm(1.0), gtx.lazy_adam(0.1)),
    2,
    rows_per_step={"emb": 3, "w": None},
  )
  params = _params()
  step = jax.jit(lambda g, s: tx.update(g, s, params))
  nan = jnp.ones((3, 2)).at[0].set(jnp.nan)
  _, state = step(_grads(values=nan), tx.init(params))
  return step(_grads(), state)


def _schedule_zero_jit():
  tx = gtx.accumulate(optax.sgd(1.0), lambda n: jnp.int32(0))
  fn = jax.jit(lambda g, s: tx.update(g, s))
  return jax.block_until_ready(fn(jnp.ones(2), tx.init(jnp.ones(2))))


def _mirrored_step_bad_batch():
  m = gtx.Mirrored()
  step = m.step(lambda p, s, b: (p, s))
  return step(jnp.ones(2), (), jnp.ones((m.num_replicas + 1, 2)))


def _unbound_axis():
  tx = gtx.all_reduce("nope")
  return jax.jit(lambda g: tx.update(g, optax.EmptyState()))(jnp.ones(2))


ROWS = [
  # SparseRows
  Row(1, lambda: gtx.SparseRows(jnp.array([0.0]), jnp.ones((1, 2)), 4),
      error=(TypeError, "`indices` must be integer row ids")),
  Row(2, lambda: gtx.SparseRows(jnp.zeros((1, 1), int), jnp.ones((1, 2)), 4),
      error=(ValueError, "`indices` must be 1-D")),
  Row(3, lambda: gtx.SparseRows(jnp.array([0, 1]), jnp.ones((3, 2)), 4),
      error=(ValueError, "`values` must have shape `[n, *row_shape]`")),
  Row(4, lambda: gtx.SparseRows(jnp.array([0]), jnp.ones((1, 2)), 4.0),
      error=(TypeError, "`num_rows` must be a Python int")),
  Row(5, lambda: _rows([-1, NUM_ROWS + 3]), check=_padding_stands_for_nothing),
  # lookup and sparse_value_and_grad
  Row(6, lambda: gtx.lookup(TABLE, jnp.array([0.0])),
      error=(TypeError, "`ids` must be integer row ids")),
  Row(7, lambda: gtx.lookup(jnp.float32(1.0), jnp.array([0])),
      error=(ValueError, "must have at least one axis")),
  Row(8, lambda: gtx.lookup(TABLE, jnp.array([-1, 3, NUM_ROWS])),
      check=_reads_zero_rows),
  Row(9, lambda: gtx.lookup(TABLE, jnp.array([NUM_ROWS]), bounds_check=True),
      error=(ValueError, "id(s) outside [0, 4) found with bounds_check=True")),
  Row(10, _bounds_checked_jit,
      error=(jax.errors.JaxRuntimeError, "id(s) outside [0, 4)")),
  Row(11, lambda: gtx.sparse_grad(lambda t, i: gtx.lookup(t, i).sum())(
        TABLE, jnp.array([-1, 3, 9])), check=_no_gradient_for_padding),
  Row(12, lambda: gtx.sparse_grad(lambda t: t.sum(), argnums=(0.5,))(TABLE),
      error=(TypeError, "`argnums` must be an int or a non-empty tuple")),
  Row(13, lambda: gtx.sparse_grad(lambda t: t.sum(), argnums=2)(TABLE),
      error=(ValueError, "out of range for 1 positional arguments")),
  # apply_updates
  Row(14, lambda: gtx.apply_updates(_params(), {"emb": TABLE}),
      error=(ValueError, "`updates` does not have the tree structure of")),
  Row(15, lambda: gtx.apply_updates(TABLE, _rows([0], num_rows=5)),
      error=(ValueError, "does not match its parameter of shape (4, 2)")),
  Row(16, lambda: gtx.apply_updates(TABLE, _rows([-1, NUM_ROWS])),
      check=_padding_writes_nowhere),
  Row(17, lambda: gtx.apply_updates(jnp.ones(3, jnp.bfloat16),
                                    jnp.full(3, 0.5, jnp.float32)),
      check=_keeps_param_dtype),
  # dense optax transforms fed a SparseRows
  Row(18, lambda: _update(optax.sgd(0.1), _grads()),
      error=(TypeError, "`optax.scale` (a step of `optax.sgd(learning_rate)`")),
  Row(19, lambda: _update(optax.adam(0.1), _grads()),
      error=(TypeError, "`optax.scale_by_adam` (a step of `optax.adam`")),
  Row(20, lambda: _update(optax.clip_by_global_norm(1.0), _grads()),
      error=(TypeError, "`gtx.clip_by_global_norm(m)` for")),
  # lazy_adam
  Row(21, lambda: _update(gtx.lazy_adam(0.1), {"emb": _rows([0])}),
      error=(ValueError, "`updates` does not have the tree structure of")),
  Row(22, lambda: _update(gtx.lazy_adam(0.1),
                          {"emb": _rows([0], num_rows=5), "w": jnp.ones(2)}),
      error=(ValueError, "does not match its parameter of shape (4, 2)")),
  Row(23, lambda: gtx.lazy_adam(0.1, b1=0.99, b2=0.9, catch_up=True),
      error=(ValueError, "needs 0 <= b1 < sqrt(b2)")),
  Row(24, lambda: _jit_update(
        gtx.lazy_adam(0.1), _grads(values=jnp.ones((3, 2)).at[0].set(jnp.inf))),
      check=_nan_in_touched_rows_only),
  # accumulate
  Row(25, lambda: gtx.accumulate(optax.sgd(1.0), 0),
      error=(ValueError, "`every_k` must be >= 1")),
  Row(26, lambda: gtx.accumulate(optax.sgd(1.0), 2.0),
      error=(TypeError, "`every_k` must be a Python int >= 1")),
  Row(27, _schedule_zero_jit,
      error=(jax.errors.JaxRuntimeError, "the `every_k` schedule returned 0")),
  Row(28, lambda: _update(gtx.accumulate(optax.sgd(1.0), 2), _grads()),
      error=(ValueError, "`rows_per_step` declares no row count for it")),
  Row(29, lambda: _update(gtx.accumulate(optax.sgd(1.0), 2,
                                         rows_per_step={"emb": 2, "w": None}),
                          _grads()),
      error=(ValueError, "carries 3 rows but `rows_per_step` declares 2")),
  Row(30, lambda: _update(gtx.accumulate(optax.sgd(1.0), 2), jnp.ones(3),
                          params=jnp.ones(4)),
      error=(ValueError, "has shape (3,) but its parameter")),
  Row(31, lambda: _update(gtx.accumulate(optax.sgd(1.0), 2),
                          {"w": jnp.ones(2)}),
      error=(ValueError, "`updates` does not have the tree structure of")),
  Row(32, _accumulate_nan, check=_nan_emitted_at_window_end),
  # drop_stale and staleness_stats
  Row(33, lambda: gtx.drop_stale(optax.sgd(1.0), -1),
      error=(ValueError, "`max_staleness` must be >= 0")),
  Row(34, lambda: _update(gtx.drop_stale(gtx.scale(1.0), 1), _grads()),
      error=(TypeError, "needs the extra keyword argument `grad_step`")),
  Row(35, lambda: _update(gtx.drop_stale(gtx.scale(1.0), 1), _grads(),
                          grad_step=0.0),
      error=(TypeError, "`grad_step` must be an integer step")),
  Row(36, lambda: _update(gtx.drop_stale(gtx.scale(1.0), 1), _grads(),
                          grad_step=jnp.zeros(2, jnp.int32)),
      error=(ValueError, "`grad_step` must be a scalar")),
  Row(37, lambda: _update(gtx.drop_stale(gtx.scale(1.0), 1), _grads(),
                          grad_step=3),
      error=(ValueError, "ahead of the global step")),
  Row(38, lambda: _jit_update(gtx.drop_stale(gtx.scale(1.0), 1), _grads(),
                              grad_step=jnp.int32(3)),
      check=_dropped_and_counted),
  Row(39, lambda: gtx.staleness_stats(gtx.lazy_adam(0.1).init(_params())),
      error=(ValueError, "found no DropStaleState")),
  # clip_by_global_norm, add_decayed_weights
  Row(40, lambda: gtx.clip_by_global_norm(1.0).update(
        _rows([0, 1], jnp.ones((2, 2)).at[1, 0].set(jnp.nan)),
        optax.EmptyState()),
      check=_nan_norm_clips_to_nan),
  Row(41, lambda: gtx.add_decayed_weights(0.1).update(
        _grads(), optax.EmptyState()),
      error=(ValueError, "needs `params`")),
  # all_reduce and Mirrored
  Row(42, lambda: gtx.all_reduce("i", op="max"),
      error=(ValueError, "`op` must be one of 'mean', 'sum'")),
  Row(43, _unbound_axis, error=(NameError, "axis name 'nope' is not bound")),
  Row(44, lambda: gtx.Mirrored().shard_batch(jnp.ones((3, 2))),
      error=(ValueError, "does not split evenly over 8 replicas")),
  Row(45, _mirrored_step_bad_batch,
      error=(ValueError, "does not split evenly over 8 replicas")),
  Row(46, lambda: gtx.Mirrored().shard_batch({"x": jnp.float32(1.0)}),
      error=(ValueError, "every batch leaf needs a leading batch axis")),
  Row(47, lambda: gtx.apply_updates(jnp.ones(1), jnp.ones(3)),
      error=(ValueError, "Updates must have their parameter's shape")),
  Row(48, lambda: gtx.lazy_adam(0.1).update(
          jnp.ones((3, 1)), gtx.lazy_adam(0.1).init(jnp.ones(3)), jnp.ones(3)),
      error=(ValueError, "Gradients must have their parameter's shape")),
]  # fmt: skip


@pytest.mark.parametrize("row", ROWS, ids=lambda r: f"row{r.number}")
def test_row(row):
  if row.error is not None:
    kind, words = row.error
    with pytest.raises(kind, match=re.escape(words)):
      row.trigger()
  else:
    row.check(row.trigger())


def _guide_table():
  """{number: (error name or None, key words or None)} from the guide."""
  out = {}
  for line in GUIDE.read_text().splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 4 or not cells[0].isdigit():
      continue
    m = re.search(r"`(\w+Error)`: \"([^\"]+)\"", cells[3])
    out[int(cells[0])] = (m.group(1), m.group(2)) if m else (None, None)
  return out


def test_guide_table_lists_these_rows():
  table = _guide_table()
  assert sorted(table) == [r.number for r in ROWS]
  for r in ROWS:
    want = (r.error[0].__name__, r.error[1]) if r.error else (None, None)
    assert table[r.number] == want, f"row {r.number} of the guide's table"


# ----------------------------------------------------------------------------
# optax.apply_if_finite with SparseRows gradients


def test_apply_if_finite_skips_a_sparse_nan_step():
  tx = optax.apply_if_finite(
    optax.chain(gtx.clip_by_global_norm(10.0), gtx.lazy_adam(0.1)), 2
  )
  params = _params()
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    u, state = tx.update(grads, state, params)
    return gtx.apply_updates(params, u), state

  bad = jnp.ones((3, 2)).at[1, 1].set(jnp.nan)
  p1, s1 = step(params, state, _grads(values=bad))
  for k in params:
    np.testing.assert_array_equal(p1[k], params[k])  # nothing moved
  inner = s1.inner_state[1][0]
  assert int(inner.count) == 0  # the inner state did not advance
  assert int(s1.notfinite_count) == 1 and not bool(s1.last_finite)
  p2, s2 = step(p1, s1, _grads())  # a finite step goes through
  assert int(s2.inner_state[1][0].count) == 1
  assert int(s2.notfinite_count) == 0
  moved = np.abs(np.asarray(p2["emb"]) - np.asarray(TABLE)).max(axis=1)
  np.testing.assert_array_equal(moved > 0, [True, False, True, False])


def test_apply_if_finite_inside_accumulate_skips_the_window():
  # apply_if_finite must sit inside accumulate: around it, its "reject"
  # branch returns zeros shaped like the n-row gradient while the emitted
  # update has k * n rows, and lax.cond refuses the mismatch.
  rows = {"emb": 3, "w": None}
  tx = gtx.accumulate(
    optax.apply_if_finite(gtx.lazy_adam(0.1), 2), 2, rows_per_step=rows
  )
  params = _params()
  state = tx.init(params)
  step = jax.jit(lambda g, s: tx.update(g, s, params))
  bad = jnp.ones((3, 2)).at[0].set(jnp.nan)
  for g in (_grads(values=bad), _grads()):
    u, state = step(g, state)
  np.testing.assert_array_equal(u["emb"].values, 0.0)  # the window skipped
  np.testing.assert_array_equal(u["w"], 0.0)
  assert int(state.inner_state.total_notfinite) == 1
  for g in (_grads(), _grads()):  # the next window is applied
    u, state = step(g, state)
  assert np.abs(np.asarray(u["w"])).min() > 0.05
  assert int(state.inner_state.inner_state[0].count) == 1

  outside = optax.apply_if_finite(
    gtx.accumulate(gtx.lazy_adam(0.1), 2, rows_per_step=rows), 2
  )
  with pytest.raises(TypeError, match="cond branches must have equal output"):
    _jit_update(outside, _grads())
