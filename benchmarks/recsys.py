"""Recommender scale: a DLRM-shaped model (``benchmarks.models``: Criteo's
cardinalities capped at ``--cap``, one leaf per table, a linear or mlp
head) timed round-robin, per optimizer of :data:`OPTIMIZERS`, against the
tables stacked by hand into one leaf, the optimizer alone on pre-built
gradients, torch and FBGEMM (``benchmarks.twins``) and the random-rows
floor; then trace, lower and compile of the whole step at
``--compile-tables`` tables and each compiled step's ops. The results'
notes say what each system runs.

  python -m benchmarks.recsys [--quick] [--optimizers ...] [--dists ...]
      [--heads ...] [--cap 100000] [--dim 64] [--batch 2048]
      [--compile-tables 26 52 104] [--no-steps] [--no-compile]
      [--rounds 10] [--burst 10] [--settle 3]
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks import _common, _results, _timing, models, twins
from benchmarks._common import parse, parser, with_threads
from benchmarks._results import columns, headline, markdown_table
from benchmarks._timing import RUN, Clock, Counter, Schedule, step_runner
from benchmarks.plots import plot_recsys

SEED = 0

# name: (the gtx optimizer, torch's twin, FBGEMM's fused twin or None)
OPTIMIZERS = {
  "lazy_adam": (lambda: gtx.lazy_adam(1e-3), "SparseAdam", None),
  "rowwise_adagrad": (
    lambda: gtx.rowwise_adagrad(1e-2),
    "Adagrad",
    "EXACT_ROWWISE_ADAGRAD",
  ),
  "adagrad": (lambda: gtx.adagrad(1e-2), "Adagrad", "EXACT_ADAGRAD"),
  "lazy_sgd": (lambda: gtx.lazy_sgd(1e-2), "SGD", "EXACT_SGD"),
}
# the gtx systems: name: (compile variant, loss of the tables' rows, stacked)
VARIANTS = {
  "gtx": ("per-table", lambda rows: models.per_table_loss(len(rows)), False),
  "gtx stacked": ("stacked", models.stacked_loss, True),
}
# (system, head, optimizer) -> (tx, jitted step, jitted opt-only step): the
# runs on uniform and on Zipf ids share one compiled step
_JITTED: dict[tuple, tuple] = {}


def _jitted(key, loss, make_tx):
  if key not in _JITTED:
    tx = make_tx()

    def opt_step(p, s, g):
      u, s = tx.update(g, s, p)
      return gtx.apply_updates(p, u), s

    step = models.whole_step(loss, tx)
    _JITTED[key] = tx, step, jax.jit(opt_step, donate_argnums=(0, 1))
  return _JITTED[key]


def _opt_grads(loss, params_np, rows, data, stacked: bool):
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
  dim = params_np["emb" if stacked else "t0"].shape[1]
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
    if stacked:
      flat = jnp.asarray((step_ids + offsets).reshape(-1))
      g["emb"] = gtx.SparseRows(flat, vals.reshape(-1, dim), sum(rows))
    for i, v in enumerate([] if stacked else rows):
      if f"t{i}" not in dense:
        col = jnp.asarray(np.ascontiguousarray(step_ids[:, i]))
        g[f"t{i}"] = gtx.SparseRows(col, vals[:, i], v)
    out.append(g)
  return out


def run_group(opt_name, dist, head, rows, args, sched, systems, bandwidth):
  """One optimizer on one model (``args``: its sizes, torch's threads):
  every system round-robin on the same fresh ids."""
  dim, threads, clock = args.dim, args.torch_threads, Clock()
  make_tx, torch_opt, fb_opt = OPTIMIZERS[opt_name]
  data = models.make_data(rows, args.batch, sched.steps, dist)
  params = models.init_params(rows, dim, head, args.hidden)
  ids = [jnp.asarray(s) for s in data.ids]
  labels = [jnp.asarray(y) for y in data.labels]
  fns, first, keep = {}, {}, []
  # the optimizer part barely depends on the head: timed with the linear one
  opt_only = "opt only" in systems and head == "linear"
  for name, (_, loss_of, stacked) in VARIANTS.items():
    # the whole step and the optimizer alone on pre-built gradients, on the
    # same donated params and state
    p = models.stacked(params, len(rows)) if stacked else params
    loss = loss_of(rows)
    tx, jstep, jopt = _jitted((name, head, opt_name), loss, make_tx)
    box = [{k: jnp.array(v) for k, v in p.items()}]
    box.append(tx.init(box[0]))
    _common.huge_pages(box)
    fns[name] = step_runner(
      jstep, box, lambda i: (ids[i % len(ids)], labels[i % len(ids)])
    )
    first[name] = float(fns[name](0))
    keep.append(box)
    if opt_only:
      grads = _opt_grads(loss, p, rows, data, stacked)
      run_opt = step_runner(jopt, box, lambda i, g=grads: (g[i % len(g)],))
      run_opt(0)
      fns[f"{name} opt only"] = run_opt
      keep.append(grads)
  twin = f"torch {torch_opt}"
  fb = f"FBGEMM {fb_opt}" if fb_opt else None
  competitors = [(twin, twins.dlrm_torch, torch_opt)]
  if "fbgemm" in systems and fb:
    competitors.append((fb, twins.dlrm_fbgemm, fb_opt))
  for t in threads if "torch" in systems else []:
    for system, make, optim in competitors:
      # the first thread count is the system's plain name
      label = f"{system}, {t} thread{'s' * (t > 1)}"
      label = system if t == threads[0] else label
      run, first[label], objs = make(params, rows, optim, data)
      fns[label] = with_threads(t, run)
      keep.append(objs)
  layout = twins.state_layout(make_tx(), dim)
  offsets = models.row_offsets(rows)
  floor_run, floor_lib = twins.random_rows_floor(
    layout, sum(rows), dim, data, offsets
  )
  fns["floor: random rows"] = with_threads(max(threads), floor_run)
  print(f"  set up in {clock.wall():.0f} s", flush=True)
  del params, p  # the numpy tables, before the timing
  gc.collect()
  times = sched.time(
    {k: Counter(f) for k, f in fns.items()}, label=f"{opt_name}, {dist}, {head}"
  )
  spread = RUN.timings[-1]["ms"]
  unique = float(np.mean([len(np.unique(s + offsets)) for s in data.ids]))
  wide, narrow = layout
  floor_bytes = unique * (wide * dim + narrow) * 4 * 2
  floor_bytes += args.batch * len(rows) * (dim + 1) * 4  # the gradient rows
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


def compile_point(tables, cap, dim, batch, opt_name, variant) -> dict:
  """Trace, lower and compile the whole step once on abstract inputs, a
  fresh step function each time (nothing from jit's caches)."""
  rows = models.table_rows(tables, cap)
  _, loss_of, stacked = next(v for v in VARIANTS.values() if v[0] == variant)
  params = models.abstract_params(rows, dim, stacked)
  tx = OPTIMIZERS[opt_name][0]()
  state = jax.eval_shape(tx.init, params)
  ids = jax.ShapeDtypeStruct((batch, tables), jnp.int32)
  y = jax.ShapeDtypeStruct((batch,), jnp.float32)
  jitted = models.whole_step(loss_of(rows), tx)
  phases = _common.compile_phases(jitted, params, state, ids, y)
  return {"tables": tables, "variant": variant, "optimizer": opt_name, **phases}


def compile_sweep(counts, cap, dim, batch, optimizers) -> list[dict]:
  compile_point(2, cap, dim, batch, optimizers[0], "per-table")  # warm up
  out = []
  for opt_name in optimizers:
    for tables in counts:
      for variant, _, _ in VARIANTS.values():
        r = compile_point(tables, cap, dim, batch, opt_name, variant)
        print(f"compile {opt_name} {tables} tables {variant}", r, flush=True)
        out.append(r)
        gc.collect()
  return out


STEP_HEADERS = columns(
  "ids | head | optimizer | gtx ms | gtx stacked ms | torch twin | torch ms "
  "| torch / gtx | torch / gtx, p10 | torch, other threads: ms (/ gtx) | "
  "stacked / gtx | FBGEMM ms | FBGEMM / gtx | FBGEMM, other threads: ms (/ "
  "gtx) | gtx opt only ms | stacked opt only ms | random-rows floor ms | "
  "sequential floor ms | unique rows | first losses agree"
)
# compile_point's op counts, in the order of OPS_HEADERS
OPS_KEYS = ["kernels", "fusion", "while", "sort", "scatter", "gather"]
OPS_HEADERS = ["optimizer", "tables", "variant", *OPS_KEYS, "HLO lines"]


def _step_row(dist, head, opt_name, r) -> list:
  ms, p10, twin, fb = r["ms"], r["p10_ms"], r["twin"], r["fbgemm"]
  g, t, f = ms["gtx"], ms.get(twin), ms.get(fb)
  losses = list(r["first_loss"].values())
  agree = bool(np.allclose(losses, losses[0], rtol=1e-4, atol=1e-6))

  def opt(v):
    return f"{v:.2f}" if v is not None else "-"

  def others(system):
    cells = [
      f"{k.rsplit(', ', 1)[1]}: {v:.2f} ({v / g:.2f}x)"
      for k, v in ms.items()
      if system and k.startswith(f"{system}, ")
    ]
    return "; ".join(cells) or "-"

  def per(a, b=g):  # a ratio cell
    return f"{a / b:.2f}x" if a else "-"

  return (
    [dist, head, opt_name, f"{g:.2f}", f"{ms['gtx stacked']:.2f}"]
    + [twin.removeprefix("torch "), opt(t), per(t)]
    + [per(t and p10[twin], p10["gtx"]), others(twin), per(ms["gtx stacked"])]
    + [opt(f), per(f), others(fb)]
    + [opt(ms.get(f"{k} opt only")) for k in ("gtx", "gtx stacked")]
    + [f"{ms['floor: random rows']:.2f}", f"{r['floor_sequential_ms']:.2f}"]
    + [round(r["unique_rows"])]
    + ["yes" if agree else "NO: " + ", ".join(f"{x:.6g}" for x in losses)]
  )


def _compile_tables(points: list[dict]) -> tuple[list, list]:
  by = {(p["optimizer"], p["tables"], p["variant"]): p for p in points}
  base_tables = min(p["tables"] for p in points)
  rows, ops = [], []
  for p in points:
    key3 = [p["optimizer"], p["tables"], p["variant"]]
    base = by[(p["optimizer"], base_tables, p["variant"])]
    other = by.get((p["optimizer"], p["tables"], "stacked"))
    per_stacked = "-"
    if p["variant"] == "per-table" and other:
      per_stacked = f"{p['total_s'] / other['total_s']:.2f}x"
    rows.append(
      key3
      + [f"{p[f'{k}_s']:.2f}" for k in ("trace", "lower", "compile", "total")]
      + [f"{p['total_s'] / base['total_s']:.2f}x", per_stacked]
    )
    ops.append(key3 + [p[k] for k in [*OPS_KEYS, "hlo_lines"]])
  return rows, ops


def _parser():
  """The arguments and their --quick sizes."""
  p = parser(__doc__, schedule=Schedule(5, 5, 2), huge_pages=True)
  sizes = dict(tables=26, cap=100_000, dim=64, batch=2048, hidden=256)
  sizes.update(compile_cap=20_000, compile_dim=32, compile_batch=1024)
  for k, v in sizes.items():
    p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
  p.add_argument(
    "--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS
  )
  p.add_argument("--dists", nargs="+", default=["uniform", "zipf"])
  _common.add_head_args(p, OPTIMIZERS)
  p.add_argument(
    "--torch-threads",
    type=int,
    nargs="+",
    default=[2, 1],
    help="torch's threads for torch and FBGEMM, each its own system (the "
    "first is the ratios' twin)",
  )
  for what in ("torch", "fbgemm", "opt-only", "steps", "compile"):
    p.add_argument(f"--no-{what}", action="store_true")
  p.add_argument("--compile-tables", type=int, nargs="+", default=[26, 52, 104])
  p.add_argument(
    "--compile-optimizers",
    nargs="+",
    default=["lazy_adam", "rowwise_adagrad"],
    choices=OPTIMIZERS,
  )
  p.add_argument(
    "--label", default="", help="added to the title, e.g. which code this is"
  )
  quick = dict(tables=8, cap=2000, dim=16, batch=256, hidden=32)
  quick.update(rounds=2, burst=2, settle=1, compile_tables=[4, 8])
  quick.update(compile_cap=500, compile_dim=8, compile_batch=64)
  return p, quick


def _headlines(steps: list, points: list[dict], args) -> list[dict]:
  """The step's speed-ups over torch and over per-table leaves, and the
  compile time's growth with the tables."""
  heads = []
  targets = {"lazy_adam": ">= 2x", "rowwise_adagrad": ">= 4x"}
  for r in steps:
    c = dict(zip(STEP_HEADERS, r, strict=True))
    opt, where = c["optimizer"], f"({c['head']}, {c['ids']})"
    if c["head"] == "linear" and c["torch / gtx"] != "-" and opt in targets:
      metric = (
        f"{opt} step vs torch {c['torch twin']} (linear head, {c['ids']})"
      )
      ratio = float(c["torch / gtx"].rstrip("x"))
      heads.append(headline(metric, ratio, targets[opt]))
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


def _notes(args, rows, sched, systems, raw, bandwidth, points, code) -> str:
  versions = f"jax {jax.__version__}, gradtx/ as of commit {code}"
  if "torch" in systems:
    versions += f", torch {_common.version('torch')} (2 threads)"
  versions += (
    f", fbgemm_gpu {_common.version('fbgemm_gpu')}"
    if "fbgemm" in systems
    else ", FBGEMM not installed (see benchmarks.probes fbgemm_anchor)"
  )
  caution = _results.oversubscribed(
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
    compile_rows, ops_rows = _compile_tables(points)
    lo = min(args.compile_tables)
    notes += (
      "\n\n### Compile time of the whole step\n\n"
      f"Tables capped at {args.compile_cap:,} rows, {args.compile_dim} wide, "
      f"batch {args.compile_batch:,}, linear head; one measurement each, "
      "on abstract inputs (`jax.jit(step).trace(...)`, `.lower()`, "
      "`.compile()`), a fresh step function each time.\n\n"
      + markdown_table(
        columns(
          "optimizer | tables | variant | trace s | lower s | compile s | "
          f"total s | total / {lo} tables | per-table / stacked"
        ),
        compile_rows,
      )
      + "\n\n### Ops in the compiled step\n\n"
      f"Static counts in the {jax.default_backend()} program (a while body "
      "counts once): kernels = ops of the entry computation and of the "
      "bodies it runs through control flow, except parameters, constants, "
      "tuples and bitcasts (a fusion is one kernel); scatter and gather "
      "also inside fusions.\n\n" + markdown_table(OPS_HEADERS, ops_rows)
    )
  return notes


def main(argv: list[str] | None = None) -> None:
  p, quick = _parser()
  args = parse(p, argv, quick=quick)
  if args.quick:
    args.optimizers = args.mlp_optimizers = args.optimizers[:2]
  torch = not args.no_torch and _common.available("torch")
  fb = torch and not args.no_fbgemm and _common.fbgemm()
  on = {"torch": torch, "fbgemm": fb, "opt only": not args.no_opt_only}
  systems = {k for k, v in on.items() if v}
  sched = Schedule.from_args(args)
  rows = models.table_rows(args.tables, args.cap)
  code = _results.commit()
  bandwidth = _timing.warm_copy_bandwidth()
  steps, raw = [], []
  for head in [] if args.no_steps else args.heads:
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
  png = _results.result_path("recsys", ".png")
  plot_recsys(raw, points, len(rows), png)
  notes = _notes(args, rows, sched, systems, raw, bandwidth, points, code)
  _results.write_results(
    "recsys",
    f"Recommender scale: {len(rows)} tables, per-table vs stacked vs torch vs "
    "FBGEMM" + (f" ({args.label})" if args.label else ""),
    STEP_HEADERS,
    steps,
    notes=notes + f"\n\nPlot: {png.name}.",
    extra={
      "headline": _headlines(steps, points, args),
      "commit": code,
      "groups": raw,
      "compile": points,
      "warm_copy_bandwidth": bandwidth,
    },
  )


if __name__ == "__main__":
  main()
