"""Lazy Adam step on an embedding table: gradtx vs optax.adam vs plain jnp.

One jitted, donated step on a ``[rows, dim]`` table given a row-sparse
gradient of ``ids`` fresh rows: ``gtx.lazy_adam``, ``optax.adam`` on the
dense gradient and :func:`reference_lazy_step`, beside the bandwidth floor.

  python -m benchmarks.lazy_adam [--rows 100000 1000000 10000000]
      [--dim 64] [--ids 8192] [--mem-gib 8] [--quick]
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradtx as gtx
from benchmarks import optimizer_steps as runner
from benchmarks._timing import Counter, step_runner

LR, B1, B2, EPS = 1e-3, 0.9, 0.999, 1e-8
ROUNDS = 15
WARMUP = 2


def reference_lazy_step(params, state, indices, values):
  """Lazy Adam in plain jnp: no gradtx, no scatter/gather hints."""
  m, v, count = state
  rows = params.shape[0]
  n = indices.shape[0]
  uniq, inverse = jnp.unique(
    indices, size=n, fill_value=rows, return_inverse=True
  )
  g = jax.ops.segment_sum(values, inverse.reshape(-1), num_segments=n)
  count = count + 1
  m_rows = B1 * m[uniq] + (1 - B1) * g
  v_rows = B2 * v[uniq] + (1 - B2) * g * g
  m_hat = m_rows / (1 - B1**count)
  v_hat = v_rows / (1 - B2**count)
  u = -LR * m_hat / (jnp.sqrt(v_hat) + EPS)
  params = params.at[uniq].add(u, mode="drop")
  m = m.at[uniq].set(m_rows, mode="drop")
  v = v.at[uniq].set(v_rows, mode="drop")
  return params, (m, v, count)


def _ref_step(params, state, grad):
  return reference_lazy_step(params, state, grad.indices, grad.values)


def _system(kind, rows, dim, grads) -> runner.System:
  """``gtx``, ``optax`` or ``ref`` on its own zero table, a step on the
  next of ``grads``."""
  params = jnp.zeros((rows, dim), jnp.float32)
  if kind == "ref":
    zeros = jnp.zeros((rows, dim), jnp.float32)
    state = (zeros, jnp.zeros((rows, dim)), jnp.zeros([], jnp.int32))
    step = jax.jit(_ref_step, donate_argnums=(0, 1))
  elif kind == "optax":
    tx = optax.adam(LR, B1, B2, EPS)
    state, step = tx.init(params), runner.update_step(tx, optax.apply_updates)
  else:
    tx = gtx.lazy_adam(LR, B1, B2, EPS)
    params, grads = {"emb": params}, [{"emb": g} for g in grads]
    state, step = tx.init(params), runner.update_step(tx)
  box = [params, state]
  args_of = lambda i: (grads[i % len(grads)],)  # noqa: E731
  return runner.System(Counter(step_runner(step, box, args_of), 0), box)


def _check_same_step(rows, dim, grad):
  """gtx and the jnp reference agree after one step (outside the timing)."""
  outs = []
  for kind in ("gtx", "ref"):
    system = _system(kind, rows, dim, [grad])
    system.run()
    p = jax.tree.leaves(system.keep[0])[0]
    outs.append(np.asarray(p[: min(rows, 200_000)]))
    del system, p
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-7)


def _case(rows, ctx):
  dim, ids, mem = ctx.args.dim, ctx.args.ids, ctx.mem
  rng = np.random.RandomState(0)
  grads, uniques = [], []
  for _ in range(ROUNDS + WARMUP):
    idx = rng.randint(0, rows, size=ids)
    uniques.append(len(np.unique(idx)))
    vals = jnp.asarray(rng.normal(size=(ids, dim)), jnp.float32)
    grads.append(gtx.SparseRows(jnp.asarray(idx, jnp.int32), vals, rows))
  table = rows * dim * 4
  _check_same_step(rows, dim, grads[0])
  gc.collect()
  variants = {"gtx": grads, "ref": grads}
  dense_ok = 4 * table <= mem
  if dense_ok:
    variants["optax"] = [g.to_dense() for g in grads[:1]]
  together = 3 * table * len(variants) + (table if dense_ok else 0)
  label = f"{rows:,} x {dim}"
  if together <= mem:
    systems = {k: _system(k, rows, dim, g) for k, g in variants.items()}
    ms = ctx.time(systems, label, warmup=WARMUP, rounds=ROUNDS)
    del systems
  else:
    ms = {}
    for k, g in variants.items():
      name = f"{k}, {label}"
      system = {name: _system(k, rows, dim, g)}
      ms[k] = ctx.time(system, name, rounds=ROUNDS)[name]
      del system
  del grads, variants
  unique = float(np.mean(uniques))
  floor = runner.floor_ms(unique, dim, ids, ctx.bandwidth)
  speedup = ms["optax"] / ms["gtx"] if "optax" in ms else "-"
  return [
    [label, ids, round(unique), ms["gtx"], ms["ref"]]
    + [ms.get("optax", "skipped (> mem)"), speedup, ms["ref"] / ms["gtx"]]
    + [floor, ms["gtx"] / floor]
    + ["interleaved" if together <= mem else "sequential"]
  ]


def _finish(rows, ctx):
  heads = runner.row_heads(
    rows,
    ("lazy_adam speed-up vs optax.adam ({0})", 6, ">= 15x at 1M rows", 1),
    ("lazy_adam / bandwidth floor ({0})", 9, "<= 8x", 2),
  )
  notes = (
    f"All jitted with params and state donated; median of {ROUNDS} steps"
    ", round-robin when all variants fit in memory together, else one "
    "after the other. Every gtx / jnp-ref step gets a gradient on fresh "
    "uniform ids (pre-generated, none reused). optax.adam gets one dense "
    "[rows, dim] gradient (it touches every row anyway); "
    "it is skipped where params, m, v and the gradient would exceed "
    f"{ctx.mem / 2**30:.0f} GiB. floor = bytes a lazy step must move "
    "(read+write the touched rows of params, m and v, read the gradient) "
    f"/ warm copy bandwidth ({ctx.bandwidth / 1e9:.1f} GB/s, a copy into a "
    "pre-faulted buffer, read + write counted). optax.adam runs in this "
    "process, which imported gradtx: its host-memory setting (last "
    "paragraph) applies to it too."
  )
  return notes, {"headline": heads, "warm_copy_bandwidth": ctx.bandwidth}


SCENARIO = runner.Scenario(
  name="lazy_adam",
  title="Lazy Adam step: gradtx vs optax.adam (dense) vs plain-jnp lazy step",
  columns="table | ids/step | unique rows | gtx ms | jnp ref ms | optax.adam "
  "ms | speed-up vs optax | jnp ref / gtx | floor ms | gtx / floor | timing",
  doc=__doc__,
  cases=lambda ctx: ctx.args.rows,
  case=_case,
  finish=_finish,
  flags={"--rows": [10**5, 10**6, 10**7], "--dim": 64, "--ids": 8192},
  quick=dict(rows=[20_000, 200_000], ids=1024),
  options=dict(fresh_memory=True),
  mem_gib=8,
  floor=True,
)


main = SCENARIO.main

if __name__ == "__main__":
  main()
