"""The whole training step per sparse optimizer: gradtx vs optax vs torch.

The one-table step of each optimizer of :data:`OPTIMIZERS` on fresh ids,
round-robin with its twins (dense optax, torch, FBGEMM's fused CPU kernels
where ``fbgemm_gpu`` imports: ``PYTHONPATH=. /tmp/fbvenv/bin/python -m
benchmarks.optimizers``) and torch SparseAdam, the anchor of every group.

  python -m benchmarks.optimizers [--rows 1000000] [--dim 64] [--ids 8192]
      [--rounds 10] [--burst 10] [--settle 3] [--smoke]
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import optax

import gradtx as gtx
from benchmarks import _common as bench
from benchmarks import optimizer_steps as runner
from benchmarks._timing import RUN, Counter, Schedule
from benchmarks.models import one_table
from benchmarks.optimizer_steps import TABLE, jax_table, torch_table

LR = 1e-2
MOMENTUM = 0.9

# optimizer -> (gtx factory, dense optax factory or None, torch name or None)
OPTIMIZERS: dict[str, tuple[Callable, Callable | None, str | None]] = {
  "adagrad": (lambda: gtx.adagrad(LR), lambda: optax.adagrad(LR), "Adagrad"),
  "rowwise_adagrad": (lambda: gtx.rowwise_adagrad(LR), None, None),
  "lazy_sgd": (lambda: gtx.lazy_sgd(LR), lambda: optax.sgd(LR), "SGD"),
  "lazy_sgd momentum": (
    lambda: gtx.lazy_sgd(LR, MOMENTUM),
    lambda: optax.sgd(LR, MOMENTUM),
    None,
  ),
  "ftrl": (lambda: gtx.ftrl(LR, l1_regularization_strength=1e-4), None, None),
  "lazy_adam": (lambda: gtx.lazy_adam(LR), None, "SparseAdam"),
}
# optimizer -> FBGEMM's matching fused optimizer and pooling mode (bags of
# one id: SUM where NONE is refused on CPU)
FBGEMM = {
  "adagrad": ("EXACT_ADAGRAD", "SUM"),
  "rowwise_adagrad": ("EXACT_ROWWISE_ADAGRAD", "NONE"),
  "lazy_sgd": ("EXACT_SGD", "SUM"),
}


def _fbgemm(name, data):
  torch = bench.import_torch()
  optim, pooling = FBGEMM[name]
  ids = [torch.from_numpy(i.astype("int64")) for i in data.ids_np]
  ct = torch.from_numpy(data.ct_np)
  run_, per_row, tbe = bench.tbe_step(
    *data.table.shape, optim, pooling, LR, ids, ct
  )
  bench.torch_huge_pages([p for _, p in tbe.named_parameters()])
  return runner.System(Counter(run_), tbe, per_row)


def _case(case, ctx):
  """gtx, its dense optax twin, its torch twin, FBGEMM's fused twin and
  torch SparseAdam, round-robin on the same fresh ids."""
  (dist, name), a = case, ctx.args
  make_gtx, make_optax, torch_name = OPTIMIZERS[name]
  data = one_table(a.rows, a.dim, a.ids, dist, ctx.sched.steps)
  s = {"gtx": jax_table(make_gtx(), data)}
  if not a.no_dense and make_optax is not None:
    s["optax (dense)"] = jax_table(make_optax(), data, dense=True)
  twins = []
  if bench.fbgemm() and name in FBGEMM:
    twins.append(f"FBGEMM {FBGEMM[name][0]}")
    s[twins[-1]] = _fbgemm(name, data)
  for opt in dict.fromkeys([torch_name, "SparseAdam"]) if ctx.torch else []:
    if opt is not None:
      s[f"torch {opt}"] = torch_table(opt, data, lr=LR)
      if opt == torch_name:
        twins.insert(0, f"torch {opt}")
  del data
  ms = ctx.time(s, f"{name}, {dist}")
  anchor = ms.get("torch SparseAdam")
  return [
    [dist, name, k, v, anchor / v if anchor else "-"]
    + ["; ".join(f"{ms[t] / v:.2f}x {t}" for t in twins if k == "gtx") or "-"]
    + [round(s[k].per_row, 1), s[k].copies]
    for k, v in ms.items()
  ]


def _finish(rows, ctx):
  ms, fb = {tuple(r[:3]): r[3] for r in rows}, "FBGEMM EXACT_ROWWISE_ADAGRAD"
  mine = [  # the gtx rows of rowwise_adagrad, FBGEMM's ms / gtx's last
    [*r, ms[(*r[:2], fb)] / r[3] if ms.get((*r[:2], fb)) else "-"]
    for r in rows
    if r[1:3] == ["rowwise_adagrad", "gtx"]
  ]
  heads = runner.row_heads(
    mine,
    ("rowwise_adagrad step vs torch SparseAdam ({0})", 4, ">= 3.5x", 2),
    (f"rowwise_adagrad step vs {fb} ({{0}})", 8, "> 1x", 2),
  )
  fbgemm_note = (
    f"{bench.version('fbgemm_gpu')} (fused CPU kernels, the optimizer in "
    "the backward; bags of one id)"
    if bench.fbgemm()
    else "not installed (see benchmarks.probes fbgemm_anchor: its own run)"
  )
  a = ctx.args
  notes = (
    f"{a.rows:,} x {a.dim} float32 table, {a.ids:,} fresh ids a "
    "step, loss sum(tanh(E[ids]) * ct) with a plain E[ids] read; "
    f"{ctx.sched.describe()}, per optimizer group (each group timed with "
    "torch SparseAdam in the same rounds; the schedule of "
    "benchmarks.train_step). 'x vs SparseAdam' and 'x vs twin' are how many"
    " times faster than that step (twins: torch's and FBGEMM's version of "
    "the same optimizer). State bytes/row: the optimizer's per-row state "
    "(torch's after one step). 'copies': table-sized copies in the compiled"
    " JAX step (0 = in place). torch "
    + (bench.version("torch") if ctx.torch else "not installed: skipped")
    + f"; FBGEMM {fbgemm_note}."
  )
  return notes, {"headline": heads, "smoke": RUN.quick}


SCENARIO = runner.Scenario(
  name="optimizers",
  title="Sparse optimizers, whole training step: gradtx vs optax (dense) vs "
  "torch",
  columns="ids | optimizer | system | ms/step | x vs SparseAdam | x vs twin "
  "| state bytes/row | copies",
  doc=__doc__,
  cases=lambda ctx: itertools.product(
    ctx.args.dists, ctx.args.only or OPTIMIZERS
  ),
  case=_case,
  finish=_finish,
  flags={
    **TABLE,
    "--dists": ["uniform", "zipf"],
    "--only": dict(nargs="+", choices=list(OPTIMIZERS)),
    "--no-dense": False,
  },
  quick=bench.QUICK_TABLE,
  options=dict(schedule=Schedule(), huge_pages=True),
  torch=True,
)


main = SCENARIO.main

if __name__ == "__main__":
  main()
