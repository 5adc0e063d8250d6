"""One process of the multi-process Mirrored test, and the training run it
shares with the in-process reference.

tests/test_mirrored.py starts this script once per process::

  python tests/mirrored_worker.py --port P --num-processes 2 \\
      --process-id I --out DIR

with ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` and
``JAX_PLATFORMS=cpu`` in its environment. Each process joins the JAX
distributed runtime on 127.0.0.1 (gloo CPU collectives), runs
:func:`train` on its part of every batch and writes the final params to
``DIR/process_I.npz``. Not a test module: pytest collects ``test_*.py``.
"""

from __future__ import annotations

import sys

import jax
import numpy as np
import optax
import procs

import gradtx as gtx

NUM_ROWS = 64
DIM = 4
GLOBAL_BATCH = 16
IDS_PER_EXAMPLE = 3
STEPS = 3


def init_params() -> dict[str, np.ndarray]:
  return procs.init_params(NUM_ROWS, DIM)


def global_batch(step: int) -> dict[str, np.ndarray]:
  """The whole batch of a step; rows are split across processes."""
  rng = np.random.RandomState(1000 + step)
  ids = rng.randint(0, NUM_ROWS, size=(GLOBAL_BATCH, IDS_PER_EXAMPLE))
  return {
    "ids": ids.astype(np.int32),
    "y": rng.normal(size=(GLOBAL_BATCH,)).astype(np.float32),
  }


loss_fn = procs.loss_fn


def make_tx(axis_name: str) -> optax.GradientTransformation:
  return optax.chain(gtx.all_reduce(axis_name), gtx.lazy_adam(0.05))


def train(m: gtx.Mirrored) -> tuple[dict[str, np.ndarray], list[float]]:
  """STEPS mirrored steps; this process passes its rows of each batch."""
  tx = make_tx(m.axis_name)

  def train_step(params, opt_state, batch):
    loss, grads = gtx.sparse_value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = gtx.apply_updates(params, updates)
    return params, opt_state, m.reduce_in_step(loss, "mean")

  step = m.step(train_step, donate_argnums=(0, 1))
  host_params = init_params()
  params = m.replicate(host_params)
  opt_state = m.replicate(tx.init(host_params))
  n, i = jax.process_count(), jax.process_index()
  rows = GLOBAL_BATCH // n
  losses = []
  for s in range(STEPS):
    local = jax.tree.map(
      lambda x: x[i * rows : (i + 1) * rows], global_batch(s)
    )
    params, opt_state, loss = step(params, opt_state, m.shard_batch(local))
    losses.append(float(np.asarray(loss.addressable_data(0))))
  out = jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), params)
  return out, losses


def main(argv: list[str] | None = None) -> None:
  with procs.joined(argv, "--out") as args:
    assert jax.process_count() == args.num_processes
    m = gtx.Mirrored()
    params, losses = train(m)
    np.savez(
      f"{args.out}/process_{args.process_id}.npz",
      losses=np.asarray(losses),
      num_replicas=m.num_replicas,
      local_devices=jax.local_device_count(),
      **params,
    )


if __name__ == "__main__":
  main(sys.argv[1:])
