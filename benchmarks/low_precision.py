"""Low-precision tables and 8-bit optimizer state: the whole step's time.

Each variant runs the step users run on one ``[V, D]`` table (forward with
the loss returned, sparse backward, lazy Adam, apply; jitted, params and
state donated, on huge pages), with fresh ids every step (uniform and Zipf),
side by side in one process:

* ``float32``: float32 table, float32 moments (768 B/row at D = 64);
* ``bf16 nearest``: bfloat16 table, float32 moments (``mu_dtype`` and
  ``nu_dtype``: by default the moments take the table's dtype), rounded to
  nearest;
* ``bf16 stochastic``: the same with ``gtx.apply_updates(..., key=)``;
* ``int8 m/v``: float32 table, 8-bit moments (``mu_dtype="int8"``,
  ``nu_dtype="int8"``);
* ``bf16 stochastic + int8 m/v``: both (264 B/row at D = 64);
* ``torch SparseAdam``: float32, the competitor (``torch.set_num_threads(2)``).

The bandwidth floor is the bytes a variant must move per step (each touched
row's param and state read and written once) over the measured bandwidth of
a copy into an already-touched buffer.

  python -m benchmarks.low_precision [--rows 1000000] [--dim 64] [--ids 8192]
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks._common import (
  QUICK_TABLE,
  add_table_args,
  available,
  make_ids,
  parse,
  parser,
)
from benchmarks._results import write_results
from benchmarks._timing import (
  Counter,
  Schedule,
  step_runner,
  warm_copy_bandwidth,
)
from benchmarks.twins import torch_sparse_adam

LR = 1e-3
INT8 = dict(mu_dtype="int8", nu_dtype="int8")
F32 = dict(mu_dtype=jnp.float32, nu_dtype=jnp.float32)
VARIANTS = {
  "float32": (jnp.float32, {}, False),
  "bf16 nearest": (jnp.bfloat16, F32, False),
  "bf16 stochastic": (jnp.bfloat16, F32, True),
  "int8 m/v": (jnp.float32, INT8, False),
  "bf16 stochastic + int8 m/v": (jnp.bfloat16, INT8, True),
}


def _variant(table_np, ids, ct, dtype, state_kw, stochastic):
  tx = gtx.lazy_adam(LR, **state_kw)

  def loss_fn(params, ids_, ct_):
    rows = gtx.lookup(params["emb"], ids_).astype(jnp.float32)
    return jnp.sum(jnp.tanh(rows) * ct_)

  def step(params, state, ids_, ct_, key):
    loss, g = gtx.sparse_value_and_grad(loss_fn)(params, ids_, ct_)
    u, state = tx.update(g, state, params)
    key = key if stochastic else None
    return gtx.apply_updates(params, u, key=key), state, loss

  params = {"emb": jnp.asarray(table_np, dtype)}
  box = [params, tx.init(params)]
  gtx.use_huge_pages(box)
  jstep = jax.jit(step, donate_argnums=(0, 1))
  key = jax.random.key(0)
  per_row = gtx.bytes_per_row(tx, params)["['emb']"]

  run = step_runner(
    jstep, box, lambda i: (ids[i % len(ids)], ct, jax.random.fold_in(key, i))
  )
  return run, box, per_row


def run_config(rows, dim, n, dist, sched, bandwidth, with_torch):
  ids_np = make_ids(rows, n, sched.steps, dist)
  rng = np.random.default_rng(1)
  table_np = (0.1 * rng.standard_normal((rows, dim))).astype(np.float32)
  ct_np = rng.standard_normal((n, dim)).astype(np.float32)
  ids = [jnp.asarray(i) for i in ids_np]
  ct = jnp.asarray(ct_np)
  fns, keep, per_row = {}, [], {}
  for name, (dtype, kw, sr) in VARIANTS.items():
    run, box, per_row[name] = _variant(table_np, ids, ct, dtype, kw, sr)
    fns[name] = Counter(run, 0)
    keep.append(box)
  if with_torch:
    run, box = torch_sparse_adam(table_np, ids_np, ct_np, False)
    fns["torch SparseAdam"] = Counter(run, 0)
    per_row["torch SparseAdam"] = 3 * dim * 4
    keep.append(box)
  del table_np
  gc.collect()
  times = sched.time(fns, label=dist)
  unique = float(np.mean([len(np.unique(i)) for i in ids_np]))
  out = []
  base = times["float32"]
  for name, t in times.items():
    floor_ms = unique * per_row[name] * 2 / bandwidth * 1e3
    out.append(
      [
        dist,
        name,
        f"{per_row[name]:.0f}",
        f"{t * 1e3:.2f}",
        f"{t / base:.3f}",
        f"{floor_ms:.2f}",
      ]
    )
  del keep, fns
  gc.collect()
  return out


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__.split("\n\n")[0], schedule=Schedule())
  add_table_args(p)
  p.add_argument("--no-torch", action="store_true")
  args = parse(p, argv, quick=QUICK_TABLE)
  sched = Schedule.from_args(args)
  bandwidth = warm_copy_bandwidth()
  with_torch = not args.no_torch and available("torch")
  rows = []
  for dist in ("uniform", "zipf"):
    rows += run_config(
      args.rows, args.dim, args.ids, dist, sched, bandwidth, with_torch
    )
  write_results(
    "low_precision",
    f"Low precision, whole lazy-Adam step: {args.rows:,} x {args.dim} "
    f"table, {args.ids:,} fresh ids per step",
    ["ids", "variant", "B/row", "step ms", "vs float32", "floor ms"],
    rows,
    notes=(
      sched.describe()
      + f"; all variants in one process; floor: touched rows x B/row, read "
      f"and written, at {bandwidth / 1e9:.1f} GB/s (copy into a touched "
      "buffer)."
    ),
  )


if __name__ == "__main__":
  main()
