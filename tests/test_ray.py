"""Asynchronous training across Ray processes (examples/ray_trainer.py):
drop_stale's exact counts with pushes released in a fixed order, a worker
killed mid-run, a parameter server killed and restored from its checkpoint,
and no process left behind.

One local Ray cluster (2 CPUs, no dashboard) serves the whole module; every
test starts its own actors and stops them.
"""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
TASK = {"seed": 0, "num_rows": 200, "num_train": 512, "num_eval": 128}
LR = 0.5
MARKER = "GRADTX_RAY_TEST_MARKER"  # in the environment of every Ray process

# ray.init starts its processes with subprocess.Popen(preexec_fn=...), a
# fork that runs the at-fork hooks (JAX's warns of threads and deadlocks)
# and then an exec: nothing of this process runs in the child.
pytestmark = pytest.mark.filterwarnings(
  r"ignore:os\.fork\(\) was called:RuntimeWarning"
)


def test_gradtx_does_not_import_ray():
  code = "import sys, gradtx; print('ray' in sys.modules)"
  out = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    check=True,
    env=dict(os.environ, PYTHONPATH=str(ROOT)),
  )
  assert out.stdout.strip() == "False"


def _processes_with(marker: str) -> list[str]:
  """The processes (other than this one) whose environment holds
  ``MARKER=marker``: what a Ray cluster started from here left running."""
  import psutil

  found = []
  for p in psutil.process_iter(["pid", "name"]):
    if p.info["pid"] == os.getpid():
      continue
    try:
      if p.environ().get(MARKER) == marker:
        found.append(f"{p.info['pid']} {p.info['name']}")
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
      continue
  return found


def _assert_none_left(marker: str, timeout: float = 20.0) -> None:
  deadline = time.monotonic() + timeout
  while (left := _processes_with(marker)) and time.monotonic() < deadline:
    time.sleep(0.2)
  assert not left, f"Ray processes left running: {left}"


@pytest.fixture(scope="module")
def rt():
  pytest.importorskip("ray", reason="Ray is not installed (extra `ray`)")
  from examples import ray_trainer

  marker = uuid.uuid4().hex
  os.environ[MARKER] = marker
  try:
    ray_trainer.init_ray(num_cpus=2, log_to_driver=False)
    # The marker does reach Ray's processes (what the checks below rely on).
    assert _processes_with(marker), "no Ray process carries the marker"
    yield ray_trainer
  finally:
    import ray

    ray.shutdown()
    del os.environ[MARKER]
  _assert_none_left(marker)  # the normal end: ray.shutdown stops them all


def _expected(workers: int, limit: int | None, rounds: int):
  """TensorFlow's rule, by hand: every worker reads at the same step, then
  the pushes arrive in worker order. [(worker, accepted, staleness)]."""
  step, out = 0, []
  for _ in range(rounds):
    read = step
    for w in range(workers):
      tau = step - read
      ok = limit is None or tau <= limit
      out.append((w, ok, tau))
      step += ok
  return out


def _sgd_reference(params, accepted_grads):
  """Sparse SGD by hand: every accepted gradient subtracted, duplicate rows
  summed."""
  p = {k: np.array(v, np.float64) for k, v in params.items()}
  for g in accepted_grads:
    rows = g["emb"]
    np.add.at(p["emb"], rows.indices, -LR * rows.values.astype(np.float64))
    p["w"] -= LR * g["w"]
    p["b"] -= LR * g["b"]
  return p


@pytest.fixture(scope="class")
def three_workers(rt):
  """A server (no checkpoints: each test resets it) and three workers."""
  ps, ws = rt.start_actors(TASK, rt.ServerConfig(max_staleness=None), 3)
  yield ps, ws
  rt.stop_actors([ps, *ws])


class TestFixedReleaseOrder:
  """On one set of actors, stopped after these tests."""

  @pytest.mark.parametrize("limit", [0, 1])
  def test_exact_counts(self, rt, three_workers, limit):
    _fixed_release_order(rt, three_workers, limit)


def _fixed_release_order(rt, three_workers, limit):
  """Like TensorFlow's DropStaleGradientOptimizer test: N workers read the
  parameters at the same step, then their pushes are released in worker
  order, so worker i's gradient is i steps stale (fewer after drops). For
  N = 1, 2, 3 in turn on one server, the accepted and dropped counts, each
  push's staleness and the final parameters are exactly what the rule
  gives."""
  import ray

  ps, ws = three_workers
  ray.get(
    ps.reset.remote(rt.ServerConfig(max_staleness=limit, learning_rate=LR))
  )
  params0 = ray.get(ps.state.remote())["params"]
  accepted_grads, seen = [], []
  rounds = 2
  for n in (1, 2, 3):
    before = ray.get(ps.stats.remote())
    for _ in range(rounds):
      held = ray.get([w.compute.remote() for w in ws[:n]])
      assert len({step for step, _, _ in held}) == 1  # one step read
      for w in range(n):
        r = ray.get(ws[w].push.remote())
        seen.append((w, r.outcome == "accepted", r.staleness))
        assert r.outcome in ("accepted", "dropped")
        if r.outcome == "accepted":
          accepted_grads.append(held[w][2])
    want = _expected(n, limit, rounds)
    assert seen[-len(want) :] == want
    after = ray.get(ps.stats.remote())
    accepted = sum(ok for _, ok, _ in want)
    assert after["step"] - before["step"] == accepted
    assert after["num_dropped"] - before["num_dropped"] == len(want) - accepted
  # In all: limit 0 keeps one gradient a round, limit 1 two.
  assert (after["step"], after["num_dropped"]) == {0: (6, 6), 1: (10, 2)}[limit]
  assert after["hist"] == {0: {0: 6, 1: 6}, 1: {0: 6, 1: 4, 2: 2}}[limit]
  want_params = _sgd_reference(params0, accepted_grads)
  got_params = ray.get(ps.state.remote())["params"]
  for k in want_params:
    np.testing.assert_allclose(got_params[k], want_params[k], atol=1e-5)
  # 12 pulls of 6 versions: each version was put into the object store
  # once, for every worker that read it.
  assert after["puts"] == 2 * 3


def _check_at_most_once(r):
  """Every push the server got came once, and its counters add up to them
  (nothing was applied without being logged, or twice)."""
  tags = [(x.sender, x.seq) for x in r.received]
  assert len(tags) == len(set(tags))
  counts = {"accepted": 0, "dropped": 0, "rolled_back": 0}
  for x in r.received:
    counts[x.outcome] += 1
  return counts


def test_killed_worker_loses_its_gradient_and_restarts(rt):
  """The only worker (it sleeps 0.3 s between its pull and its gradient) is
  killed right after the driver hands it its second step: that gradient
  never reaches the server, nothing is pushed twice, Ray restarts the
  worker and its new process trains to the end."""
  r = rt.run(
    TASK,
    workers=1,
    max_staleness=None,
    num_steps=6,
    delay=0.3,
    kill_worker_after=1,
  )
  counts = _check_at_most_once(r)
  # No server restart: its log holds every push of the run.
  assert counts["accepted"] == r.applied and counts["dropped"] == r.dropped
  assert r.applied == 6 and r.stopped_by == "steps"
  worker, sender, seq = r.killed_worker_step
  assert (worker, sender, seq) == (0, r.senders[0][0], 1)
  sent = [(x.sender, x.seq) for x in r.received]
  assert (sender, seq) not in sent  # lost, not applied
  assert sent[0] == (sender, 0)  # the step before it was
  assert len(r.senders[0]) == 2  # restarted once ...
  assert sent[1:] == [(r.senders[0][1], i) for i in range(5)]  # ... trained on
  assert r.by_worker[0]["lost"] == 1
  assert np.isfinite(r.final_loss) and r.final_loss < r.curve[0][1]


def _tree_equal(a, b):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()  # bit for bit


def _restarted(ps, old_server, timeout=60.0):
  """Waits until the server answers from a new process; its stats."""
  import ray

  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    try:
      stats = ray.get(ps.stats.remote())
    except ray.exceptions.ActorUnavailableError:
      time.sleep(0.1)
      continue
    if stats["server"] != old_server:
      return stats
    time.sleep(0.1)
  raise AssertionError("the parameter server did not restart")


def test_restarted_server_restores_its_checkpoint_and_rolls_back(rt, tmp_path):
  """The server (Adagrad: per-row state) checkpoints every 2 accepted
  gradients. Killed at step 3, it restarts from step 2 with params,
  optimizer state, step, drop counters and per-worker counters bit for bit
  as they were; a gradient read at step 3 (a version the restart threw
  away) is rolled back, one read at step 1 (a version the restored server
  shares) goes through drop_stale as one step stale. The test itself
  pulls and pushes that second one, as a worker would."""
  import ray

  from examples import async_trainer as at

  config = rt.ServerConfig(
    max_staleness=1,
    optimizer="adagrad",
    learning_rate=0.1,
    checkpoint_dir=str(tmp_path / "ckpt"),
    checkpoint_every=2,
  )
  ps, (w0,) = rt.start_actors(TASK, config, 1)
  data = at.make_task(**TASK)
  try:
    initial = ray.get(ps.state.remote())
    assert ray.get(w0.step.remote()).step == 1
    pulled = ray.get(ps.pull.remote())  # read at step 1, pushed later
    assert pulled.step == 1
    params = ray.get(pulled.params)
    _, g = at.grad_fn(params, data.train_ids[-32:], data.train_labels[-32:])
    assert ray.get(w0.step.remote()).step == 2  # checkpointed
    saved = ray.get(ps.state.remote())
    saved_stats = ray.get(ps.stats.remote())
    assert ray.get(w0.step.remote()).step == 3  # not checkpointed
    assert ray.get(w0.compute.remote())[0] == 3  # held: read at step 3
    old = saved_stats["server"]

    ray.kill(ps, no_restart=False)
    stats = _restarted(ps, old)
    restored = ray.get(ps.state.remote())
    _tree_equal(restored, saved)
    with pytest.raises(AssertionError):  # the state did move: not trivial
      _tree_equal(restored["opt_state"], initial["opt_state"])
    assert stats["step"] == 2 and stats["restored_from"] == 2
    assert stats["lineage"] == {old: 2}
    for k in ("num_dropped", "last_staleness", "rolled_back", "by_worker"):
      assert stats[k] == saved_stats[k]

    r0 = ray.get(w0.push.remote())  # read at (old, 3): rolled back
    assert (r0.outcome, r0.step, r0.staleness) == ("rolled_back", 2, None)
    r1 = ray.get(ps.push.remote(rt.to_wire(g), 1, old, 1, ("test", 0)))
    assert (r1.accepted, r1.step, r1.staleness) == (True, 3, 1)  # kept
    after = ray.get(ps.stats.remote())
    assert after["rolled_back"] == 1 and after["num_dropped"] == 0
    assert after["by_worker"][0]["rolled_back"] == 1
    assert after["by_worker"][1]["accepted"] == 1
    # The worker reads again, from the new server.
    r = ray.get(w0.step.remote())
    assert (r.outcome, r.server, r.staleness) == (
      "accepted",
      after["server"],
      0,
    )
  finally:
    rt.stop_actors([ps, w0])


def test_killed_server_restarts_and_training_finishes(rt, tmp_path):
  """The run's own fault: the server is killed once the global step reaches
  7 and restarts from its last checkpoint (every 5 steps); every gradient
  read from the old server follows the rule; training reaches its steps."""
  r = rt.run(
    TASK,
    workers=1,
    max_staleness=None,
    num_steps=15,
    delay=0.05,
    checkpoint_dir=str(tmp_path / "ckpt"),
    checkpoint_every=5,
    kill_ps_after=7,
  )
  assert r.steps_before_ps_kill >= 7
  c = r.ps_restored_from
  assert c % 5 == 0 and 5 <= c <= r.steps_before_ps_kill
  assert r.applied >= 15 and r.stopped_by == "steps"
  old, new = r.stats["lineage"], r.stats["server"]
  assert list(old.values()) == [c]
  counts = _check_at_most_once(r)
  assert counts["rolled_back"] == r.rolled_back
  for x in r.received:
    if x.server in old:  # read from the killed server, pushed to the new
      want = "rolled_back" if x.grad_step > c else "accepted"
      assert x.outcome == want, x
    else:
      assert x.server == new and x.outcome == "accepted"
  # The restored counters plus the new server's pushes are the totals.
  assert sum(c["accepted"] for c in r.by_worker.values()) == r.applied
  assert np.isfinite(r.final_loss) and r.final_loss < r.curve[0][1]


def test_a_failing_driver_leaves_no_process(tmp_path):
  """The server is killed with no checkpoint to restart from: the driver
  fails with a clear error, and ray.shutdown (in its finally) leaves no Ray
  process running."""
  pytest.importorskip("ray", reason="Ray is not installed (extra `ray`)")
  marker = uuid.uuid4().hex
  env = dict(os.environ, PYTHONPATH=str(ROOT), **{MARKER: marker})
  cmd = [sys.executable, "-m", "examples.ray_trainer", "--workers", "1"]
  cmd += ["--steps", "100000", "--kill-ps-after", "3", "--num-cpus", "2"]
  proc = subprocess.run(
    cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
  )
  assert proc.returncode == 1, proc.stdout + proc.stderr
  assert "the parameter server died and could not restart" in proc.stderr
  _assert_none_left(marker)
