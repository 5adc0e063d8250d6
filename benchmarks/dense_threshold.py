"""Where dense beats sparse: the whole lazy_adam step of a table read R
times per step, with its gradient sparse (SparseRows, lazy update of the
touched rows) and dense (``dense=``: jax's dense gradient, Adam on the
whole table), side by side in one process, over tables of V rows for a
fixed R. The crossover R / V sets ``gradtx._autodiff.DENSE_READS_PER_ROW``.

  python -m benchmarks.dense_threshold [--reads 4096] [--dim 64]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks._common import parse, parser
from benchmarks._results import columns, write_results
from benchmarks._timing import Counter, Schedule, step_runner
from gradtx._autodiff import DENSE_READS_PER_ROW

RATIOS = (0.05, 0.1, 0.25, 0.35, 0.5, 1.0, 2.0, 4.0, 8.0, 64.0, 2048.0)
STEPS = 8  # distinct id batches cycled through


def _step(kind: str):
  tx = gtx.lazy_adam(1e-3)

  def loss(p, ids):
    return jnp.sum(jnp.tanh(p["emb"][ids]) * p["w"])

  opts = (
    {"require_sparse": "['emb']"} if kind == "sparse" else {"dense": "['emb']"}
  )
  vg = gtx.sparse_value_and_grad(loss, **opts)

  def step(p, s, ids):
    value, g = vg(p, ids)
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s, value

  return tx, jax.jit(step, donate_argnums=(0, 1))


def _batch(batches: list, k: int) -> tuple:
  return (batches[k % len(batches)],)


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__, schedule=Schedule())
  p.add_argument("--reads", type=int, default=4096)
  p.add_argument("--dim", type=int, default=64)
  args = parse(p, argv, quick=dict(reads=256, rounds=2, burst=2, settle=1))
  sched = Schedule.from_args(args)
  rng = np.random.RandomState(0)
  rows = []
  for ratio in RATIOS:
    v = max(1, int(round(args.reads / ratio)))
    batches = [
      jnp.asarray(rng.randint(0, v, args.reads), jnp.int32)
      for _ in range(STEPS)
    ]
    fns = {}
    for kind in ("sparse", "dense"):
      tx, step = _step(kind)
      p = {
        "emb": jnp.asarray(rng.normal(size=(v, args.dim)), jnp.float32),
        "w": jnp.ones(args.dim, jnp.float32),
      }
      args_of = functools.partial(_batch, batches)
      run = step_runner(step, [p, tx.init(p)], args_of)
      fns[kind] = Counter(run)
    t = sched.time(fns, label=f"reads / V {ratio:g}")
    picks = "dense" if ratio >= DENSE_READS_PER_ROW else "sparse"
    ms = [f"{t[k] * 1e3:.3f}" for k in ("sparse", "dense")]
    rows.append(
      [f"{v:,}", f"{ratio:g}", *ms, f"{t['sparse'] / t['dense']:.2f}", picks]
    )
  write_results(
    "dense_threshold",
    f"Sparse vs dense gradient, whole lazy_adam step, {args.reads:,} reads "
    f"per step, {args.dim} wide",
    columns(
      "rows V | reads / V | sparse ms | dense ms | sparse / dense | gtx picks"
    ),
    rows,
    notes=sched.describe() + "; both in one process, fresh uniform ids.",
  )


if __name__ == "__main__":
  main()
