"""Non-finite gradients: what a NaN or an inf in one row of a SparseRows
gradient poisons in each transformation (that row of the params and of the
per-row state, nothing else), and where ``optax.apply_if_finite`` goes with
accumulate, drop_stale and Mirrored (docs/guides/reliability.md).

"Nothing else" is checked against the same run with the bad entries turned
into padding (an out-of-range id, which contributes nothing): every other
row of the params and state must be bit-identical."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conformance import cast, each, step_fn, together

import gradtx as gtx

V, D = 8, 2
BAD_ROW = 3
PAD = V  # an out-of-range id: padding
IDS = (1, BAD_ROW, BAD_ROW, 5, PAD)  # a duplicate of the bad row, padding
N = len(IDS)


def _params():
  rng = np.random.RandomState(0)
  return {
    "emb": cast(rng.normal(size=(V, D)), jnp.float32),
    "w": cast(rng.normal(size=(3,)), jnp.float32),
  }


def _grads(seed, bad=None, ids=IDS, bad_dense=False):
  """Row-sparse gradient; ``bad`` goes into column 0 of the first slot of
  BAD_ROW, or -- with ``bad=None`` -- that slot is padding instead."""
  rng = np.random.RandomState(seed)
  ids = np.array(ids, np.int32)
  vals = rng.normal(size=(len(ids), D)).astype(np.float32)
  slot = list(ids).index(BAD_ROW) if BAD_ROW in ids else None
  if slot is not None:
    if bad is None:
      ids[slot] = PAD
    else:
      vals[slot, 0] = bad
  w = rng.normal(size=(3,)).astype(np.float32)
  if bad_dense:
    w[1] = np.nan
  return {"emb": gtx.SparseRows(ids, vals, V), "w": jnp.asarray(w)}


def _step(tx):
  @jax.jit
  def step(params, state, g, extra):
    u, state = tx.update(g, state, params, **extra)
    return gtx.apply_updates(params, u), state

  step.tx = tx
  return step


def _run(step, grads, **extra):
  """Runs a jitted ``_step(tx)`` from a fresh init. Runs compared bit for
  bit share one ``step``: another program may round differently."""
  if not hasattr(step, "tx"):
    step = _step(step)
  tx = step.tx
  params = _params()
  state = tx.init(params)
  for i, g in enumerate(grads):
    kw = {k: jnp.asarray(np.int32(v[i])) for k, v in extra.items()}
    params, state = step(params, state, g, kw)
  return params, state


def _row_leaves(tree):
  """``(path, leaf)`` of every leaf with V leading rows (a per-row leaf)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [
    (jax.tree_util.keystr(p), np.asarray(x))
    for p, x in flat
    if np.ndim(x) >= 1 and np.shape(x)[0] == V
  ]


def _bad_rows(x):
  x = np.asarray(x, np.float64).reshape(V, -1)
  return set(np.nonzero((~np.isfinite(x)).any(axis=1))[0].tolist())


def _assert_only_bad_row_poisoned(got, want, poisoned_state):
  """Row BAD_ROW of the table (and of the per-row state leaves named in
  ``poisoned_state``) is non-finite; every other row and leaf is
  bit-identical to the run without the bad entries."""
  (gp, gs), (wp, ws) = got, want
  assert _bad_rows(gp["emb"]) == {BAD_ROW}
  keep = np.arange(V) != BAD_ROW
  np.testing.assert_array_equal(np.asarray(gp["emb"])[keep], wp["emb"][keep])
  np.testing.assert_array_equal(gp["w"], wp["w"])
  names = []
  for (path, g), (_, w) in zip(_row_leaves(gs), _row_leaves(ws), strict=True):
    bad = _bad_rows(g) if np.issubdtype(g.dtype, np.floating) else set()
    if bad:
      names.append(path)
      assert bad == {BAD_ROW}, path
    np.testing.assert_array_equal(g[keep], w[keep], err_msg=path)
  assert sorted(names) == sorted(poisoned_state)
  for g, w in zip(jax.tree.leaves(gs), jax.tree.leaves(ws), strict=True):
    if not (np.ndim(g) >= 1 and np.shape(g)[0] == V):
      np.testing.assert_array_equal(g, w)  # counters, dense leaves


# name -> (transformation, the per-row state leaves a bad row poisons)
ROW_OPTIMIZERS = {
  "lazy_adam": (
    lambda: gtx.lazy_adam(0.1),
    ["[0].mu['emb']", "[0].nu['emb']"],
  ),
  "lazy_adam_catch_up": (
    lambda: gtx.lazy_adam(0.1, catch_up=True),
    ["[0].mu['emb']", "[0].nu['emb']"],
  ),
  "adagrad": (lambda: gtx.adagrad(0.1), ["[0].sum_of_squares['emb']"]),
  "rowwise_adagrad": (
    lambda: gtx.rowwise_adagrad(0.1),
    ["[0].sum_of_squares['emb']"],
  ),
  "ftrl": (lambda: gtx.ftrl(0.1), [".n['emb']", ".z['emb']"]),
  "lazy_sgd": (lambda: gtx.lazy_sgd(0.1), []),
  "lazy_sgd_momentum": (
    lambda: gtx.lazy_sgd(0.1, momentum=0.9),
    ["[0].trace['emb']"],
  ),
}


def test_a_bad_row_poisons_only_that_row():
  # Every optimizer's step in one jitted program; the runs compared bit for
  # bit are calls of it.
  names = list(ROW_OPTIMIZERS)
  txs = [ROW_OPTIMIZERS[n][0]() for n in names]
  step = jax.jit(together(names, [step_fn(tx) for tx in txs]))
  init = jax.jit(lambda p: [tx.init(p) for tx in txs])  # one program

  def run(grads):
    carries = [(_params(), s) for s in init(_params())]
    for g in grads:
      carries = step(carries, [(g,)] * len(txs))
    return carries

  # The bad step, then clean steps that touch the bad row again: the
  # poison stays in that row and spreads nowhere.
  later = [_grads(2), _grads(3, ids=(0, BAD_ROW, 6, 6, PAD))]
  want = run([_grads(1, None)] + later)
  for bad in (np.nan, np.inf, -np.inf):
    got = run([_grads(1, bad)] + later)
    each(
      [f"{n} ({bad})" for n in names],
      lambda k, _, got=got: _assert_only_bad_row_poisoned(
        got[k], want[k], ROW_OPTIMIZERS[names[k]][1]
      ),
    )


def test_apply_updates_writes_a_bad_value_to_its_row_only():
  params = _params()
  u = _grads(1, np.nan)
  apply = jax.jit(gtx.apply_updates)  # one program for both updates
  got = np.asarray(apply(params, u)["emb"])
  want = np.asarray(params["emb"]).copy()
  ids = np.asarray(u["emb"].indices)
  ok = ids < V
  np.add.at(want, ids[ok], np.asarray(u["emb"].values)[ok])
  np.testing.assert_array_equal(got, want)  # NaN where numpy puts it
  assert _bad_rows(got) == {BAD_ROW}
  # A non-finite value in a padding slot writes nowhere.
  vals = np.ones((N, D), np.float32)
  vals[-1] = np.inf
  pad_only = gtx.SparseRows(np.array(IDS, np.int32), vals, V)
  pad_only = {"emb": pad_only, "w": jnp.asarray(np.zeros(3, np.float32))}
  assert not _bad_rows(apply(params, pad_only)["emb"])


def test_clip_by_global_norm_nan_poisons_everything_inf_one_row():
  tx = gtx.clip_by_global_norm(1.0)
  update = jax.jit(lambda g, p: tx.update(g, tx.init(p)))  # for both values
  for bad, want_rows in [(np.nan, {1, BAD_ROW, 5}), (np.inf, {BAD_ROW})]:
    u, _ = update(_grads(1, bad), _params())
    table = np.zeros((V, D), np.float32)
    ids = np.asarray(u["emb"].indices)
    ok = ids < V
    np.add.at(table, ids[ok], np.asarray(u["emb"].values)[ok])
    assert _bad_rows(table) == want_rows
    # NaN: the norm is NaN and so is every value; inf: the scale is 0, so
    # finite values become 0 and the inf becomes NaN (inf * 0).
    assert np.all(np.isnan(u["w"])) == np.isnan(bad)


ROWS = {"emb": N, "w": None}


def test_accumulate_holds_the_poison_until_it_emits_then_forgets_it():
  tx = gtx.accumulate(gtx.lazy_adam(0.1), 2, rows_per_step=ROWS)
  params = _params()
  state = tx.init(params)

  @jax.jit  # one compile for 3 calls: the update, and the params it gives
  def update(g, state, p):
    u, state = tx.update(g, state, p)
    return u, state, gtx.apply_updates(p, u)

  # micro-step 1 (bad, sparse and dense): nothing is applied yet
  u, state, p1 = update(_grads(1, np.nan, bad_dense=True), state, params)
  np.testing.assert_array_equal(p1["emb"], params["emb"])
  assert not np.any(np.isnan(np.asarray(u["emb"].values)))
  # micro-step 2 emits: the bad row, and the bad element of the dense leaf
  # (Adam is elementwise), are poisoned
  u, state, p2 = update(_grads(2), state, p1)
  assert _bad_rows(p2["emb"]) == {BAD_ROW}
  np.testing.assert_array_equal(np.isnan(p2["w"]), [False, True, False])
  # the buffers are emptied: the next window starts clean
  acc = state.accumulator
  acc_w = np.asarray(acc["w"])
  assert np.all(np.isfinite(acc_w)) and np.all(acc_w == 0)
  assert np.all(np.isfinite(np.asarray(acc["emb"].values)))
  u, state, _ = update(_grads(3, ids=(0, 6, 6, 7, PAD)), state, p2)
  assert np.all(np.isfinite(np.asarray(u["emb"].values)))


def test_drop_stale_a_dropped_bad_gradient_changes_nothing():
  tx = _step(gtx.drop_stale(gtx.lazy_adam(0.1), 0))
  good = [_grads(1), _grads(2)]
  # call 2 (read at step 0, now at 1: stale) carries a NaN and is dropped
  got_p, got_s = _run(
    tx, [good[0], _grads(5, np.nan), good[1]], grad_step=[0, 0, 1]
  )
  want_p, want_s = _run(tx, good, grad_step=[0, 1])
  jax.tree.map(np.testing.assert_array_equal, got_p, want_p)
  jax.tree.map(
    np.testing.assert_array_equal, got_s.inner_state, want_s.inner_state
  )
  assert int(got_s.num_dropped) == 1 and int(got_s.step) == 2


def _mirrored_run(tx, m, steps):
  """``steps``: a list of per-replica gradient lists (one per replica)."""

  def fn(params, state, batch):
    g = {
      "emb": gtx.SparseRows(batch["ids"], batch["vals"], V),
      "w": batch["w"][0],
    }
    u, state = tx.update(g, state, params)
    return gtx.apply_updates(params, u), state

  step = m.step(fn, donate_argnums=(0, 1))
  params = m.replicate(_params())
  state = m.replicate(tx.init(_params()))
  for per_replica in steps:
    batch = {
      "ids": np.concatenate([g["emb"].indices for g in per_replica]),
      "vals": np.concatenate([g["emb"].values for g in per_replica]),
      "w": np.stack([g["w"] for g in per_replica]),
    }
    params, state = step(params, state, m.shard_batch(batch))
  shards = [np.asarray(s.data) for s in params["emb"].addressable_shards]
  for s in shards[1:]:  # the replicas agree, NaN included
    np.testing.assert_array_equal(s, shards[0])
  return jax.tree.map(np.asarray, (params, state))


def test_all_reduce_spreads_a_replica_bad_row_to_that_row_everywhere():
  m = gtx.Mirrored()
  tx = optax.chain(gtx.all_reduce(m.axis_name), gtx.lazy_adam(0.1))
  R = m.num_replicas

  def steps(bad):
    # replica 2 has the bad entry at step 0; the others never touch BAD_ROW
    return [
      [_grads(10 * s + r, bad if (r, s) == (2, 0) else None) for r in range(R)]
      for s in range(2)
    ]

  got = _mirrored_run(tx, m, steps(np.nan))
  want = _mirrored_run(tx, m, steps(None))
  _assert_only_bad_row_poisoned(
    got, want, ["[1][0].mu['emb']", "[1][0].nu['emb']"]
  )


# ----------------------------------------------------------------------------
# Guards: where optax.apply_if_finite goes


def _assert_same(a, b):
  """Equal up to the rounding of a different compiled program."""
  jax.tree.map(
    lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7), a, b
  )


def test_guard_inside_accumulate_skips_the_window_with_a_bad_gradient():
  inner = gtx.lazy_adam(0.1)
  guarded = gtx.accumulate(
    optax.apply_if_finite(inner, 3), 2, rows_per_step=ROWS
  )
  plain = gtx.accumulate(inner, 2, rows_per_step=ROWS)
  w1, w3 = [_grads(1), _grads(2)], [_grads(5), _grads(6)]
  bad_window = [_grads(3), _grads(4, np.inf, bad_dense=True)]
  got_p, got_s = _run(guarded, w1 + bad_window + w3)
  want_p, want_s = _run(plain, w1 + w3)  # the bad window never happened
  _assert_same(got_p, want_p)
  _assert_same(got_s.inner_state.inner_state, want_s.inner_state)
  assert int(got_s.inner_state.total_notfinite) == 1
  assert int(got_s.num_updates) == 3  # the window was emitted, and skipped


def test_guard_outside_accumulate_is_rejected_for_sparse_leaves():
  tx = optax.apply_if_finite(
    gtx.accumulate(gtx.lazy_adam(0.1), 2, rows_per_step=ROWS), 3
  )
  with pytest.raises(TypeError, match="branches must have equal output"):
    _run(tx, [_grads(1)])


def test_guard_outside_drop_stale_keeps_the_global_step():
  inner = gtx.lazy_adam(0.1)
  guarded = optax.apply_if_finite(gtx.drop_stale(inner, 1), 3)
  plain = gtx.drop_stale(inner, 1)
  good = [_grads(1), _grads(2), _grads(3)]
  # the bad gradient is rejected before drop_stale counts it: the global
  # step does not advance, so the later gradients are no staler for it
  got_p, got_s = _run(
    guarded, good[:1] + [_grads(9, np.nan)] + good[1:], grad_step=[0, 1, 1, 1]
  )
  want_p, want_s = _run(plain, good, grad_step=[0, 1, 1])
  _assert_same(got_p, want_p)
  _assert_same(got_s.inner_state, want_s)
  stats = gtx.staleness_stats(got_s)
  assert int(stats["step"]) == 3 and int(stats["num_dropped"]) == 0
  assert int(got_s.total_notfinite) == 1


def test_guard_after_all_reduce_skips_on_every_replica():
  m = gtx.Mirrored()
  R = m.num_replicas
  guard = lambda: optax.apply_if_finite(gtx.lazy_adam(0.1), 3)  # noqa: E731
  tx = optax.chain(gtx.all_reduce(m.axis_name), guard())

  def step(s, bad=None):
    return [
      _grads(10 * s + r, bad if r == 2 else None, bad_dense=bad is not None)
      for r in range(R)
    ]

  got_p, got_s = _mirrored_run(tx, m, [step(0), step(1, np.nan), step(2)])
  want_p, want_s = _mirrored_run(tx, m, [step(0), step(2)])
  _assert_same(got_p, want_p)
  _assert_same(got_s[1].inner_state, want_s[1].inner_state)
  assert int(got_s[1].total_notfinite) == 1
