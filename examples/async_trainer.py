"""A real asynchronous (parameter-server style) trainer using gtx.drop_stale.

N worker threads and one applier share the parameters:

- each worker repeatedly reads a snapshot ``(params, step)`` under a lock,
  computes a jitted loss and gradient on its own shard of the data (JAX
  releases the GIL while it computes, so workers really run concurrently),
  and pushes ``(grads, step_read)`` to a queue; like a TensorFlow
  parameter-server worker it then waits until the applier has handled that
  gradient before it reads the parameters again;
- the applier (the calling thread) pops gradients in arrival order, runs the
  jitted ``drop_stale`` update with ``grad_step=step_read``, applies it with
  ``gtx.apply_updates`` and publishes the new parameters and the new global
  step (``state.step`` of the drop_stale state).

With one worker every gradient is fresh (staleness 0). With N workers a
gradient arrives after the others' gradients that were applied while it was
computed, so its staleness is typically up to N - 1. A straggler (a worker
with a longer ``delay``) brings gradients so stale that ``drop_stale``
drops them; ``RunResult.dropped_by_worker`` counts them per worker.

Faults: when a worker raises, the applier and every other worker stop (they
check a shared stop event between steps, and the applier polls its queue),
all threads are joined within ``join_timeout`` seconds, and ``run_async``
re-raises the worker's exception (with a note naming the worker). No thread
is left running; a thread that does not stop in time is a ``RuntimeError``
naming it.

The task is a small sparse-feature classifier: each example is a bag of
feature ids drawn from a power law over an embedding table; the model sums
the looked-up rows (``gtx.lookup``, so the table's gradient is a
``gtx.SparseRows``) and applies a linear softmax layer. Labels come from a
random teacher of the same form. Everything is seeded.

Run ``python -m examples.async_trainer --workers 4 --max-staleness 1``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradtx as gtx


@dataclasses.dataclass(frozen=True)
class Task:
  """A synthetic sparse-feature classification problem (numpy arrays)."""

  train_ids: np.ndarray  # int32 [num_train, features]
  train_labels: np.ndarray  # int32 [num_train]
  eval_ids: np.ndarray  # int32 [num_eval, features]
  eval_labels: np.ndarray  # int32 [num_eval]
  num_rows: int
  num_classes: int


def make_task(
  *,
  seed: int = 0,
  num_rows: int = 2000,
  features: int = 8,
  num_classes: int = 8,
  num_train: int = 8192,
  num_eval: int = 2048,
  teacher_dim: int = 8,
) -> Task:
  """Bags of power-law distributed ids labelled by a random teacher."""
  rng = np.random.default_rng(seed)
  prob = 1.0 / np.arange(1, num_rows + 1) ** 1.1
  prob /= prob.sum()
  table = rng.normal(size=(num_rows, teacher_dim))
  proj = rng.normal(size=(teacher_dim, num_classes))

  def sample(n):
    ids = rng.choice(num_rows, size=(n, features), p=prob).astype(np.int32)
    logits = table[ids].sum(axis=1) @ proj
    logits += rng.gumbel(size=logits.shape)  # label noise: softmax sampling
    return ids, np.argmax(logits, axis=-1).astype(np.int32)

  train_ids, train_labels = sample(num_train)
  eval_ids, eval_labels = sample(num_eval)
  return Task(
    train_ids, train_labels, eval_ids, eval_labels, num_rows, num_classes
  )


def init_params(task: Task, *, dim: int = 16, seed: int = 0) -> dict:
  """Embedding table, projection and bias."""
  rng = np.random.default_rng(seed + 1)
  return {
    "emb": jnp.asarray(0.1 * rng.normal(size=(task.num_rows, dim)), "float32"),
    "w": jnp.asarray(0.1 * rng.normal(size=(dim, task.num_classes)), "float32"),
    "b": jnp.zeros([task.num_classes], jnp.float32),
  }


def loss_fn(params: dict, ids: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy of the bag-of-embeddings classifier."""
  pooled = gtx.lookup(params["emb"], ids).sum(axis=1)
  logits = pooled @ params["w"] + params["b"][None, :]
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


# Built once: jit caches are shared by every run and every thread.
grad_fn = jax.jit(gtx.sparse_value_and_grad(loss_fn))
eval_fn = jax.jit(loss_fn)


# The inner optimizers a run can use: sparse SGD (no state) and two with
# per-row state, whose checkpoint a restarted parameter server must restore.
OPTIMIZERS: dict[str, Callable[[float], optax.GradientTransformation]] = {
  "sgd": gtx.scale_by_learning_rate,
  "adagrad": gtx.adagrad,
  "lazy_adam": gtx.lazy_adam,
}


def make_optimizer(
  max_staleness: int | None,
  *,
  learning_rate: float = 0.5,
  rescale: bool = False,
  optimizer: str = "sgd",
) -> optax.GradientTransformationExtraArgs:
  """``drop_stale`` around sparse SGD (or another of :data:`OPTIMIZERS`)."""
  if optimizer not in OPTIMIZERS:
    raise ValueError(
      f"`optimizer` must be one of {sorted(OPTIMIZERS)}; got {optimizer!r}."
    )
  return gtx.drop_stale(
    OPTIMIZERS[optimizer](learning_rate), max_staleness, rescale=rescale
  )


_APPLY_CACHE: dict[tuple[Any, ...], Any] = {}


def make_apply_step(
  max_staleness: int | None,
  learning_rate: float,
  rescale: bool,
  optimizer: str = "sgd",
  *,
  donate_params: bool = False,
) -> tuple[optax.GradientTransformationExtraArgs, Callable[..., Any]]:
  """The optimizer and the parameter server's jitted
  ``step(params, state, grads, grad_step) -> (params, state)``, built once
  per setting (jit caches are shared by every run and every thread).

  The step donates the optimizer state (updated in place, as every gradtx
  step should be), and the params too with ``donate_params=True``. Only a
  server that hands no one its params arrays may donate them: this file's
  workers read the published params while the next step runs, and a
  donated array is deleted by the call; ``examples/ray_trainer.py``'s
  server sends copies and donates both."""
  key = (max_staleness, learning_rate, rescale, optimizer, donate_params)
  if key not in _APPLY_CACHE:
    tx = make_optimizer(
      max_staleness,
      learning_rate=learning_rate,
      rescale=rescale,
      optimizer=optimizer,
    )

    def step(params, state, grads, grad_step):
      updates, state = tx.update(grads, state, params, grad_step=grad_step)
      return gtx.apply_updates(params, updates), state

    step = jax.jit(step, donate_argnums=(0, 1) if donate_params else 1)

    _APPLY_CACHE[key] = (tx, step)
  return _APPLY_CACHE[key]


def worker_delays(workers: int, delay: float | Sequence[float]) -> list[float]:
  """One delay per worker (see :func:`run_async`), checked."""
  if workers < 1:
    raise ValueError(f"`workers` must be >= 1; got {workers}.")
  delays = [delay] * workers if np.ndim(delay) == 0 else list(delay)
  if len(delays) != workers or min(delays) < 0:
    raise ValueError(
      f"`delay` must be a number >= 0 or one per worker ({workers}); got "
      f"{delay!r}."
    )
  return [float(d) for d in delays]


@dataclasses.dataclass
class RunResult:
  """What one asynchronous run measured."""

  workers: int
  max_staleness: int | None
  applied: int  # gradients accepted (the final global step)
  received: int  # gradients that reached the applier
  dropped: int
  dropped_fraction: float
  staleness_hist: dict[int, int]  # staleness -> gradients received
  wall_time: float  # seconds from starting the workers to joining them
  final_loss: float  # eval loss of the final parameters
  curve: list[tuple[int, float]]  # (applied steps, eval loss)
  curve_seconds: list[float]  # seconds since the start at each curve point
  stopped_by: str  # "steps" or "time"
  params: Any  # the final parameters
  received_by_worker: dict[int, int]  # worker -> gradients received
  dropped_by_worker: dict[int, int]  # worker -> gradients dropped as stale


class _Shared:
  """The parameter server's published values."""

  def __init__(self, params: Any, step: int):
    self.lock = threading.Lock()
    self.params = params
    self.step = step


def run_async(
  task: Task,
  *,
  workers: int,
  max_staleness: int | None,
  num_steps: int = 200,
  time_limit: float = 60.0,
  learning_rate: float = 0.5,
  rescale: bool = False,
  batch_size: int = 32,
  eval_every: int = 10,
  delay: float | Sequence[float] = 0.0,
  seed: int = 0,
  fault: Callable[[int, int], None] | None = None,
  join_timeout: float = 10.0,
) -> RunResult:
  """Trains with ``workers`` threads until ``num_steps`` gradients have been
  applied or ``time_limit`` seconds have passed, whichever comes first.

  Args:
    task: the data.
    workers: number of worker threads (>= 1).
    max_staleness: passed to ``gtx.drop_stale`` (None: no limit).
    num_steps: stop after this many accepted gradients.
    time_limit: stop after this many seconds of training.
    learning_rate: SGD step size.
    rescale: ``drop_stale(..., rescale=True)``.
    batch_size: examples per gradient.
    eval_every: evaluate the eval loss every this many applied steps.
    delay: seconds each worker sleeps between reading the parameters and
      computing its gradient (a slower worker or network; 0 for none); a
      sequence gives one delay per worker (a straggler).
    seed: seeds the parameters and each worker's batch sampling.
    fault: a test hook, ``fault(worker, i)``, called by each worker before
      computing its ``i``-th gradient; what it raises is that worker's
      failure.
    join_timeout: seconds to wait for the threads to stop once the run
      ends or fails.

  Returns:
    A :class:`RunResult`. The worker threads have all been joined.

  Raises:
    The exception of the first worker that failed (the other workers and
    the applier are stopped and joined first), or RuntimeError when a
    thread does not stop within ``join_timeout``.
  """
  if num_steps < 1:
    raise ValueError(f"`num_steps` must be >= 1; got {num_steps}.")
  delays = worker_delays(workers, delay)
  tx, apply_step = make_apply_step(max_staleness, learning_rate, rescale)
  params = init_params(task, seed=seed)
  state = tx.init(params)
  eval_ids = jnp.asarray(task.eval_ids)
  eval_labels = jnp.asarray(task.eval_labels)
  shards = [
    (task.train_ids[w::workers], task.train_labels[w::workers])
    for w in range(workers)
  ]
  # Compile everything before the clock starts (results are thrown away).
  _, g0 = grad_fn(
    params, jnp.asarray(shards[0][0][:batch_size]), shards[0][1][:batch_size]
  )
  jax.block_until_ready(
    apply_step(params, jax.tree.map(jnp.copy, state), g0, 0)
  )
  jax.block_until_ready(eval_fn(params, eval_ids, eval_labels))

  shared = _Shared(params, 0)
  inbox: queue.Queue = queue.Queue()
  stop = threading.Event()
  errors: list[tuple[int, BaseException]] = []

  def worker(wid: int) -> None:
    try:
      rng = np.random.default_rng([seed, wid])
      ids, labels = shards[wid]
      i = 0
      while not stop.is_set():
        with shared.lock:
          p, step_read = shared.params, shared.step
        if delays[wid] and stop.wait(delays[wid]):
          return
        if fault is not None:
          fault(wid, i)
        pick = rng.integers(0, len(ids), size=batch_size)
        loss, grads = grad_fn(p, ids[pick], labels[pick])
        jax.block_until_ready(grads)
        handled = threading.Event()
        inbox.put((wid, grads, step_read, handled))
        while not handled.wait(0.02):
          if stop.is_set():
            return
        i += 1
    except BaseException as e:  # re-raised by the applier
      errors.append((wid, e))
      stop.set()

  threads = [
    threading.Thread(target=worker, args=(w,), name=f"worker-{w}")
    for w in range(workers)
  ]
  hist: collections.Counter = collections.Counter()
  by_worker: collections.Counter = collections.Counter()
  dropped_by: collections.Counter = collections.Counter()
  curve = [(0, float(eval_fn(params, eval_ids, eval_labels)))]
  seconds = [0.0]
  step = received = 0
  stopped_by = "time"
  t0 = time.perf_counter()
  for t in threads:
    t.start()
  try:
    while time.perf_counter() - t0 < time_limit and not errors:
      try:
        wid, grads, step_read, handled = inbox.get(timeout=0.02)
      except queue.Empty:
        continue
      dropped_before = int(state.num_dropped)  # the step donates `state`
      params, state = apply_step(params, state, grads, step_read)
      new_step = int(state.step)  # waits for the update
      hist[step - step_read] += 1
      received += 1
      by_worker[wid] += 1
      dropped_by[wid] += int(state.num_dropped) - dropped_before
      with shared.lock:
        shared.params, shared.step = params, new_step
      handled.set()
      if new_step != step and new_step % eval_every == 0:
        curve.append((new_step, float(eval_fn(params, eval_ids, eval_labels))))
        seconds.append(time.perf_counter() - t0)
      step = new_step
      if step >= num_steps:
        stopped_by = "steps"
        break
  finally:
    stop.set()
    deadline = time.monotonic() + join_timeout
    for t in threads:
      t.join(max(deadline - time.monotonic(), 0.0))
    wall = time.perf_counter() - t0
  stuck = [t.name for t in threads if t.is_alive()]
  if errors:
    wid, error = errors[0]
    if hasattr(error, "add_note"):  # Python >= 3.11
      error.add_note(f"(raised in async worker {wid}; the run was stopped)")
    if stuck:
      raise RuntimeError(
        f"async worker {wid} failed and threads {stuck} did not stop within "
        f"join_timeout={join_timeout} s"
      ) from error
    raise error
  if stuck:
    raise RuntimeError(
      f"threads {stuck} did not stop within join_timeout={join_timeout} s"
    )
  final_loss = float(eval_fn(params, eval_ids, eval_labels))
  if curve[-1][0] != step:
    curve.append((step, final_loss))
    seconds.append(wall)
  stats = gtx.staleness_stats(state)
  return RunResult(
    workers=workers,
    max_staleness=max_staleness,
    applied=int(stats["step"]),
    received=received,
    dropped=int(stats["num_dropped"]),
    dropped_fraction=float(stats["dropped_fraction"]),
    staleness_hist=dict(sorted(hist.items())),
    wall_time=wall,
    final_loss=final_loss,
    curve=curve,
    curve_seconds=seconds,
    stopped_by=stopped_by,
    params=params,
    received_by_worker=dict(sorted(by_worker.items())),
    dropped_by_worker={w: dropped_by[w] for w in sorted(by_worker)},
  )


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
  """The command-line options of both trainers (this one and
  ``examples/ray_trainer.py``); :func:`run_arguments` reads them."""
  parser.add_argument("--workers", type=int, default=4)
  parser.add_argument(
    "--max-staleness",
    type=lambda s: None if s.lower() == "none" else int(s),
    default=None,
    help="an int >= 0, or 'none' for no limit",
  )
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--time-limit", type=float, default=60.0)
  parser.add_argument("--learning-rate", type=float, default=0.5)
  parser.add_argument("--rescale", action="store_true")
  parser.add_argument("--delay", type=float, default=0.0)
  parser.add_argument("--seed", type=int, default=0)


def run_arguments(args: argparse.Namespace) -> dict[str, Any]:
  """The keyword arguments of :func:`run_async` that
  :func:`add_run_arguments` added."""
  return {
    "workers": args.workers,
    "max_staleness": args.max_staleness,
    "num_steps": args.steps,
    "time_limit": args.time_limit,
    "learning_rate": args.learning_rate,
    "rescale": args.rescale,
    "delay": args.delay,
    "seed": args.seed,
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_run_arguments(parser)
  args = parser.parse_args(argv)
  r = run_async(make_task(seed=args.seed), **run_arguments(args))
  print(
    f"workers={r.workers} max_staleness={r.max_staleness} "
    f"applied={r.applied} received={r.received} dropped={r.dropped} "
    f"({r.dropped_fraction:.1%}) final eval loss={r.final_loss:.4f} "
    f"wall={r.wall_time:.2f}s stopped by {r.stopped_by}"
  )
  print("staleness histogram:", r.staleness_hist)


if __name__ == "__main__":
  main()
