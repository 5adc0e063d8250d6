"""The whole training step: gradtx lazy_adam vs torch SparseAdam vs optax.adam.

What users run, side by side in one process on the same table and ids
(``models.one_table``: fresh ids every step, uniform or Zipf s = 1.05):
forward with the loss returned (``sum(E[ids] * ct)``, linear in the table,
or ``sum(tanh(E[ids]) * ct)``), backward, optimizer, apply. ``gtx`` and
``gtx catch_up``: ``gtx.lazy_adam`` on ``gtx.sparse_value_and_grad``;
``gtx opt only``: its ``update`` + ``apply_updates`` alone on pre-built
gradients of the same ids, same buffers; ``torch``:
``nn.Embedding(sparse=True)`` + ``SparseAdam``, 2 threads; ``optax``:
``optax.adam`` on ``jax.value_and_grad``, skipped where its four tables
would not fit in ``--mem-gib`` beside the others. The floor: the bytes a
lazy step must move (the touched rows of params, m and v read and
written, the gradient rows read) at the bandwidth of a copy into a
pre-faulted buffer.

  python -m benchmarks.train_step [--rows 100000 1000000 4000000] [--dim 64]
      [--ids 8192] [--rounds 10] [--burst 10] [--settle 3] [--mem-gib 10]
      [--smoke] [--profile]
"""

from __future__ import annotations

import gc

import jax
import numpy as np
import optax

import gradtx as gtx
from benchmarks import models, twins
from benchmarks._common import (
  add_memory_arg,
  available,
  memory_budget,
  parse,
  parser,
)
from benchmarks._results import columns, headline, oversubscribed, write_results
from benchmarks._timing import (
  Counter,
  Schedule,
  step_runner,
  warm_copy_bandwidth,
)

LR = 1e-3


def _gtx(data, linear, catch_up):
  """The whole gtx step and its optimizer part alone (``update`` +
  ``apply_updates`` on pre-built gradients of the step's ids), on the same
  donated buffers."""
  tx = gtx.lazy_adam(LR, catch_up=catch_up)
  run, box, copies = models.one_table_step(tx, data, linear=linear, lookup=True)
  rows, dim = data.table.shape
  vals = np.random.default_rng(2).standard_normal((len(data.ct), dim))
  grads = [gtx.SparseRows(i, vals.astype(np.float32), rows) for i in data.ids]

  def opt_step(params, state, g):
    u, state = tx.update({"emb": g}, state, params)
    return gtx.apply_updates(params, u), state

  jopt = jax.jit(opt_step, donate_argnums=(0, 1))
  run_opt = step_runner(jopt, box, lambda i: (grads[i % len(grads)],))
  return run, run_opt, copies, box


def run_config(rows, dim, n, dist, linear, sched, mem, bandwidth, torch):
  data = models.one_table(rows, dim, n, dist, sched.steps)
  fns, keep, copies = {}, [], {}
  fns["gtx"], fns["gtx opt only"], copies["gtx"], b = _gtx(data, linear, False)
  fns["gtx catch_up"], _, copies["gtx catch_up"], b2 = _gtx(data, linear, True)
  keep += [b, b2]
  used = 6 * rows * dim * 4
  if torch:
    fns["torch"], b, _ = twins.torch_table(
      "SparseAdam", data, linear=linear, lr=LR
    )
    keep.append(b)
    used += 3 * rows * dim * 4
  if used + 4 * rows * dim * 4 <= mem:
    tx = optax.adam(LR)
    fns["optax"], b, copies["optax"] = models.one_table_step(
      tx, data, linear=linear, dense=True
    )
    keep.append(b)
  gc.collect()
  times = sched.time(
    {k: Counter(f, 0) for k, f in fns.items()},
    label=f"{rows:,} x {dim}, {dist}, {'linear' if linear else 'tanh'}",
  )
  unique = data.unique()
  floor_bytes = unique * dim * 4 * 6 + n * (dim + 1) * 4
  del keep, fns, data
  gc.collect()
  return {
    "ms": {k: t * 1e3 for k, t in times.items()},
    "unique": unique,
    "floor_ms": floor_bytes / bandwidth * 1e3,
    "copies": copies,
  }


def _row(rows, dim, n, dist, linear, res):
  ms, floor, copies = res["ms"], res["floor_ms"], res["copies"]
  g, t, o = ms["gtx"], ms.get("torch", "-"), ms.get("optax", "-")
  return [
    f"{rows:,} x {dim}",
    dist,
    "linear" if linear else "tanh",
    n,
    round(res["unique"]),
    g,
    ms["gtx catch_up"],
    t,
    o,
    t / g if t != "-" else "-",
    o / g if o != "-" else "-",
    ms["gtx opt only"],
    floor,
    ms["gtx opt only"] / floor,
    g / floor,
    f"{copies['gtx']}/{copies['gtx catch_up']}",
    copies.get("optax", "-"),
  ]


def profile(rows: int, dim: int, n: int, linear: bool, steps: int = 20):
  """Per-thunk time of the compiled gtx step (XLA:CPU runs one thunk per
  fusion, sort, scatter...): ``[(ms per step, calls per step, name)]``,
  from a ``jax.profiler`` trace of ``steps`` steps on fresh ids."""
  import collections
  import gzip
  import json
  import tempfile
  from pathlib import Path

  data = models.one_table(rows, dim, n, "uniform", steps + 2)
  run, _, _ = models.one_table_step(gtx.lazy_adam(LR), data, linear=linear)
  run(0)
  run(1)
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for i in range(2, steps + 2):
        run(i)
    events = json.load(gzip.open(next(Path(d).rglob("*.trace.json.gz"))))
  events = events["traceEvents"] if isinstance(events, dict) else events
  total = collections.defaultdict(list)
  for e in events:
    name = e.get("name", "")
    # Python frames and runtime wrappers are not thunks of the step.
    if name.startswith("$") or "::" in name or "Pjit" in name:
      continue
    if e.get("ph") == "X" and "dur" in e:
      total[name].append(e["dur"])
  return sorted(
    ((sum(v) / steps / 1e3, len(v) / steps, k) for k, v in total.items()),
    reverse=True,
  )


HEADERS = columns(
  "table | ids | loss | ids/step | unique rows | gtx ms | gtx catch_up ms | "
  "torch SparseAdam ms | optax.adam ms | torch / gtx | optax / gtx | "
  "gtx opt only ms | floor ms | opt only / floor | step / floor | "
  "gtx table copies (lazy/catch_up) | optax table copies"
)


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__, schedule=Schedule(), huge_pages=True)
  p.add_argument(
    "--rows", type=int, nargs="+", default=[100_000, 10**6, 4 * 10**6]
  )
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--ids", type=int, default=8192)
  p.add_argument("--dists", nargs="+", default=["uniform", "zipf"])
  p.add_argument("--losses", nargs="+", default=["linear", "tanh"])
  add_memory_arg(p, 10)
  p.add_argument("--no-torch", action="store_true")
  p.add_argument(
    "--profile",
    action="store_true",
    help="print the per-thunk time of the gtx step (first --rows, uniform "
    "ids, each --losses) instead of the comparison",
  )
  args = parse(p, argv, quick=dict(rows=[5_000], ids=256, rounds=3))
  if args.profile:
    for loss in args.losses:
      print(f"\n{args.rows[0]:,} x {args.dim}, {args.ids} ids, {loss} loss")
      for ms, calls, name in profile(
        args.rows[0], args.dim, args.ids, loss == "linear"
      )[:30]:
        print(f"{ms:9.3f} ms/step  x{calls:5.1f}  {name[:70]}")
    return
  torch = not args.no_torch and available("torch")
  sched, mem = Schedule.from_args(args), memory_budget(args)
  bandwidth = warm_copy_bandwidth()
  results = []
  for rows in args.rows:
    for dist in args.dists:
      for loss in args.losses:
        linear = loss == "linear"
        res = run_config(
          rows, args.dim, args.ids, dist, linear, sched, mem, bandwidth, torch
        )
        results.append(_row(rows, args.dim, args.ids, dist, linear, res))
        print(results[-1], flush=True)
  caution = oversubscribed(
    "so every figure is inflated (compare with a quiet run) and torch's "
    "worker threads suffer more from it than XLA's: the torch / gtx ratio "
    "here overstates the quiet-machine ratio."
  )
  heads = [
    headline(
      f"train step speed-up vs torch SparseAdam ({r[0]}, {r[1]}, {r[2]})",
      round(r[9], 2),
      ">= 2x at 1M x 64, uniform",
    )
    for r in results
    if isinstance(r[9], float)
  ]
  worst = round(max(r[13] for r in results), 2)
  heads.append(
    headline("optimizer part / bandwidth floor (worst)", worst, "<= 8x")
  )
  write_results(
    "train_step",
    "Whole training step: gradtx lazy_adam vs torch SparseAdam vs optax.adam",
    HEADERS,
    results,
    notes=(
      f"Forward (loss returned) + backward + optimizer + apply, {args.ids:,}"
      f" fresh ids every step (pre-generated), "
      f"{sched.describe()} (machine noise hits all "
      "alike; consecutive steps are a training loop's steady state: torch's "
      "OpenMP workers, spinning after torch's step, slow the next system's "
      "first steps). gtx and optax jitted with params "
      "and state donated; torch `nn.Embedding(sparse=True)` + `SparseAdam`, "
      "2 threads. `gtx opt only` = `lazy_adam.update` + `apply_updates` on a"
      " SparseRows of the same fresh ids. floor = (read + write the touched "
      "rows of params, m, v; read the gradient rows) / warm copy bandwidth "
      f"({bandwidth / 1e9:.1f} GB/s, `np.copyto` into a pre-faulted buffer, "
      "read + write counted). Table copies = `copy` instructions producing a"
      f" table-shaped value in the compiled step.{caution}"
    ),
    extra={"headline": heads, "warm_copy_bandwidth": bandwidth},
  )


if __name__ == "__main__":
  main()
