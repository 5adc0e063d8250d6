"""Sparse versus dense gradient of unmodified embedding models.

Part 1, step time: an embedding-bag model (read, mean-pool, dense layer,
logistic loss) on a ``[rows, dim]`` table with ``ids`` fresh ids per step,
its table read three ways -- ``gtx.lookup``, plain ``table[ids]`` and a Flax
``nn.Embed`` layer -- each differentiated by ``gtx.sparse_value_and_grad``,
against ``jax.value_and_grad`` (dense) of ``table[ids]`` and of ``nn.Embed``.
All jitted, timed round-robin in one process; the compiled memory of each.

Part 2, trace + compile time of ``gtx.sparse_value_and_grad`` against
``jax.value_and_grad`` on a Flax model of 24 unrolled residual MLP blocks
over an ``nn.Embed`` table (the jaxpr analysis is a trace-time cost).

  python -m benchmarks.sparse_grad [--rows 1000000] [--dim 64] [--ids 8192]
      [--blocks 24] [--smoke]
"""

from __future__ import annotations

import statistics

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks._common import compile_phases, memory
from benchmarks._results import columns, headline, markdown_table
from benchmarks._timing import Counter
from benchmarks.optimizer_steps import TABLE, Scenario, System, run

SEQ = 16  # ids per example
POOL = 16  # distinct id batches, cycled: fresh ids every step


def bag_loss(read):
  """The embedding-bag loss with the table read by ``read(table, ids)``."""

  def loss(params, ids, labels):
    pooled = jnp.mean(read(params["emb"], ids), axis=1)
    logits = pooled @ params["w"] + params["b"]
    return jnp.mean(jnp.logaddexp(0.0, -labels * logits))

  return loss


def _embed(table, ids):
  layer = nn.Embed(table.shape[0], table.shape[1])
  return layer.apply({"params": {"embedding": table}}, ids)


READS = {
  "gtx.lookup": gtx.lookup,
  "table[ids]": lambda t, i: t[i],
  "nn.Embed": _embed,
}


def _case(_, ctx):
  """The gradient of each read, sparse and dense (no dense gtx.lookup),
  checked against the dense ``table[ids]`` once, outside the timing."""
  rows, dim, ids = ctx.args.rows, ctx.args.dim, ctx.args.ids
  rng = np.random.RandomState(0)
  params = {
    "emb": jnp.asarray(rng.normal(size=(rows, dim)) * 0.01, jnp.float32),
    "w": jnp.asarray(rng.normal(size=(dim,)), jnp.float32),
    "b": jnp.zeros([], jnp.float32),
  }
  batch = ids // SEQ
  pool = [
    (
      jnp.asarray(rng.randint(0, rows, size=(batch, SEQ)), jnp.int32),
      jnp.asarray(rng.choice([-1.0, 1.0], size=batch), jnp.float32),
    )
    for _ in range(POOL)
  ]

  fns = {}
  for name, read in READS.items():
    fns[f"sparse {name}"] = jax.jit(gtx.sparse_value_and_grad(bag_loss(read)))
    if name != "gtx.lookup":
      fns[f"dense {name}"] = jax.jit(jax.value_and_grad(bag_loss(read)))
  mem = {k: memory(f.lower(params, *pool[0]).compile()) for k, f in fns.items()}

  ref_v, ref_g = fns["dense table[ids]"](params, *pool[0])
  for k, f in fns.items():
    v, g = f(params, *pool[0])
    emb = g["emb"].to_dense() if k.startswith("sparse") else g["emb"]
    np.testing.assert_allclose(v, ref_v, rtol=1e-5, err_msg=k)
    np.testing.assert_allclose(emb, ref_g["emb"], rtol=1e-4, atol=1e-7)
    assert isinstance(g["emb"], gtx.SparseRows) == k.startswith("sparse"), k
  del ref_g, g, emb

  def caller(f):
    return Counter(lambda k: jax.block_until_ready(f(params, *pool[k % POOL])))

  ms = ctx.time({k: System(caller(f)) for k, f in fns.items()}, "step")
  out = []
  for name in READS:
    sparse_ms = ms[f"sparse {name}"]
    dense_key = f"dense {name}" if name != "gtx.lookup" else "dense table[ids]"
    dense_ms = ms[dense_key]
    s_mem, d_mem = mem[f"sparse {name}"], mem[dense_key]
    out.append(
      [f"{rows:,} x {dim}", name, ids, dense_ms, sparse_ms]
      + [dense_ms / sparse_ms, sparse_ms / ms["sparse gtx.lookup"]]
      + [(m["temp"] + m["output"]) / 2**20 for m in (d_mem, s_mem)]
      + [rows * dim * 4 / 2**20]
    )
  return out


class Deep(nn.Module):
  """``nn.Embed`` then ``blocks`` unrolled pre-norm residual MLP blocks."""

  rows: int
  dim: int
  blocks: int

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(self.rows, self.dim)(ids).mean(axis=1)
    for _ in range(self.blocks):
      h = nn.LayerNorm()(x)
      x = x + nn.Dense(self.dim)(nn.gelu(nn.Dense(2 * self.dim)(h)))
    return nn.Dense(1)(x)[:, 0]


def compile_times(blocks: int, repeats: int) -> list:
  rows, dim, batch = 10_000, 64, 32
  model = Deep(rows, dim, blocks)
  rng = np.random.RandomState(1)
  ids = jnp.asarray(rng.randint(0, rows, size=(batch, SEQ)), jnp.int32)
  labels = jnp.asarray(rng.choice([-1.0, 1.0], size=batch), jnp.float32)
  params = jax.jit(model.init)(jax.random.key(0), ids)

  def loss(params, ids, labels):
    logits = model.apply(params, ids)
    return jnp.mean(jnp.logaddexp(0.0, -labels * logits))

  grads = {
    "jax.value_and_grad": jax.value_and_grad,
    "gtx.sparse_value_and_grad": gtx.sparse_value_and_grad,
  }
  samples = {k: ([], []) for k in grads}
  for _ in range(repeats):
    for k, grad in grads.items():
      f = jax.jit(grad(loss))  # a new function: nothing cached
      r = compile_phases(f, params, ids, labels)
      samples[k][0].append(r["trace_s"] + r["lower_s"])
      samples[k][1].append(r["compile_s"])
  med = {
    k: (statistics.median(a), statistics.median(b))
    for k, (a, b) in samples.items()
  }
  base = sum(med["jax.value_and_grad"])
  return [
    [k, blocks, trace, comp, trace + comp, (trace + comp) / base]
    for k, (trace, comp) in med.items()
  ]


def _finish(rows, ctx):
  args = ctx.args
  comp = compile_times(args.blocks, args.repeats)
  comp_headers = columns(
    "gradient | blocks | trace+lower s | compile s | total s | vs jax"
  )
  notes = (
    "Each row: the same embedding-bag loss with its table read as named, "
    "fresh ids every step (a pool of "
    f"{POOL} batches, cycled). dense ms: `jax.value_and_grad` of that loss "
    "(`table[ids]` for the gtx.lookup row); sparse ms: "
    "`gtx.sparse_value_and_grad` of it, unmodified. vs lookup: sparse ms "
    "over the `gtx.lookup` row's (1.0 = the same cost). Both jitted; "
    "median of interleaved rounds. temp+out is the compiled temporary plus "
    "output memory (`memory_analysis()`). The dense gradient runs in this "
    "process, which imported gradtx: its host-memory setting (last "
    "paragraph) applies to the dense step too.\n\n"
    f"Trace + compile time, {args.blocks} unrolled residual MLP blocks over "
    f"an `nn.Embed` table (median of {args.repeats}; a new jitted function "
    "each time):\n\n" + markdown_table(comp_headers, comp)
  )
  if args.note:
    notes += f"\n\n{args.note}"
  heads = [
    headline(
      f"sparse grad speed-up vs dense, {r[1]} ({r[0]})",
      round(r[5], 1),
      ">= 40x",
    )
    for r in rows
  ]
  heads += [
    headline(
      f"{r[1]} step time vs the gtx.lookup path",
      round(r[6], 2),
      "1.0 within noise",
    )
    for r in rows
    if r[1] != "gtx.lookup"
  ]
  heads.append(
    headline(
      f"trace+compile vs jax.value_and_grad ({args.blocks} blocks)",
      round(comp[-1][5], 2),
      "<= 1.5x",
    )
  )
  return notes, {
    "compile": {"headers": comp_headers, "rows": comp},
    "headline": heads,
  }


SCENARIO = Scenario(
  name="sparse_grad",
  title="Sparse vs dense gradient of unmodified embedding models",
  columns="table | read | ids/step | dense ms | sparse ms | speed-up | vs "
  "lookup | dense temp+out MiB | sparse temp+out MiB | one table MiB",
  doc=__doc__,
  cases=lambda ctx: [None],
  case=_case,
  finish=_finish,
  flags={
    **TABLE,
    "--blocks": 24,
    "--repeats": 3,
    "--note": dict(default="", help="a sentence on the machine's state"),
  },
  quick=dict(rows=20_000, ids=512, rounds=3, blocks=4, repeats=1),
  options=dict(rounds=15, fresh_memory=True),
)


def main(argv: list[str] | None = None) -> None:
  run(SCENARIO, argv)


if __name__ == "__main__":
  main()
