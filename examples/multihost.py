"""Multi-process mirrored training that fails fast and resumes exactly.

One process of a data-parallel job over ``N`` processes (``K`` CPU devices
each, gloo collectives)::

  python -m examples.multihost --coordinator HOST:PORT --num-processes N \\
      --process-id I --steps S --checkpoint-dir DIR --out FILE.npz \\
      [--devices-per-process K]

Start it once per process with the same arguments except ``--process-id``.
The model is an embedding table (``gtx.lookup``: its gradient is a
``gtx.SparseRows``) pooled into two dense layers; the optimizer is
``optax.chain(gtx.all_reduce, gtx.accumulate(gtx.lazy_adam, 2))`` inside a
``gtx.Mirrored`` step. The batch of step ``t`` on process ``i`` is derived
from ``(t, i)`` alone, so a run is the same whenever it is interrupted.

- Every :data:`SAVE_EVERY` steps all processes save the params and the
  optimizer state with orbax into ``DIR`` (a directory per step, committed
  atomically by process 0 once every process has written its part). On
  start the script resumes from the latest committed checkpoint in ``DIR``.
- After each step it prints ``step N`` (flushed). At the end process 0
  writes the final params to ``FILE.npz`` (keys: param paths joined with
  ``/``, e.g. ``dense1/w``) and every process exits 0.
- When a peer is lost (killed, crashed, its host gone), every other process
  exits with status :data:`EXIT_PEER_LOST` within seconds, printing one
  line to stderr that starts with ``multihost: process I of N:`` and names
  the lost process or the failed collective. Restarting all processes with
  the same arguments then continues from the last committed checkpoint and
  ends with the same params, bit for bit, as a run that was never
  interrupted. See the multi-host guide for the settings behind this.

Test hook: with ``GRADTX_MULTIHOST_DIE_IN_SAVE=T:I`` in its environment,
process ``I`` is SIGKILLed while saving the checkpoint of step ``T``, after
writing its part and before the checkpoint is committed (it prints ``dying
in save T`` first).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

CHILD_ENV = "GRADTX_MULTIHOST_CHILD"  # set in the training process
# The process the user starts only supervises the training process (see
# "Failing fast"): it never imports JAX, which saves it seconds of CPU.
SUPERVISOR = __name__ == "__main__" and os.environ.get(CHILD_ENV) != "1"
if not SUPERVISOR:
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import orbax.checkpoint as ocp

  import gradtx as gtx

NUM_ROWS = 256
DIM = 8
HIDDEN = 16
IDS_PER_EXAMPLE = 4
BATCH_PER_REPLICA = 4
EVERY_K = 2
LEARNING_RATE = 0.02
SAVE_EVERY = 3
MAX_TO_KEEP = 2

# The failure settings (see the multi-host guide for the trade-offs).
HEARTBEAT_TIMEOUT_S = 10  # the coordination service declares a process dead
INIT_TIMEOUT_S = 60  # every process must join within this
SHUTDOWN_TIMEOUT_S = 10  # a finishing process waits this long for the others
EXIT_PEER_LOST = 3
DIE_IN_SAVE_ENV = "GRADTX_MULTIHOST_DIE_IN_SAVE"


# ----------------------------------------------------------------------------
# Model and data


def init_params() -> dict[str, dict[str, np.ndarray]]:
  """The same initial params on every process (a fixed seed)."""
  rng = np.random.default_rng(0)

  def normal(*shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)

  return {
    "embed": {"table": normal(NUM_ROWS, DIM, scale=0.1)},
    "dense1": {
      "w": normal(DIM, HIDDEN, scale=DIM**-0.5),
      "b": np.zeros(HIDDEN, np.float32),
    },
    "dense2": {"w": normal(HIDDEN, scale=HIDDEN**-0.5), "b": np.float32(0)},
  }


def local_batch(step: int, process_id: int, rows: int) -> dict[str, Any]:
  """Process ``process_id``'s ``rows`` examples of step ``step``.

  A function of ``(step, process_id)`` only: a resumed run sees the same
  data as an uninterrupted one. Ids follow a power law (a few hot rows, a
  long tail); targets come from a fixed random teacher of the same form.
  """
  rng = np.random.default_rng([step, process_id])
  p = 1.0 / np.arange(1, NUM_ROWS + 1) ** 1.1
  ids = rng.choice(NUM_ROWS, size=(rows, IDS_PER_EXAMPLE), p=p / p.sum())
  teacher = np.random.default_rng(1).standard_normal(NUM_ROWS)
  y = np.tanh(teacher[ids].sum(axis=1))
  return {"ids": ids.astype(np.int32), "y": y.astype(np.float32)}


def loss_fn(params: Any, batch: Any) -> jax.Array:
  """Mean squared error of a pooled-embedding two-layer network."""
  pooled = gtx.lookup(params["embed"]["table"], batch["ids"]).mean(axis=1)
  h = jnp.tanh(pooled @ params["dense1"]["w"] + params["dense1"]["b"])
  pred = h @ params["dense2"]["w"] + params["dense2"]["b"]
  return jnp.mean(jnp.square(pred - batch["y"]))


def make_tx(axis_name: str, num_replicas: int) -> optax.GradientTransformation:
  """All-reduce, then lazy Adam on 2-step accumulated gradients.

  ``rows_per_step`` counts the table rows of one step after the all-gather:
  the ids of the global batch.
  """
  global_ids = num_replicas * BATCH_PER_REPLICA * IDS_PER_EXAMPLE
  rows = jax.tree.map(lambda _: None, init_params())
  rows["embed"]["table"] = global_ids
  return optax.chain(
    gtx.all_reduce(axis_name),
    gtx.accumulate(gtx.lazy_adam(LEARNING_RATE), EVERY_K, rows_per_step=rows),
  )


def flat_params(params: Any) -> dict[str, np.ndarray]:
  """``{"dense1/w": array, ...}``: param paths joined with ``/``."""
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  return {"/".join(str(k.key) for k in path): np.asarray(x) for path, x in flat}


# ----------------------------------------------------------------------------
# Failing fast
#
# Three things end a process whose peer is gone. (1) A collective or a
# barrier fails: gloo sees the peer's sockets close, orbax's barrier is
# cancelled. That is a Python exception, turned into the one-line error by
# `fail`. (2) The JAX coordination client learns of the loss (the
# coordinator's socket closed, or the service's heartbeat check declared a
# process dead) and terminates the process from a native thread with a
# fatal log and a stack dump; jaxlib offers no Python hook for it. (3)
# gloo's transport thread meets a message of another collective (the
# survivor's ranks left a collective at different points) and aborts the
# process with an exception nothing catches. So the training runs in a
# child process, and this process -- the one the user started -- watches
# it: it forwards the child's output, swallows the native reports of (2)
# and (3) and turns them into the one-line error.


def one_line(args: argparse.Namespace, reason: str) -> str:
  """``multihost: process I of N: <reason>``, on one line."""
  line = " ".join(str(reason).split())
  if len(line) > 400:
    line = line[:397] + "..."
  return f"multihost: process {args.process_id} of {args.num_processes}: {line}"


def fail(args: argparse.Namespace, reason: str) -> None:
  """Prints the one-line error and ends this process at once.

  ``os._exit``: a normal exit would run JAX's atexit shutdown, which waits
  for the lost peer at a barrier.
  """
  sys.stdout.flush()
  print(one_line(args, reason), file=sys.stderr, flush=True)
  os._exit(EXIT_PEER_LOST)


_FATAL = "Terminating process because the JAX distributed service"
# Native log lines of the coordination runtime; from the first, the child's
# stderr is held back until it is known whether a fatal report follows.
_COORDINATION = ("coordination_service", "Polled an error from coordination")
_STATUS_END = (
  " Either the leader",
  "Additional GRPC error",
  "*** Check failure",
  " RPC: ",
  " The tasks have crashed",
  " [type.googleapis",
)
# The C++ runtime's report of an exception no native code caught; gloo's
# transport thread ends the process this way when the messages of a
# collective cross (a peer lost in the middle of a collective).
_TERMINATE = re.compile(
  r"terminate called after throwing an instance of '(.+)'"
)


def _fatal_reason(report: str) -> str:
  """The lost peer, from the coordination client's fatal report."""
  status = " ".join(report.split("absl::Status:", 1)[-1].split())
  for end in _STATUS_END:
    status = status.split(end, 1)[0]
  dead = re.search(r"stopped sending heartbeats\):((?: \d+,?)+)", status)
  if dead:
    who = "lost peer process " + ", ".join(re.findall(r"\d+", dead[1]))
  elif "coordination service" in status:
    who = "lost the coordinator (process 0)"
  else:
    who = "lost a peer"
  return f"{who}: the JAX distributed service reported {status.strip()}"


def _abort_reason(report: str) -> str:
  """What ended the process, from an uncaught native exception's report."""
  kind = _TERMINATE.search(report)
  # the exception's message: the what() line (a stack dump may follow)
  what = report.partition("what():")[2].split("\n", 1)[0].strip()
  if kind and kind[1].startswith("gloo::"):
    return (
      "a cross-process operation failed (gloo aborted the training "
      f"process; a peer lost in the middle of a collective): {what}"
    )
  name = kind[1] if kind else "an exception"
  return f"the training process aborted on an uncaught {name}: {what}"


class ChildStderr:
  """Sorts the training process's stderr: what passes through, and the
  native reports that are held back and turned into the one-line error.

  :meth:`feed` takes one line and returns it when it passes through (else
  ``None``); once the process has ended with status ``rc``,
  :meth:`unexplained` gives the held lines to print after all and
  :meth:`verdict` the one-line reason (``None``: no error of its own to
  report).
  """

  def __init__(self) -> None:
    self.fatal: list[str] = []  # the coordination client's fatal report
    self.aborted: list[str] = []  # an uncaught native exception's report
    self.held: list[str] = []  # coordination errors logged before either

  def feed(self, line: str) -> str | None:
    if self.fatal or _FATAL in line:
      self.fatal.append(line)
    elif self.aborted or _TERMINATE.search(line):
      self.aborted.append(line)
    elif self.held or any(c in line for c in _COORDINATION):
      self.held.append(line)
    else:
      return line
    return None

  def unexplained(self) -> list[str]:
    """Held lines to print after all: everything but the coordination
    service's fatal report explains them away (they may be the user's own
    traceback)."""
    return [] if self.fatal else self.held

  def verdict(self, rc: int) -> str | None:
    if self.fatal:
      return _fatal_reason("".join(self.fatal))
    if self.aborted:
      return _abort_reason("".join(self.aborted))
    if rc < 0:
      return f"the training process died of {signal.Signals(-rc).name}"
    return None


def _die_with_parent(parent: int) -> None:
  """In the child, before exec: SIGKILL it when the supervisor dies."""
  libc = ctypes.CDLL(None, use_errno=True)
  pr_set_pdeathsig = 1
  libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
  if os.getppid() != parent:  # the supervisor died before prctl
    os._exit(EXIT_PEER_LOST)


def supervise(args: argparse.Namespace, argv: list[str]) -> int:
  """Runs the training in a child process and returns the exit status.

  The child's stdout is this process's; its stderr goes through here so a
  native fatal report or abort becomes one line. The child dies with this
  process (``PR_SET_PDEATHSIG``): killing the process the user started
  kills the training.
  """
  module = __spec__.name if __spec__ else "examples.multihost"
  child = subprocess.Popen(
    [sys.executable, "-m", module, *argv],
    env=dict(os.environ, **{CHILD_ENV: "1"}),
    stderr=subprocess.PIPE,
    preexec_fn=functools.partial(_die_with_parent, os.getpid()),
  )

  def forward_kill(signum, frame):
    del frame
    child.kill()
    os._exit(128 + signum)

  signal.signal(signal.SIGTERM, forward_kill)
  signal.signal(signal.SIGINT, forward_kill)
  stderr = ChildStderr()
  assert child.stderr is not None
  # The child's own one-line error is held and printed last: the runtime's
  # threads may still log a line or two while the child exits.
  held = []
  for raw in child.stderr:
    line = stderr.feed(raw.decode(errors="replace"))
    if line is not None and line.startswith("multihost: process "):
      held.append(line)
    elif line is not None:
      sys.stderr.write(line)
      sys.stderr.flush()
  rc = child.wait()
  sys.stderr.writelines(stderr.unexplained())
  reason = stderr.verdict(rc)
  if reason is None:
    sys.stderr.writelines(held)
    sys.stderr.flush()
    return rc
  sys.stderr.writelines(held)
  print(one_line(args, reason), file=sys.stderr)
  return EXIT_PEER_LOST


# ----------------------------------------------------------------------------
# Checkpoints


def _die_in_save(process_id: int) -> int | None:
  spec = os.environ.get(DIE_IN_SAVE_ENV)
  if not spec:
    return None
  try:
    step, proc = (int(x) for x in spec.split(":"))
  except ValueError as e:
    raise ValueError(
      f"{DIE_IN_SAVE_ENV} must be STEP:PROCESS_ID (two ints); got {spec!r}."
    ) from e
  return step if proc == process_id else None


def make_manager(directory: str, process_id: int) -> tuple[Any, Any]:
  """An orbax CheckpointManager keeping the last :data:`MAX_TO_KEEP` steps
  and its handler (whose ``step`` the training loop sets before a save)."""

  class _HookedHandler(ocp.StandardCheckpointHandler):
    """orbax's standard handler, with the die-in-save test hook."""

    def __init__(self, die_at: int | None):
      super().__init__()
      self._die_at = die_at
      self.step = -1

    async def async_save(self, directory, *args, **kwargs):
      futures = await super().async_save(directory, *args, **kwargs)
      if self.step == self._die_at:
        for f in futures or ():
          f.result()  # this process's part is on disk; nothing committed yet
        print(f"dying in save {self.step}", flush=True)
        if os.environ.get(CHILD_ENV) == "1":
          os.kill(os.getppid(), signal.SIGKILL)  # the process the user started
        os.kill(os.getpid(), signal.SIGKILL)
      return futures

  handler = _HookedHandler(_die_in_save(process_id))
  options = ocp.CheckpointManagerOptions(
    save_interval_steps=SAVE_EVERY,
    max_to_keep=MAX_TO_KEEP,
    enable_async_checkpointing=False,
  )
  registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
  registry.add("state", ocp.args.StandardSave, handler)
  registry.add("state", ocp.args.StandardRestore, handler)
  mngr = ocp.CheckpointManager(
    Path(directory).absolute(), options=options, handler_registry=registry
  )
  return mngr, handler


# ----------------------------------------------------------------------------
# Training


def train(args: argparse.Namespace) -> dict[str, np.ndarray]:
  m = gtx.Mirrored()
  tx = make_tx(m.axis_name, m.num_replicas)

  def train_step(params, opt_state, batch):
    loss, grads = gtx.sparse_value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = gtx.apply_updates(params, updates)
    return params, opt_state, m.reduce_in_step(loss, "mean")

  step_fn = m.step(train_step, donate_argnums=(0, 1))
  host_params = init_params()
  mngr, handler = make_manager(args.checkpoint_dir, args.process_id)
  start = mngr.latest_step()
  if start is None:
    start = 0
    params = m.replicate(host_params)
    opt_state = m.replicate(tx.init(host_params))
  else:
    replicated = jax.sharding.NamedSharding(
      m.mesh, jax.sharding.PartitionSpec()
    )
    abstract = jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=replicated),
      {
        "params": jax.eval_shape(lambda p: p, host_params),
        "opt_state": jax.eval_shape(tx.init, host_params),
      },
    )
    restore = ocp.args.StandardRestore(abstract)
    tree = mngr.restore(start, args=ocp.args.Composite(state=restore))
    params, opt_state = tree["state"]["params"], tree["state"]["opt_state"]
    print(f"resumed from step {start}", flush=True)
  rows = BATCH_PER_REPLICA * jax.local_device_count()
  for t in range(start, args.steps):
    batch = m.shard_batch(local_batch(t, args.process_id, rows))
    params, opt_state, loss = step_fn(params, opt_state, batch)
    jax.block_until_ready(loss)
    print(f"step {t + 1}", flush=True)
    if (t + 1) % SAVE_EVERY == 0 and t + 1 < args.steps:
      handler.step = t + 1
      save = ocp.args.StandardSave({"params": params, "opt_state": opt_state})
      mngr.save(t + 1, args=ocp.args.Composite(state=save))
  mngr.close()
  return flat_params(
    jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), params)
  )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog="python -m examples.multihost",
    description=__doc__.splitlines()[0],
  )
  parser.add_argument("--coordinator", required=True, help="HOST:PORT")
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--steps", type=int, required=True)
  parser.add_argument("--checkpoint-dir", required=True)
  parser.add_argument("--out", required=True, help="FILE.npz (process 0)")
  parser.add_argument("--devices-per-process", type=int, default=1)
  args = parser.parse_args(argv)
  if args.num_processes < 1:
    parser.error(f"--num-processes must be >= 1; got {args.num_processes}")
  if not 0 <= args.process_id < args.num_processes:
    parser.error(
      f"--process-id must be in [0, {args.num_processes}); got "
      f"{args.process_id}"
    )
  if args.steps < 0:
    parser.error(f"--steps must be >= 0; got {args.steps}")
  if args.devices_per_process < 1:
    parser.error(
      f"--devices-per-process must be >= 1; got {args.devices_per_process}"
    )
  if ":" not in args.coordinator:
    parser.error(f"--coordinator must be HOST:PORT; got {args.coordinator!r}")
  return args


class _QuietOrbaxThreads(logging.Filter):
  """Drops orbax's log of an exception in its save thread: orbax re-raises
  it in the thread that waits for the save, which reports it in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    return "_SignalingThread.run() raised" not in str(record.msg)


def run(args: argparse.Namespace) -> None:
  """The training process: join the job, train, write ``--out``."""
  logging.getLogger("absl").addFilter(_QuietOrbaxThreads())
  # Before anything initialises a backend: K CPU devices (this overrides
  # --xla_force_host_platform_device_count in XLA_FLAGS) and gloo.
  jax.config.update("jax_platforms", "cpu")
  jax.config.update("jax_num_cpu_devices", args.devices_per_process)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=args.coordinator,
    num_processes=args.num_processes,
    process_id=args.process_id,
    initialization_timeout=INIT_TIMEOUT_S,
    heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
    shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
  )
  try:
    final = train(args)
  except jax.errors.JaxRuntimeError as e:  # a collective or barrier failed
    fail(args, f"a cross-process operation failed (a peer lost): {e}")
  if args.process_id == 0:
    np.savez(args.out, **final)
  jax.distributed.shutdown()


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse_args(argv)
  if SUPERVISOR:
    sys.exit(supervise(args, argv))
  run(args)


if __name__ == "__main__":
  main()
