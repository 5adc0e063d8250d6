"""The whole training step per sparse optimizer: gradtx vs optax vs torch.

For each optimizer of :data:`OPTIMIZERS`, the one-table step users run
(``models.one_table_step``: forward with ``sum(tanh(E[ids]) * ct)``
returned, a plain ``E[ids]`` read, backward, optimizer, apply; jitted,
donated) on fresh ids (uniform or Zipf), round-robin in one process with
its twins: the dense optax optimizer on ``jax.value_and_grad`` (optax has
no FTRL and no row-wise Adagrad), torch's ``nn.Embedding(sparse=True)``
with ``Adagrad``, ``SGD`` (no momentum for sparse gradients) or
``SparseAdam`` (2 threads), FBGEMM's fused CPU kernels (:data:`FBGEMM`;
only where ``fbgemm_gpu`` imports: run this module in that environment
with gradtx importable, ``PYTHONPATH=. /tmp/fbvenv/bin/python -m
benchmarks.optimizers``), and torch SparseAdam, the anchor, in every
group's rounds.

  python -m benchmarks.optimizers [--rows 1000000] [--dim 64] [--ids 8192]
      [--rounds 10] [--burst 10] [--settle 3] [--smoke]
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import gradtx as gtx
from benchmarks import _common as bench
from benchmarks._results import columns, headline, write_results
from benchmarks._timing import RUN, Counter, Schedule
from benchmarks.models import one_table, one_table_step
from benchmarks.twins import torch_table

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


def _jax(make_tx, data, dense: bool):
  """``(run, buffers, state bytes per row, table copies)``."""
  run, box, copies = one_table_step(make_tx(), data, dense=dense)
  leaves = [x for x in jax.tree.leaves(box[1]) if jnp.ndim(x) >= 1]
  per_row = sum(x.size * x.dtype.itemsize for x in leaves)
  return Counter(run), box, per_row / data.table.shape[0], copies


def _fbgemm(name, data):
  torch = bench.import_torch()
  optim, pooling = FBGEMM[name]
  ids = [torch.from_numpy(i.astype("int64")) for i in data.ids_np]
  ct = torch.from_numpy(data.ct_np)
  run, per_row, tbe = bench.tbe_step(
    *data.table.shape, optim, pooling, LR, ids, ct
  )
  bench.torch_huge_pages([p for _, p in tbe.named_parameters()])
  return Counter(run), tbe, per_row, "-"


def run_group(opt_name, args, dist, sched, torch, fbgemm) -> list[list[Any]]:
  """One optimizer: gtx, its dense optax twin, its torch twin, FBGEMM's
  fused twin and torch SparseAdam, round-robin on the same fresh ids."""
  make_gtx, make_optax, torch_name = OPTIMIZERS[opt_name]
  data = one_table(args.rows, args.dim, args.ids, dist, sched.steps)
  systems = {"gtx": _jax(make_gtx, data, dense=False)}
  if not args.no_dense and make_optax is not None:
    systems["optax (dense)"] = _jax(make_optax, data, dense=True)
  twins = []
  if fbgemm and opt_name in FBGEMM:
    twins.append(f"FBGEMM {FBGEMM[opt_name][0]}")
    systems[twins[-1]] = _fbgemm(opt_name, data)
  for name in dict.fromkeys([torch_name, "SparseAdam"]) if torch else []:
    if name is not None:
      run, objs, per_row = torch_table(name, data, lr=LR)
      systems[f"torch {name}"] = Counter(run), objs, per_row, "-"
      if name == torch_name:
        twins.insert(0, f"torch {name}")
  times = sched.time(
    {k: v[0] for k, v in systems.items()}, label=f"{opt_name}, {dist}"
  )
  ms = {k: t * 1e3 for k, t in times.items()}
  anchor = ms.get("torch SparseAdam")
  out = []
  for k, v in ms.items():
    vs_twins = [f"{ms[t] / v:.2f}x {t}" for t in twins if k == "gtx"]
    _, _, per_row, copies = systems[k]
    out.append(
      [
        dist,
        opt_name,
        k,
        v,
        anchor / v if anchor else "-",
        "; ".join(vs_twins) or "-",
        round(per_row, 1),
        copies,
      ]
    )
  del systems, data
  gc.collect()
  return out


def main(argv: list[str] | None = None) -> None:
  p = bench.parser(__doc__, schedule=Schedule(), huge_pages=True)
  bench.add_table_args(p)
  p.add_argument("--dists", nargs="+", default=["uniform", "zipf"])
  p.add_argument("--only", nargs="+", choices=list(OPTIMIZERS))
  p.add_argument("--no-dense", action="store_true")
  args = bench.parse(p, argv, quick=bench.QUICK_TABLE)
  torch, fbgemm = bench.available("torch"), bench.fbgemm()
  sched = Schedule.from_args(args)
  rows = []
  for dist in args.dists:
    for name in args.only or OPTIMIZERS:
      rows += run_group(name, args, dist, sched, torch, fbgemm)
      print(*rows[-1], flush=True)
  heads = []
  ms = {(r[0], r[1], r[2]): r[3] for r in rows}
  for r in rows:
    if r[1] != "rowwise_adagrad" or r[2] != "gtx":
      continue
    if r[4] != "-":
      metric = f"rowwise_adagrad step vs torch SparseAdam ({r[0]})"
      heads.append(headline(metric, round(r[4], 2), ">= 3.5x"))
    fb = ms.get((r[0], r[1], "FBGEMM EXACT_ROWWISE_ADAGRAD"))
    if fb:
      metric = f"rowwise_adagrad step vs FBGEMM EXACT_ROWWISE_ADAGRAD ({r[0]})"
      heads.append(headline(metric, round(fb / r[3], 2), "> 1x"))
  fbgemm_note = (
    f"{bench.version('fbgemm_gpu')} (fused CPU kernels, the optimizer in "
    "the backward; bags of one id)"
    if fbgemm
    else "not installed (see benchmarks/fbgemm_anchor.py for its own run)"
  )
  notes = (
    f"{args.rows:,} x {args.dim} float32 table, {args.ids:,} fresh ids a "
    "step, loss sum(tanh(E[ids]) * ct) with a plain E[ids] read; "
    f"{sched.describe()}, per optimizer group (each group timed with torch "
    "SparseAdam in the same rounds; the schedule of benchmarks.train_step). "
    "'x vs SparseAdam' and 'x vs twin' are how many times faster than that "
    "step (twins: torch's and FBGEMM's version of the same optimizer). "
    "State bytes/row: the optimizer's per-row state (torch's after one "
    "step). 'copies': table-sized copies in the compiled JAX step (0 = in "
    "place). torch "
    + (bench.version("torch") if torch else "not installed: skipped")
    + f"; FBGEMM {fbgemm_note}."
  )
  write_results(
    "optimizers",
    "Sparse optimizers, whole training step: gradtx vs optax (dense) vs torch",
    columns(
      "ids | optimizer | system | ms/step | x vs SparseAdam | x vs twin | "
      "state bytes/row | copies"
    ),
    rows,
    notes=notes,
    extra={"headline": heads, "smoke": RUN.quick},
  )


if __name__ == "__main__":
  main()
