"""Starting the test workers in their own processes, and the worker's side.

A test starts a worker script of this folder with :func:`launched`::

  with procs.launched("mirrored_worker.py", ["--out", str(tmp_path)],
                      tmp_path, timeout=90):
    ...  # the in-process reference, while the workers run

Each process gets ``devices`` fake CPU devices and this process's environment
otherwise (so a single-process worker shares the persistent compilation
cache conftest.py sets up), writes its output to a log file (a full pipe
could stall one process while the other waits for it in a collective), and
must exit 0. A worker joins the distributed runtime with :func:`joined`
(which turns that cache off: see there), and trains the small model of
:func:`init_params` and :func:`loss_fn` on its own batches.
Not a test module: pytest collects ``test_*.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx

LOG_TAIL = 4000  # characters of a failed process's log in the error


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def worker_env(devices: int) -> dict[str, str]:
  """This process's environment, with ``devices`` fake CPU devices."""
  return dict(
    os.environ,
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    JAX_PLATFORMS="cpu",
  )


def start(cmd: Sequence[str], log: Path, **popen: Any) -> subprocess.Popen:
  """Starts ``cmd`` with its stdout and stderr going to the file ``log``."""
  with open(log, "wb") as f:
    return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, **popen)


def kill(processes: Sequence[subprocess.Popen]) -> None:
  """Kills the processes still running, and reaps them."""
  for p in processes:
    if p.poll() is None:
      p.kill()
      p.wait()


def _status(returncode: int) -> str:
  """``0``, ``1``, or ``-6 (SIGABRT)`` for a process a signal ended."""
  if returncode >= 0:
    return str(returncode)
  try:
    return f"{returncode} ({signal.Signals(-returncode).name})"
  except ValueError:
    return str(returncode)


def assert_exited_ok(
  processes: Sequence[subprocess.Popen], logs: Sequence[Path]
) -> None:
  """Every (ended) process exited 0; else the exit status and the tail of
  the log of each one that did not. All of them: the first listed is not
  always the first that failed (a process that aborts leaves its peers
  failing as they wait for it)."""
  failed = [
    f"process {i} exited {_status(p.returncode)}:\n"
    + log.read_text(errors="replace")[-LOG_TAIL:]
    for i, (p, log) in enumerate(zip(processes, logs, strict=True))
    if p.returncode != 0
  ]
  assert not failed, "\n\n".join(failed)


@contextlib.contextmanager
def launched(
  script: str,
  args: Sequence[str],
  log_dir: Path,
  *,
  timeout: float,
  num_processes: int = 2,
  devices: int = 2,
) -> Iterator[list[subprocess.Popen]]:
  """Runs ``num_processes`` copies of the worker ``script`` of this folder
  while the ``with`` body runs.

  With more than one process, each is passed ``--port P --num-processes N
  --process-id I`` (for :func:`joined`) before ``args``; a single process is
  passed ``args`` alone. Process ``I`` logs to ``log_dir/log_I.txt``. On
  leaving the body the processes are waited for, ``timeout`` seconds in
  all; any still running then (or when the body raised) is killed
  (``SIGKILL``), and every one that exited non-zero fails the test with the
  tail of its log.
  """
  cmd = [sys.executable, str(Path(__file__).with_name(script))]
  if num_processes > 1:
    cmd += ["--port", str(free_port()), "--num-processes", str(num_processes)]
  env = worker_env(devices)
  processes: list[subprocess.Popen] = []
  logs: list[Path] = []
  try:
    for i in range(num_processes):
      flags = ["--process-id", str(i)] if num_processes > 1 else []
      logs.append(log_dir / f"log_{i}.txt")
      processes.append(start(cmd + flags + list(args), logs[-1], env=env))
    yield processes
    deadline = time.monotonic() + timeout
    for p in processes:
      try:
        p.wait(timeout=max(deadline - time.monotonic(), 0))
      except subprocess.TimeoutExpired:
        break  # killed below: fails with the logs
  finally:
    kill(processes)
  assert_exited_ok(processes, logs)


# ----------------------------------------------------------------------------
# The worker's side


@contextlib.contextmanager
def joined(
  argv: Sequence[str] | None, *options: str
) -> Iterator[argparse.Namespace]:
  """Parses ``--port``, ``--num-processes``, ``--process-id`` and the
  worker's own required ``options`` (e.g. ``"--out"``) from ``argv``, and
  joins the JAX distributed runtime on 127.0.0.1 (gloo CPU collectives)
  until the ``with`` body ends.

  Every program is compiled in the process, never loaded from the
  persistent compilation cache: an XLA:CPU executable deserialized from it
  (seen with jaxlib 0.10.2 and 0.12) may run a collective and a conditional
  holding collectives in either order, and the order differs from device
  to device under load. Gloo pairs two devices' messages in the order they
  are sent, so one collective receives another's data: a size mismatch
  aborts the process (and its peer waits out the heartbeat timeout), an
  equal size gives a silently wrong result. This must run before anything
  is compiled: JAX decides whether to use the cache at the first compile.
  """
  jax.config.update("jax_enable_compilation_cache", False)
  parser = argparse.ArgumentParser()
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--process-id", type=int, required=True)
  for option in options:
    parser.add_argument(option, required=True)
  args = parser.parse_args(argv)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{args.port}",
    num_processes=args.num_processes,
    process_id=args.process_id,
    initialization_timeout=30,
  )
  try:
    yield args
  finally:
    jax.distributed.shutdown()


def init_params(num_rows: int, dim: int) -> dict[str, np.ndarray]:
  """A ``[num_rows, dim]`` table and a linear read-out, seeded."""
  rng = np.random.RandomState(0)
  return {
    "emb": rng.normal(size=(num_rows, dim)).astype(np.float32),
    "w": rng.normal(size=(dim,)).astype(np.float32),
    "b": np.zeros((), np.float32),
  }


def loss_fn(params, batch):
  """Mean squared error of a bag-of-embeddings linear model."""
  bag = gtx.lookup(params["emb"], batch["ids"]).sum(axis=1)
  pred = bag @ params["w"] + params["b"]
  return jnp.mean(jnp.square(pred - batch["y"]))
