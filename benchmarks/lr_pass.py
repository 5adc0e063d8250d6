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

import gradtx as gtx
from benchmarks._common import table_step, table_variants


def main(argv: list[str] | None = None) -> None:
  pairs = {
    "lazy_adam": (gtx.lazy_adam(1e-3), gtx.scale_by_lazy_adam()),
    "rowwise_adagrad": (gtx.rowwise_adagrad(1e-2), gtx.scale_by_rowwise_rss()),
    "adagrad": (gtx.adagrad(1e-2), gtx.scale_by_rss()),
  }
  table_variants(
    __doc__,
    argv,
    "lr_pass",
    "The learning rate's pass, whole step: {rows:,} x {dim} table, {ids:,} "
    "fresh uniform ids per step",
    ["optimizer", "variant", "step ms", "vs chain"],
    {
      name: {
        "chain (rule + lr pass)": lambda c=chain: (c, table_step(gtx, c)),
        "rule alone": lambda r=rule: (r, table_step(gtx, r)),
      }
      for name, (chain, rule) in pairs.items()
    },
  )


if __name__ == "__main__":
  main()
