"""Recommender scale: a DLRM-shaped model with one table per feature.

The model as users write it (``benchmarks.models``: Criteo Kaggle's 26
cardinalities capped at ``--cap`` rows, ``--dim`` wide, one leaf per table
read ``p[f"t{i}"][ids[:, i]]``, a ``linear`` or ``mlp`` head, binary
cross-entropy returned), fresh ids every step (uniform or Zipf), timed
round-robin in one process per optimizer (:data:`OPTIMIZERS`, each with its
torch and FBGEMM twins): ``gtx`` (one jitted, donated step),
``gtx stacked`` (the tables stacked by hand into one leaf, read
``p["emb"][ids + offsets]``), the optimizer parts alone on pre-built
gradients (``opt only``), torch (26 ``nn.Embedding(sparse=True)``, the
head on Adam for SparseAdam; at each ``--torch-threads``), FBGEMM (one
table-batched module, SUM bags of one id, the optimizer fused in the
backward; where ``fbgemm_gpu`` imports, see ``benchmarks.fbgemm_anchor``),
and the random-rows floor (``twins.random_rows_floor``) beside the
sequential floor at the warm copy bandwidth. Then trace, lower and compile
of the whole gtx step at ``--compile-tables`` tables, per-table against
stacked, and each compiled step's ops (what a GPU would launch).

Writes ``benchmarks/results/recsys.{md,json,png}``.

  python -m benchmarks.recsys [--quick] [--optimizers ...] [--dists ...]
      [--heads ...] [--cap 100000] [--dim 64] [--batch 2048]
      [--compile-tables 26 52 104] [--no-steps] [--no-compile]
      [--rounds 10] [--burst 10] [--settle 3]
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks import models, twins
from benchmarks._common import (
  add_head_args,
  available,
  compile_phases,
  fbgemm,
  huge_pages,
  parse,
  parser,
  version,
  with_threads,
)
from benchmarks._results import (
  columns,
  commit,
  headline,
  markdown_table,
  oversubscribed,
  result_path,
  write_results,
)
from benchmarks._timing import (
  RUN,
  Clock,
  Counter,
  Schedule,
  step_runner,
  warm_copy_bandwidth,
)
from benchmarks.plots import plot_recsys

SEED = 0


class Opt(NamedTuple):
  """One optimizer and its twins."""

  gtx: Callable[[], Any]
  torch: str  # torch's twin, see _torch_optimizers
  fbgemm: str | None  # FBGEMM's fused twin


OPTIMIZERS = {
  "lazy_adam": Opt(lambda: gtx.lazy_adam(1e-3), "SparseAdam", None),
  "rowwise_adagrad": Opt(
    lambda: gtx.rowwise_adagrad(1e-2), "Adagrad", "EXACT_ROWWISE_ADAGRAD"
  ),
  "adagrad": Opt(lambda: gtx.adagrad(1e-2), "Adagrad", "EXACT_ADAGRAD"),
  "lazy_sgd": Opt(lambda: gtx.lazy_sgd(1e-2), "SGD", "EXACT_SGD"),
}


# ----------------------------------------------------------------------------
# gtx

# (variant, head, optimizer) -> (tx, jitted step, jitted opt-only step):
# the runs on uniform and on Zipf ids share one compiled step
_JITTED: dict[tuple, tuple] = {}


def _gtx_runs(key, loss, make_tx, params_np, ids, labels, grads):
  """``(run, run_opt, first loss, buffers)``: the whole step and the
  optimizer alone on pre-built ``grads`` (None without them), on the same
  donated params and state."""
  if key not in _JITTED:
    tx = make_tx()

    def opt_step(p, s, g):
      u, s = tx.update(g, s, p)
      return gtx.apply_updates(p, u), s

    step = models.whole_step(loss, tx)
    _JITTED[key] = tx, step, jax.jit(opt_step, donate_argnums=(0, 1))
  tx, jstep, jopt = _JITTED[key]
  params = {k: jnp.array(v) for k, v in params_np.items()}
  box = [params, tx.init(params)]
  huge_pages(box)
  n = len(ids)
  run = step_runner(jstep, box, lambda i: (ids[i % n], labels[i % n]))
  first = float(run(0))
  if grads is None:
    return run, None, first, box
  run_opt = step_runner(jopt, box, lambda i: (grads[i % len(grads)],))
  run_opt(0)
  return run, run_opt, first, box


def _opt_grads(loss, params_np, rows, data, stacked_rows: bool):
  """Per step: a gradient tree of the form the step's own gradient has
  (``gtx.sparse_grad`` of ``loss``: SparseRows of the step's ids, dense
  where it gives dense, as for the smallest tables), fixed values."""
  rng = np.random.default_rng(SEED + 3)
  batch, tables = data.ids[0].shape
  form = jax.eval_shape(
    gtx.sparse_grad(loss),
    {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in params_np.items()},
    data.ids[0],
    data.labels[0],
  )
  dim = params_np["emb" if stacked_rows else "t0"].shape[1]
  vals = jnp.asarray(rng.standard_normal((batch, tables, dim)), jnp.float32)
  dense = {
    k: jnp.asarray(rng.standard_normal(np.shape(v)), jnp.float32)
    for k, v in params_np.items()
    if not isinstance(form[k], gtx.SparseRows)
  }
  offsets = models.row_offsets(rows)
  out = []
  for step_ids in data.ids:
    g = dict(dense)
    if stacked_rows:
      flat = jnp.asarray((step_ids + offsets).reshape(-1))
      g["emb"] = gtx.SparseRows(flat, vals.reshape(-1, dim), sum(rows))
    else:
      for i, v in enumerate(rows):
        if f"t{i}" not in dense:
          col = jnp.asarray(np.ascontiguousarray(step_ids[:, i]))
          g[f"t{i}"] = gtx.SparseRows(col, vals[:, i], v)
    out.append(g)
  return out


# ----------------------------------------------------------------------------
# the step's time


def _threads_label(system: str, n: int, threads: list[int]) -> str:
  """The first thread count is the system's plain name."""
  return system if n == threads[0] else f"{system}, {n} thread{'s' * (n > 1)}"


def run_group(opt_name, dist, head, rows, args, sched, systems, bandwidth):
  """One optimizer on one model (``args``: its sizes, torch's threads):
  every system round-robin on the same fresh ids. Returns ``{"ms":
  {system: ms}, ...}``."""
  dim, threads, clock = args.dim, args.torch_threads, Clock()
  opt, tables = OPTIMIZERS[opt_name], len(rows)
  data = models.make_data(rows, args.batch, sched.steps, dist)
  params = models.init_params(rows, dim, head, args.hidden)
  ids = [jnp.asarray(s) for s in data.ids]
  labels = [jnp.asarray(y) for y in data.labels]
  fns, first, keep = {}, {}, []
  # the optimizer part barely depends on the head: timed with the linear one
  opt_only = "opt only" in systems and head == "linear"
  stacked = models.stacked(params, tables)
  for name, loss, p, stacked_rows in [
    ("gtx", models.per_table_loss(tables), params, False),
    ("gtx stacked", models.stacked_loss(rows), stacked, True),
  ]:
    grads = _opt_grads(loss, p, rows, data, stacked_rows) if opt_only else None
    key = (name, head, opt_name)
    run, run_opt, first[name], box = _gtx_runs(
      key, loss, opt.gtx, p, ids, labels, grads
    )
    fns[name] = run
    if opt_only:
      fns[f"{name} opt only"] = run_opt
    keep.append((box, grads))
  twin = f"torch {opt.torch}"
  fb = f"FBGEMM {opt.fbgemm}" if opt.fbgemm else None
  competitors = [(twin, twins.dlrm_torch, opt.torch)]
  if "fbgemm" in systems and fb:
    competitors.append((fb, twins.dlrm_fbgemm, opt.fbgemm))
  for n in threads if "torch" in systems else []:
    for system, make, optim in competitors:
      label = _threads_label(system, n, threads)
      run, first[label], objs = make(params, rows, optim, data)
      fns[label] = with_threads(n, run)
      keep.append(objs)
  layout = twins.state_layout(opt.gtx(), dim)
  offsets = models.row_offsets(rows)
  floor_run, floor_lib = twins.random_rows_floor(
    layout, sum(rows), dim, data, offsets
  )
  fns["floor: random rows"] = with_threads(max(threads), floor_run)
  print(f"  set up in {clock.wall():.0f} s", flush=True)
  del params, stacked
  gc.collect()
  times = sched.time(
    {k: Counter(f) for k, f in fns.items()}, label=f"{opt_name}, {dist}, {head}"
  )
  spread = RUN.timings[-1]["ms"]
  unique = float(np.mean([len(np.unique(s + offsets)) for s in data.ids]))
  wide, narrow = layout
  floor_bytes = unique * (wide * dim + narrow) * 4 * 2
  floor_bytes += args.batch * tables * (dim + 1) * 4  # the gradient rows read
  del keep, fns
  gc.collect()
  return {
    "ms": {k: t * 1e3 for k, t in times.items()},
    "p10_ms": {k: s["p10"] for k, s in spread.items()},
    "first_loss": first,
    "unique_rows": unique,
    "floor_sequential_ms": floor_bytes / bandwidth * 1e3,
    "floor_library": floor_lib,
    "twin": twin,
    "fbgemm": fb,
  }


# ----------------------------------------------------------------------------
# compile time and ops


def compile_point(
  tables: int, cap: int, dim: int, batch: int, opt_name: str, variant: str
) -> dict[str, Any]:
  """Trace, lower and compile the whole step once on abstract inputs."""
  rows = models.table_rows(tables, cap)
  params = models.abstract_params(rows, dim, variant == "stacked")
  loss = (
    models.stacked_loss(rows)
    if variant == "stacked"
    else models.per_table_loss(tables)
  )
  tx = OPTIMIZERS[opt_name].gtx()
  state = jax.eval_shape(tx.init, params)
  ids = jax.ShapeDtypeStruct((batch, tables), jnp.int32)
  y = jax.ShapeDtypeStruct((batch,), jnp.float32)
  # a fresh step function each time: nothing comes from jit's caches
  jitted = models.whole_step(loss, tx)
  return {
    "tables": tables,
    "variant": variant,
    "optimizer": opt_name,
    **compile_phases(jitted, params, state, ids, y),
  }


def compile_sweep(counts, cap, dim, batch, optimizers) -> list[dict]:
  compile_point(2, cap, dim, batch, optimizers[0], "per-table")  # warm up
  out = []
  for opt_name in optimizers:
    for tables in counts:
      for variant in ("per-table", "stacked"):
        r = compile_point(tables, cap, dim, batch, opt_name, variant)
        print(
          f"compile {opt_name} {tables} tables {variant}: trace "
          f"{r['trace_s']:.2f} s, compile {r['compile_s']:.2f} s, "
          f"{r['kernels']} kernels",
          flush=True,
        )
        out.append(r)
        gc.collect()
  return out


# ----------------------------------------------------------------------------
# report


STEP_HEADERS = columns(
  "ids | head | optimizer | gtx ms | gtx stacked ms | torch twin | torch ms "
  "| torch / gtx | torch / gtx, p10 | torch, other threads: ms (/ gtx) | "
  "stacked / gtx | FBGEMM ms | FBGEMM / gtx | FBGEMM, other threads: ms (/ "
  "gtx) | gtx opt only ms | stacked opt only ms | random-rows floor ms | "
  "sequential floor ms | unique rows | first losses agree"
)


def _step_row(dist, head, opt_name, r) -> list:
  ms, p10 = r["ms"], r["p10_ms"]
  g, t = ms["gtx"], ms.get(r["twin"])
  t10 = p10.get(r["twin"])
  fb = ms.get(r["fbgemm"]) if r["fbgemm"] else None
  losses = list(r["first_loss"].values())
  agree = bool(np.allclose(losses, losses[0], rtol=1e-4, atol=1e-6))

  def opt(x, fmt="{:.2f}"):
    return fmt.format(x) if x is not None else "-"

  def others(system):
    cells = [
      f"{k.rsplit(', ', 1)[1]}: {v:.2f} ({v / g:.2f}x)"
      for k, v in ms.items()
      if system and k.startswith(f"{system}, ")
    ]
    return "; ".join(cells) or "-"

  return [
    dist,
    head,
    opt_name,
    f"{g:.2f}",
    f"{ms['gtx stacked']:.2f}",
    r["twin"].removeprefix("torch "),
    opt(t),
    opt(t / g if t else None, "{:.2f}x"),
    opt(t10 / p10["gtx"] if t10 else None, "{:.2f}x"),
    others(r["twin"]),
    f"{ms['gtx stacked'] / g:.2f}x",
    opt(fb),
    opt(fb / g if fb else None, "{:.2f}x"),
    others(r["fbgemm"]),
    opt(ms.get("gtx opt only")),
    opt(ms.get("gtx stacked opt only")),
    f"{ms['floor: random rows']:.2f}",
    f"{r['floor_sequential_ms']:.2f}",
    round(r["unique_rows"]),
    "yes" if agree else "NO: " + ", ".join(f"{x:.6g}" for x in losses),
  ]


def _compile_headers(fewest: int) -> list[str]:
  return columns(
    "optimizer | tables | variant | trace s | lower s | compile s | total s "
    f"| total / {fewest} tables | per-table / stacked"
  )


# compile_point's op counts, in the order of OPS_HEADERS
OPS_KEYS = ["kernels", "fusion", "while", "sort", "scatter", "gather"]
OPS_KEYS += ["hlo_lines"]
OPS_HEADERS = ["optimizer", "tables", "variant", *OPS_KEYS[:-1], "HLO lines"]


def _compile_tables(points: list[dict]) -> tuple[list, list]:
  by = {(p["optimizer"], p["tables"], p["variant"]): p for p in points}
  base_tables = min(p["tables"] for p in points)
  rows, ops = [], []
  for p in points:
    key = (p["optimizer"], base_tables, p["variant"])
    other = by.get((p["optimizer"], p["tables"], "stacked"))
    key3 = [p["optimizer"], p["tables"], p["variant"]]
    per_stacked = "-"
    if p["variant"] == "per-table" and other:
      per_stacked = f"{p['total_s'] / other['total_s']:.2f}x"
    rows.append(
      key3
      + [f"{p[f'{k}_s']:.2f}" for k in ("trace", "lower", "compile", "total")]
      + [f"{p['total_s'] / by[key]['total_s']:.2f}x", per_stacked]
    )
    ops.append(key3 + [p[k] for k in OPS_KEYS])
  return rows, ops


def _parser():
  """The arguments and their --quick sizes."""
  p = parser(__doc__, schedule=Schedule(5, 5, 2), huge_pages=True)
  p.add_argument("--tables", type=int, default=26)
  p.add_argument("--cap", type=int, default=100_000)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--batch", type=int, default=2048)
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument(
    "--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS
  )
  p.add_argument("--dists", nargs="+", default=["uniform", "zipf"])
  add_head_args(p, OPTIMIZERS)
  p.add_argument(
    "--torch-threads",
    type=int,
    nargs="+",
    default=[2, 1],
    help="torch.set_num_threads for torch and FBGEMM, each its own system "
    "(the first is the twin of the ratios; one thread is immune to an "
    "oversubscribed machine, where a two-thread OpenMP barrier waits for a "
    "preempted thread at every op)",
  )
  p.add_argument("--no-torch", action="store_true")
  p.add_argument("--no-fbgemm", action="store_true")
  p.add_argument("--no-opt-only", action="store_true")
  p.add_argument("--no-steps", action="store_true")
  p.add_argument("--no-compile", action="store_true")
  p.add_argument("--compile-tables", type=int, nargs="+", default=[26, 52, 104])
  p.add_argument("--compile-cap", type=int, default=20_000)
  p.add_argument("--compile-dim", type=int, default=32)
  p.add_argument("--compile-batch", type=int, default=1024)
  p.add_argument(
    "--compile-optimizers",
    nargs="+",
    default=["lazy_adam", "rowwise_adagrad"],
    choices=OPTIMIZERS,
  )
  p.add_argument(
    "--label", default="", help="added to the title, e.g. which code this is"
  )
  p.add_argument(
    "--replot",
    metavar="JSON",
    help="only redraw the plot of a results file (next to it, as .png)",
  )
  quick = dict(tables=8, cap=2000, dim=16, batch=256, hidden=32)
  quick.update(rounds=2, burst=2, settle=1, compile_tables=[4, 8])
  quick.update(compile_cap=500, compile_dim=8, compile_batch=64)
  return p, quick


def _headlines(steps: list, points: list[dict], args) -> list[dict]:
  """The step's speed-ups over torch and over per-table leaves, and the
  compile time's growth with the tables."""
  heads = []
  for r in steps:
    c = dict(zip(STEP_HEADERS, r, strict=True))
    opt, where = c["optimizer"], f"({c['head']}, {c['ids']})"
    if c["head"] == "linear" and c["torch / gtx"] != "-":
      if opt in ("lazy_adam", "rowwise_adagrad"):
        heads.append(
          headline(
            f"{opt} step vs torch {c['torch twin']} (linear head, {c['ids']})",
            float(c["torch / gtx"].rstrip("x")),
            ">= 2x" if opt == "lazy_adam" else ">= 4x",
          )
        )
    value = float(c["stacked / gtx"].rstrip("x"))
    heads.append(
      headline(f"{opt} stacked / per-table step {where}", value, ">= 1x")
    )
  by = {(p["optimizer"], p["tables"], p["variant"]): p for p in points}
  lo, hi = min(args.compile_tables), max(args.compile_tables)
  for opt in args.compile_optimizers if points else []:
    a, b = by[(opt, lo, "per-table")], by[(opt, hi, "per-table")]
    s = by[(opt, hi, "stacked")]
    ratio = round(b["total_s"] / a["total_s"], 2)
    heads.append(
      headline(f"{opt} compile, {hi} / {lo} tables", ratio, "<= 1.5x")
    )
    ratio = round(b["total_s"] / s["total_s"], 2)
    metric = f"{opt} compile at {hi} tables, per-table / stacked"
    heads.append(headline(metric, ratio, "<= 2x"))
  return heads


def main(argv: list[str] | None = None) -> None:
  p, quick = _parser()
  args = parse(p, argv, quick=quick)
  if args.replot:
    data = json.loads(Path(args.replot).read_text())
    tables = int(data["notes"].split(" ", 1)[0])  # "26 tables (..."
    path = Path(args.replot).with_suffix(".png")
    plot_recsys(data["groups"], data["compile"], tables, path)
    return
  if args.quick:
    args.optimizers = args.mlp_optimizers = args.optimizers[:2]
  systems = set()
  if not args.no_torch and available("torch"):
    systems.add("torch")
  if "torch" in systems and not args.no_fbgemm and fbgemm():
    systems.add("fbgemm")
  if not args.no_opt_only:
    systems.add("opt only")
  sched = Schedule.from_args(args)
  rows = models.table_rows(args.tables, args.cap)
  code = commit()
  bandwidth = warm_copy_bandwidth()
  steps, raw = [], []
  if not args.no_steps:
    for head in args.heads:
      for dist in args.dists:
        for opt_name in args.optimizers:
          if head == "mlp" and opt_name not in args.mlp_optimizers:
            continue
          print(f"{opt_name}, {dist} ids, {head} head", flush=True)
          r = run_group(
            opt_name, dist, head, rows, args, sched, systems, bandwidth
          )
          raw.append({"ids": dist, "head": head, "optimizer": opt_name, **r})
          steps.append(_step_row(dist, head, opt_name, r))
          print(dict(zip(STEP_HEADERS, steps[-1], strict=True)), flush=True)
  points = []
  if not args.no_compile:
    sizes = args.compile_cap, args.compile_dim, args.compile_batch
    points = compile_sweep(args.compile_tables, *sizes, args.compile_optimizers)
  compile_rows, ops_rows = _compile_tables(points) if points else ([], [])
  png = result_path("recsys", ".png")
  plot_recsys(raw, points, len(rows), png)
  heads = _headlines(steps, points, args)
  lo = min(args.compile_tables)
  versions = f"jax {jax.__version__}, gradtx/ as of commit {code}"
  if "torch" in systems:
    versions += f", torch {version('torch')} (2 threads)"
  versions += (
    f", fbgemm_gpu {version('fbgemm_gpu')}"
    if "fbgemm" in systems
    else ", FBGEMM not installed (see benchmarks/fbgemm_anchor.py)"
  )
  caution = oversubscribed(
    "so every figure is inflated and torch's and FBGEMM's worker threads "
    "(an OpenMP barrier per op) suffer more from it than XLA's: the torch / "
    "gtx ratios overstate the quiet-machine ratios (the p10 column is less "
    "exposed)."
  )
  notes = (
    f"{len(rows)} tables (Criteo Kaggle's cardinalities capped at "
    f"{args.cap:,}: {sum(rows):,} rows) x {args.dim} float32, batch "
    f"{args.batch:,}, one id per table per example, fresh ids every step; "
    f"heads: linear (a logit weight vector per feature), mlp (tanh layer of "
    f"{args.hidden} over the concatenated embeddings); binary cross-entropy "
    f"returned. {sched.describe()}, every system of a row in the same "
    "rounds. torch twin: SparseAdam (head on Adam) for lazy_adam, sparse "
    "Adagrad for rowwise_adagrad and adagrad, SGD for lazy_sgd. FBGEMM: one "
    "table-batched module for all tables, SUM bags of one id, the head on "
    "torch's Adagrad/SGD. torch and FBGEMM run at "
    f"{args.torch_threads[0]} intra-op threads (the ratios' twins) and also "
    f"at {', '.join(map(str, args.torch_threads[1:])) or '-'} (the 'other "
    "threads' columns), each its own system in the same rounds. gtx opt "
    "only: `update` + `apply_updates` on pre-built gradients of the same "
    "ids, linear-head rows only. Random-rows floor: "
    f"{raw[0]['floor_library'] if raw else '-'} of each step's unique rows "
    "in one buffer per state kind (params included), measured in the same "
    "rounds; sequential floor: those bytes read + written and the gradient "
    f"rows read, over the warm copy bandwidth ({bandwidth / 1e9:.1f} GB/s). "
    "'first losses agree': every system's first-step loss on the same "
    f"params and ids. {versions}.{caution}"
  )
  if points:
    notes += (
      "\n\n### Compile time of the whole step\n\n"
      f"Tables capped at {args.compile_cap:,} rows, {args.compile_dim} wide, "
      f"batch {args.compile_batch:,}, linear head; one measurement each, "
      "on abstract inputs (`jax.jit(step).trace(...)`, `.lower()`, "
      "`.compile()`), a fresh step function each time.\n\n"
      + markdown_table(_compile_headers(lo), compile_rows)
      + "\n\n### Ops in the compiled step\n\n"
      f"Static counts in the {jax.default_backend()} program (a while body "
      "counts once): kernels = ops of the entry computation and of the "
      "bodies it runs through control flow, except parameters, constants, "
      "tuples and bitcasts (a fusion is one kernel); scatter and gather "
      "also inside fusions.\n\n" + markdown_table(OPS_HEADERS, ops_rows)
    )
  notes += f"\n\nPlot: {png.name}."
  write_results(
    "recsys",
    f"Recommender scale: {len(rows)} tables, per-table vs stacked vs torch vs "
    "FBGEMM" + (f" ({args.label})" if args.label else ""),
    STEP_HEADERS,
    steps,
    notes=notes,
    extra={
      "headline": heads,
      "commit": code,
      "groups": raw,
      "compile": points,
      "warm_copy_bandwidth": bandwidth,
    },
  )


if __name__ == "__main__":
  main()
