"""Sparse versus dense gradient of an embedding model.

An embedding-bag model (lookup, mean-pool, dense layer, logistic loss) with a
``[rows, dim]`` table and ``ids`` looked-up ids per step:
``gtx.sparse_value_and_grad`` against ``jax.value_and_grad``, both jitted,
timed round-robin in one process, plus the compiled memory of each.

  python -m benchmarks.sparse_grad [--rows 1000000] [--dim 64] [--ids 8192]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks._common import memory, time_interleaved, write_results


def loss(params, ids, labels):
  pooled = jnp.mean(gtx.lookup(params["emb"], ids), axis=1)
  logits = pooled @ params["w"] + params["b"]
  return jnp.mean(jnp.logaddexp(0.0, -labels * logits))


def run(rows: int, dim: int, ids: int, seq: int = 16) -> list:
  rng = np.random.RandomState(0)
  params = {
    "emb": jnp.asarray(rng.normal(size=(rows, dim)) * 0.01, jnp.float32),
    "w": jnp.asarray(rng.normal(size=(dim,)), jnp.float32),
    "b": jnp.zeros([], jnp.float32),
  }
  batch = ids // seq
  id_arr = jnp.asarray(rng.randint(0, rows, size=(batch, seq)), jnp.int32)
  labels = jnp.asarray(rng.choice([-1.0, 1.0], size=batch), jnp.float32)

  sparse = jax.jit(gtx.sparse_value_and_grad(loss))
  dense = jax.jit(jax.value_and_grad(loss))
  sparse_mem = memory(sparse.lower(params, id_arr, labels).compile())
  dense_mem = memory(dense.lower(params, id_arr, labels).compile())

  # Same value, same gradient (checked once, outside the timing).
  vs, gs = sparse(params, id_arr, labels)
  vd, gd = dense(params, id_arr, labels)
  np.testing.assert_allclose(vs, vd, rtol=1e-5)
  np.testing.assert_allclose(
    gs["emb"].to_dense(), gd["emb"], rtol=1e-4, atol=1e-7
  )
  del gs, gd

  times = time_interleaved(
    {
      "sparse": lambda: jax.block_until_ready(sparse(params, id_arr, labels)),
      "dense": lambda: jax.block_until_ready(dense(params, id_arr, labels)),
    }
  )
  table_mb = rows * dim * 4 / 2**20
  return [
    f"{rows:,} x {dim}",
    ids,
    times["dense"] * 1e3,
    times["sparse"] * 1e3,
    times["dense"] / times["sparse"],
    (dense_mem["temp"] + dense_mem["output"]) / 2**20,
    (sparse_mem["temp"] + sparse_mem["output"]) / 2**20,
    table_mb,
  ]


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000])
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--ids", type=int, default=8192)
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args(argv)
  if args.quick:
    args.rows, args.ids = [50_000], 1024
  rows = [run(r, args.dim, args.ids) for r in args.rows]
  write_results(
    "sparse_grad",
    "Sparse vs dense gradient of an embedding model",
    [
      "table",
      "ids/step",
      "dense ms",
      "sparse ms",
      "speed-up",
      "dense temp+out MiB",
      "sparse temp+out MiB",
      "one table MiB",
    ],
    rows,
    notes=(
      "Both jitted; median of interleaved rounds. temp+out is the compiled "
      "temporary plus output memory (`memory_analysis()`): the dense "
      "gradient needs a whole `[rows, dim]` buffer, the sparse one only "
      "`ids x dim` rows."
    ),
    extra={
      "headline": [
        {
          "metric": f"sparse grad speed-up vs dense ({r[0]})",
          "value": round(r[4], 1),
          "target": ">= 10x",
        }
        for r in rows
      ]
    },
  )


if __name__ == "__main__":
  main()
