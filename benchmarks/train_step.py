"""The whole training step: gradtx lazy_adam vs torch SparseAdam vs optax.adam.

Forward (loss returned), backward, optimizer and apply on one table
(``models.one_table``: fresh uniform or Zipf ids every step), each system
side by side in one process, beside the optimizer alone and the bandwidth
floor of a lazy step.

  python -m benchmarks.train_step [--rows 100000 1000000 4000000] [--dim 64]
      [--ids 8192] [--rounds 10] [--burst 10] [--settle 3] [--mem-gib 10]
      [--smoke]
"""

from __future__ import annotations

import itertools

import numpy as np
import optax

import gradtx as gtx
from benchmarks import models
from benchmarks import optimizer_steps as runner
from benchmarks._results import headline, oversubscribed
from benchmarks._timing import Counter, Schedule, step_runner
from benchmarks.optimizer_steps import jax_table, torch_table

LR = 1e-3


def _opt_only(tx, data, box):
  """``tx``'s update and apply alone on the step's ids, on the gtx step's
  buffers ``box``."""
  rows, dim = data.table.shape
  vals = np.random.default_rng(2).standard_normal((len(data.ct), dim))
  grads = [
    {"emb": gtx.SparseRows(i, vals.astype(np.float32), rows)} for i in data.ids
  ]
  args_of = lambda i: (grads[i % len(grads)],)  # noqa: E731
  return runner.System(
    Counter(step_runner(runner.update_step(tx), box, args_of), 0)
  )


def _case(case, ctx):
  rows, dist, loss = case
  dim, n, linear = ctx.args.dim, ctx.args.ids, loss == "linear"
  loss = "linear" if linear else "tanh"
  data = models.one_table(rows, dim, n, dist, ctx.sched.steps)
  s = {}
  for name, catch_up in (("gtx", False), ("gtx catch_up", True)):
    tx = gtx.lazy_adam(LR, catch_up=catch_up)
    s[name] = jax_table(tx, data, 0, linear=linear, lookup=True)
    if not catch_up:
      s["gtx opt only"] = _opt_only(tx, data, s[name].keep)
  used = 6 * rows * dim * 4
  if ctx.torch:
    s["torch"] = torch_table("SparseAdam", data, 0, linear=linear, lr=LR)
    used += 3 * rows * dim * 4
  if used + 4 * rows * dim * 4 <= ctx.mem:
    s["optax"] = jax_table(optax.adam(LR), data, 0, linear=linear, dense=True)
  unique = data.unique()
  del data
  ms = ctx.time(s, f"{rows:,} x {dim}, {dist}, {loss}")
  floor = runner.floor_ms(unique, dim, n, ctx.bandwidth)
  g, opt = ms["gtx"], ms["gtx opt only"]
  t, o = ms.get("torch", "-"), ms.get("optax", "-")
  return [
    [f"{rows:,} x {dim}", dist, loss, n, round(unique), g, ms["gtx catch_up"]]
    + [t, o, t / g if t != "-" else "-", o / g if o != "-" else "-"]
    + [opt, floor, opt / floor, g / floor]
    + [f"{s['gtx'].copies}/{s['gtx catch_up'].copies}"]
    + [s["optax"].copies if "optax" in s else "-"]
  ]


def _finish(rows, ctx):
  caution = oversubscribed(
    "so every figure is inflated (compare with a quiet run) and torch's "
    "worker threads suffer more from it than XLA's: the torch / gtx ratio "
    "here overstates the quiet-machine ratio."
  )
  metric = "train step speed-up vs torch SparseAdam ({0}, {1}, {2})"
  heads = runner.row_heads(rows, (metric, 9, ">= 2x at 1M x 64, uniform", 2))
  worst = round(max(r[13] for r in rows), 2)
  heads.append(
    headline("optimizer part / bandwidth floor (worst)", worst, "<= 8x")
  )
  notes = (
    f"Forward (loss returned) + backward + optimizer + apply, "
    f"{ctx.args.ids:,} fresh ids every step (pre-generated), "
    f"{ctx.sched.describe()} (machine noise hits all "
    "alike; consecutive steps are a training loop's steady state: torch's "
    "OpenMP workers, spinning after torch's step, slow the next system's "
    "first steps). gtx and optax jitted with params "
    "and state donated; torch `nn.Embedding(sparse=True)` + `SparseAdam`, "
    "2 threads. `gtx opt only` = `lazy_adam.update` + `apply_updates` on a"
    " SparseRows of the same fresh ids. floor = (read + write the touched "
    "rows of params, m, v; read the gradient rows) / warm copy bandwidth "
    f"({ctx.bandwidth / 1e9:.1f} GB/s, `np.copyto` into a pre-faulted "
    "buffer, read + write counted). Table copies = `copy` instructions "
    f"producing a table-shaped value in the compiled step.{caution}"
  )
  return notes, {"headline": heads, "warm_copy_bandwidth": ctx.bandwidth}


SCENARIO = runner.Scenario(
  name="train_step",
  title="Whole training step: gradtx lazy_adam vs torch SparseAdam vs "
  "optax.adam",
  columns="table | ids | loss | ids/step | unique rows | gtx ms | gtx "
  "catch_up ms | torch SparseAdam ms | optax.adam ms | torch / gtx | optax "
  "/ gtx | gtx opt only ms | floor ms | opt only / floor | step / floor | "
  "gtx table copies (lazy/catch_up) | optax table copies",
  doc=__doc__,
  cases=lambda ctx: itertools.product(
    ctx.args.rows, ctx.args.dists, ctx.args.losses
  ),
  case=_case,
  finish=_finish,
  flags={
    **{"--rows": [100_000, 10**6, 4 * 10**6], "--dim": 64, "--ids": 8192},
    "--dists": ["uniform", "zipf"],
    "--losses": ["linear", "tanh"],
    "--no-torch": False,
  },
  quick=dict(rows=[5_000], ids=256, rounds=3),
  options=dict(schedule=Schedule(), huge_pages=True),
  mem_gib=10,
  floor=True,
  torch=True,
)


main = SCENARIO.main

if __name__ == "__main__":
  main()
