"""Table stacks: a recommender's whole training step, per-table leaves
against ``gtx.TableStack``, beside torch and FBGEMM, the stack's optimizer
part alone and its random-rows floor, per optimizer of
``models.STACK_OPTIMIZERS`` (models: ``models.criteo_models`` and
``models.bag_models``); compile time and op counts against the number of
features; where a step's rows land on an 8-way row-sharded stack; and the
criteo step as stacks of ``--lanes`` lanes. The notes of
``results/stacks.md`` and ``results/stack_lanes.md`` say what each runs.

  python -m benchmarks.stacks [--quick] [--rounds 8] [--only stacks lanes]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks import _common, _results, models, twins
from benchmarks._results import columns, markdown_table, write_results
from benchmarks._timing import Counter, Schedule, step_runner

SEED = 0
SYSTEMS = ["gtx per-table", "gtx stack", "torch", "fbgemm"]


def optimizer_runner(loss, tx, params, batches, labels):
  """The optimizer part of the stack's step alone: ``tx.update`` and
  ``gtx.apply_updates`` (jitted, params and state donated) on the
  step's real gradients, computed once beforehand."""
  grad = jax.jit(lambda p, b, y: gtx.sparse_value_and_grad(loss)(p, b, y)[1])
  grads = [grad(params, b, y) for b, y in zip(batches, labels, strict=True)]

  def update(p, s, g):
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s

  update = jax.jit(update, donate_argnums=(0, 1))
  box = [jax.tree.map(jnp.copy, params), None]
  box[1] = tx.init(box[0])
  _common.huge_pages(box)
  run = Counter(step_runner(update, box, lambda i: (grads[i % len(grads)],)), 0)
  run()
  return run


def _model(model, dist, args):
  """``(stack, names, per-table loss, stack loss, feeds, labels, the
  twins' feed, ids per step and table, rows per table)`` of one model."""
  if model == "criteo":
    crows = [min(c, args.cap) for c in models.CRITEO_KAGGLE]
    batches, labels = models.criteo_data(crows, args.batch, args.steps, dist)
    stack, names, ptl, stl = models.criteo_models(crows, args.dim, args.batch)
    flat = [[b[n] for n in names] for b in batches]
    feeds = {"per-table": batches, "stack": batches}
    return stack, names, ptl, stl, feeds, labels, batches, flat, crows
  n, rows, batch = args.bag_tables, args.bag_rows, args.bag_batch
  raw, labels, cap = models.bag_data(n, rows, batch, args.steps, dist)
  stack, names, ptl, stl = models.bag_models(n, rows, args.dim, batch)
  seg = {}
  for b in raw:
    for name, (_, lengths, _, _) in b.items():
      s = np.repeat(np.arange(len(lengths)), lengths)
      full = np.full(cap, batch - 1, np.int32)
      full[: len(s)] = s
      seg.setdefault(name, []).append(full)
  feeds = {
    "per-table": [
      {n: (b[n][0], seg[n][k], b[n][2]) for n in names}
      for k, b in enumerate(raw)
    ],
    "stack": [{n: gtx.Jagged(*b[n][:3]) for n in names} for b in raw],
  }
  flat = [[b[n][0][: b[n][3]] for n in names] for b in raw]
  return stack, names, ptl, stl, feeds, labels, raw, flat, [rows] * n


def _tables(rng, rows, dim) -> list[np.ndarray]:
  return [
    (0.05 * rng.standard_normal((r, dim))).astype(np.float32) for r in rows
  ]


def _head(features, dim, head="linear"):
  rng = np.random.default_rng(SEED + 4)
  return models.head_params(features, dim, head, models.HIDDEN, rng)


def gtx_systems(make, systems, labels) -> dict:
  """Each gtx system ``name: (loss, params, feeds)``'s whole step, on its
  own optimizer (params, made device arrays, and state donated)."""
  out = {}
  for name, (loss, params, feeds) in systems.items():
    tx = make()
    step = models.whole_step(loss, tx)
    params = jax.tree.map(jnp.asarray, params)
    out[name] = models.loop_runner(step, params, tx, feeds, labels)
  return out


def twin_systems(torch, opt, tables_np, hp_np, feed, labels, bags) -> dict:
  """torch's twin of ``opt`` (one module a table) and FBGEMM's (one
  table-batched module), where they import and FBGEMM has ``opt``."""
  _, torch_name, lr, fb_optim = models.STACK_OPTIMIZERS[opt]
  out, twin = {}, (lr, feed, labels, bags)
  if torch is not None:
    out["torch"], _ = twins.torch_runner(
      torch, tables_np, hp_np, torch_name, *twin
    )
  if torch is not None and fb_optim and _common.fbgemm():
    out["fbgemm"], _ = twins.fbgemm_runner(
      torch, tables_np, hp_np, fb_optim, *twin
    )
  return out


def step_rows(args, torch) -> list[dict]:
  out = []
  rng = np.random.default_rng(SEED + 2)
  for model in ("criteo", "bags"):
    for dist in args.dists:
      stack, names, ptl, stl, feeds, labels, twin_feed, flat, rows_np = _model(
        model, dist, args
      )
      tables_np = _tables(rng, rows_np, args.dim)
      offsets = np.concatenate([[0], np.cumsum(rows_np)[:-1]])
      # per step, the unique rows of all tables in one id space
      unique = [
        np.unique(
          np.concatenate([x + o for x, o in zip(f, offsets, strict=True)])
        )
        for f in flat
      ]
      configs = [("linear", o) for o in args.optimizers]
      if model == "criteo" and "mlp" in args.heads:
        configs += [("mlp", o) for o in args.mlp_optimizers]
      for head, opt in configs:
        make = models.STACK_OPTIMIZERS[opt][0]
        hp_np = _head(len(names), args.dim, head)
        per_table = dict(zip(names, tables_np, strict=True))
        emb = jax.tree.map(np.asarray, stack.stack(per_table))
        stacked = {"emb": emb, "head": hp_np}
        per_table = {**per_table, "head": hp_np}
        systems = {
          "gtx per-table": (ptl, per_table, feeds["per-table"]),
          "gtx stack": (stl, stacked, feeds["stack"]),
        }
        fns = gtx_systems(make, systems, labels)
        fns |= twin_systems(
          torch, opt, tables_np, hp_np, twin_feed, labels, model == "bags"
        )
        fns["gtx stack optimizer"] = optimizer_runner(
          stl,
          make(),
          jax.tree.map(jnp.asarray, stacked),
          feeds["stack"],
          labels,
        )
        fns["floor"] = twins.floor_runner(
          torch, sum(rows_np), args.dim, opt, unique
        )
        t = Schedule.from_args(args).time(
          fns, label=f"{model}, {head}, {dist}, {opt}"
        )
        out.append(
          dict(model=model, head=head, dist=dist, optimizer=opt)
          | {"unique_rows": float(np.mean([len(u) for u in unique]))}
          | {k: v * 1e3 for k, v in t.items()}
        )
        print(out[-1], flush=True)
  return out


def shard_balance(args, shards: int = 8) -> list[dict]:
  """Per device of a ``shards``-way row-sharded Criteo stack: the ids a
  step reads there and its unique rows there, max over mean across the
  devices (1.0 is even), with the stack's round-robin placement and with
  tables stacked contiguously and cut into ``shards`` blocks."""
  rows = [min(c, args.cap) for c in models.CRITEO_KAGGLE]
  names = [f"f{t}" for t in range(len(rows))]
  specs = {
    n: gtx.TableSpec(r, args.dim) for n, r in zip(names, rows, strict=True)
  }
  placements = {
    "contiguous blocks": gtx.TableStack(specs),
    "round-robin (shards=8)": gtx.TableStack(specs, shards=shards),
  }
  out = []
  for dist in ("uniform", "zipf", "zipf (rank ids)"):
    cols = [
      # make_ids' Zipf ids with the permutation undone: rank k is id k
      np.minimum(_zipf_ranks(r, args.batch, args.steps, SEED + t), r - 1)
      if dist == "zipf (rank ids)"
      else _common.make_ids(r, args.batch, args.steps, dist, SEED + t)
      for t, r in enumerate(rows)
    ]
    for place, stack in placements.items():
      (plan,) = stack.stacks.values()
      per_shard = plan.size // shards
      ratios = {"ids": [], "unique rows": []}
      for k in range(args.steps):
        logical = np.concatenate(
          [cols[t][k] + stack.location(n)[1] for t, n in enumerate(names)]
        )
        for what, x in (("ids", logical), ("unique rows", np.unique(logical))):
          device = np.asarray(plan.physical(x)) // per_shard
          counts = np.bincount(device, minlength=shards)
          ratios[what].append(counts.max() / counts.mean())
      row = {"dist": dist, "placement": place}
      row.update({k: float(np.mean(v)) for k, v in ratios.items()})
      out.append(row)
      print(row, flush=True)
  return out


def _zipf_ranks(rows, n, steps, seed):
  rng = np.random.default_rng(seed)
  cdf = np.cumsum(np.arange(1, rows + 1, dtype=np.float64) ** -_common.ZIPF_S)
  cdf /= cdf[-1]
  return [
    np.searchsorted(cdf, rng.random(n), side="right").astype(np.int32)
    for _ in range(steps)
  ]


def compile_point(features: int, optimizer: str, per_table_max: int) -> dict:
  rows = [min(models.CRITEO_KAGGLE[i % 26], 20_000) for i in range(features)]
  dim, batch = 32, 1024
  out = {"features": features, "optimizer": optimizer}
  rng = np.random.default_rng(SEED)
  ids = {
    f"f{t}": rng.integers(0, r, batch).astype(np.int32)
    for t, r in enumerate(rows)
  }
  y = np.zeros(batch, np.float32)
  stack, names, ptl, stl = models.criteo_models(rows, dim, batch)
  f32 = jnp.float32
  head = {
    "w": jax.ShapeDtypeStruct((features, dim), f32),
    "b": jax.ShapeDtypeStruct((), f32),
  }
  per_table = {
    n: jax.ShapeDtypeStruct((r, dim), f32)
    for n, r in zip(names, rows, strict=True)
  }
  variants = {
    "per-table": (ptl, per_table),
    "stack": (stl, {"emb": jax.eval_shape(stack.init, jax.random.key(0))}),
  }
  if features > per_table_max:
    del variants["per-table"]
  for variant, (loss, p) in variants.items():
    p = {**p, "head": head}
    tx = models.STACK_OPTIMIZERS[optimizer][0]()
    s = jax.eval_shape(tx.init, p)
    jitted = models.whole_step(loss, tx)
    out[variant] = _common.compile_phases(jitted, p, s, ids, y)
    print(features, optimizer, variant, out[variant], flush=True)
  return out


def _plot(steps: list[dict], points: list[dict]) -> None:
  """``results/stacks.png``: the step table as bars, compile time and
  kernels against the number of features."""
  try:
    fig, (ax, bx) = _results.figure(
      1, 2, figsize=(17, 4.5), gridspec_kw={"width_ratios": [3, 1]}
    )
  except ImportError:
    print("matplotlib not installed: no plot")
    return
  labels = [
    f"{r['model']} {r['head']}\n{r['dist']}\n{r['optimizer']}" for r in steps
  ]
  width = 0.2
  for k, sys_ in enumerate(SYSTEMS):
    xs = [i + (k - 1.5) * width for i in range(len(steps))]
    ax.bar(xs, [r.get(sys_, 0) for r in steps], width, label=sys_)
  ax.set_xticks(range(len(steps)), labels, fontsize=7)
  ax.set_ylabel("ms per whole step")
  ax.legend()
  ax.set_title("whole training step (lower is better)")
  for v in ("per-table", "stack"):
    pts = [p for p in points if v in p and p["optimizer"] == "lazy_adam"]
    for key, style, what, scale in (
      ("total_s", "o-", "trace+lower+compile s", 1),
      ("kernels", "s--", "kernels / 100", 100),
    ):
      if pts:
        xs = [p["features"] for p in pts]
        ys = [p[v][key] / scale for p in pts]
        bx.plot(xs, ys, style, label=f"{v}: {what}")
  bx.set_xlabel("features")
  bx.legend(fontsize=8)
  bx.set_title("compile and kernels (lazy_adam step)")
  _results.save_figure(fig, _results.result_path("stacks", ".png"), dpi=110)


def _step_table(steps: list[dict]) -> tuple[list, list]:
  headers = columns(
    "model | head | ids | optimizer | unique rows | "
    + " | ".join(f"{s} ms" for s in SYSTEMS)
    + " | stack / per-table speed | stack / torch speed | stack / fbgemm "
    "speed | stack optimizer ms | floor ms | optimizer / floor"
  )
  rows = []
  for r in steps:
    stack_ms, opt_ms = r["gtx stack"], r["gtx stack optimizer"]
    speed = [r.get(s) for s in ("gtx per-table", "torch", "fbgemm")]
    rows.append(
      [r["model"], r["head"], r["dist"], r["optimizer"]]
      + [f"{r['unique_rows']:,.0f}"]
      + [f"{r[s]:.2f}" if s in r else "n/a" for s in SYSTEMS]
      + [f"{ms / stack_ms:.2f}x" if ms else "n/a" for ms in speed]
      + [f"{opt_ms:.2f}", f"{r['floor']:.2f}", f"{opt_ms / r['floor']:.2f}x"]
    )
  return headers, rows


def lane_rows(args, sched: Schedule) -> list[list]:
  """The lanes table's rows: per ids and optimizer, the criteo step
  per-table and as a stack of each of ``args.lanes`` lanes (ms), the speed
  over ``lanes=1`` and over per-table."""
  crows = [min(c, args.cap) for c in models.CRITEO_KAGGLE]
  rng = np.random.default_rng(models.SEED + 2)
  tables_np = _tables(rng, crows, args.dim)
  rows = []
  for dist in args.dists:
    batches, labels = models.criteo_data(crows, args.batch, args.steps, dist)
    _, names, per_table_loss, _ = models.criteo_models(crows, args.dim)
    per_table_np = dict(zip(names, tables_np, strict=True))
    for opt in args.lane_optimizers:
      hp = _head(len(names), args.dim)
      systems = {"per-table": (per_table_loss, dict(per_table_np))}
      for lanes in args.lanes:
        stack, _, _, loss = models.criteo_models(
          crows, args.dim, args.batch, lanes
        )
        systems[f"lanes={lanes}"] = (loss, {"emb": stack.stack(per_table_np)})
      systems = {
        k: (loss, {**emb, "head": hp}, batches)
        for k, (loss, emb) in systems.items()
      }
      fns = gtx_systems(models.STACK_OPTIMIZERS[opt][0], systems, labels)
      t = sched.time(fns, label=f"{dist}, {opt}")
      lanes = [t[f"lanes={k}"] for k in args.lanes]
      rows.append(
        [dist, opt, f"{t['per-table'] * 1e3:.2f}"]
        + [f"{x * 1e3:.2f}" for x in lanes]
        + [
          f"{t['lanes=1'] / x:.2f}x"
          for k, x in zip(args.lanes, lanes, strict=True)
          if k != 1
        ]
        + [f"{t['per-table'] / x:.2f}x" for x in lanes]
      )
      print(rows[-1], flush=True)
  return rows


def write_lanes(args) -> None:
  sched = Schedule.from_args(args)
  rows = lane_rows(args, sched)
  write_results(
    "stack_lanes",
    "Lanes of a table stack: the Criteo whole step (ms, median)",
    ["ids", "optimizer", "per-table ms"]
    + [f"lanes={k} ms" for k in args.lanes]
    + [f"lanes={k} / lanes=1 speed" for k in args.lanes if k != 1]
    + [f"lanes={k} / per-table speed" for k in args.lanes],
    rows,
    notes=(
      f"Criteo's 26 cardinalities capped at {args.cap:,}, {args.dim} wide, "
      f"batch {args.batch}, a linear head; the stacks made with "
      "`batch_size` as the recommenders guide makes them (tables read 4 "
      f"times a row or more in a dense stack); {sched.describe()}. Default "
      "path: no opt-in call (host memory reused as gradtx sets it at "
      "import), the OS's pages."
    ),
  )


def write_stacks(args) -> None:
  torch = _common.import_torch()
  steps = [] if args.no_steps else step_rows(args, torch)
  balance = shard_balance(args)
  points = [
    compile_point(n, o, args.per_table_max)
    for n in ([] if args.no_compile else args.compile_features)
    for o in args.compile_optimizers
  ]
  headers, rows = _step_table(steps)
  compile_rows = [
    [pnt["features"], pnt["optimizer"], v]
    + [f"{pnt[v][f'{k}_s']:.2f}" for k in ("trace", "lower", "compile")]
    + [f"{pnt[v]['total_s']:.2f}"]
    + [pnt[v][k] for k in ("kernels", "scatter", "gather", "while")]
    for pnt in points
    for v in ("per-table", "stack")
    if v in pnt
  ]
  balance_rows = [
    [b["dist"], b["placement"], f"{b['ids']:.2f}", f"{b['unique rows']:.2f}"]
    for b in balance
  ]
  notes = (
    "Whole training step, loss returned, params and state donated, fresh "
    "ids every step; the stacks made as the recommenders guide makes "
    "them, with the step's batch size (`gtx.TableStack(specs, "
    "batch_size=B)`: the tables a step reads at least 4 times a row in a "
    "dense stack, two lanes on a CPU at batch 2048); speed ratios > 1 mean "
    "the stack is faster. fbgemm: FBGEMM's table-batched module on the host "
    "(`SplitTableBatchedEmbeddingBagsCodegen`, fbgemm-gpu-cpu, 2 threads), "
    "all tables in one module, its own jagged input, pooled by a sum, the "
    "optimizer fused into the backward; n/a for lazy_adam (no Adam on CPU) "
    "or where fbgemm_gpu does not import. Heads: linear (a logit weight "
    "vector per feature, a bias), mlp (a tanh layer of "
    f"{models.HIDDEN} over the concatenated features, then a logit); torch "
    "and FBGEMM run the head with their dense optimizer of the same kind "
    "(Adam for SparseAdam). stack optimizer: `tx.update` + "
    "`gtx.apply_updates` alone on the stack's real gradients (computed "
    "beforehand), jitted and donated. floor: the random-rows floor of that "
    "part (shared/ANCHORS.md): the step's unique rows of the parameter and "
    "of each state array read and written back with nothing computed "
    "(torch `index_select` + `index_copy_`, 2 threads; numpy where torch "
    "is missing). Compile: trace + lower + XLA compile of the criteo step "
    "(20k-row cap, 32 wide, batch 1024, linear head), op counts of the "
    "compiled program.\n\n"
    + markdown_table(
      columns(
        "features | optimizer | variant | trace s | lower s | compile s | "
        "total s | kernels | scatter | gather | while"
      ),
      compile_rows,
    )
    + "\n\nRow shards: a step's Criteo ids (26 features, batch "
    f"{args.batch}, the step table's cap) on an 8-way row-sharded stack, "
    "per device max / mean over the 8 devices (1.00 is even), averaged "
    "over the steps; contiguous blocks: the tables one after the other, cut "
    "into 8 blocks; zipf (rank ids): the hot rows are the low ids "
    "(vocabularies sorted by frequency).\n\n"
    + markdown_table(
      columns(
        "ids | placement | ids per device, max / mean | unique rows per "
        "device, max / mean"
      ),
      balance_rows,
    )
  )
  _plot(steps, points)
  write_results(
    "stacks",
    "Table stacks: whole step, per-table vs stack vs torch and FBGEMM",
    headers,
    rows,
    notes=notes,
    extra={"steps": steps, "compile": points, "shard_balance": balance},
  )


def main(argv: list[str] | None = None) -> None:
  flags = dict(steps=6, huge_pages=True, fresh_memory=True)
  ap = _common.parser(__doc__, schedule=Schedule(6, 3, 1), **flags)
  ap.add_argument("--dists", nargs="+", default=["uniform", "zipf"])
  sizes = dict(cap=100_000, dim=64, batch=2048, bag_tables=8)
  sizes.update(bag_rows=200_000, bag_batch=1024, per_table_max=104)
  for k, v in sizes.items():
    ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
  for flag, default in (
    ("--optimizers", list(models.STACK_OPTIMIZERS)),
    ("--compile-optimizers", ["lazy_adam"]),
    ("--lane-optimizers", ["lazy_adam", "rowwise_adagrad"]),
  ):
    ap.add_argument(
      flag, nargs="+", default=default, choices=models.STACK_OPTIMIZERS
    )
  _common.add_head_args(ap, models.STACK_OPTIMIZERS)
  ap.add_argument(
    "--compile-features", type=int, nargs="+", default=[26, 104, 500]
  )
  ap.add_argument("--lanes", type=int, nargs="+", default=[1, 2, 4])
  ap.add_argument(
    "--only",
    nargs="+",
    choices=["stacks", "lanes"],
    default=["stacks", "lanes"],
  )
  ap.add_argument("--no-steps", action="store_true")
  ap.add_argument("--no-compile", action="store_true")
  quick = dict(cap=5000, bag_rows=5000, batch=256, bag_batch=128, rounds=2)
  quick = dict(quick, compile_features=[26, 52])
  args = _common.parse(ap, argv, quick=quick)
  if "lanes" in args.only:
    write_lanes(args)
  if "stacks" in args.only:
    write_stacks(args)


if __name__ == "__main__":
  main()
