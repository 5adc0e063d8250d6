"""Checkpoint and resume: every gradtx state round-trips through orbax and
through ``.npz`` bit for bit, and a run resumed in a fresh process (on 4
devices instead of 8 for the mirrored run) continues exactly."""

import checkpoint_worker as worker
import jax
import jax.numpy as jnp
import numpy as np
import optax
import procs
import pytest
from conformance import each, step_fn, together

import gradtx as gtx

NUM_ROWS = 12
DIM = 2
N = 6  # rows per SparseRows gradient


def _params():
  rng = np.random.RandomState(0)
  return {
    "emb": jnp.asarray(rng.normal(size=(NUM_ROWS, DIM)), jnp.float32),
    "w": jnp.asarray(rng.normal(size=(DIM, 3)), jnp.float32),
    "b": jnp.zeros((), jnp.float32),
  }


def _grads(step):
  """Row-sparse with duplicates and padding (-1, NUM_ROWS + 1), and dense."""
  rng = np.random.RandomState(10 + step)
  ids = rng.randint(0, NUM_ROWS // 2 + step, size=N)
  ids[1] = ids[0]
  ids[-1] = -1 if step % 2 else NUM_ROWS + 1
  return {
    "emb": gtx.SparseRows(
      ids.astype(np.int32),
      rng.normal(size=(N, DIM)).astype(np.float32),
      NUM_ROWS,
    ),
    "w": jnp.asarray(rng.normal(size=(DIM, 3)), jnp.float32),
    "b": jnp.asarray(rng.normal(), jnp.float32),
  }


ROWS = {"emb": N, "w": None, "b": None}
SCHEDULE = optax.exponential_decay(0.1, transition_steps=1, decay_rate=0.5)
# The step each call read its params at, as drop_stale sees it: None means
# "the current step" (fresh); an int is absolute (stale by step - it).
READ_AT = (None, None, 0, None, 0, None)


def _nested():
  return optax.chain(
    gtx.clip_by_global_norm(10.0),
    gtx.drop_stale(
      gtx.accumulate(
        gtx.lazy_adam(SCHEDULE, catch_up=True), 3, rows_per_step=ROWS
      ),
      1,
      rescale=True,
    ),
  )


# name -> (make_tx, number of updates before the checkpoint). Between them
# they hold every gradtx state type: lazy Adam with and without catch-up, a
# schedule's count, bfloat16 moments, accumulate mid-window with a sparse
# buffer, drop_stale counters after drops, and optax wrappers around them.
STATES = {
  "lazy_adamw_schedule": (
    lambda: gtx.lazy_adamw(SCHEDULE, mu_dtype=jnp.bfloat16),
    3,
  ),
  "accumulate_mid_window": (
    lambda: gtx.accumulate(gtx.lazy_adam(0.1), 3, rows_per_step=ROWS),
    2,
  ),
  "nested_chain": (_nested, 6),
  "apply_if_finite": (
    lambda: optax.apply_if_finite(gtx.lazy_adam(0.1, catch_up=True), 2),
    3,
  ),
  # [V] row-wise accumulators and a schedule's count.
  "rowwise_adagrad_schedule": (
    lambda: gtx.rowwise_adagrad(SCHEDULE, weight_decay=0.01),
    3,
  ),
  # 8-bit moments (QuantizedRows: codes and scales).
  "lazy_adam_int8": (
    lambda: gtx.lazy_adam(SCHEDULE, mu_dtype="int8", nu_dtype="int8"),
    3,
  ),
  "lazy_sgd_int8_accumulate": (
    lambda: gtx.accumulate(
      gtx.lazy_sgd(0.1, 0.9, accumulator_dtype="int8"), 3, rows_per_step=ROWS
    ),
    2,
  ),
  # FTRL's count, n and z, inside an accumulation window.
  "ftrl_accumulate": (
    lambda: gtx.accumulate(
      gtx.ftrl(0.1, l1_regularization_strength=0.01), 3, rows_per_step=ROWS
    ),
    2,
  ),
}


def _inputs(carries, starts, t):
  """Call ``t`` after each run's start: its gradient and the step it read
  its params at (see READ_AT)."""
  out = []
  for (_, state), start in zip(carries, starts, strict=True):
    read = READ_AT[(start + t) % len(READ_AT)]
    grad_step = _stale_step(state) if read is None else read
    out.append((_grads(start + t), {"grad_step": jnp.int32(grad_step)}))
  return out


def _stale_step(state):
  try:
    return int(gtx.staleness_stats(state)["step"])
  except ValueError:
    return 0  # no drop_stale in this state: grad_step is ignored


def assert_trees_identical(got, want):
  """Same treedef (NamedTuple and SparseRows types, num_rows), dtypes,
  shapes and bits."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(g), np.asarray(w)
    assert g.dtype == w.dtype and g.shape == w.shape
    np.testing.assert_array_equal(g, w)


def _save_restore(fmt, tree, abstract, path):
  if fmt == "orbax":
    worker.save_orbax(path / "ckpt", tree)
    return worker.restore_orbax(path / "ckpt", abstract)
  worker.save_npz(path / "ckpt.npz", tree)
  return worker.restore_npz(path / "ckpt.npz", abstract)


def _saved_inside_a_window(name, state):
  if name.endswith("accumulate") or name in (
    "accumulate_mid_window",
    "nested_chain",
  ):
    acc = [
      x
      for x in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, gtx.AccumulateState)
      )
      if isinstance(x, gtx.AccumulateState)
    ]
    assert int(acc[0].num_accumulated) > 0  # saved inside a k-window
    assert isinstance(acc[0].accumulator["emb"], gtx.SparseRows)
  if name == "nested_chain":
    assert int(gtx.staleness_stats(state)["num_dropped"]) > 0


def test_state_round_trips_and_continues_exactly(tmp_path):
  # Every state in one run of one jitted program: each saved after its own
  # number of updates, then 3 more (want); restored, the 3 updates again
  # from each one's own step (got), in the same program.
  names = list(STATES)
  txs = [STATES[n][0]() for n in names]
  before = [STATES[n][1] for n in names]
  step = jax.jit(together(names, [step_fn(tx) for tx in txs]))
  carries = jax.jit(lambda p: [(p, tx.init(p)) for tx in txs])(_params())
  saved, want = [None] * len(names), [None] * len(names)
  for t in range(max(before) + 3):
    for k, b in enumerate(before):
      if t == b:
        saved[k] = carries[k]
      elif t == b + 3:
        want[k] = carries[k]
    carries = step(carries, _inputs(carries, [0] * len(names), t))
  want = [w if w is not None else c for w, c in zip(want, carries, strict=True)]

  each(names, lambda k, name: _saved_inside_a_window(name, saved[k][1]))
  for fmt in ("orbax", "npz"):
    restored = []
    for k, name in enumerate(names):
      path = tmp_path / fmt / name
      path.mkdir(parents=True)
      abstract = worker.abstract_tree(txs[k], _params())
      tree = {"params": saved[k][0], "opt_state": saved[k][1]}
      r = _save_restore(fmt, tree, abstract, path)
      restored.append((r["params"], r["opt_state"]))
    each(
      [f"{n} ({fmt})" for n in names],
      lambda k, _, r=restored: assert_trees_identical(r[k], saved[k]),
    )
    # Continue from the restored states: the same updates, bit for bit.
    for t in range(3):
      restored = step(restored, _inputs(restored, before, t))
    each(
      [f"{n} ({fmt}, continued)" for n in names],
      lambda k, _, r=restored: assert_trees_identical(r[k], want[k]),
    )


def test_npz_restore_rejects_a_checkpoint_of_another_state(tmp_path):
  params = _params()
  tx = gtx.lazy_adam(0.1, catch_up=True)
  worker.save_npz(tmp_path / "c.npz", tx.init(params))
  with pytest.raises(ValueError, match="holds 13 leaves; the state has 7"):
    worker.restore_npz(
      tmp_path / "c.npz", jax.eval_shape(gtx.lazy_adam(0.1).init, params)
    )


def test_mirrored_state_restores_onto_four_devices_in_process(tmp_path):
  m8, m4 = gtx.Mirrored(), gtx.Mirrored(jax.devices()[:4])
  tx = worker.make_tx(m8.axis_name)
  params = worker.init_params()
  tree = m8.replicate({"params": params, "opt_state": tx.init(params)})
  sharding = jax.sharding.NamedSharding(m4.mesh, jax.sharding.PartitionSpec())
  worker.save_orbax(tmp_path / "m", tree)
  got = worker.restore_orbax(
    tmp_path / "m", worker.abstract_tree(tx, params, sharding)
  )
  assert_trees_identical(got, tree)
  for leaf in jax.tree.leaves(got):
    assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)


def _mirrored_run(m, tx, step_fn, stop):
  params = worker.init_params()
  tree = m.replicate({"params": params, "opt_state": tx.init(params)})
  p, s = worker.train(tree["params"], tree["opt_state"], 0, stop, step_fn, m)
  return {"params": p, "opt_state": s}


def test_resume_in_a_fresh_process(tmp_path):
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  ckpt.mkdir()
  out.mkdir()
  params = worker.init_params()

  # Plain jit: an uninterrupted run, and the same run saved at SAVE_AT.
  tx = worker.make_tx()
  step_fn = worker.make_step(tx, None)
  want_p, want_s = worker.train(
    params, tx.init(params), 0, worker.STEPS, step_fn
  )
  p, s = worker.train(params, tx.init(params), 0, worker.SAVE_AT, step_fn)
  acc = s.inner_state
  assert int(acc.num_accumulated) > 0  # inside a k-window
  assert np.any(np.asarray(acc.accumulator["emb"].indices) < worker.NUM_ROWS)
  assert int(s.num_dropped) > 0
  lazy = acc.inner_state[0]
  assert len(set(np.asarray(lazy.last_step["emb"]).tolist())) > 2  # catch-up
  worker.save_orbax(ckpt / "plain_orbax", {"params": p, "opt_state": s})
  worker.save_npz(ckpt / "plain.npz", {"params": p, "opt_state": s})

  # Mirrored on 8 devices: uninterrupted, and saved at SAVE_AT.
  m8 = gtx.Mirrored()
  tx8 = worker.make_tx(m8.axis_name)
  step8 = worker.make_step(tx8, m8)
  want_m = _mirrored_run(m8, tx8, step8, worker.STEPS)
  saved_m = _mirrored_run(m8, tx8, step8, worker.SAVE_AT)
  worker.save_orbax(ckpt / "mirrored_orbax", saved_m)
  saved_m = jax.tree.map(np.asarray, saved_m)

  # One fresh process, on 4 devices; nothing to do here while it runs.
  args = ["--ckpt", str(ckpt), "--out", str(out)]
  alone = dict(num_processes=1, devices=4, timeout=240)
  with procs.launched("checkpoint_worker.py", args, tmp_path, **alone):
    pass

  want = {"params": want_p, "opt_state": want_s}
  abstract = worker.abstract_tree(tx, params)
  for fmt in ("orbax", "npz"):
    got = worker.restore_npz(out / f"plain_{fmt}.npz", abstract)
    assert_trees_identical(got, want)

  with np.load(out / "devices.npz") as f:
    assert int(f["num_replicas"]) == 4
  abstract_m = worker.abstract_tree(worker.make_tx("replica"), params)
  restored = worker.restore_npz(out / "mirrored_restored.npz", abstract_m)
  assert_trees_identical(restored, saved_m)
  got = worker.restore_npz(out / "mirrored.npz", abstract_m)
  # 4 replicas instead of 8: the dense all-reduce sums in another order, so
  # only float reassociation separates the runs. Counters are exact.
  assert jax.tree.structure(got) == jax.tree.structure(want_m)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want_m), strict=True):
    w = np.asarray(w)
    if np.issubdtype(w.dtype, np.integer):
      np.testing.assert_array_equal(g, w)
    else:
      np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
  moved = np.abs(got["params"]["emb"] - params["emb"]).max()
  assert moved > 0.01  # the run did train
