"""Lanes of a table stack: the Criteo step (26 one-hot features, a linear
head, loss returned, params and state donated, fresh ids every step) with
the tables one leaf each, one stack (``lanes=1``, the default) and
``gtx.TableStack(..., lanes=L)``, side by side in one process, on the
default path (no opt-in call, the OS's pages).

Writes ``benchmarks/results/stack_lanes.{md,json}``.

  python -m benchmarks.stack_lanes [--lanes 1 2 4] [--rounds 8]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks import models
from benchmarks._common import parse, parser
from benchmarks._results import write_results
from benchmarks._timing import Schedule


def lane_loss(specs, names, dim, lanes, batch):
  # made as the recommenders guide makes a stack, with the batch size
  stack = gtx.TableStack(specs, batch_size=batch, lanes=lanes)

  def loss(p, ids, y):
    x = stack.lookup(p["emb"], ids, output="concat")
    return models.bce(
      models.logit(p["head"], x.reshape(x.shape[0], len(names), dim)), y
    )

  return stack, loss


def main(argv: list[str] | None = None) -> None:
  ap = parser(__doc__, schedule=Schedule(8, 3, 1), steps=8)
  ap.add_argument("--cap", type=int, default=100_000)
  ap.add_argument("--dim", type=int, default=64)
  ap.add_argument("--batch", type=int, default=2048)
  ap.add_argument("--lanes", type=int, nargs="+", default=[1, 2, 4])
  ap.add_argument("--dists", nargs="+", default=["uniform", "zipf"])
  ap.add_argument(
    "--optimizers",
    nargs="+",
    default=["lazy_adam", "rowwise_adagrad"],
    choices=models.STACK_OPTIMIZERS,
  )
  quick = dict(cap=5000, batch=256, rounds=2, steps=4)
  args = parse(ap, argv, quick=quick)
  sched = Schedule.from_args(args)
  crows = [min(c, args.cap) for c in models.CRITEO_KAGGLE]
  rng = np.random.default_rng(models.SEED + 2)
  tables_np = [
    (0.05 * rng.standard_normal((r, args.dim))).astype(np.float32)
    for r in crows
  ]
  rows = []
  for dist in args.dists:
    batches, labels = models.criteo_data(crows, args.batch, args.steps, dist)
    _, names, per_table_loss, _ = models.criteo_models(crows, args.dim)
    specs = {
      n: gtx.TableSpec(r, args.dim) for n, r in zip(names, crows, strict=True)
    }
    per_table_np = dict(zip(names, tables_np, strict=True))
    for opt in args.optimizers:
      make = models.STACK_OPTIMIZERS[opt][0]
      hp = models.head_params(
        len(names),
        args.dim,
        "linear",
        models.HIDDEN,
        np.random.default_rng(models.SEED + 4),
      )

      def head(hp=hp):  # each system its own (its step donates them)
        return jax.tree.map(jnp.asarray, hp)

      per = {n: jnp.asarray(t) for n, t in per_table_np.items()}
      tx = make()
      fns = {
        "per-table": models.loop_runner(
          models.whole_step(per_table_loss, tx),
          {**per, "head": head()},
          tx,
          batches,
          labels,
        )
      }
      for lanes in args.lanes:
        stack, loss = lane_loss(specs, names, args.dim, lanes, args.batch)
        params = {"emb": stack.stack(per_table_np), "head": head()}
        tx = make()
        fns[f"lanes={lanes}"] = models.loop_runner(
          models.whole_step(loss, tx), params, tx, batches, labels
        )
      t = sched.time(fns, label=f"{dist}, {opt}")
      base = t["lanes=1"]
      rows.append(
        [dist, opt, f"{t['per-table'] * 1e3:.2f}"]
        + [f"{t[f'lanes={k}'] * 1e3:.2f}" for k in args.lanes]
        + [f"{base / t[f'lanes={k}']:.2f}x" for k in args.lanes if k != 1]
        + [f"{t['per-table'] / t[f'lanes={k}']:.2f}x" for k in args.lanes]
      )
      print(rows[-1], flush=True)
  others = [k for k in args.lanes if k != 1]
  write_results(
    "stack_lanes",
    "Lanes of a table stack: the Criteo whole step (ms, median)",
    ["ids", "optimizer", "per-table ms"]
    + [f"lanes={k} ms" for k in args.lanes]
    + [f"lanes={k} / lanes=1 speed" for k in others]
    + [f"lanes={k} / per-table speed" for k in args.lanes],
    rows,
    notes=(
      f"Criteo's 26 cardinalities capped at {args.cap:,}, {args.dim} wide, "
      f"batch {args.batch}, a linear head; the stacks made with "
      "`batch_size` as the recommenders guide makes them (tables read 4 "
      f"times a row or more in a dense stack); {sched.describe()}. Default "
      "path: no opt-in call (host memory reused as gradtx sets it at "
      "import), the OS's pages."
    ),
  )


if __name__ == "__main__":
  main()
