"""A/B of gradtx's one row reader on the whole training step.

``gather_rows`` (``gradtx._rowio``) is the one reader of lookup, the row
engine and weight decay. Before it, the row engine read state rows with a
fill-mode gather and lookup with a gather of clamped ids plus a per-row
select. This times the whole lazy_adam / rowwise_adagrad step (forward with
the loss returned, sparse backward, optimizer, apply; jitted and donated;
fresh uniform ids every step) with the engine's reads done each way, side by
side in one process, and reports the ratio.

  python -m benchmarks.row_reader [--rows 1000000] [--dim 64] [--ids 8192]
"""

from __future__ import annotations

from typing import Any

import jax
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
  uniform_batches,
)
from benchmarks._results import write_results
from benchmarks._timing import Schedule
from gradtx import _rowio

_ONE_READER = _rowio.gather_rows


def _fill_reader(table: Any, ids: Any, *, unique: bool = False, what=""):
  """The engine's reader before: a fill-mode gather."""
  del what
  return table.at[ids].get(mode="fill", fill_value=0, unique_indices=unique)


def _step(tx: Any, reader: Any) -> Any:
  def loss(p, ids):
    return jnp.sum(jnp.tanh(p["emb"][ids]) * 0.01)

  def step(p, s, ids):
    _rowio.gather_rows = reader  # read at trace time
    try:
      value, g = gtx.sparse_value_and_grad(loss)(p, ids)
      u, s = tx.update(g, s, p)
      return gtx.apply_updates(p, u), s, value
    finally:
      _rowio.gather_rows = _ONE_READER

  return jax.jit(step, donate_argnums=(0, 1))


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__, schedule=Schedule())
  add_table_args(p)
  args = parse(p, argv, quick=QUICK_TABLE)
  sched = Schedule.from_args(args)
  rng = np.random.RandomState(0)
  batches = uniform_batches(rng, args.rows, args.ids)
  rows = []
  for name, make in (
    ("lazy_adam", lambda: gtx.lazy_adam(1e-3)),
    ("rowwise_adagrad", lambda: gtx.rowwise_adagrad(1e-2)),
  ):
    fns = {}
    for variant, reader in (
      ("fill gather", _fill_reader),
      ("clamp + select (one reader)", _ONE_READER),
    ):
      tx = make()
      table = jnp.asarray(rng.normal(size=(args.rows, args.dim)), jnp.float32)
      fns[variant] = table_runner(_step(tx, reader), tx, table, batches)
    rows += ratio_rows(name, fns, sched)
  write_results(
    "row_reader",
    f"One row reader, whole step: {args.rows:,} x {args.dim} table, "
    f"{args.ids:,} fresh uniform ids per step",
    ["optimizer", "engine reads", "step ms", "vs fill"],
    rows,
    notes=sched.describe() + "; both variants in one process.",
  )


if __name__ == "__main__":
  main()
