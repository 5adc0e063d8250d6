"""A row read alone: what the backend's gather costs against numpy's take.

Every sparse step reads rows three ways: the forward's lookup, the
optimizer's state rows and, on some paths, the parameter rows. On CPU the
single-table step is a few of these reads and in-place writes, so their
cost bounds the step. This times, for a ``--rows`` x D float32 table and
``--ids`` fresh uniform ids a call, side by side in one process:

- ``gtx.lookup`` jitted, its rows returned (the read alone);
- ``gtx.lookup`` jitted inside a loss (rows times a cotangent, summed), as
  the forward of ``benchmarks/train_step.py`` reads them;
- numpy's ``np.take`` into a buffer written once before (one thread);
- the random-rows floor: the rows' bytes, read and written, at the warm
  copy bandwidth (``shared/ANCHORS.md``).

Writes ``benchmarks/results/row_gather.{md,json}``.

  python -m benchmarks.row_gather [--rows 1000000] [--ids 8192]
      [--dims 16 32 64 128]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks._common import parse, parser
from benchmarks._results import write_results
from benchmarks._timing import Counter, Schedule, warm_copy_bandwidth


def systems(table_np: np.ndarray, ids_np: list[np.ndarray]) -> dict:
  """name -> a call that reads the next batch of ids."""
  table = jax.device_put(table_np)
  ids = [jax.device_put(i) for i in ids_np]
  ct = jax.device_put(np.ones((len(ids_np[0]), table_np.shape[1]), np.float32))
  read = jax.jit(gtx.lookup)
  loss = jax.jit(lambda t, i: jnp.sum(gtx.lookup(t, i) * ct))
  out = np.empty((len(ids_np[0]), table_np.shape[1]), table_np.dtype)
  np.take(table_np, ids_np[0], axis=0, out=out)  # fault the pages in

  def cycle(call):
    return Counter(lambda k: call(k % len(ids)), 0)

  return {
    "gtx.lookup": cycle(lambda k: read(table, ids[k]).block_until_ready()),
    "gtx.lookup in a loss": cycle(
      lambda k: loss(table, ids[k]).block_until_ready()
    ),
    "numpy take": cycle(
      lambda k: np.take(table_np, ids_np[k], axis=0, out=out)
    ),
  }


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__, schedule=Schedule(rounds=10, burst=10, settle=2))
  p.add_argument("--rows", type=int, default=1_000_000)
  p.add_argument("--ids", type=int, default=8192)
  p.add_argument("--dims", type=int, nargs="+", default=[16, 32, 64, 128])
  args = parse(p, argv, quick=dict(rows=5_000, ids=256, dims=[16], rounds=2))
  sched = Schedule.from_args(args)
  bandwidth = warm_copy_bandwidth()
  rng = np.random.default_rng(0)
  ids_np = [
    rng.integers(0, args.rows, args.ids).astype(np.int32) for _ in range(16)
  ]
  rows = []
  for dim in args.dims:
    table_np = rng.standard_normal((args.rows, dim)).astype(np.float32)
    fns = systems(table_np, ids_np)
    t = sched.time(fns, label=f"dim {dim}")
    floor = 2 * args.ids * dim * 4 / bandwidth
    numpy_ms = t["numpy take"] * 1e3
    for name, sec in t.items():
      rows.append(
        [
          dim,
          name,
          f"{sec * 1e3:.3f}",
          f"{sec * 1e3 / numpy_ms:.2f}x",
          f"{sec / floor:.2f}x",
        ]
      )
    del table_np, fns
  write_results(
    "row_gather",
    f"A row read alone: {args.rows:,} rows x D float32, {args.ids:,} fresh "
    "uniform ids a call",
    ["D", "read", "ms", "vs numpy take", "vs floor"],
    rows,
    notes=(
      f"{sched.describe().replace('steps', 'calls')}; all in one process. "
      "floor: the rows' bytes read and written at the warm copy bandwidth "
      f"({bandwidth / 1e9:.1f} GB/s). numpy take: one thread, into a "
      "buffer written once before. `gtx.lookup in a loss`: "
      "`jnp.sum(gtx.lookup(t, ids) * ct)` jitted, the forward of the "
      "single-table step."
    ),
  )


if __name__ == "__main__":
  main()
