"""Asynchronous training across processes on Ray, with gtx.drop_stale.

One parameter-server actor and N worker actors, each a process of its own:

- the **parameter server** (:class:`ParameterServer`, a synchronous actor:
  it runs one call at a time, so a pull never sees half an update) holds
  the parameters and the state of ``gtx.drop_stale(inner, max_staleness)``
  (the global step, the drop counters and the inner optimizer's state).
  ``pull()`` returns the global step and the parameters, put into Ray's
  object store once per version however many workers read it;
  ``push(grads, grad_step, ...)`` runs the jitted ``drop_stale`` update and
  ``gtx.apply_updates`` and answers ``(accepted, step)``, so a worker whose
  gradient was dropped knows at once and reads fresh parameters;
- each **worker** (:class:`Worker`) has its own shard of the data of
  ``examples/async_trainer.py`` (the same task, model and loss), pulls,
  computes ``gtx.sparse_value_and_grad`` (the embedding table's gradient is
  a ``gtx.SparseRows``), and pushes the gradient as numpy arrays (jax
  arrays are not zero-copy in the object store) together with the step it
  read;
- the **driver** (:func:`run`) keeps one step of every worker in flight and
  waits on them with ``ray.wait``; the counts per worker, the staleness
  histogram and the held-out loss come from the parameter server.

Faults (``--kill-worker-after K``, ``--kill-ps-after K``):

- **A worker dies** (here ``ray.kill`` right after the driver hands it a
  step, once the global step reaches K): the gradient it was computing never
  reaches the server and is lost. Pushes are at most once: no actor task is
  ever retried (``max_task_retries=0``), so a push that did reach the server
  is applied once, and one that did not is not sent again. Ray restarts the
  worker (``max_restarts``), which makes its shard again; the driver pings
  it (``ready``) until it answers, then hands it steps again, and the end
  of a run waits for a worker still restarting.
- **The parameter server dies** (``ray.kill`` once the global step reaches
  K): with ``--checkpoint-dir`` it saves an orbax checkpoint every
  ``--checkpoint-every`` accepted gradients (params, the whole optimizer
  state with the global step and drop counters, and its per-worker
  counters) before it answers the push that reached that step. Ray restarts
  it and it restores the latest checkpoint, bit for bit; the gradients it
  had applied after that checkpoint are lost with it. Pushes that were
  running or queued in the dead server fail in their worker (counted
  ``lost``), which reads again. Without a checkpoint directory the server
  cannot restart and the run fails.
- **The rule for gradients from before a restart.** Every server process
  has an id (``server``) that ``pull`` returns and ``push`` sends back. A
  version is ``(server, step)``; a restored server knows which earlier
  versions its history shares: those of the checkpoint's writer up to the
  checkpoint's step (and the writer's own history). A gradient computed
  against a shared version is an ordinary stale gradient and goes through
  ``drop_stale``. A gradient computed against a version the restart threw
  away -- a step after the checkpoint, which the restored server never
  reached, or a step it will reach again with different parameters -- is
  **rolled back**: the server answers ``accepted=False`` without running
  ``drop_stale`` (its counters stay as restored), counts it in
  ``rolled_back``, and the worker reads fresh parameters. ``drop_stale``
  alone could not tell these apart: it sees only step numbers, and would
  drop a gradient from a step ahead of its own but accept one from a
  thrown-away step it has since reached again.

Run ``python -m examples.ray_trainer --workers 4 --max-staleness 1``; the
last line reads ``workers N, applied A, dropped D, held-out loss L``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from examples import async_trainer as at

try:
  import ray
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError(
    "examples.ray_trainer needs Ray: `pip install -e '.[ray]'`."
  ) from e

REPO = Path(__file__).resolve().parent.parent
# What a call to a restarting actor raises (the call may or may not have
# run), and a read of an object whose owner (the server that put the
# parameters) died. A call to an actor dead for good raises ActorDiedError.
TRANSIENT = (
  ray.exceptions.ActorUnavailableError,
  ray.exceptions.ObjectLostError,
)


def runtime_env(platform: str = "cpu") -> dict[str, Any]:
  """The Ray job's ``runtime_env``: JAX on ``platform`` in every actor, this
  checkout importable (``gradtx`` and ``examples``), and this process's
  ``XLA_FLAGS`` without a fake device count (the tests ask for 8 CPU
  devices; an actor needs one)."""
  flags = " ".join(
    f
    for f in os.environ.get("XLA_FLAGS", "").split()
    if not f.startswith("--xla_force_host_platform_device_count")
  )
  path = os.pathsep.join(
    p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
  )
  return {
    "env_vars": {
      "JAX_PLATFORMS": platform,
      "XLA_FLAGS": flags,
      "PYTHONPATH": path,
    }
  }


def init_ray(**kwargs: Any) -> Any:
  """``ray.init`` with :func:`runtime_env` and no dashboard."""
  kwargs.setdefault("include_dashboard", False)
  kwargs.setdefault("runtime_env", runtime_env())
  return ray.init(**kwargs)


# ----------------------------------------------------------------------------
# Gradients as numpy


@dataclasses.dataclass(frozen=True)
class WireRows:
  """A ``gtx.SparseRows`` as it travels: numpy ``indices`` and ``values``."""

  indices: np.ndarray  # int32 [n]
  values: np.ndarray  # [n, *row_shape]
  num_rows: int


def _is_rows(x: Any) -> bool:
  return isinstance(x, gtx.SparseRows)


def to_wire(grads: Any) -> Any:
  """``grads`` with every array numpy and every SparseRows a WireRows."""

  def one(g):
    if isinstance(g, gtx.SparseRows):
      return WireRows(np.asarray(g.indices), np.asarray(g.values), g.num_rows)
    return np.asarray(g)

  return jax.tree.map(one, grads, is_leaf=_is_rows)


def from_wire(wire: Any) -> Any:
  """The inverse of :func:`to_wire`."""

  def one(w):
    if isinstance(w, WireRows):
      return gtx.SparseRows(w.indices, w.values, w.num_rows)
    return w

  return jax.tree.map(one, wire)


# ----------------------------------------------------------------------------
# The parameter server


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """What a :class:`ParameterServer` trains with."""

  max_staleness: int | None
  rescale: bool = False
  optimizer: str = "sgd"  # a key of async_trainer.OPTIMIZERS
  learning_rate: float = 0.5
  batch_size: int = 32  # of the workers' gradients (to compile ahead)
  seed: int = 0
  checkpoint_dir: str | None = None
  checkpoint_every: int = 50  # accepted gradients between checkpoints
  max_to_keep: int = 2


class Pulled(NamedTuple):
  """What :meth:`ParameterServer.pull` returns."""

  step: int  # the global step of these parameters
  params: Any  # ObjectRef of the numpy parameters (one per version)
  server: str  # the id of the server process that holds this version


class Pushed(NamedTuple):
  """What :meth:`ParameterServer.push` answers."""

  accepted: bool
  step: int  # the global step after this push
  staleness: int | None  # step - grad_step on arrival; None if rolled back
  rolled_back: bool  # computed against a version a restart threw away
  server: str  # the id of the server process that answered


class Received(NamedTuple):
  """A push as the server logged it."""

  worker: int
  sender: str  # the worker process's id
  seq: int  # the sender's gradient number
  server: str  # the server process whose parameters it was computed on
  grad_step: int
  outcome: str  # "accepted", "dropped" or "rolled_back"


def _manager(directory: str, max_to_keep: int) -> Any:
  import orbax.checkpoint as ocp

  options = ocp.CheckpointManagerOptions(
    max_to_keep=max_to_keep, enable_async_checkpointing=False
  )
  return ocp.CheckpointManager(Path(directory).absolute(), options=options)


class ParameterServer:
  """Parameters, the ``drop_stale`` state and the counters, in one actor.

  Meant to run as a synchronous Ray actor (see :func:`start_actors`): one
  call at a time, so ``pull`` and ``push`` are atomic.
  """

  def __init__(self, task: dict[str, Any], config: ServerConfig):
    data = at.make_task(**task)
    self._task = data
    self._eval = (jnp.asarray(data.eval_ids), jnp.asarray(data.eval_labels))
    self._mngr = None
    self._start(config)

  def _start(self, config: ServerConfig) -> None:
    self.config = config
    # The params leave this actor as copies (`pull`), so the step may
    # donate them: params and state are updated in place.
    self.tx, self._step_fn = at.make_apply_step(
      config.max_staleness,
      config.learning_rate,
      config.rescale,
      config.optimizer,
      donate_params=True,
    )
    self.server = uuid.uuid4().hex[:12]
    params = at.init_params(self._task, seed=config.seed)
    state = self.tx.init(params)
    # Compile the update before the first push, on zeros shaped like the
    # workers' gradients (thrown away).
    batch = [x[: config.batch_size] for x in self._eval]
    shapes = jax.eval_shape(at.grad_fn, params, *batch)[1]
    zeros = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), shapes)
    copies = jax.tree.map(jnp.copy, (params, state))  # the step donates them
    jax.block_until_ready(self._step_fn(*copies, zeros, 0))
    jax.block_until_ready(at.eval_fn(params, *self._eval))
    self._meta: dict[str, Any] = {
      "by_worker": {},  # worker -> {"accepted", "dropped", "rolled_back"}
      "hist": {},  # staleness -> gradients that went through drop_stale
      "rolled_back": 0,
      "lineage": {},  # earlier server -> last step of it in our history
    }
    self.restored_from: int | None = None
    if config.checkpoint_dir is not None:
      self._mngr = _manager(config.checkpoint_dir, config.max_to_keep)
      latest = self._mngr.latest_step()
      if latest is None:
        self._save(0, params, state)
      else:
        params, state = self._restore(latest, params, state)
    self._params, self._state = params, state
    self._ref: Any = None
    self._ref_step = -1
    self.puts = 0  # parameter versions put into the object store
    self._log: list[Received] = []  # pushes received by this process

  def reset(self, config: ServerConfig) -> str:
    """Starts a new run on this process: fresh parameters and optimizer
    state under ``config``, counters at zero and a new :attr:`server` id
    (so a gradient computed before the reset is rolled back). For servers
    without checkpoints: one that checkpoints is one run, and Ray would
    restart it with the config it was created with. Returns the new id."""
    if self._mngr is not None or config.checkpoint_dir is not None:
      raise ValueError(
        "ParameterServer.reset is for servers without checkpoints "
        "(`checkpoint_dir=None`, before and after): start a new server for "
        "a run that checkpoints."
      )
    self._start(config)
    return self.server

  # -- checkpoints

  def _save(self, step: int, params: Any, state: Any) -> None:
    import orbax.checkpoint as ocp

    meta = dict(self._meta, server=self.server)
    self._mngr.save(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardSave({"params": params, "opt_state": state}),
        meta=ocp.args.JsonSave(meta),
      ),
    )

  def _restore(self, step: int, params: Any, state: Any) -> tuple[Any, Any]:
    import orbax.checkpoint as ocp

    abstract = jax.eval_shape(lambda: {"params": params, "opt_state": state})
    got = self._mngr.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
      ),
    )
    meta = dict(got.meta)
    writer = meta.pop("server")
    # The writer's history up to `step` is ours; so is what it shared with
    # the servers before it, up to the same step.
    lineage = {k: min(v, step) for k, v in meta["lineage"].items()}
    lineage[writer] = step
    meta["lineage"] = lineage
    meta["hist"] = {int(k): v for k, v in meta["hist"].items()}
    meta["by_worker"] = {int(k): v for k, v in meta["by_worker"].items()}
    self._meta = meta
    self.restored_from = step
    return got.state["params"], got.state["opt_state"]

  # -- the protocol

  def pull(self) -> Pulled:
    """The global step and the parameters (an ObjectRef, one per version)."""
    step = int(self._state.step)
    if self._ref_step != step:
      self._ref = ray.put(jax.device_get(self._params))
      self._ref_step = step
      self.puts += 1
    return Pulled(step, self._ref, self.server)

  def _in_history(self, server: str, grad_step: int) -> bool:
    if server == self.server:
      return True  # a step ahead of ours is drop_stale's to drop
    last = self._meta["lineage"].get(server)
    return last is not None and grad_step <= last

  def _count(self, worker: int, outcome: str) -> None:
    counts = self._meta["by_worker"].setdefault(
      worker, {"accepted": 0, "dropped": 0, "rolled_back": 0}
    )
    counts[outcome] += 1

  def push(
    self, grads: Any, grad_step: int, server: str, worker: int, tag: Any
  ) -> Pushed:
    """Applies a gradient read at ``(server, grad_step)`` through
    ``drop_stale``, or rolls it back (see the module docstring).

    ``worker`` counts it per worker; ``tag`` (the sender's id and gradient
    number) goes into :meth:`received`, which shows every push this server
    process got, once each.
    """
    step = int(self._state.step)
    if not self._in_history(server, grad_step):
      self._meta["rolled_back"] += 1
      self._count(worker, "rolled_back")
      self._log.append(Received(worker, *tag, server, grad_step, "rolled_back"))
      return Pushed(False, step, None, True, self.server)
    self._params, self._state = self._step_fn(
      self._params, self._state, from_wire(grads), grad_step
    )
    new_step = int(self._state.step)
    accepted = new_step != step
    staleness = step - grad_step
    hist = self._meta["hist"]
    hist[staleness] = hist.get(staleness, 0) + 1
    outcome = "accepted" if accepted else "dropped"
    self._count(worker, outcome)
    self._log.append(Received(worker, *tag, server, grad_step, outcome))
    every = self.config.checkpoint_every
    if self._mngr is not None and accepted and new_step % every == 0:
      self._save(new_step, self._params, self._state)
    return Pushed(accepted, new_step, staleness, False, self.server)

  # -- reading it

  def evaluate(self) -> tuple[int, float, float]:
    """``(step, held-out loss, time.time())`` of the current parameters."""
    loss = float(at.eval_fn(self._params, *self._eval))
    return int(self._state.step), loss, time.time()

  def stats(self) -> dict[str, Any]:
    """The counters (restored ones included) and this process's puts."""
    s = gtx.staleness_stats(self._state)
    return {
      "max_staleness": self.config.max_staleness,
      "rescale": self.config.rescale,
      "step": int(s["step"]),
      "num_dropped": int(s["num_dropped"]),
      "last_staleness": int(s["last_staleness"]),
      "rolled_back": self._meta["rolled_back"],
      "by_worker": {w: dict(c) for w, c in self._meta["by_worker"].items()},
      "hist": dict(sorted(self._meta["hist"].items())),
      "server": self.server,
      "restored_from": self.restored_from,
      "lineage": dict(self._meta["lineage"]),
      "puts": self.puts,
    }

  def received(self) -> list[Received]:
    """Every push this server process got, in arrival order."""
    return list(self._log)

  def state(self) -> dict[str, Any]:
    """The parameters and the whole optimizer state, as numpy."""
    return jax.device_get({"params": self._params, "opt_state": self._state})


# ----------------------------------------------------------------------------
# The workers


class StepResult(NamedTuple):
  """One worker step as the driver sees it."""

  worker: int
  sender: str  # the worker process's id (a new one after a restart)
  seq: int  # the sender's gradient number
  grad_step: int
  server: str  # the server process the parameters came from
  outcome: str  # "accepted", "dropped", "rolled_back" or "lost"
  step: int  # the server's global step after the push (-1 if lost)
  answered_by: str  # the server process that answered ("" if lost)
  staleness: int | None
  loss: float  # the training loss of this batch (nan if lost before)


class Worker:
  """Pulls, computes a sparse gradient on its own shard, pushes.

  Meant to run as a Ray actor (see :func:`start_actors`). :meth:`step` is
  one whole step; :meth:`compute` and :meth:`push` are its two halves, for
  a driver that releases pushes in an order of its choosing.
  """

  def __init__(
    self,
    ps: Any,
    task: dict[str, Any],
    worker: int,
    workers: int,
    *,
    batch_size: int = 32,
    seed: int = 0,
    delay: float = 0.0,
    pull_timeout: float = 120.0,
  ):
    self.ps = ps
    self.worker = worker
    self.pull_timeout = pull_timeout
    data = at.make_task(**task)
    self.ids = data.train_ids[worker::workers]
    self.labels = data.train_labels[worker::workers]
    self.batch_size = batch_size
    self.delay = delay
    self.sender = uuid.uuid4().hex[:12]
    self._rng = np.random.default_rng([seed, worker])
    self._seq = 0
    self._held: tuple[Any, int, str, int, float] | None = None

  def reset(self, seed: int) -> None:
    """Starts the batch sequence of ``seed`` again (for a new run on a
    server that was reset)."""
    self._rng = np.random.default_rng([seed, self.worker])
    self._held = None

  def _pull(self) -> tuple[Pulled, Any]:
    """Pulls, again while the server restarts (a pull changes nothing, so
    it may be repeated; a push never is)."""
    deadline = time.monotonic() + self.pull_timeout
    while True:
      try:
        pulled = ray.get(self.ps.pull.remote())
        return pulled, ray.get(pulled.params)
      except TRANSIENT:
        if time.monotonic() > deadline:
          raise
        time.sleep(0.1)

  def ready(self) -> str:
    """Compiles the gradient on the current parameters; returns
    :attr:`sender`, this process's id."""
    _, params = self._pull()
    pick = np.arange(self.batch_size) % len(self.ids)
    jax.block_until_ready(at.grad_fn(params, self.ids[pick], self.labels[pick]))
    return self.sender

  def compute(self) -> tuple[int, float, Any]:
    """Pulls and computes a gradient, held for :meth:`push`; returns the
    step it was read at, the batch loss and the gradient (numpy)."""
    pulled, params = self._pull()
    if self.delay:
      time.sleep(self.delay)
    pick = self._rng.integers(0, len(self.ids), size=self.batch_size)
    loss, grads = at.grad_fn(params, self.ids[pick], self.labels[pick])
    loss = float(loss)
    wire = to_wire(grads)
    self._held = (wire, pulled.step, pulled.server, self._seq, loss)
    self._seq += 1
    return pulled.step, loss, wire

  def push(self) -> StepResult:
    """Pushes the gradient :meth:`compute` made, once: it is then gone,
    whether the server answered or died with it."""
    if self._held is None:
      raise RuntimeError(f"worker {self.worker}: push() before compute()")
    wire, grad_step, server, seq, loss = self._held
    self._held = None
    tag = (self.sender, seq)
    result = StepResult(
      self.worker,
      self.sender,
      seq,
      grad_step,
      server,
      "lost",
      -1,
      "",
      None,
      loss,
    )
    try:
      r = ray.get(
        self.ps.push.remote(wire, grad_step, server, self.worker, tag)
      )
    except TRANSIENT:  # the server died with the push running or queued
      return result
    if r.rolled_back:
      outcome = "rolled_back"
    else:
      outcome = "accepted" if r.accepted else "dropped"
    return result._replace(
      outcome=outcome, step=r.step, answered_by=r.server, staleness=r.staleness
    )

  def step(self) -> StepResult:
    """:meth:`compute` then :meth:`push`."""
    self.compute()
    return self.push()


def start_actors(
  task: dict[str, Any],
  config: ServerConfig,
  workers: int,
  *,
  delay: float | list[float] = 0.0,
  max_restarts: int = 3,
  gpus_per_worker: float = 0.0,
  start_timeout: float = 300.0,
) -> tuple[Any, list[Any]]:
  """The server actor and ``workers`` worker actors, started and compiled.

  ``task`` holds the keyword arguments of ``async_trainer.make_task``: each
  actor makes the (seeded) task and keeps its part, as it would read its
  part from storage -- worker ``w`` the shard ``w::workers`` of the
  training set, the server the held-out set -- so no data moves and a
  restarted actor makes its part again.

  The cluster's free CPUs are shared out: each actor asks for one CPU, or
  for an equal part of the free ones when there are more actors than that
  (more processes than cores then run; the OS shares the cores out). No actor
  task is retried (at-most-once pushes); an actor that dies is restarted
  up to ``max_restarts`` times -- the server only when it has a checkpoint
  directory to restore from.

  ``gpus_per_worker > 0`` asks Ray for that many GPUs per worker (a
  fraction: workers share one) and runs their JAX on CUDA, without
  preallocating GPU memory when they share; the server stays on the CPU,
  where the object store is.
  """
  delays = at.worker_delays(workers, delay)
  cpus = ray.available_resources().get("CPU", 0.0)
  per_actor = min(1.0, cpus / (workers + 1))
  ps_restarts = max_restarts if config.checkpoint_dir is not None else 0
  ps = (
    ray.remote(ParameterServer)
    .options(num_cpus=per_actor, max_restarts=ps_restarts, max_task_retries=0)
    .remote(task, config)
  )
  options: dict[str, Any] = {}
  if gpus_per_worker:
    env = {"JAX_PLATFORMS": "cuda"}
    if gpus_per_worker < 1:  # JAX would take 75% of the GPU per process
      env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    options = {"num_gpus": gpus_per_worker, "runtime_env": {"env_vars": env}}
  worker_cls = ray.remote(Worker).options(
    num_cpus=per_actor,
    max_restarts=max_restarts,
    max_task_retries=0,
    **options,
  )
  ws = [
    worker_cls.remote(
      ps,
      task,
      w,
      workers,
      batch_size=config.batch_size,
      seed=config.seed,
      delay=delays[w],
    )
    for w in range(workers)
  ]
  try:
    ray.get([w.ready.remote() for w in ws], timeout=start_timeout)
  except ray.exceptions.GetTimeoutError:
    stop_actors([ps, *ws])
    raise RuntimeError(
      f"the actors did not start within start_timeout={start_timeout} s "
      f"(asking for {per_actor:.2f} CPU each; the cluster has "
      f"{ray.available_resources().get('CPU', 0.0)} free)"
    ) from None
  return ps, ws


def stop_actors(actors: list[Any]) -> None:
  """Kills the actors for good (no restart)."""
  for a in actors:
    ray.kill(a, no_restart=True)


# ----------------------------------------------------------------------------
# The driver


@dataclasses.dataclass
class RayRunResult:
  """What one run measured (counts from the server, which restores them
  with its checkpoint)."""

  workers: int
  max_staleness: int | None
  applied: int  # the final global step
  dropped: int  # by drop_stale, as too stale
  rolled_back: int  # computed against versions a restart threw away
  lost: int  # steps whose gradient never got an answer (a process died)
  dropped_fraction: float
  staleness_hist: dict[int, int]  # staleness -> gradients through drop_stale
  by_worker: dict[int, dict[str, int]]  # accepted/dropped/rolled_back/lost
  wall_time: float  # seconds from the first step handed out to the last reply
  final_loss: float  # held-out loss of the final parameters
  curve: list[tuple[int, float, float]]  # (step, held-out loss, seconds)
  stopped_by: str  # "steps" or "time"
  puts: int  # parameter versions put into the object store (last server)
  senders: dict[int, list[str]]  # worker -> its processes, in order
  ps_restored_from: int | None  # the checkpoint step of the last restart
  steps_before_ps_kill: int | None  # the highest step seen before the kill
  killed_worker_step: tuple[int, str, int] | None  # (worker, sender, seq)
  received: list[Received]  # the push log of the last server process
  stats: dict[str, Any]  # the server's stats() at the end


def run(
  task: dict[str, Any],
  *,
  workers: int,
  max_staleness: int | None,
  num_steps: int = 200,
  time_limit: float = 60.0,
  learning_rate: float = 0.5,
  rescale: bool = False,
  optimizer: str = "sgd",
  batch_size: int = 32,
  delay: float | list[float] = 0.0,
  seed: int = 0,
  eval_every: int = 10,
  checkpoint_dir: str | None = None,
  checkpoint_every: int = 50,
  kill_worker_after: int | None = None,
  kill_ps_after: int | None = None,
  max_restarts: int = 3,
  gpus_per_worker: float = 0.0,
  drain_timeout: float = 30.0,
) -> RayRunResult:
  """Trains on the Ray cluster this process is connected to until
  ``num_steps`` gradients have been applied or ``time_limit`` seconds have
  passed; then lets the steps in flight finish (their gradients are
  counted) and stops every actor it started.

  Args:
    task: the keyword arguments of ``async_trainer.make_task`` (see
      :func:`start_actors`).
    workers: number of worker actors (>= 1).
    max_staleness: passed to ``gtx.drop_stale`` (None: no limit).
    num_steps: stop handing out steps once the global step reaches this.
    time_limit: ... or after this many seconds.
    learning_rate, rescale, optimizer: the server's optimizer.
    batch_size: examples per gradient.
    delay: seconds each worker sleeps between its pull and its gradient (a
      slower worker or network); a list gives one per worker.
    seed: seeds the parameters and the workers' batches.
    eval_every: the server evaluates the held-out loss every this many
      global steps (for :attr:`RayRunResult.curve`).
    checkpoint_dir: the server's orbax checkpoints (None: none, and a dead
      server ends the run).
    checkpoint_every: accepted gradients between checkpoints.
    kill_worker_after: kill worker 0 (``ray.kill``, Ray restarts it) right
      after handing it a step, once the global step has reached this.
    kill_ps_after: kill the server once the global step has reached this.
    max_restarts: restarts each actor may use.
    gpus_per_worker: GPUs each worker asks for (see :func:`start_actors`).
    drain_timeout: seconds to wait for the steps in flight at the end.

  Raises:
    RuntimeError: the server died and could not restart (no checkpoint
      directory, or no restarts left), or a worker ran out of restarts.
  """
  config = ServerConfig(
    max_staleness=max_staleness,
    rescale=rescale,
    optimizer=optimizer,
    learning_rate=learning_rate,
    batch_size=batch_size,
    seed=seed,
    checkpoint_dir=checkpoint_dir,
    checkpoint_every=checkpoint_every,
  )
  ps, ws = start_actors(
    task,
    config,
    workers,
    delay=delay,
    max_restarts=max_restarts,
    gpus_per_worker=gpus_per_worker,
  )
  try:
    return train(
      ps,
      ws,
      num_steps=num_steps,
      time_limit=time_limit,
      eval_every=eval_every,
      kill_worker_after=kill_worker_after,
      kill_ps_after=kill_ps_after,
      drain_timeout=drain_timeout,
    )
  finally:
    stop_actors([ps, *ws])


class _ServerDied(RuntimeError):
  pass


def _server_died(error: BaseException) -> _ServerDied:
  return _ServerDied(
    "the parameter server died and could not restart: it restarts only "
    "from a checkpoint (pass `checkpoint_dir`, `--checkpoint-dir`) and at "
    f"most `max_restarts` times ({type(error).__name__})"
  )


def _ask(method: Any, timeout: float = 60.0) -> Any:
  """``ray.get(method.remote())``, again while its actor restarts (for
  calls that change nothing)."""
  deadline = time.monotonic() + timeout
  while True:
    try:
      return ray.get(method.remote())
    except ray.exceptions.ActorUnavailableError:
      if time.monotonic() > deadline:
        raise
      time.sleep(0.1)


def train(
  ps: Any,
  ws: list[Any],
  *,
  num_steps: int = 200,
  time_limit: float = 60.0,
  eval_every: int = 10,
  kill_worker_after: int | None = None,
  kill_ps_after: int | None = None,
  drain_timeout: float = 30.0,
) -> RayRunResult:
  """The driver loop of :func:`run` on actors :func:`start_actors` made (a
  benchmark resets them and trains again: ``ps.reset``, ``w.reset``)."""
  lost: collections.Counter = collections.Counter()
  senders: dict[int, list[str]] = {w: [] for w in range(len(ws))}
  # The global step of each server process that answered, in the order
  # they first did: after a restart, late answers of the old one may still
  # arrive, and the newest one's step is the global step.
  servers: dict[str, int] = {}
  steps: dict[Any, int] = {}  # a step in flight -> its worker
  pings: dict[Any, int] = {}  # a restarting worker's ready() -> worker
  retry: dict[int, float] = {}  # restarting worker -> when to ping it
  killed_worker: tuple[int, str, int] | None = None
  ps_killed_at: int | None = None
  stopped_by = "time"

  def seen(w: int, sender: str) -> None:
    if not senders[w] or senders[w][-1] != sender:
      senders[w].append(sender)

  def answer(w: int, ref: Any) -> Any:
    """Worker ``w``'s answer; None when it is restarting (it died with the
    call, or the call found it restarting): ping it until it answers."""
    try:
      return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
      if isinstance(e, ray.exceptions.ActorDiedError):
        raise _server_died(e) from e  # what the worker's call raised
      raise
    except ray.exceptions.ActorDiedError as e:
      raise RuntimeError(f"worker {w} died with no restarts left") from e
    except ray.exceptions.RayActorError:
      return None

  def on_step(w: int, ref: Any) -> StepResult | None:
    nonlocal last_answer
    r = answer(w, ref)
    last_answer = time.perf_counter()
    if r is None:
      lost[w] += 1  # the worker died with this step
      retry[w] = time.monotonic()
      return None
    seen(w, r.sender)
    if r.outcome == "lost":
      lost[w] += 1
    else:
      servers[r.answered_by] = max(servers.get(r.answered_by, 0), r.step)
    return r

  def global_step() -> int:
    return next(reversed(servers.values())) if servers else 0

  t0 = last_answer = time.perf_counter()
  wall0 = time.time()
  try:
    evals = [ps.evaluate.remote()]
    next_eval = eval_every
    steps.update({w.step.remote(): i for i, w in enumerate(ws)})
    # Training hands out steps; then the drain lets the steps in flight
    # finish (their gradients are in the counts) and waits for workers
    # still restarting (to see them back), handing out nothing.
    training, drain_until = True, 0.0
    while True:
      now = time.monotonic()
      if training and time.perf_counter() - t0 >= time_limit:
        training = False
      if not training:
        drain_until = drain_until or now + drain_timeout
        if not (steps or pings or retry) or now > drain_until:
          break
      for w, when in list(retry.items()):
        if when <= now:
          del retry[w]
          pings[ws[w].ready.remote()] = w
      left = time_limit - (time.perf_counter() - t0)
      wait = min([left if training else drain_until - now, 0.5])
      wait = min([wait, *(when - now for when in retry.values())])
      refs = [*steps, *pings]
      if not refs:
        time.sleep(max(wait, 0))
        continue
      ready, _ = ray.wait(refs, num_returns=1, timeout=max(wait, 0))
      if not ready:
        continue
      ref = ready[0]
      if ref in pings:
        w = pings.pop(ref)
        sender = answer(w, ref)
        if sender is None:
          retry[w] = time.monotonic() + 0.2
        else:
          seen(w, sender)
          if training:
            steps[ws[w].step.remote()] = w
        continue
      w = steps.pop(ref)
      r = on_step(w, ref)
      if not training:
        continue
      step = global_step()
      if step >= next_eval:
        evals.append(ps.evaluate.remote())
        next_eval = (step // eval_every + 1) * eval_every
      if step >= num_steps:
        stopped_by, training = "steps", False
        continue
      if r is None:
        continue
      steps[ws[w].step.remote()] = w
      if (
        kill_worker_after is not None
        and killed_worker is None
        and w == 0
        and step >= kill_worker_after
      ):
        ray.kill(ws[0], no_restart=False)  # with the step just handed out
        killed_worker = (0, r.sender, r.seq + 1)
      if (
        kill_ps_after is not None
        and ps_killed_at is None
        and step >= kill_ps_after
      ):
        ray.kill(ps, no_restart=False)
        ps_killed_at = step
    wall = last_answer - t0
    stats = _ask(ps.stats)
    received = _ask(ps.received)
    final = _ask(ps.evaluate)
  except ray.exceptions.ActorDiedError as e:  # the driver's call to it
    if isinstance(e, ray.exceptions.RayTaskError):
      raise
    raise _server_died(e) from e
  curve = []
  for ref in evals:
    try:
      s, loss, when = ray.get(ref)
    except ray.exceptions.RayActorError:
      continue  # asked of a server process that died before answering
    curve.append((s, loss, when - wall0))
  curve.append((final[0], final[1], wall))  # the params at the end
  by_worker = {}
  for w in range(len(ws)):
    c = {"accepted": 0, "dropped": 0, "rolled_back": 0}
    c.update(stats["by_worker"].get(w, {}))
    c["lost"] = lost[w]
    by_worker[w] = c
  applied, dropped = stats["step"], stats["num_dropped"]
  return RayRunResult(
    workers=len(ws),
    max_staleness=stats["max_staleness"],
    applied=applied,
    dropped=dropped,
    rolled_back=stats["rolled_back"],
    lost=sum(lost.values()),
    dropped_fraction=dropped / max(applied + dropped, 1),
    staleness_hist=stats["hist"],
    by_worker=by_worker,
    wall_time=wall,
    final_loss=final[1],
    curve=curve,
    stopped_by=stopped_by,
    puts=stats["puts"],
    senders=senders,
    ps_restored_from=stats["restored_from"],
    steps_before_ps_kill=ps_killed_at,
    killed_worker_step=killed_worker,
    received=received,
    stats=stats,
  )


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  at.add_run_arguments(parser)
  parser.add_argument(
    "--optimizer", choices=sorted(at.OPTIMIZERS), default="sgd"
  )
  parser.add_argument("--batch-size", type=int, default=32)
  parser.add_argument("--checkpoint-dir", default=None)
  parser.add_argument("--checkpoint-every", type=int, default=50)
  parser.add_argument("--kill-worker-after", type=int, default=None)
  parser.add_argument("--kill-ps-after", type=int, default=None)
  parser.add_argument(
    "--gpus-per-worker",
    type=float,
    default=0.0,
    help="GPUs per worker actor (a fraction shares one); 0: CPU",
  )
  parser.add_argument(
    "--num-cpus",
    type=int,
    default=None,
    help="CPUs of the local Ray cluster (default: all)",
  )
  args = parser.parse_args(argv)
  init_ray(num_cpus=args.num_cpus)
  try:
    r = run(
      {"seed": args.seed},
      **at.run_arguments(args),
      optimizer=args.optimizer,
      batch_size=args.batch_size,
      checkpoint_dir=args.checkpoint_dir,
      checkpoint_every=args.checkpoint_every,
      kill_worker_after=args.kill_worker_after,
      kill_ps_after=args.kill_ps_after,
      gpus_per_worker=args.gpus_per_worker,
    )
  finally:
    ray.shutdown()
  for w, c in r.by_worker.items():
    restarts = len(r.senders[w]) - 1
    print(
      f"worker {w}: accepted {c['accepted']}, dropped {c['dropped']}, "
      f"rolled back {c['rolled_back']}, lost {c['lost']}, "
      f"restarts {restarts}"
    )
  print("staleness histogram:", r.staleness_hist)
  if r.killed_worker_step is not None:
    w, sender, seq = r.killed_worker_step
    reached = any(x[:3] == (w, sender, seq) for x in r.received)
    print(
      f"worker {w} killed with gradient {seq} in flight: "
      + ("it reached the server" if reached else "lost, never pushed")
    )
  if r.steps_before_ps_kill is not None:
    print(
      f"parameter server killed at step {r.steps_before_ps_kill}, restored "
      f"from the checkpoint of step {r.ps_restored_from}; "
      f"{r.rolled_back} gradient(s) rolled back"
    )
  print(
    f"{r.wall_time:.2f} s, {r.applied / r.wall_time:.0f} gradients applied "
    f"per second, params put {r.puts} times, stopped by {r.stopped_by}"
  )
  print(
    f"workers {r.workers}, applied {r.applied}, dropped {r.dropped}, "
    f"held-out loss {r.final_loss:.4f}"
  )


if __name__ == "__main__":
  main()
