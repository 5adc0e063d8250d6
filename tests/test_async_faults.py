"""Faults in the threaded async trainer (examples/async_trainer.py): a worker
that raises stops everything within a bounded time and its error is
re-raised with no thread left running; a straggler's gradients are dropped
by drop_stale and counted per worker."""

import threading
import time

import pytest

from examples import async_trainer as at


@pytest.fixture(scope="module")
def task():
  return at.make_task(seed=0, num_rows=200, num_train=512, num_eval=128)


def _trainer_threads():
  return [t.name for t in threading.enumerate() if t.name.startswith("worker")]


class Boom(Exception):
  pass


@pytest.mark.parametrize("at_gradient", [0, 3])
def test_a_failing_worker_stops_the_run_and_is_reraised(task, at_gradient):
  failed_at = []
  calls = []

  def fault(worker, i):
    calls.append((worker, time.monotonic()))
    if worker == 1 and i == at_gradient:
      failed_at.append(time.monotonic())
      raise Boom(f"worker 1 failed at gradient {i}")

  with pytest.raises(Boom, match=f"at gradient {at_gradient}") as info:
    at.run_async(
      task,
      workers=3,
      max_staleness=2,
      num_steps=10**6,
      time_limit=60.0,
      fault=fault,
      join_timeout=5.0,
    )
  returned = time.monotonic()
  assert not _trainer_threads()  # every worker joined
  # Bounded: the run ended within a gradient's time of the fault, not at
  # the time limit.
  assert returned - failed_at[0] < 5.0
  # The other workers stopped: none started a gradient after the applier
  # returned.
  assert all(t <= returned for _, t in calls)
  assert "async worker 1" in " ".join(info.value.__notes__)


def test_a_thread_that_does_not_stop_is_an_error(task):
  release, stuck = threading.Event(), threading.Event()

  def fault(worker, i):
    if worker == 0 and i == 2:
      # Fail only once worker 1 is stuck, whatever the thread timing.
      assert stuck.wait(10.0), "worker 1 never got stuck"
      raise Boom("first failure")
    if worker == 1 and i == 1:
      stuck.set()
      release.wait(10.0)  # stuck past join_timeout

  try:
    with pytest.raises(RuntimeError, match=r"did not stop within") as info:
      at.run_async(
        task,
        workers=2,
        max_staleness=None,
        num_steps=10**6,
        fault=fault,
        join_timeout=0.3,
      )
    assert isinstance(info.value.__cause__, Boom)
    assert "worker-1" in str(info.value)
  finally:
    release.set()
    for t in threading.enumerate():
      if t.name.startswith("worker"):
        t.join(10.0)
  assert not _trainer_threads()


def test_straggler_gradients_are_dropped_and_counted(task):
  # Workers 0 and 1 push a gradient every ~10 ms; worker 2 sleeps 0.2 s
  # between reading the parameters and computing, so by the time its
  # gradient arrives tens of steps have been applied: staleness > 1.
  r = at.run_async(
    task,
    workers=3,
    max_staleness=1,
    num_steps=60,
    delay=[0.01, 0.01, 0.2],
  )
  assert not _trainer_threads()
  assert r.stopped_by == "steps" and r.applied == 60
  assert r.received_by_worker[2] >= 1
  assert r.dropped_by_worker[2] == r.received_by_worker[2]
  assert sum(r.dropped_by_worker.values()) == r.dropped
  assert sum(r.received_by_worker.values()) == r.received
  assert r.received == r.applied + r.dropped
  fast_accepted = sum(
    r.received_by_worker[w] - r.dropped_by_worker[w] for w in (0, 1)
  )
  assert fast_accepted == r.applied  # every applied gradient was a fast one
  assert max(r.staleness_hist) > 1


def test_bad_delay_is_rejected(task):
  with pytest.raises(ValueError, match="one per worker"):
    at.run_async(task, workers=2, max_staleness=1, delay=[0.1])
  with pytest.raises(ValueError, match=">= 0"):
    at.run_async(task, workers=1, max_staleness=1, delay=-1.0)
