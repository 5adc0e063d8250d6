"""Sparse versus dense gradient of unmodified embedding models: the step
of an embedding-bag model with its table read three ways, and a deep Flax
model's trace + compile time, by ``gtx.sparse_value_and_grad`` and by
``jax.value_and_grad``.

  python -m benchmarks.sparse_grad [--rows 1000000] [--dim 64] [--ids 8192]
      [--blocks 24] [--smoke]
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks._common import compile_phases, memory
from benchmarks._results import columns, headline, markdown_table
from benchmarks._timing import Counter
from benchmarks.optimizer_steps import TABLE, Scenario, System, row_heads

SEQ = 16  # ids per example
POOL = 16  # distinct id batches, cycled: fresh ids every step


def _logistic(logits, labels):
  return jnp.mean(jnp.logaddexp(0.0, -labels * logits))


def _batch(rng, rows: int, batch: int) -> tuple:
  """``batch`` examples of ``SEQ`` ids and their labels."""
  ids = jnp.asarray(rng.randint(0, rows, size=(batch, SEQ)), jnp.int32)
  return ids, jnp.asarray(rng.choice([-1.0, 1.0], size=batch), jnp.float32)


def bag_loss(read):
  """The embedding-bag loss with the table read by ``read(table, ids)``."""

  def loss(params, ids, labels):
    pooled = jnp.mean(read(params["emb"], ids), axis=1)
    return _logistic(pooled @ params["w"] + params["b"], labels)

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
  """Each read's gradient, sparse and dense (no dense gtx.lookup), checked
  against the dense ``table[ids]``'s outside the timing."""
  rows, dim, ids = ctx.args.rows, ctx.args.dim, ctx.args.ids
  rng = np.random.RandomState(0)
  params = {
    "emb": jnp.asarray(rng.normal(size=(rows, dim)) * 0.01, jnp.float32),
    "w": jnp.asarray(rng.normal(size=(dim,)), jnp.float32),
    "b": jnp.zeros([], jnp.float32),
  }
  pool = [_batch(rng, rows, ids // SEQ) for _ in range(POOL)]
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
    dense = f"dense {name}" if name != "gtx.lookup" else "dense table[ids]"
    d, sp = ms[dense], ms[f"sparse {name}"]
    mib = [mem[k]["temp"] + mem[k]["output"] for k in (dense, f"sparse {name}")]
    out.append(
      [f"{rows:,} x {dim}", name, ids, d, sp, d / sp]
      + [sp / ms["sparse gtx.lookup"], *(m / 2**20 for m in mib)]
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
  ids, labels = _batch(rng, rows, batch)
  params = jax.jit(model.init)(jax.random.key(0), ids)

  def loss(params, ids, labels):
    return _logistic(model.apply(params, ids), labels)

  grads = {
    "jax.value_and_grad": jax.value_and_grad,
    "gtx.sparse_value_and_grad": gtx.sparse_value_and_grad,
  }
  samples = {k: [] for k in grads}
  for _ in range(repeats):
    for k, grad in grads.items():
      f = jax.jit(grad(loss))  # a new function: nothing cached
      r = compile_phases(f, params, ids, labels)
      samples[k].append((r["trace_s"] + r["lower_s"], r["compile_s"]))
  med = {k: np.median(v, axis=0).tolist() for k, v in samples.items()}
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
  heads = row_heads(
    rows, ("sparse grad speed-up vs dense, {1} ({0})", 5, ">= 40x", 1)
  ) + row_heads(
    [r for r in rows if r[1] != "gtx.lookup"],
    ("{1} step time vs the gtx.lookup path", 6, "1.0 within noise", 2),
  )
  metric = f"trace+compile vs jax.value_and_grad ({args.blocks} blocks)"
  heads.append(headline(metric, round(comp[-1][5], 2), "<= 1.5x"))
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


main = SCENARIO.main

if __name__ == "__main__":
  main()
