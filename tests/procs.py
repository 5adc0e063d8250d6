"""Starting the test workers in their own processes, and the worker's side.

A test starts a worker script of this folder with :func:`launched`::

  with procs.launched("mirrored_worker.py", ["--out", str(tmp_path)],
                      tmp_path, timeout=90):
    ...  # the in-process reference, while the workers run

Each process gets ``devices`` fake CPU devices and this process's environment
otherwise (so the persistent compilation cache conftest.py sets up is shared
with them), writes its output to a log file (a full pipe could stall one
process while the other waits for it in a collective), and must exit 0. A
worker joins the distributed runtime with :func:`joined`, and trains the
small model of :func:`init_params` and :func:`loss_fn` on its own batches.
Not a test module: pytest collects ``test_*.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
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


def assert_exited_ok(
  processes: Sequence[subprocess.Popen], logs: Sequence[Path]
) -> None:
  """Every (ended) process exited 0; else the tail of its log."""
  for p, log in zip(processes, logs, strict=True):
    assert p.returncode == 0, log.read_text(errors="replace")[-LOG_TAIL:]


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
  leaving the body each process is waited for, ``timeout`` seconds at most;
  any still running then (or when the body raised) is killed, and one that
  exited non-zero fails with the tail of its log.
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
    for p in processes:
      p.wait(timeout=timeout)
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
  until the ``with`` body ends."""
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
