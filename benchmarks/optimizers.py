"""The whole training step per sparse optimizer: gradtx vs optax vs torch.

For each optimizer, the step users run (forward with the loss returned,
backward, optimizer, apply), on the same model and the same fresh ids, timed
round-robin in one process:

* ``gtx``: ``gtx.sparse_value_and_grad`` of the unmodified loss (a plain
  ``E[ids]`` read; a SparseRows gradient), the gradtx optimizer,
  ``gtx.apply_updates``; jitted, params and state donated.
* ``optax`` (dense equivalent): ``jax.value_and_grad`` (a dense ``[V, D]``
  gradient) + ``optax.adagrad`` / ``optax.sgd`` + ``optax.apply_updates``;
  jitted, donated. optax has no FTRL and no row-wise Adagrad.
* ``torch``: ``nn.Embedding(sparse=True)`` with ``torch.optim.Adagrad``,
  ``torch.optim.SGD`` (sparse gradients: no momentum in torch) or
  ``torch.optim.SparseAdam``, ``torch.set_num_threads(2)``, ``loss.item()``
  returned. Skipped cleanly without torch.
* ``FBGEMM``: TorchRec's fused CPU kernels (``benchmarks.fbgemm_anchor``):
  EXACT_ROWWISE_ADAGRAD, EXACT_ADAGRAD, EXACT_SGD, the optimizer fused in
  the backward. Only where ``fbgemm_gpu`` imports: its wheel needs its own
  torch, so run this module in that environment with gradtx importable
  (``PYTHONPATH=. /tmp/fbvenv/bin/python -m benchmarks.optimizers`` after
  ``pip install jax optax`` there); skipped cleanly otherwise.

The model is ``loss = sum(tanh(E[ids]) * ct)`` on a ``[V, D]`` table; ids are
fresh every step (pre-generated, uniform or Zipf s = 1.05, as in
``benchmarks.train_step``). Every optimizer group is timed against torch
SparseAdam in the same rounds, the anchor of the issue's goal.

  python -m benchmarks.optimizers [--rows 1000000] [--dim 64] [--ids 8192]
      [--rounds 10] [--burst 10] [--settle 3] [--smoke]
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradtx as gtx
from benchmarks._common import (
  QUICK_TABLE,
  add_table_args,
  available,
  fbgemm,
  hlo_table_copies,
  huge_pages,
  import_torch,
  make_ids,
  parse,
  parser,
  torch_huge_pages,
  torch_state,
  version,
)
from benchmarks._results import write_results
from benchmarks._timing import RUN, Counter, Schedule, step_runner
from benchmarks.fbgemm_anchor import tbe_step

LR = 1e-2
MOMENTUM = 0.9


def _loss(rows: jax.Array, ct: jax.Array) -> jax.Array:
  return jnp.sum(jnp.tanh(rows) * ct)


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


def _state_bytes_per_row(state: Any, rows: int) -> float:
  leaves = [x for x in jax.tree.leaves(state) if jnp.ndim(x) >= 1]
  return sum(x.size * x.dtype.itemsize for x in leaves) / rows


def _jax_variant(make_tx, table, ids, ct, dense: bool):
  tx = make_tx()

  def step(params, state, ids_, ct_):
    if dense:
      loss, g = jax.value_and_grad(lambda p: _loss(p["emb"][ids_], ct_))(params)
    else:
      loss, g = gtx.sparse_value_and_grad(lambda p: _loss(p["emb"][ids_], ct_))(
        params
      )
    u, state = tx.update(g, state, params)
    apply = optax.apply_updates if dense else gtx.apply_updates
    return apply(params, u), state, loss

  params = {"emb": jnp.array(table)}
  box = [params, tx.init(params)]
  huge_pages(box)
  per_row = _state_bytes_per_row(box[1], table.shape[0])
  jstep = jax.jit(step, donate_argnums=(0, 1))
  copies = hlo_table_copies(jstep, table.shape, box[0], box[1], ids[0], ct)

  run = step_runner(jstep, box, lambda i: (ids[i % len(ids)], ct))
  return run, box, per_row, copies


def _torch_variant(name, table_np, ids_np, ct_np):
  torch = import_torch()
  emb = torch.nn.Embedding(*table_np.shape, sparse=True)
  with torch.no_grad():
    emb.weight.copy_(torch.from_numpy(table_np))
  opt = {
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=LR),
    "SGD": lambda p: torch.optim.SGD(p, lr=LR),
    "SparseAdam": lambda p: torch.optim.SparseAdam(p, lr=LR),
  }[name](emb.parameters())
  ids = [torch.from_numpy(i.astype(np.int64)) for i in ids_np]
  ct = torch.from_numpy(ct_np)

  def run(i):
    opt.zero_grad(set_to_none=True)
    loss = (torch.tanh(emb(ids[i % len(ids)])) * ct).sum()
    loss.backward()
    opt.step()
    loss.item()

  # state after one step (torch allocates it lazily)
  run(0)
  states = torch_state([opt])
  torch_huge_pages([emb.weight, *states])
  per_row = (
    sum(t.numel() * t.element_size() for t in states if t.dim() >= 1)
    / table_np.shape[0]
  )
  return run, (emb, opt), per_row


def _fbgemm_variant(name, table_np, ids_np, ct_np):
  torch = import_torch()
  optim, pooling = FBGEMM[name]
  ids = [torch.from_numpy(i.astype(np.int64)) for i in ids_np]
  run, per_row, tbe = tbe_step(
    *table_np.shape, optim, pooling, LR, ids, torch.from_numpy(ct_np)
  )
  torch_huge_pages([p for _, p in tbe.named_parameters()])
  return run, tbe, per_row


def run_group(
  opt_name: str,
  rows: int,
  dim: int,
  n: int,
  dist: str,
  sched: Schedule,
  with_torch: bool,
  with_dense: bool,
  with_fbgemm: bool = False,
) -> list[list[Any]]:
  """One optimizer: gtx, its dense optax twin, its torch twin, FBGEMM's
  fused twin and torch SparseAdam, round-robin on the same fresh ids."""
  make_gtx, make_optax, torch_name = OPTIMIZERS[opt_name]
  ids_np = make_ids(rows, n, sched.steps, dist)
  rng = np.random.default_rng(1)
  table = (0.1 * rng.standard_normal((rows, dim))).astype(np.float32)
  ct_np = rng.standard_normal((n, dim)).astype(np.float32)
  ids = [jnp.asarray(i) for i in ids_np]
  ct = jnp.asarray(ct_np)
  fns, keep, per_row, copies = {}, [], {}, {}
  run, box, per_row["gtx"], copies["gtx"] = _jax_variant(
    make_gtx, table, ids, ct, dense=False
  )
  fns["gtx"] = run
  keep.append(box)
  if with_dense and make_optax is not None:
    run, box, per_row["optax (dense)"], copies["optax (dense)"] = _jax_variant(
      make_optax, table, ids, ct, dense=True
    )
    fns["optax (dense)"] = run
    keep.append(box)
  twins = []
  if with_fbgemm and opt_name in FBGEMM:
    label = f"FBGEMM {FBGEMM[opt_name][0]}"
    run, objs, per_row[label] = _fbgemm_variant(opt_name, table, ids_np, ct_np)
    fns[label] = run
    keep.append(objs)
    twins.append(label)
  if with_torch:
    for name in dict.fromkeys([torch_name, "SparseAdam"]):
      if name is None:
        continue
      label = f"torch {name}"
      run, objs, per_row[label] = _torch_variant(name, table, ids_np, ct_np)
      fns[label] = run
      keep.append(objs)
      if name == torch_name:
        twins.insert(0, label)
  runners = {k: Counter(f) for k, f in fns.items()}
  times = sched.time(runners, label=f"{opt_name}, {dist}")
  del keep, runners, fns
  gc.collect()
  ms = {k: t * 1e3 for k, t in times.items()}
  out = []
  anchor = ms.get("torch SparseAdam")
  for k, v in ms.items():
    vs_twins = [f"{ms[t] / v:.2f}x {t}" for t in twins if k == "gtx"]
    out.append(
      [
        dist,
        opt_name,
        k,
        v,
        anchor / v if anchor else "-",
        "; ".join(vs_twins) or "-",
        round(per_row[k], 1),
        copies.get(k, "-"),
      ]
    )
  return out


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__, schedule=Schedule(), huge_pages=True)
  add_table_args(p)
  p.add_argument("--dists", nargs="+", default=["uniform", "zipf"])
  p.add_argument("--only", nargs="+", choices=list(OPTIMIZERS))
  p.add_argument("--no-dense", action="store_true")
  args = parse(p, argv, quick=QUICK_TABLE)
  with_torch = available("torch")
  with_fbgemm = fbgemm()
  sched = Schedule.from_args(args)
  rows = []
  for dist in args.dists:
    for name in args.only or OPTIMIZERS:
      group = run_group(
        name,
        args.rows,
        args.dim,
        args.ids,
        dist,
        sched,
        with_torch,
        not args.no_dense,
        with_fbgemm,
      )
      rows += group
      for r in group:
        print(r, flush=True)
  headline = []
  ms = {(r[0], r[1], r[2]): r[3] for r in rows}
  for r in rows:
    if r[1] == "rowwise_adagrad" and r[2] == "gtx" and r[4] != "-":
      headline.append(
        {
          "metric": f"rowwise_adagrad step vs torch SparseAdam ({r[0]})",
          "value": round(r[4], 2),
          "target": ">= 3.5x",
        }
      )
    fb = ms.get((r[0], r[1], "FBGEMM EXACT_ROWWISE_ADAGRAD"))
    if r[1] == "rowwise_adagrad" and r[2] == "gtx" and fb:
      headline.append(
        {
          "metric": "rowwise_adagrad step vs FBGEMM EXACT_ROWWISE_ADAGRAD "
          f"({r[0]})",
          "value": round(fb / r[3], 2),
          "target": "> 1x",
        }
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
    + (version("torch") if with_torch else "not installed: skipped")
    + "; FBGEMM "
    + (
      f"{version('fbgemm_gpu')} (fused CPU kernels, the optimizer in the "
      "backward; bags of one id)"
      if with_fbgemm
      else "not installed (see benchmarks/fbgemm_anchor.py for its own run)"
    )
    + "."
  )
  write_results(
    "optimizers",
    "Sparse optimizers, whole training step: gradtx vs optax (dense) vs torch",
    [
      "ids",
      "optimizer",
      "system",
      "ms/step",
      "x vs SparseAdam",
      "x vs twin",
      "state bytes/row",
      "copies",
    ],
    rows,
    notes=notes,
    extra={"headline": headline, "smoke": RUN.quick},
  )


if __name__ == "__main__":
  main()
