"""Whole-step speed of this checkout against earlier commits, in separate
processes.

Each version's ``gradtx`` is exported from git into a folder of its own,
and every measurement is a fresh process that imports one version, builds
one step, runs it and exits: no version inherits another's allocator,
compiled programs or caches. The processes alternate over ``--rounds``
rounds, the order reversed every other round; the table's notes say what
each figure is. The steps (the whole one users run, on the default path):
every built-in optimizer and the guide's lazy Lion on one table, torch's
``SparseAdam`` beside lazy Adam (``--torch-python``, default
``.venv-bench``'s python where it exists); the step of
``benchmarks.recsys`` on ``--tables`` tables; with ``--bags`` the weighted
bags of ``benchmarks.stacks``, with ``--hashed`` the hashed Criteo step of
``benchmarks.vocab``.

  python -m benchmarks.ab_versions --before REV [REV ...] [--after REV]
      [--rows 1000000] [--dim 64] [--ids 8192] [--rounds 5] [--steps 30]
      [--only TEXT] [--tables 26] [--bags] [--hashed]
      [--torch-python PATH | --no-torch]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
from typing import Any

import numpy as np

from benchmarks._common import ROOT, export_version, import_torch, parse, parser
from benchmarks._results import columns, result_path, write_results
from benchmarks._timing import Clock, record

CHECKOUT = "this checkout"
TORCH = "torch SparseAdam"
WARMUP = 5


def lazy_lion(gtx: Any, lr: float, b1=0.9, b2=0.99, weight_decay=0.0) -> Any:
  """The guide's lazy Lion, a user's rule on ``gtx.row_transformation``."""
  import jax.numpy as jnp

  def init(p):
    return (jnp.zeros_like(p),)

  def rule(g, p, m):
    c = b1 * m + (1 - b1) * g
    update = -lr * (jnp.sign(c) + weight_decay * p)
    return update, (1 - b2) * g + b2 * m

  return gtx.row_transformation(rule, init, needs_params=True)


# the single-table steps: name -> the optimizer, from the version's gtx
SINGLE = {
  "lazy_adam": lambda g: g.lazy_adam(1e-3),
  "lazy_adamw": lambda g: g.lazy_adamw(1e-3, weight_decay=1e-4),
  "rowwise_adagrad": lambda g: g.rowwise_adagrad(1e-2),
  "adagrad": lambda g: g.adagrad(1e-2),
  "ftrl": lambda g: g.ftrl(0.05, l1_regularization_strength=1e-4),
  "lazy_sgd_momentum": lambda g: g.lazy_sgd(1e-2, momentum=0.9),
  "lazy_adam_catch_up": lambda g: g.lazy_adam(1e-3, catch_up=True),
  "user lazy_lion (row_transformation)": lambda g: lazy_lion(
    g, 1e-4, weight_decay=1e-4
  ),
}
# the recsys steps on --tables tables; the hashed Criteo steps (--hashed)
MANY = {
  "lazy_adam": lambda g: g.lazy_adam(1e-3),
  "rowwise_adagrad": lambda g: g.rowwise_adagrad(1e-2),
}
# kind -> its cases and its rows' label; the bags stack steps (--bags):
# benchmarks.stacks' optimizers by name
KINDS = {
  "single": (SINGLE, "{case}"),
  "many": (MANY, "{case}, {tables} tables"),
  "bags": (dict.fromkeys(["lazy_adam", "sgd"]), "{case}, bags stack"),
  "hashed": (MANY, "{case}, 26 hashed tables"),
}
HASHED_FILL = 20  # untimed steps first, so the maps are full and evicting
SIZES = ("rows", "dim", "ids", "tables", "steps")  # a step's process gets


def _single_data(spec: dict) -> tuple[np.ndarray, list[np.ndarray]]:
  """The table and every step's fresh ids, alike in every process."""
  rng = np.random.default_rng(0)
  table = rng.standard_normal((spec["rows"], spec["dim"]), dtype=np.float32)
  batches = [
    rng.integers(0, spec["rows"], spec["ids"]).astype(np.int32)
    for _ in range(WARMUP + spec["steps"])
  ]
  return table, batches


def _gtx_step(spec: dict) -> tuple:
  """``(jitted step, donated state, batches, untimed steps)`` of the
  step ``spec`` names, from the gradtx on ``sys.path``."""
  import jax
  import jax.numpy as jnp

  import gradtx as gtx
  from benchmarks import models
  from benchmarks._common import table_step

  kind, steps, dim = spec["kind"], WARMUP + spec["steps"], spec["dim"]
  tx = KINDS[kind][0][spec["case"]]
  tx = tx(gtx) if tx else models.STACK_OPTIMIZERS[spec["case"]][0]()
  if kind == "single":
    table, ids = _single_data(spec)
    params = {"emb": jnp.asarray(table)}
    del table
    step, batches = table_step(gtx, tx), [(jnp.asarray(b),) for b in ids]
  elif kind == "many":  # benchmarks.recsys: a linear head, Zipf ids
    rows = models.table_rows(spec["tables"], 100_000)
    data = models.make_data(rows, 2048, steps, "zipf")
    params = models.init_params(rows, 64, "linear", 0)
    params = jax.tree.map(jnp.asarray, params)
    step = models.whole_step(models.per_table_loss(spec["tables"]), tx)
    batches = list(zip(data.ids, data.labels, strict=True))
  elif kind == "bags":  # benchmarks.stacks: 8 tables of 200k, 1-20 Zipf ids
    tables, rows, batch = 8, 200_000, 1024
    raw, labels, _ = models.bag_data(tables, rows, batch, steps, "zipf")
    stack, names, _, loss = models.bag_models(tables, rows, dim, batch)
    rng = np.random.default_rng(0)
    per_table = {
      n: (0.05 * rng.standard_normal((rows, dim))).astype(np.float32)
      for n in names
    }
    head = models.head_params(tables, dim, "linear", models.HIDDEN, rng)
    params = {"emb": stack.stack(per_table), "head": head}
    params = jax.tree.map(jnp.asarray, params)
    del per_table
    step, batches = (
      models.whole_step(loss, tx),
      [
        ({n: gtx.Jagged(b[n][0], b[n][1], b[n][2]) for n in names}, y)
        for b, y in zip(raw, labels, strict=True)
      ],
    )
  else:  # hashed, benchmarks.vocab's: 26 Criteo features, batch 2,048,
    # each table as many rows as its distinct ids over the 16 batches
    names, raw, labels, distinct = models.criteo_raw(2048, 16, 1.2, 0)
    rows = {n: max(64, distinct[n]) for n in names}
    stack, params, step = models.hashed_criteo(names, rows, dim, tx, True)
    vocab = stack.init_vocab(jax.random.key(1))
    batches = [
      ({n: jnp.asarray(b[n]) for n in names}, jnp.asarray(y))
      for b, y in zip(raw, labels, strict=True)
    ]
    return step, [params, tx.init(params), vocab], batches, HASHED_FILL
  return step, [params, tx.init(params)], batches, 0


def _torch_single(spec: dict) -> Any:
  """torch's twin of the lazy Adam step: ``nn.Embedding(sparse=True)``,
  the same loss, ``SparseAdam``, two threads, ``loss.item()`` returned."""
  torch = import_torch()
  table, batches = _single_data(spec)
  emb = torch.nn.Embedding(*table.shape, sparse=True)
  with torch.no_grad():
    emb.weight.copy_(torch.from_numpy(table))
  del table
  opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-3)
  ids = [torch.from_numpy(b.astype(np.int64)) for b in batches]

  def run(k: int) -> None:
    opt.zero_grad(set_to_none=True)
    loss = (torch.tanh(emb(ids[k])) * 0.01).sum()
    loss.backward()
    opt.step()
    loss.item()

  return run


def worker(spec: dict) -> dict:
  """Runs one step ``WARMUP`` times (after its untimed fill), then
  ``spec["steps"]`` timed times on fresh ids: wall and process CPU ms of
  each, and the compiled step's op counts."""
  ops: dict = {}
  if spec["path"] is None:
    run = _torch_single(spec)
  else:
    from benchmarks._common import hlo_op_counts

    sys.path.insert(0, spec["path"])
    jitted, box, batches, fill = _gtx_step(spec)
    compiled = jitted.lower(*box, *batches[0]).compile()
    ops = hlo_op_counts(compiled.as_text())

    def run(k: int) -> None:
      *box[:], loss = compiled(*box, *batches[k % len(batches)])
      loss.block_until_ready()

    for k in range(fill):
      run(k)
  for k in range(WARMUP):
    run(k)
  wall, cpu = [], []
  for k in range(WARMUP, WARMUP + spec["steps"]):
    clock = Clock()
    run(k)
    wall.append(1e3 * clock.wall())
    cpu.append(1e3 * clock.cpu())
  return {"wall": wall, "cpu": cpu, "ops": ops}


def _spawn(python: str, spec: dict) -> dict:
  env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")
  cmd = [python, "-m", "benchmarks.ab_versions", "--worker", json.dumps(spec)]
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
  if out.returncode:
    raise RuntimeError(f"the step's process failed:\n{out.stderr}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def _spread(xs: list[float]) -> str:
  return f"{min(xs):.2f}-{max(xs):.2f}"


def measure(label: str, kind: str, case: str, systems: dict, args) -> list:
  """Rows for one step: every system of ``systems`` (label -> (python,
  gradtx folder or None for torch)) over ``args.rounds`` rounds."""
  names = list(systems)
  per: dict[str, list[dict]] = {n: [] for n in names}
  for r in range(args.rounds):
    for n in names if r % 2 == 0 else names[::-1]:
      python, path = systems[n]
      spec = dict(kind=kind, case=case, path=path)
      spec.update({k: getattr(args, k) for k in SIZES})
      per[n].append(_spawn(python, spec))
      got = statistics.median(per[n][-1]["wall"])
      print(f"{label} | {n} | round {r + 1}: {got:.2f} ms", file=sys.stderr)
  seconds = {n: [w / 1e3 for x in per[n] for w in x["wall"]] for n in names}
  record(
    label,
    seconds,
    args.steps,
    rounds=args.rounds,
    processes="one per version and round",
  )
  median = statistics.median
  wall = {n: [median(x["wall"]) for x in per[n]] for n in names}
  base, rows = wall[names[0]], []
  for n in names:
    ratios = [a / b for a, b in zip(wall[n], base, strict=True)]
    p10 = median([float(np.percentile(x["wall"], 10)) for x in per[n]])
    cpu = median([median(x["cpu"]) for x in per[n]])
    ops = per[n][0]["ops"]
    rows.append(
      [label, n, f"{median(wall[n]):.2f}", _spread(wall[n])]
      + [f"{median(wall[n]) / median(base):.3f}", _spread(ratios)]
      + [f"{p10:.2f}", f"{cpu:.2f}"]
      + [ops.get("kernels", "-"), ops.get("scatter", "-")]
    )
  return rows


def _torch_python(args: Any) -> str | None:
  if args.no_torch:
    return None
  candidates = [args.torch_python] if args.torch_python else []
  candidates += [str(ROOT / ".venv-bench" / "bin" / "python"), sys.executable]
  for python in filter(os.path.exists, candidates):
    check = [python, "-c", "import torch"]
    if subprocess.run(check, capture_output=True).returncode == 0:
      return python
  return None


def _with_previous(payload_path: pathlib.Path) -> tuple[str, dict | None]:
  """The results now in ``ab_versions.md|json`` (before this run
  overwrites them), kept below the new table: the last A/B run."""
  md = payload_path.with_suffix(".md")
  if not payload_path.exists() or not md.exists():
    return "", None
  old = json.loads(payload_path.read_text())
  old.pop("previous", None)
  text = md.read_text().split("\n### Previous run: ", 1)[0].strip()
  return text.replace("## ", "### Previous run: ", 1), old


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__.split("\n\n")[0], rounds=5, steps=30)
  p.add_argument("--before", nargs="+", default=[], help="the first: baseline")
  p.add_argument("--after", help="a git revision (default: this checkout)")
  for flag, default in (("rows", 1_000_000), ("dim", 64), ("ids", 8192)):
    p.add_argument(f"--{flag}", type=int, default=default)
  p.add_argument("--only", nargs="+", help="steps, as the table's first column")
  p.add_argument("--tables", type=int, default=26, help="0: no recsys step")
  p.add_argument("--bags", action="store_true", help="the bags stack step")
  p.add_argument("--hashed", action="store_true", help="the hashed step")
  p.add_argument("--torch-python", default=None)
  p.add_argument("--no-torch", action="store_true")
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  quick = dict(rows=20_000, ids=512, rounds=2, steps=5, tables=4)
  args = parse(p, argv, quick=quick)
  if args.worker:
    print(json.dumps(worker(json.loads(args.worker))))
    return
  if not args.before:
    p.error("--before: give at least one earlier git revision")
  revs = {f"before ({rev})": rev for rev in args.before}
  revs[f"after ({args.after})" if args.after else CHECKOUT] = args.after
  systems = {
    n: (sys.executable, export_version(rev) if rev else str(ROOT))
    for n, rev in revs.items()
  }
  torch_python = _torch_python(args)
  rows, runs = [], dict(many=args.tables, bags=args.bags, hashed=args.hashed)
  for kind, (cases, label) in KINDS.items():
    for case in cases if runs.get(kind, True) else ():
      name = label.format(case=case, tables=args.tables)
      if args.only and name not in args.only:
        continue
      these = dict(systems)
      if (kind, case) == ("single", "lazy_adam") and torch_python:
        these[TORCH] = (torch_python, None)
      rows += measure(name, kind, case, these, args)
    if kind == "single":
      single = bool(rows)  # the title names the single table's size
  versions = " vs ".join(
    reversed([n.split("(")[-1].rstrip(")") for n in systems])
  )
  previous_md, previous = _with_previous(result_path("ab_versions", ".json"))
  notes = (
    f"{args.rounds} rounds of fresh processes, one per version and step, "
    "alternating (the order reversed every other round); each process "
    f"runs the step {WARMUP} times untimed, then {args.steps} timed steps "
    "on fresh ids. step ms: the median over rounds of each round's median "
    "step; spread: the lowest and highest round; vs before: against the "
    "first version's median, and its spread the lowest and highest ratio "
    "of two runs of the same round; p10 ms: the median over rounds of "
    "each round's 10th-percentile step (the steps that had the cores, less "
    "exposed to other programs on a shared machine); cpu ms: the "
    "process's CPU time per step (its threads together; less sensitive "
    "to other programs on the cores than wall time). kernels, scatters: "
    "what the compiled step launches (benchmarks._common.hlo_op_counts), "
    "the same on every machine. torch: nn.Embedding(sparse=True) + "
    "SparseAdam, 2 threads, the same loss and ids."
  )
  if not torch_python:
    notes += " torch did not import: no torch row."
  title = f"Whole step, {versions}"
  if single:
    title += f": {args.rows:,} x {args.dim} table, {args.ids:,} fresh "
    title += "uniform ids per step"
  md = write_results(
    "ab_versions",
    title,
    columns(
      "step | version | step ms | spread ms | vs before | spread | p10 ms | "
      "cpu ms | kernels | scatters"
    ),
    rows,
    notes=notes,
    extra={"previous": previous} if previous else None,
  )
  if previous_md:
    result_path("ab_versions", ".md").write_text(md + "\n" + previous_md + "\n")


if __name__ == "__main__":
  main()
