"""The training run of the checkpoint tests, and the fresh process that
resumes it.

tests/test_checkpoint.py trains a small embedding model with the nested
chain of :func:`make_tx` (drop_stale around accumulate around lazy_adam with
catch-up and a learning-rate schedule; for the mirrored run all_reduce in
front), checkpoints it at step :data:`SAVE_AT` -- in the middle of an
accumulation window -- with orbax and with ``.npz``, and starts this script
in a fresh Python process::

  python tests/checkpoint_worker.py --ckpt DIR --out DIR

with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` and
``JAX_PLATFORMS=cpu``. It restores each checkpoint against a freshly
initialised abstract state (so NamedTuples and SparseRows come back with
their types), trains from :data:`SAVE_AT` to :data:`STEPS` and writes what
it restored and where it ended to ``DIR/<name>.npz``. The mirrored run was
saved from 8 devices and resumes on the 4 of this process. Not a test
module: pytest collects ``test_*.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import procs

import gradtx as gtx

NUM_ROWS = 24
DIM = 3
GLOBAL_BATCH = 8
IDS_PER_EXAMPLE = 3
IDS_PER_STEP = GLOBAL_BATCH * IDS_PER_EXAMPLE
EVERY_K = 2
MAX_STALENESS = 1
# The staleness each call asks for: grad_step = step - delay. Delays above
# MAX_STALENESS are dropped (and do not count towards the k-window).
DELAYS = (0, 0, 2, 1, 0, 0, 3, 0, 1, 0)
STEPS = len(DELAYS)
SAVE_AT = 6  # 5 accepted calls so far: one gradient held in a k=2 window


def init_params() -> dict[str, np.ndarray]:
  return procs.init_params(NUM_ROWS, DIM)


def global_batch(step: int) -> dict[str, np.ndarray]:
  """The whole batch of a step: duplicate ids, padding ids (-1, too big)."""
  rng = np.random.RandomState(100 + step)
  # A window of rows that slides with the step: rows fall out of use and
  # come back, so catch-up has skipped steps to make up.
  ids = rng.randint(2 * step, 2 * step + 10, size=(GLOBAL_BATCH, 3))
  ids[:, 1] = ids[:, 0]  # duplicates within an example
  ids[0, 2] = -1  # padding
  ids[3, 2] = NUM_ROWS + 5  # padding
  return {
    "ids": ids.astype(np.int32),
    "y": rng.normal(size=(GLOBAL_BATCH,)).astype(np.float32),
  }


loss_fn = procs.loss_fn


def make_tx(axis_name: str | None = None) -> optax.GradientTransformation:
  """The nested chain under test (one all_reduce in front when mirrored).

  ``rows_per_step`` counts the rows after the all-gather (the global batch),
  so the state has the same shapes whatever the number of replicas.
  """
  lr = optax.exponential_decay(0.05, transition_steps=2, decay_rate=0.9)
  inner = gtx.lazy_adam(lr, catch_up=True)
  rows = {"emb": IDS_PER_STEP, "w": None, "b": None}
  tx = gtx.drop_stale(
    gtx.accumulate(inner, EVERY_K, rows_per_step=rows), MAX_STALENESS
  )
  if axis_name is None:
    return tx
  return optax.chain(gtx.all_reduce(axis_name), tx)


def make_step(tx: optax.GradientTransformation, m: gtx.Mirrored | None):
  """The jitted step ``(params, state, batch, grad_step) -> (params,
  state)``: plain jit on one device, or Mirrored.step (donating)."""

  def train_step(params, opt_state, batch, grad_step):
    loss, grads = gtx.sparse_value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(
      grads, opt_state, params, grad_step=grad_step
    )
    return gtx.apply_updates(params, updates), opt_state

  if m is None:
    return jax.jit(train_step)
  return m.step(train_step, donate_argnums=(0, 1))


def train(
  params: Any,
  opt_state: Any,
  start: int,
  stop: int,
  step_fn: Any,
  m: gtx.Mirrored | None = None,
) -> tuple[Any, Any]:
  """Calls ``start .. stop - 1``; the step read is derived from the state."""
  for t in range(start, stop):
    step = int(gtx.staleness_stats(opt_state)["step"])
    grad_step = jnp.int32(max(step - DELAYS[t], 0))
    batch = global_batch(t)
    if m is not None:
      batch = m.shard_batch(batch)
    params, opt_state = step_fn(params, opt_state, batch, grad_step)
  return params, opt_state


# ----------------------------------------------------------------------------
# Saving and restoring


def abstract_tree(tx: Any, params: Any, sharding: Any = None) -> Any:
  """``{"params", "opt_state"}`` as ShapeDtypeStructs, from a fresh init."""
  tree = {
    "params": jax.eval_shape(lambda p: p, params),
    "opt_state": jax.eval_shape(tx.init, params),
  }
  if sharding is None:
    return tree
  return jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), tree
  )


def save_orbax(path: Path, tree: Any) -> None:
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(Path(path).absolute(), tree)
    ckptr.wait_until_finished()


def restore_orbax(path: Path, abstract: Any) -> Any:
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.restore(Path(path).absolute(), abstract)


def save_npz(path: Path, tree: Any) -> None:
  """Every leaf (SparseRows children included) as ``leaf_<i>``."""
  leaves = jax.tree.leaves(tree)
  np.savez(path, **{f"leaf_{i}": np.asarray(x) for i, x in enumerate(leaves)})


def restore_npz(path: Path, abstract: Any) -> Any:
  """Leaves in flattening order, checked against a fresh abstract tree and
  unflattened with its treedef."""
  want, treedef = jax.tree.flatten(abstract)
  with np.load(path) as f:
    leaves = [f[f"leaf_{i}"] for i in range(len(f.files))]
  if len(leaves) != len(want):
    raise ValueError(
      f"{path} holds {len(leaves)} leaves; the state has {len(want)}."
    )
  for i, (x, s) in enumerate(zip(leaves, want, strict=True)):
    if x.dtype.kind == "V" and x.dtype.itemsize == np.dtype(s.dtype).itemsize:
      # numpy stores bfloat16 and the other ml_dtypes as raw void bytes.
      x = leaves[i] = x.view(s.dtype)
    if x.shape != s.shape or x.dtype != s.dtype:
      raise ValueError(
        f"{path}: leaf {i} is {x.dtype}{list(x.shape)}, the state expects "
        f"{s.dtype}{list(s.shape)}."
      )
  return jax.tree.unflatten(treedef, leaves)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--ckpt", required=True)
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  ckpt, out = Path(args.ckpt), Path(args.out)
  params0 = init_params()

  # Plain jit on one device, from orbax and from npz.
  tx = make_tx()
  step_fn = make_step(tx, None)
  abstract = abstract_tree(tx, params0)
  restored = {
    "orbax": restore_orbax(ckpt / "plain_orbax", abstract),
    "npz": restore_npz(ckpt / "plain.npz", abstract),
  }
  for fmt, tree in restored.items():
    p, s = train(tree["params"], tree["opt_state"], SAVE_AT, STEPS, step_fn)
    save_npz(out / f"plain_{fmt}.npz", {"params": p, "opt_state": s})

  # Mirrored, saved on 8 devices, resumed on this process's devices.
  m = gtx.Mirrored()
  tx = make_tx(m.axis_name)
  sharding = jax.sharding.NamedSharding(m.mesh, jax.sharding.PartitionSpec())
  tree = restore_orbax(
    ckpt / "mirrored_orbax", abstract_tree(tx, params0, sharding)
  )
  leaf = jax.tree.leaves(tree)[0]
  assert len(leaf.sharding.device_set) == m.num_replicas, leaf.sharding
  save_npz(out / "mirrored_restored.npz", tree)
  p, s = train(
    tree["params"], tree["opt_state"], SAVE_AT, STEPS, make_step(tx, m), m
  )
  save_npz(out / "mirrored.npz", {"params": p, "opt_state": s})
  np.savez(out / "devices.npz", num_replicas=m.num_replicas)


if __name__ == "__main__":
  main(sys.argv[1:])
