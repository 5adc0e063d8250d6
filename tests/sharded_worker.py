"""One process of the multi-process row-sharded test, and the training run
it shares with the in-process runs.

tests/test_sharded.py trains a hybrid :class:`gtx.Mirrored` (the table
row-sharded over the replicas, the dense params mirrored) on 8 devices up to
:data:`SAVE_AT` -- inside an accumulation window -- saves the params and
optimizer state with orbax, and starts this script once per process::

  python tests/sharded_worker.py --port P --num-processes 2 \\
      --process-id I --ready FILE --out DIR

with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` and
``JAX_PLATFORMS=cpu``. Each process joins the JAX distributed runtime on
127.0.0.1 (gloo CPU collectives) and, on the 4 devices of the two
processes, (1) trains from scratch for :data:`STEPS` steps, while the test
trains on 8 devices, and (2) once ``FILE`` names the 8-device checkpoint,
restores it row-sharded onto the 4 devices and trains from :data:`SAVE_AT`
to :data:`STEPS`. It writes what it restored, where
each run ended (whole arrays, gathered across processes) and the shapes of
its own shards to ``DIR/process_I.npz``. Not a test module: pytest collects
``test_*.py``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import checkpoint_worker
import jax
import jax.numpy as jnp
import numpy as np
import optax
import procs
from jax.experimental import multihost_utils

import gradtx as gtx

NUM_ROWS = 16384  # one shard of 8: 2048 x 16 float32 = 128 KiB
DIM = 16
GLOBAL_BATCH = 16
IDS_PER_EXAMPLE = 3
IDS_PER_STEP = GLOBAL_BATCH * IDS_PER_EXAMPLE
MAX_STALENESS = 1
# The staleness of each call (grad_step = step - delay); delay 2 is dropped.
DELAYS = (0, 0, 2, 1, 0, 0)
STEPS = len(DELAYS)
SAVE_AT = 4  # 3 accepted calls: one gradient held in the k=2 window


def init_params() -> dict[str, np.ndarray]:
  return procs.init_params(NUM_ROWS, DIM)


def global_batch(step: int) -> dict[str, np.ndarray]:
  """The whole batch of a step: duplicate ids, padding ids (-1, too big)."""
  rng = np.random.RandomState(100 + step)
  # A window of rows that slides with the step, so catch-up has work.
  ids = rng.randint(6 * step, 6 * step + 24, size=(GLOBAL_BATCH, 3))
  ids[:, 1] = ids[:, 0]
  ids[0, 2] = -1
  ids[3, 2] = NUM_ROWS + 5
  return {
    "ids": ids.astype(np.int32),
    "y": rng.normal(size=(GLOBAL_BATCH,)).astype(np.float32),
  }


loss_fn = procs.loss_fn


def make_tx(
  axis_name: str | None = None, chain: str = "stale_accumulate_clip_adam"
) -> optax.GradientTransformation:
  """Every row-touching transformation in one chain: drop_stale around
  accumulate around a global-norm clip (a norm across the shards) and lazy
  Adam with catch-up; or ``chain="lazy_adamw"`` (reads param rows for the
  decay). With ``axis_name``, all_reduce in front (``rows_per_step``
  counts the whole batch's rows, after the all-gather, whatever the
  replica count)."""
  if chain == "lazy_adamw":
    tx = gtx.lazy_adamw(0.05, weight_decay=0.1)
  else:
    inner = optax.chain(
      gtx.clip_by_global_norm(0.05), gtx.lazy_adam(0.05, catch_up=True)
    )
    rows = {"emb": IDS_PER_STEP, "w": None, "b": None}
    tx = gtx.drop_stale(
      gtx.accumulate(inner, 2, rows_per_step=rows), MAX_STALENESS
    )
  if axis_name is None:
    return tx
  return optax.chain(gtx.all_reduce(axis_name), tx)


def step_fn(
  tx: optax.GradientTransformation,
  m: gtx.Mirrored | None,
  loss: Any = loss_fn,
):
  """The step :func:`make_step` compiles, not compiled."""

  def train_step(params, opt_state, batch, grad_step):
    value, grads = gtx.sparse_value_and_grad(loss)(params, batch)
    updates, opt_state = tx.update(
      grads, opt_state, params, grad_step=grad_step
    )
    if m is not None:
      value = m.reduce_in_step(value, "mean")
    return gtx.apply_updates(params, updates), opt_state, value

  return train_step


def make_step(
  tx: optax.GradientTransformation,
  m: gtx.Mirrored | None,
  loss: Any = loss_fn,
):
  """``(params, state, batch, grad_step) -> (params, state, loss)``:
  jit donating params and state, or the Mirrored step."""
  train_step = step_fn(tx, m, loss)
  if m is None:
    return jax.jit(train_step, donate_argnums=(0, 1))
  return m.step(train_step, donate_argnums=(0, 1))


def _scalar(x: Any) -> Any:
  """A replicated scalar's value (any process, any placement)."""
  if isinstance(x, jax.Array):
    x = x.addressable_data(0)
  return np.asarray(x).item()


def call_grad_step(opt_state: Any, t: int) -> jax.Array:
  """The ``grad_step`` of call ``t``: the step it read its params at."""
  try:
    step = _scalar(gtx.staleness_stats(opt_state)["step"])
  except ValueError:  # no drop_stale in this chain: grad_step is unused
    step = t
  return jnp.int32(max(step - DELAYS[t], 0))


def train(
  params: Any,
  opt_state: Any,
  start: int,
  stop: int,
  step_fn: Any,
  place: Any = None,
) -> tuple[Any, Any, list[float]]:
  """Calls ``start .. stop - 1``; each process passes its rows of a batch
  through ``place`` (``mirrored.shard_batch``, a ``device_put``)."""
  n, i = jax.process_count(), jax.process_index()
  rows = GLOBAL_BATCH // n
  losses = []
  for t in range(start, stop):
    grad_step = call_grad_step(opt_state, t)
    batch = global_batch(t)
    if place is not None:
      local = jax.tree.map(lambda x: x[i * rows : (i + 1) * rows], batch)
      batch = place(local)
    params, opt_state, loss = step_fn(params, opt_state, batch, grad_step)
    losses.append(_scalar(loss))
  return params, opt_state, losses


def fresh(m: gtx.Mirrored, tx: optax.GradientTransformation) -> Any:
  """``{"params", "opt_state"}`` from scratch, placed by ``m``."""
  params = m.place(init_params())
  return {"params": params, "opt_state": m.init_state(tx, params)}


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs with each leaf's shape, dtype and sharding: the
  target of an orbax restore (a fresh placement gives the new layout)."""
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
    tree,
  )


def gathered(tree: Any) -> list[np.ndarray]:
  """Every leaf whole, on every process (in flattening order)."""
  return [
    np.asarray(x)
    for x in multihost_utils.process_allgather(
      jax.tree.leaves(tree), tiled=True
    )
  ]


def _wait_for(ready: str, timeout: float = 300.0) -> Path:
  """The checkpoint path written to ``ready``, once it is there."""
  deadline = time.monotonic() + timeout
  while not Path(ready).exists():
    if time.monotonic() > deadline:
      raise TimeoutError(f"no checkpoint named in {ready} after {timeout} s")
    time.sleep(0.2)
  return Path(Path(ready).read_text())


def main(argv: list[str] | None = None) -> None:
  with procs.joined(argv, "--ready", "--out") as args:
    m = gtx.Mirrored(shard_rows="emb")
    tx = make_tx(m.axis_name)
    step = make_step(tx, m)
    start = fresh(m, tx)
    target = abstract_like(start)
    params, state, losses = train(
      start["params"], start["opt_state"], 0, STEPS, step, m.shard_batch
    )
    full = {"params": params, "opt_state": state}
    restored = checkpoint_worker.restore_orbax(_wait_for(args.ready), target)
    mu = restored["opt_state"][1].inner_state.inner_state[1][0].mu["emb"]
    shards = {
      "emb_shard": restored["params"]["emb"].addressable_shards[0].data.shape,
      "mu_shard": mu.addressable_shards[0].data.shape,
      "emb_spec": str(restored["params"]["emb"].sharding.spec),
    }
    restored_leaves = gathered(restored)
    params, state, resumed_losses = train(
      restored["params"],
      restored["opt_state"],
      SAVE_AT,
      STEPS,
      step,
      m.shard_batch,
    )
    out = {}
    for name, leaves in (
      ("full", gathered(full)),
      ("restored", restored_leaves),
      ("resumed", gathered({"params": params, "opt_state": state})),
    ):
      out.update({f"{name}_{i}": x for i, x in enumerate(leaves)})
    np.savez(
      f"{args.out}/process_{args.process_id}.npz",
      full_losses=np.asarray(losses),
      resumed_losses=np.asarray(resumed_losses),
      num_replicas=m.num_replicas,
      local_devices=jax.local_device_count(),
      **shards,
      **out,
    )


if __name__ == "__main__":
  main(sys.argv[1:])
