"""examples/multihost.py across two real processes (gloo on loopback): a
lost process ends the job within seconds with a one-line error, and a
restart from the last checkpoint ends bit for bit where an uninterrupted run
ends -- after a kill mid-training and after a kill inside a save."""

import os
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import procs
import pytest

from examples import multihost

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8  # checkpoints at 3 and 6 (multihost.SAVE_EVERY)
DEVICES = 2  # per process: 4 replicas in all
EXIT_BOUND_S = 30.0
ERROR_LINE = re.compile(
  r"^multihost: process (\d) of 2: (lost peer process \d|lost the "
  r"coordinator \(process 0\)|a cross-process operation failed)"
)


def _cache_env(tmp: Path) -> dict[str, str]:
  # The jobs of one session compile the same programs: share a persistent
  # compilation cache (in the session's temp folder) to skip recompiling.
  return {
    "JAX_COMPILATION_CACHE_DIR": str(tmp.parent / "jax_cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
  }


class Job:
  """Two processes of examples.multihost, logs in files (a full pipe could
  stall one process while the other waits for it in a collective)."""

  def __init__(self, tmp: Path, name: str, env: dict[str, str] | None = None):
    self.logs = [tmp / f"{name}_{i}.log" for i in range(2)]
    port = str(procs.free_port())
    env = dict(os.environ, **_cache_env(tmp), **(env or {}))
    self.procs = []
    for i in range(2):
      cmd = [sys.executable, "-m", "examples.multihost"]
      cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
      cmd += ["--process-id", str(i), "--steps", str(STEPS)]
      cmd += ["--checkpoint-dir", str(tmp / "ckpt"), "--out", str(tmp / name)]
      cmd += ["--devices-per-process", str(DEVICES)]
      self.procs.append(procs.start(cmd, self.logs[i], cwd=ROOT, env=env))

  def log(self, i: int) -> str:
    return self.logs[i].read_text(errors="replace")

  def wait_for(self, i: int, text: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in self.log(i):
      if self.procs[i].poll() is not None:
        raise AssertionError(f"process {i} ended early:\n{self.log(i)[-3000:]}")
      if time.monotonic() > deadline:
        raise AssertionError(f"no {text!r} from process {i} in {timeout} s")
      time.sleep(0.05)

  def wait(self, timeout: float = 120.0) -> list[int]:
    deadline = time.monotonic() + timeout
    return [
      p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in self.procs
    ]

  def kill(self) -> None:
    procs.kill(self.procs)

  def assert_ok(self) -> None:
    self.wait()
    procs.assert_exited_ok(self.procs, self.logs)


def _run_to_end(tmp: Path, name: str) -> dict[str, np.ndarray]:
  job = Job(tmp, name)
  try:
    job.assert_ok()
  finally:
    job.kill()
  for i in range(2):
    assert f"step {STEPS}\n" in job.log(i)
  with np.load(tmp / name) as f:
    return dict(f)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """An uninterrupted 2-process run's final params."""
  return _run_to_end(tmp_path_factory.mktemp("uninterrupted"), "want.npz")


def _assert_bit_identical(got, want):
  assert sorted(got) == sorted(want)
  for k, w in want.items():
    assert got[k].dtype == w.dtype and got[k].shape == w.shape, k
    np.testing.assert_array_equal(got[k], w, err_msg=k)


def _assert_failed_fast(job, survivor, killed_at):
  """The survivor exits non-zero within EXIT_BOUND_S, its last line the
  one-line error naming the lost peer or the failed collective."""
  rc = job.procs[survivor].wait(timeout=EXIT_BOUND_S + 30)
  elapsed = time.monotonic() - killed_at
  log = job.log(survivor)
  assert rc == multihost.EXIT_PEER_LOST, log[-4000:]
  assert elapsed < EXIT_BOUND_S, elapsed
  last = log.strip().splitlines()[-1]
  m = ERROR_LINE.match(last)
  assert m and int(m[1]) == survivor, log[-4000:]
  assert "Check failure" not in log and "Traceback" not in log, log[-4000:]
  return elapsed, last


# The training process's stderr when gloo's transport thread aborted it (a
# peer SIGKILLed in the middle of a step; seen in CI), as the supervisor
# reads it.
GLOO_ABORT = """\
[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected \
peer ranks is : 3
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at external/gloo/gloo/transport/tcp/pair.cc:459] \
op.preamble.length <= op.nbytes. 8 vs 4. Received data size doesn't match \
expected size. Is there a distributed collective mismatch in your code?
"""


def test_a_native_abort_of_gloo_is_one_line_naming_the_collective():
  stderr = multihost.ChildStderr()
  passed = [stderr.feed(line) for line in GLOO_ABORT.splitlines(True)]
  assert passed[0].startswith("[Gloo] Rank 0 is connected")
  assert passed[1:] == [None, None]  # the abort report is held back
  args = multihost.parse_args(
    ["--coordinator", "h:1", "--num-processes", "2", "--process-id", "0"]
    + ["--steps", "1", "--checkpoint-dir", "c", "--out", "o"]
  )
  line = multihost.one_line(args, stderr.verdict(-signal.SIGABRT))
  assert ERROR_LINE.match(line) and "\n" not in line, line
  assert "gloo" in line and "8 vs 4" in line, line


def test_an_abort_report_keeps_the_users_own_stderr():
  # Lines held after a coordination log line are the user's too (here a
  # traceback): only a fatal report of the coordination service explains
  # them away; after gloo's abort they are printed before the one line.
  stderr = multihost.ChildStderr()
  lines = ["E1130 Polled an error from coordination service\n"]
  lines += ["Traceback (most recent call last):\n", "ValueError: bad\n"]
  lines += GLOO_ABORT.splitlines(True)[1:]
  lines += ["Fatal Python error: Aborted\n"]  # faulthandler's dump
  assert [stderr.feed(line) for line in lines] == [None] * len(lines)
  assert stderr.unexplained() == lines[:3]
  reason = stderr.verdict(-signal.SIGABRT)
  assert reason.endswith("collective mismatch in your code?"), reason


def test_a_signal_without_a_report_is_named():
  stderr = multihost.ChildStderr()
  assert stderr.feed("step 1\n") == "step 1\n"
  assert stderr.verdict(0) is None
  assert stderr.verdict(-signal.SIGKILL) == (
    "the training process died of SIGKILL"
  )


def test_output_keys_are_param_paths(uninterrupted):
  want = multihost.flat_params(multihost.init_params())
  assert sorted(uninterrupted) == sorted(want)
  assert "dense1/w" in uninterrupted and "embed/table" in uninterrupted
  # trained: the table moved, and only in rows the data touched
  moved = np.any(uninterrupted["embed/table"] != want["embed/table"], axis=1)
  assert 0 < moved.sum() < multihost.NUM_ROWS


def test_a_lost_process_fails_fast_and_a_restart_resumes_exactly(
  tmp_path, uninterrupted
):
  # One run, restarted twice (as a scheduler restarts every process with
  # the same arguments), each restart from the last committed checkpoint:
  # 1. process 1 is SIGKILLed after step 4 (a checkpoint exists at step 3);
  job = Job(tmp_path, "killed.npz")
  try:
    job.wait_for(1, "step 4\n")
    job.procs[1].send_signal(signal.SIGKILL)
    _assert_failed_fast(job, survivor=0, killed_at=time.monotonic())
  finally:
    job.kill()
  assert not (tmp_path / "killed.npz").exists()
  # 2. restarted, process 0 (the coordinator, which commits checkpoints)
  # dies while saving step 6: its part is written, the checkpoint not
  # committed;
  env = {multihost.DIE_IN_SAVE_ENV: "6:0"}
  job = Job(tmp_path, "died_in_save.npz", env)
  try:
    job.wait_for(0, "dying in save 6")
    killed_at = time.monotonic()
    assert job.procs[0].wait(timeout=30) == -signal.SIGKILL
    _assert_failed_fast(job, survivor=1, killed_at=killed_at)
  finally:
    job.kill()
  assert "resumed from step 3" in job.log(0)
  steps = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
  assert "3" in steps and "6" not in steps, steps
  # 3. restarted again, it ends bit for bit where the uninterrupted run
  # ends.
  got = _run_to_end(tmp_path, "got.npz")
  assert "resumed from step 3" in (tmp_path / "got.npz_0.log").read_text()
  _assert_bit_identical(got, uninterrupted)
