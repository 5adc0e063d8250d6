"""Lazy Adam step on an embedding table: gradtx vs optax.adam vs plain jnp.

One optimizer step on a ``[rows, dim]`` table given a row-sparse gradient
of ``ids`` fresh uniform rows (duplicates included), jitted with params and
state donated, three ways (:func:`_variant`): ``gtx.lazy_adam`` on the
SparseRows, ``optax.adam`` on the dense gradient, and a lazy step in plain
``jnp`` (:func:`reference_lazy_step`). Reported: ms/step, the speed-up over
optax.adam, and the ratio to the bandwidth floor (the touched rows of
params, m and v read and written, the gradient rows read, at the warm copy
bandwidth). Round-robin where all fit in ``--mem-gib`` together, else one
after the other; optax.adam skipped where its four tables would not fit.
The whole training step is ``benchmarks/train_step.py``.

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
from benchmarks._common import add_memory_arg, memory_budget, parse, parser
from benchmarks._results import columns, headline, write_results
from benchmarks._timing import time_fn, time_interleaved, warm_copy_bandwidth

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


def _variant(kind, rows, dim):
  """``(jitted donated step, init)`` of one variant: ``gtx`` (lazy_adam on
  a SparseRows gradient), ``optax`` (adam on the dense one) or ``ref``
  (:func:`reference_lazy_step`)."""
  tx = {"gtx": gtx.lazy_adam, "optax": optax.adam}.get(kind)
  tx = tx and tx(LR, B1, B2, EPS)

  def step(params, state, grad):
    if kind == "ref":
      return reference_lazy_step(params, state, grad.indices, grad.values)
    if kind == "optax":
      u, state = tx.update(grad, state, params)
      return optax.apply_updates(params, u), state
    u, state = tx.update({"emb": grad}, state, {"emb": params})
    return gtx.apply_updates({"emb": params}, u)["emb"], state

  def init():
    params = jnp.zeros((rows, dim), jnp.float32)
    if kind == "ref":
      zeros = jnp.zeros((rows, dim), jnp.float32)
      return params, (zeros, jnp.zeros((rows, dim)), jnp.zeros([], jnp.int32))
    return params, tx.init({"emb": params} if kind == "gtx" else params)

  return jax.jit(step, donate_argnums=(0, 1)), init


class _Runner:
  """Holds one variant's params and state; each call is one step."""

  def __init__(self, step, init, grads):
    self.step, self.grads = step, grads
    self.params, self.state = init()
    self.i = 0

  def __call__(self):
    g = self.grads[self.i % len(self.grads)]
    self.i += 1
    self.params, self.state = self.step(self.params, self.state, g)
    jax.block_until_ready(self.params)

  def close(self):
    del self.params, self.state


def _check_same_step(rows, dim, grad):
  """gtx and the jnp reference agree after one step (outside the timing)."""
  outs = []
  for kind in ("gtx", "ref"):
    step, init = _variant(kind, rows, dim)
    p, s = init()
    p, s = step(p, s, grad)
    outs.append(np.asarray(p[: min(rows, 200_000)]))
    del p, s
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-7)


def run(
  rows: int,
  dim: int,
  ids: int,
  mem_bytes: float,
  bandwidth: float,
):
  rng = np.random.RandomState(0)
  grads, uniques = [], []
  for _ in range(ROUNDS + WARMUP):
    idx = rng.randint(0, rows, size=ids)
    uniques.append(len(np.unique(idx)))
    grads.append(
      gtx.SparseRows(
        jnp.asarray(idx, jnp.int32),
        jnp.asarray(rng.normal(size=(ids, dim)), jnp.float32),
        rows,
      )
    )
  table = rows * dim * 4
  _check_same_step(rows, dim, grads[0])
  gc.collect()

  variants = {"gtx": grads, "ref": grads}
  dense_ok = 4 * table <= mem_bytes
  if dense_ok:
    variants["optax"] = dense = [g.to_dense() for g in grads[:1]]
  together = 3 * table * len(variants) + (table if dense_ok else 0)
  interleaved = together <= mem_bytes
  if interleaved:
    runners = {
      k: _Runner(*_variant(k, rows, dim), g) for k, g in variants.items()
    }
    times = time_interleaved(
      runners, warmup=WARMUP, rounds=ROUNDS, label=f"{rows:,} x {dim}"
    )
    for r in runners.values():
      r.close()
    del runners
  else:
    times = {}
    for k, g in variants.items():
      runner = _Runner(*_variant(k, rows, dim), g)
      times[k] = time_fn(
        runner, warmup=WARMUP, repeats=ROUNDS, label=f"{k}, {rows:,} x {dim}"
      )
      runner.close()
      del runner
      gc.collect()
  del grads, variants
  if dense_ok:
    del dense
  gc.collect()

  unique = float(np.mean(uniques))
  # Read + write the touched rows of params, m, v; read the gradient rows.
  floor_bytes = unique * dim * 4 * 6 + ids * (dim + 1) * 4
  floor = floor_bytes / bandwidth
  ms = {k: t * 1e3 for k, t in times.items()}
  speedup = ms["optax"] / ms["gtx"] if "optax" in ms else "-"
  return [f"{rows:,} x {dim}", ids, round(unique), ms["gtx"], ms["ref"]] + [
    ms.get("optax", "skipped (> mem)"),
    speedup,
    ms["ref"] / ms["gtx"],
    floor * 1e3,
    ms["gtx"] / (floor * 1e3),
    "interleaved" if interleaved else "sequential",
  ]


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__, fresh_memory=True)
  p.add_argument("--rows", type=int, nargs="+", default=[10**5, 10**6, 10**7])
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--ids", type=int, default=8192)
  add_memory_arg(p, 8)
  args = parse(p, argv, quick=dict(rows=[20_000, 200_000], ids=1024))
  mem_bytes = memory_budget(args)
  bandwidth = warm_copy_bandwidth()
  rows = []
  for r in args.rows:
    rows.append(run(r, args.dim, args.ids, mem_bytes, bandwidth))
    print(rows[-1], flush=True)
  heads = []
  for r in rows:
    if isinstance(r[6], float):
      metric = f"lazy_adam speed-up vs optax.adam ({r[0]})"
      heads.append(headline(metric, round(r[6], 1), ">= 15x at 1M rows"))
    metric = f"lazy_adam / bandwidth floor ({r[0]})"
    heads.append(headline(metric, round(r[9], 2), "<= 8x"))
  write_results(
    "lazy_adam",
    "Lazy Adam step: gradtx vs optax.adam (dense) vs plain-jnp lazy step",
    columns(
      "table | ids/step | unique rows | gtx ms | jnp ref ms | optax.adam ms "
      "| speed-up vs optax | jnp ref / gtx | floor ms | gtx / floor | timing"
    ),
    rows,
    notes=(
      f"All jitted with params and state donated; median of {ROUNDS} steps"
      ", round-robin when all variants fit in memory together, else one "
      "after the other. Every gtx / jnp-ref step gets a gradient on fresh "
      "uniform ids (pre-generated, none reused). optax.adam gets one dense "
      "[rows, dim] gradient (it touches every row anyway); "
      "it is skipped where params, m, v and the gradient would exceed "
      f"{mem_bytes / 2**30:.0f} GiB. floor = bytes a lazy step must move "
      "(read+write the touched rows of params, m and v, read the gradient) "
      f"/ warm copy bandwidth ({bandwidth / 1e9:.1f} GB/s, a copy into a "
      "pre-faulted buffer, read + write counted). optax.adam runs in this "
      "process, which imported gradtx: its host-memory setting (last "
      "paragraph) applies to it too."
    ),
    extra={"headline": heads, "warm_copy_bandwidth": bandwidth},
  )


if __name__ == "__main__":
  main()
