"""Low-precision tables and 8-bit optimizer state: the whole step's time.

Each variant of :data:`VARIANTS` (a table dtype, lazy Adam's moment
dtypes, stochastic rounding or not: from float32 at 768 B/row to bf16
stochastic + int8 m/v at 264 B/row, D = 64) runs the one-table step
(``models.one_table_step``, read by ``gtx.lookup``; on huge pages) on fresh
ids, uniform and Zipf, side by side in one process with torch's float32
``SparseAdam`` (2 threads). The floor: each touched row's param and state
read and written once, at the bandwidth of a copy into a touched buffer.

  python -m benchmarks.low_precision [--rows 1000000] [--dim 64] [--ids 8192]
"""

from __future__ import annotations

import gc

import jax.numpy as jnp

import gradtx as gtx
from benchmarks import _common as bench
from benchmarks._results import write_results
from benchmarks._timing import Counter, Schedule, warm_copy_bandwidth
from benchmarks.models import one_table, one_table_step
from benchmarks.twins import torch_table

LR = 1e-3
INT8 = dict(mu_dtype="int8", nu_dtype="int8")
F32 = dict(mu_dtype=jnp.float32, nu_dtype=jnp.float32)
# name -> (table dtype, lazy_adam's state dtypes, stochastic rounding)
VARIANTS = {
  "float32": (jnp.float32, {}, False),
  "bf16 nearest": (jnp.bfloat16, F32, False),
  "bf16 stochastic": (jnp.bfloat16, F32, True),
  "int8 m/v": (jnp.float32, INT8, False),
  "bf16 stochastic + int8 m/v": (jnp.bfloat16, INT8, True),
}


def run_config(args, dist, sched, bandwidth, torch):
  data = one_table(args.rows, args.dim, args.ids, dist, sched.steps)
  fns, keep, per_row = {}, [], {}
  for name, (dtype, kw, sr) in VARIANTS.items():
    tx = gtx.lazy_adam(LR, **kw)
    run, box, _ = one_table_step(
      tx, data, lookup=True, dtype=dtype, stochastic=sr
    )
    gtx.use_huge_pages(box)
    fns[name] = Counter(run, 0)
    per_row[name] = gtx.bytes_per_row(tx, box[0])["['emb']"]
    keep.append(box)
  if torch:
    run, box, _ = torch_table("SparseAdam", data, lr=LR)
    fns["torch SparseAdam"] = Counter(run)
    per_row["torch SparseAdam"] = 3 * args.dim * 4
    keep.append(box)
  gc.collect()
  times = sched.time(fns, label=dist)
  unique, base = data.unique(), times["float32"]
  del keep, fns, data
  gc.collect()
  return [
    [
      dist,
      name,
      f"{per_row[name]:.0f}",
      f"{t * 1e3:.2f}",
      f"{t / base:.3f}",
      f"{unique * per_row[name] * 2 / bandwidth * 1e3:.2f}",
    ]
    for name, t in times.items()
  ]


def main(argv: list[str] | None = None) -> None:
  p = bench.parser(__doc__.split("\n\n")[0], schedule=Schedule())
  bench.add_table_args(p)
  p.add_argument("--no-torch", action="store_true")
  args = bench.parse(p, argv, quick=bench.QUICK_TABLE)
  sched = Schedule.from_args(args)
  bandwidth = warm_copy_bandwidth()
  torch = not args.no_torch and bench.available("torch")
  rows = []
  for dist in ("uniform", "zipf"):
    rows += run_config(args, dist, sched, bandwidth, torch)
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
