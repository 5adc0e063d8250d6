"""Is the learning rate's separate pass worth folding into the row rule?

Every gradtx optimizer is ``chain(scale_by_X, scale_by_learning_rate)``:
the rule writes the update rows, the chain multiplies them by ``-lr`` and
``apply_updates`` scatters them. This times the whole step (forward with the
loss returned, sparse backward, optimizer, apply; jitted, donated, fresh
uniform ids) with the chain as it is and with the rule alone (no learning
rate at all: the most folding the rate into the rule could save), side by
side in one process.

  python -m benchmarks.lr_pass [--rows 1000000] [--dim 64] [--ids 8192]
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks._common import (
  QUICK_TABLE,
  add_table_args,
  parse,
  parser,
  ratio_rows,
  table_runner,
  table_step,
  uniform_batches,
)
from benchmarks._results import write_results
from benchmarks._timing import Schedule


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__, schedule=Schedule())
  add_table_args(p)
  args = parse(p, argv, quick=QUICK_TABLE)
  sched = Schedule.from_args(args)
  rng = np.random.RandomState(0)
  batches = uniform_batches(rng, args.rows, args.ids)
  pairs = {
    "lazy_adam": (gtx.lazy_adam(1e-3), gtx.scale_by_lazy_adam()),
    "rowwise_adagrad": (gtx.rowwise_adagrad(1e-2), gtx.scale_by_rowwise_rss()),
    "adagrad": (gtx.adagrad(1e-2), gtx.scale_by_rss()),
  }
  rows = []
  for name, (chain, rule) in pairs.items():
    fns = {}
    for variant, tx in (
      ("chain (rule + lr pass)", chain),
      ("rule alone", rule),
    ):
      table = jnp.asarray(rng.normal(size=(args.rows, args.dim)), jnp.float32)
      fns[variant] = table_runner(table_step(gtx, tx), tx, table, batches)
    rows += ratio_rows(name, fns, sched)
  write_results(
    "lr_pass",
    f"The learning rate's pass, whole step: {args.rows:,} x {args.dim} "
    f"table, {args.ids:,} fresh uniform ids per step",
    ["optimizer", "variant", "step ms", "vs chain"],
    rows,
    notes=sched.describe() + "; both variants in one process.",
  )


if __name__ == "__main__":
  main()
