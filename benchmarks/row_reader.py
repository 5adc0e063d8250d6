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

import functools
from typing import Any

import jax
import jax.numpy as jnp

import gradtx as gtx
from benchmarks._common import table_variants
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
  readers = {
    "fill gather": _fill_reader,
    "clamp + select (one reader)": _ONE_READER,
  }

  def variants(make):
    def variant(reader):
      tx = make()
      return tx, _step(tx, reader)

    return {k: functools.partial(variant, r) for k, r in readers.items()}

  table_variants(
    __doc__,
    argv,
    "row_reader",
    "One row reader, whole step: {rows:,} x {dim} table, {ids:,} fresh "
    "uniform ids per step",
    ["optimizer", "engine reads", "step ms", "vs fill"],
    {
      "lazy_adam": variants(lambda: gtx.lazy_adam(1e-3)),
      "rowwise_adagrad": variants(lambda: gtx.rowwise_adagrad(1e-2)),
    },
  )


if __name__ == "__main__":
  main()
