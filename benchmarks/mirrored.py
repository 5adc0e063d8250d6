"""Mirrored step overhead and the bytes of the cross-replica reduction.

On 8 fake CPU devices (``XLA_FLAGS`` set before JAX is imported: run it as
its own process): ``Mirrored.step`` (``all_reduce`` + SGD on sparse
gradients, donated) against the same step written with ``jax.shard_map``,
timed round-robin; and the bytes of the table gradient's reduction, sparse
all-gather against dense all-reduce, from shapes and from the compiled HLO.

  python -m benchmarks.mirrored [--rows 1000000] [--dim 64] [--ids 8192]
"""

from __future__ import annotations

from benchmarks._common import fake_cpu_devices

REPLICAS = 8
fake_cpu_devices(REPLICAS)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gradtx as gtx  # noqa: E402
from benchmarks._common import hlo_collectives, memory, parse, parser  # noqa: E402
from benchmarks._results import columns, headline, write_results  # noqa: E402
from benchmarks._timing import time_interleaved  # noqa: E402
from benchmarks.sharded import data, loss_fn, make_step  # noqa: E402

LR = 0.01
SEQ = 16  # ids per example
KINDS = ("all-gather", "all-reduce")


def run(rows: int, dim: int, ids: int, rounds: int) -> tuple[list, dict]:
  m = gtx.Mirrored()
  r, axis = m.num_replicas, m.axis_name
  host_params, (batch,) = data(rows, dim, r * (ids // SEQ), SEQ, 1)
  batch = m.shard_batch(batch)
  tx = optax.chain(gtx.all_reduce(axis), gtx.scale_by_learning_rate(LR))
  # The loss per replica, so that both steps do the same work.
  mirrored = m.step(make_step(tx), donate_argnums=(0, 1), per_replica_outputs=2)
  opt_state = tx.init(host_params)  # stateless: no leaves

  def hand_body(params, batch):  # the same step, written by hand
    loss, g = gtx.sparse_value_and_grad(loss_fn)(params, batch)
    emb = g["emb"]
    idx = lax.all_gather(emb.indices, axis, tiled=True)
    vals = lax.all_gather(emb.values / r, axis, tiled=True)
    w = lax.pmean(g["w"], axis)
    table = (
      params["emb"]
      .at[jnp.where(idx < rows, idx, rows)]
      .add(-LR * vals, mode="drop")
    )
    return {"emb": table, "w": params["w"] - LR * w}, loss[None]

  specs = dict(in_specs=(P(), P(axis)), out_specs=(P(), P(axis)))
  hand = jax.jit(
    jax.shard_map(hand_body, mesh=m.mesh, check_vma=False, **specs),
    donate_argnums=0,
  )

  # Same result, checked once. Each step donates its params, so each gets
  # its own replicated copy (replicas x the table), placed one at a time.
  def host(tree):
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)

  p1, _, loss1 = mirrored(m.replicate(host_params), opt_state, batch)
  want, want_loss = host(p1), np.asarray(loss1)
  del p1
  params, loss2 = hand(m.replicate(host_params), batch)
  del host_params
  np.testing.assert_allclose(np.asarray(loss2), want_loss, rtol=1e-6)
  for a, b in zip(*map(jax.tree.leaves, (host(params), want)), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  del want

  # Both steps consume and return the same donated params in turn.
  box = {"p": params}
  del params

  def call_mirrored():
    box["p"], _, loss = mirrored(box["p"], opt_state, batch)
    jax.block_until_ready((box["p"], loss))

  def call_hand():
    box["p"], loss = hand(box["p"], batch)
    jax.block_until_ready((box["p"], loss))

  times = time_interleaved(
    {"mirrored": call_mirrored, "hand": call_hand}, rounds=rounds, label="step"
  )

  def dense_step(params, opt_state, batch):  # a dense [rows, dim] gradient
    updates, opt_state = tx.update(
      jax.grad(loss_fn)(params, batch), opt_state, params
    )
    return gtx.apply_updates(params, updates), opt_state

  compiled = {  # the dense step compiled, not run
    "sparse": mirrored.lower(box["p"], opt_state, batch).compile(),
    "dense": m.step(dense_step, donate_argnums=(0, 1))
    .lower(box["p"], opt_state, batch)
    .compile(),
  }
  # The table gradient's bytes from the shapes (int32 ids and float32 rows
  # gathered, or the float32 table all-reduced), checked against the HLO's
  # (all-gather, all-reduce); the dense leaf w is all-reduced in both steps.
  w = dim * 4
  shapes = {"sparse": r * ids * (dim + 1) * 4, "dense": rows * dim * 4}
  want = {"sparse": (shapes["sparse"], w), "dense": (0, shapes["dense"] + w)}
  hlo = {k: hlo_collectives(c.as_text(), KINDS) for k, c in compiled.items()}
  got = {
    k: tuple(sum(b for op, b in ops if op == kind) for kind in KINDS)
    for k, ops in hlo.items()
  }
  if got != want:
    raise AssertionError(f"HLO collectives {hlo} move {got}, not {want}")
  # Ring algorithms: an all-gather brings in (r-1)/r of the result, an
  # all-reduce moves 2 (r-1)/r of the buffer (reduce-scatter + all-gather).
  ring = {
    "sparse": shapes["sparse"] * (r - 1) / r,
    "dense": shapes["dense"] * 2 * (r - 1) / r,
  }
  row = [f"{rows:,} x {dim}", ids, r, times["hand"] * 1e3]
  row += [times["mirrored"] * 1e3, times["mirrored"] / times["hand"]]
  row += [shapes["sparse"] / 2**20, got["sparse"][0] / 2**20]
  row += [shapes["dense"] / 2**20, (got["dense"][1] - w) / 2**20]
  row += [ring["dense"] / ring["sparse"]]
  extra = {
    "headline": [
      headline(
        f"Mirrored.step / hand jit+shard_map time ({row[0]})",
        round(row[5], 3),
        "<= 1.05",
      ),
      headline(
        f"dense all-reduce / sparse all-gather bytes ({row[0]})",
        round(row[10], 1),
        "",
      ),
    ],
    "hlo_collectives": {k: [list(x) for x in v] for k, v in hlo.items()},
    "ring_bytes_per_device": ring,
    "mirrored_step_memory": memory(compiled["sparse"]),
  }
  return row, extra


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__, rounds=15)
  p.add_argument("--rows", type=int, default=1_000_000)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--ids", type=int, default=8192, help="per replica")
  args = parse(p, argv, quick=dict(rows=20_000, ids=1024, rounds=5))
  if jax.device_count() != REPLICAS:
    raise SystemExit(
      f"benchmarks.mirrored needs {REPLICAS} devices; JAX was imported with "
      f"{jax.device_count()}. Run it as its own process: "
      "python -m benchmarks.mirrored"
    )
  row, extra = run(args.rows, args.dim, args.ids, args.rounds)
  write_results(
    "mirrored",
    "Mirrored step: overhead and cross-replica reduction bytes",
    columns(
      "table | ids / replica | replicas | hand jit+shard_map ms | "
      "Mirrored.step ms | Mirrored / hand | sparse all-gather MiB (shapes) | "
      "(HLO) | dense all-reduce MiB (shapes) | (HLO) | dense / sparse ring "
      "bytes"
    ),
    [row],
    notes=(
      "Both steps: gtx.sparse_value_and_grad, all-gather of the table's "
      "SparseRows gradient and pmean of the dense leaf, SGD, params donated "
      "(updated in place); timed round-robin, median. MiB: result size of "
      "the table gradient's collective, from shapes and as parsed from the "
      "compiled HLO (all-gather / all-reduce ops). Ring bytes: what each "
      "device receives with ring algorithms, (r-1)/r of the all-gather "
      "result versus 2(r-1)/r of the all-reduced buffer. The dense step is "
      "compiled, not run."
    ),
    extra=extra,
  )


if __name__ == "__main__":
  main()
