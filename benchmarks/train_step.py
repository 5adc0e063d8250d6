"""The whole training step: gradtx lazy_adam vs torch SparseAdam vs optax.adam.

What users run, timed side by side in one process on the same model and the
same ids: forward with the loss returned, backward, optimizer, apply.

* ``gtx``: ``gtx.sparse_value_and_grad`` (SparseRows gradient),
  ``gtx.lazy_adam``, ``gtx.apply_updates``; jitted, params and state
  donated. ``gtx catch_up`` is the same with ``catch_up=True``.
* ``torch``: ``nn.Embedding(sparse=True)`` + ``torch.optim.SparseAdam``
  (``torch.set_num_threads(2)``), ``loss.item()`` returned.
* ``optax``: ``jax.value_and_grad`` (dense gradient) + ``optax.adam`` +
  ``optax.apply_updates``; jitted, donated. Skipped where its four tables
  would not fit in ``--mem-gib`` beside the others.
* ``gtx opt only``: the gtx optimizer part alone (``update`` +
  ``apply_updates`` on a pre-built SparseRows gradient of the step's fresh
  ids), on the same donated buffers as ``gtx``.

Every step gets fresh ids (pre-generated outside the timed region): uniform,
or Zipf with s = 1.05 over a fixed random permutation of the rows. Two loss
forms: ``sum(E[ids] * ct)`` (linear in the table: the row gradient does not
read the rows) and ``sum(tanh(E[ids]) * ct)``. The floor is the bytes a lazy
step must move (read + write the touched rows of params, m and v; read the
gradient rows) over the bandwidth of a copy into a pre-faulted buffer.

  python -m benchmarks.train_step [--rows 100000 1000000 4000000] [--dim 64]
      [--ids 8192] [--rounds 10] [--burst 10] [--settle 3] [--mem-gib 10]
      [--smoke]
"""

from __future__ import annotations

import gc
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradtx as gtx
from benchmarks._common import (
  available,
  hlo_table_copies,
  huge_pages,
  make_ids,
  parse,
  parser,
)
from benchmarks._results import oversubscribed, write_results
from benchmarks._timing import (
  Counter,
  Schedule,
  step_runner,
  warm_copy_bandwidth,
)
from benchmarks.twins import torch_sparse_adam

LR = 1e-3
SEED = 0


def _loss_jax(rows: jax.Array, ct: jax.Array, linear: bool) -> jax.Array:
  return jnp.sum((rows if linear else jnp.tanh(rows)) * ct)


def _gtx(table, ids, grads, ct, linear, catch_up):
  tx = gtx.lazy_adam(LR, catch_up=catch_up)

  def loss_fn(params, ids_, ct_):
    return _loss_jax(gtx.lookup(params["emb"], ids_), ct_, linear)

  def step(params, state, ids_, ct_):
    loss, g = gtx.sparse_value_and_grad(loss_fn)(params, ids_, ct_)
    u, state = tx.update(g, state, params)
    return gtx.apply_updates(params, u), state, loss

  def opt_step(params, state, g):
    u, state = tx.update({"emb": g}, state, params)
    return gtx.apply_updates(params, u), state

  params = {"emb": jnp.array(table)}
  box = [params, tx.init(params)]
  huge_pages(box)
  jstep = jax.jit(step, donate_argnums=(0, 1))
  jopt = jax.jit(opt_step, donate_argnums=(0, 1))
  copies = hlo_table_copies(jstep, table.shape, box[0], box[1], ids[0], ct)

  run = step_runner(jstep, box, lambda i: (ids[i % len(ids)], ct))
  run_opt = step_runner(jopt, box, lambda i: (grads[i % len(grads)],))
  return run, run_opt, copies, box


def _optax(table, ids, ct, linear):
  tx = optax.adam(LR)

  def step(params, state, ids_, ct_):
    loss, g = jax.value_and_grad(lambda p: _loss_jax(p[ids_], ct_, linear))(
      params
    )
    u, state = tx.update(g, state, params)
    return optax.apply_updates(params, u), state, loss

  params = jnp.array(table)
  box = [params, tx.init(params)]
  huge_pages(box)
  jstep = jax.jit(step, donate_argnums=(0, 1))
  copies = hlo_table_copies(jstep, table.shape, box[0], box[1], ids[0], ct)

  run = step_runner(jstep, box, lambda i: (ids[i % len(ids)], ct))
  return run, copies, box


def run_config(
  rows: int,
  dim: int,
  n: int,
  dist: str,
  linear: bool,
  sched: Schedule,
  mem_bytes: float,
  bandwidth: float,
  with_torch: bool,
) -> dict[str, Any]:
  ids_np = make_ids(rows, n, sched.steps, dist)
  rng = np.random.default_rng(SEED + 1)
  table_np = (0.1 * rng.standard_normal((rows, dim))).astype(np.float32)
  ct_np = rng.standard_normal((n, dim)).astype(np.float32)
  ids = [jnp.asarray(i) for i in ids_np]
  ct = jnp.asarray(ct_np)
  grad_vals = jnp.asarray(rng.standard_normal((n, dim)).astype(np.float32))
  grads = [gtx.SparseRows(i, grad_vals, rows) for i in ids]
  table_bytes = rows * dim * 4
  fns, keep, copies = {}, [], {}
  run, run_opt, copies["gtx"], b = _gtx(table_np, ids, grads, ct, linear, False)
  fns["gtx"], fns["gtx opt only"] = run, run_opt
  keep.append(b)
  run, _, copies["gtx catch_up"], b = _gtx(
    table_np, ids, grads, ct, linear, True
  )
  fns["gtx catch_up"] = run
  keep.append(b)
  used = 6 * table_bytes
  if with_torch:
    fns["torch"], b = torch_sparse_adam(table_np, ids_np, ct_np, linear)
    keep.append(b)
    used += 3 * table_bytes
  if used + 4 * table_bytes <= mem_bytes:
    fns["optax"], copies["optax"], b = _optax(table_np, ids, ct, linear)
    keep.append(b)
  del table_np
  gc.collect()
  times = sched.time(
    {k: Counter(f, 0) for k, f in fns.items()},
    label=f"{rows:,} x {dim}, {dist}, {'linear' if linear else 'tanh'}",
  )
  unique = float(np.mean([len(np.unique(i)) for i in ids_np]))
  floor_bytes = unique * dim * 4 * 6 + n * (dim + 1) * 4
  del keep, fns, grads, ids
  gc.collect()
  return {
    "ms": {k: t * 1e3 for k, t in times.items()},
    "unique": unique,
    "floor_ms": floor_bytes / bandwidth * 1e3,
    "copies": copies,
  }


def _row(rows, dim, n, dist, linear, res):
  ms = res["ms"]
  g, t, o = ms["gtx"], ms.get("torch"), ms.get("optax")
  floor = res["floor_ms"]

  def fmt(x):
    return x if x is not None else "-"

  return [
    f"{rows:,} x {dim}",
    dist,
    "linear" if linear else "tanh",
    n,
    round(res["unique"]),
    g,
    ms["gtx catch_up"],
    fmt(t),
    fmt(o),
    t / g if t is not None else "-",
    o / g if o is not None else "-",
    ms["gtx opt only"],
    floor,
    ms["gtx opt only"] / floor,
    g / floor,
    "/".join(str(res["copies"][k]) for k in ("gtx", "gtx catch_up")),
    res["copies"].get("optax", "-"),
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

  ids = [jnp.asarray(i) for i in make_ids(rows, n, steps + 2, "uniform")]
  rng = np.random.default_rng(SEED + 1)
  table = (0.1 * rng.standard_normal((rows, dim))).astype(np.float32)
  ct = jnp.asarray(rng.standard_normal((n, dim)).astype(np.float32))
  run, _, _, box = _gtx(table, ids, ids, ct, linear, False)
  run(0)
  run(1)
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for i in range(2, steps + 2):
        run(i)
    path = next(Path(d).rglob("*.trace.json.gz"))
    events = json.load(gzip.open(path))
  events = events["traceEvents"] if isinstance(events, dict) else events
  total = collections.defaultdict(list)
  for e in events:
    name = e.get("name", "")
    # Python frames and runtime wrappers are not thunks of the step.
    if name.startswith("$") or "::" in name or "Pjit" in name:
      continue
    if e.get("ph") == "X" and "dur" in e:
      total[name].append(e["dur"])
  del box
  return sorted(
    ((sum(v) / steps / 1e3, len(v) / steps, k) for k, v in total.items()),
    reverse=True,
  )


HEADERS = [
  "table",
  "ids",
  "loss",
  "ids/step",
  "unique rows",
  "gtx ms",
  "gtx catch_up ms",
  "torch SparseAdam ms",
  "optax.adam ms",
  "torch / gtx",
  "optax / gtx",
  "gtx opt only ms",
  "floor ms",
  "opt only / floor",
  "step / floor",
  "gtx table copies (lazy/catch_up)",
  "optax table copies",
]


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__, schedule=Schedule(), huge_pages=True)
  p.add_argument(
    "--rows", type=int, nargs="+", default=[100_000, 1_000_000, 4_000_000]
  )
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--ids", type=int, default=8192)
  p.add_argument("--dists", nargs="+", default=["uniform", "zipf"])
  p.add_argument("--losses", nargs="+", default=["linear", "tanh"])
  p.add_argument(
    "--mem-gib",
    type=float,
    default=None,
    help="memory the variants may hold at once (default 10 GiB on CPU, "
    "half the device memory on accelerators)",
  )
  p.add_argument("--no-torch", action="store_true")
  p.add_argument(
    "--profile",
    action="store_true",
    help="print the per-thunk time of the gtx step (first --rows, uniform "
    "ids, each --losses) instead of the comparison",
  )
  args = parse(p, argv, quick=dict(rows=[5_000], ids=256, rounds=3))
  mem = args.mem_gib
  if mem is None:
    dev = jax.devices()[0]
    stats = dev.memory_stats() if dev.platform != "cpu" else None
    limit = (stats or {}).get("bytes_limit")
    mem_bytes = 0.5 * limit if limit else 10 * 2**30
  else:
    mem_bytes = mem * 2**30
  if args.profile:
    for loss in args.losses:
      print(f"\n{args.rows[0]:,} x {args.dim}, {args.ids} ids, {loss} loss")
      for ms, calls, name in profile(
        args.rows[0], args.dim, args.ids, loss == "linear"
      )[:30]:
        print(f"{ms:9.3f} ms/step  x{calls:5.1f}  {name[:70]}")
    return
  with_torch = not args.no_torch and available("torch")
  sched = Schedule.from_args(args)
  bandwidth = warm_copy_bandwidth()
  results = []
  for rows in args.rows:
    for dist in args.dists:
      for loss in args.losses:
        res = run_config(
          rows,
          args.dim,
          args.ids,
          dist,
          loss == "linear",
          sched,
          mem_bytes,
          bandwidth,
          with_torch,
        )
        results.append(
          _row(rows, args.dim, args.ids, dist, loss == "linear", res)
        )
        print(results[-1], flush=True)
  caution = oversubscribed(
    "so every figure is inflated (compare with a quiet run) and torch's "
    "worker threads suffer more from it than XLA's: the torch / gtx ratio "
    "here overstates the quiet-machine ratio."
  )
  headline = []
  for r in results:
    if isinstance(r[9], float):
      headline.append(
        {
          "metric": f"train step speed-up vs torch SparseAdam ({r[0]}, "
          f"{r[1]}, {r[2]})",
          "value": round(r[9], 2),
          "target": ">= 2x at 1M x 64, uniform",
        }
      )
  headline.append(
    {
      "metric": "optimizer part / bandwidth floor (worst)",
      "value": round(max(r[13] for r in results), 2),
      "target": "<= 8x",
    }
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
    extra={"headline": headline, "warm_copy_bandwidth": bandwidth},
  )


if __name__ == "__main__":
  main()
