"""Whole-step speed of this checkout against earlier commits, in separate
processes.

Each version's ``gradtx`` package is exported from git into a folder of its
own, and every measurement is a fresh process that imports one version,
builds one step, runs it and exits: no version inherits another's
allocator state, compiled programs or warm caches (one process holding
both versions once showed a change 10% faster that fresh processes showed
slower). The processes alternate, version after version, over
``--rounds`` rounds, the order reversed every other round so that drift in
the machine's load falls on every version alike; a version's figure is the
median of its rounds' medians, and the table gives their spread (lowest
to highest round) and the spread of the round-by-round ratio to the
baseline (the first ``--before``), which pairs runs made at the same
time.

The step is the whole one users run (forward with the loss returned,
sparse backward, optimizer, apply; jitted, params and state donated; fresh
uniform ids every step, pre-generated), on the default path (no opt-in
call). Every built-in optimizer runs, and a user-written one: the guide's
lazy Lion (docs/guides/custom_optimizer.md) through
``gtx.row_transformation``; then the DLRM-shaped step of
``benchmarks.recsys`` on ``--tables`` tables, with ``--bags`` the
weighted bags of ``benchmarks.stacks`` in one table stack, and with
``--hashed`` the hashed Criteo step of ``benchmarks.vocab`` (the id map).
torch's ``nn.Embedding(sparse=True)`` + ``SparseAdam`` runs beside lazy Adam, in
processes of its own, with ``--torch-python`` (default: ``.venv-bench``'s
python where it exists, else this one where torch imports).

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


def lazy_lion(
  gtx: Any, learning_rate: float, b1=0.9, b2=0.99, weight_decay=0.0
) -> Any:
  """The guide's lazy Lion, a user's rule on ``gtx.row_transformation``."""
  import jax.numpy as jnp

  def init(p):
    return (jnp.zeros_like(p),)

  def rule(g, p, m):
    c = b1 * m + (1 - b1) * g
    update = -learning_rate * (jnp.sign(c) + weight_decay * p)
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
# the recsys steps on --tables tables
MANY = {
  "lazy_adam": lambda g: g.lazy_adam(1e-3),
  "rowwise_adagrad": lambda g: g.rowwise_adagrad(1e-2),
}
# the bags stack steps (--bags): benchmarks.stacks' optimizers by name
BAGS = ("lazy_adam", "sgd")
# the hashed Criteo steps (--hashed): benchmarks.vocab's at capacity 100%
HASHED = MANY
HASHED_FILL = 20  # untimed steps first, so the maps are full and evicting
SIZES = ("rows", "dim", "ids", "tables", "steps")  # a step's process gets


# ----------------------------------------------------------------------------
# one process: one version, one step


def _single_data(spec: dict) -> tuple[np.ndarray, list[np.ndarray]]:
  """The table and every step's fresh uniform ids, alike in every
  process (jax's and torch's)."""
  rng = np.random.default_rng(0)
  table = rng.standard_normal((spec["rows"], spec["dim"]), dtype=np.float32)
  batches = [
    rng.integers(0, spec["rows"], spec["ids"]).astype(np.int32)
    for _ in range(WARMUP + spec["steps"])
  ]
  return table, batches


def _gtx_single(spec: dict) -> tuple[Any, dict]:
  import jax.numpy as jnp

  import gradtx as gtx
  from benchmarks._common import table_step

  table, batches = _single_data(spec)
  tx = SINGLE[spec["case"]](gtx)
  params = {"emb": jnp.asarray(table)}
  del table
  ids = [jnp.asarray(b) for b in batches]
  return _compiled_runner(
    table_step(gtx, tx), params, tx.init(params), ids, lambda b: (b,)
  )


def _gtx_many(spec: dict) -> tuple[Any, dict]:
  import jax
  import jax.numpy as jnp

  import gradtx as gtx
  from benchmarks import models

  rows = models.table_rows(spec["tables"], 100_000)
  data = models.make_data(rows, 2048, WARMUP + spec["steps"], "zipf")
  params = jax.tree.map(jnp.asarray, models.init_params(rows, 64, "linear", 0))
  loss = models.per_table_loss(spec["tables"])
  tx = MANY[spec["case"]](gtx)
  batches = list(zip(data.ids, data.labels, strict=True))
  return _compiled_runner(
    models.whole_step(loss, tx), params, tx.init(params), batches, lambda b: b
  )


def _gtx_bags(spec: dict) -> tuple[Any, dict]:
  """The bags step of ``benchmarks.stacks``: 8 tables of 200k x 64 in one
  ``gtx.TableStack`` made with the batch size, 1,024 examples of 1-20
  weighted Zipf ids per table as ``gtx.Jagged``, a linear head."""
  import jax
  import jax.numpy as jnp

  import gradtx as gtx
  from benchmarks import models

  tables, rows, batch = 8, 200_000, 1024
  raw, labels, _ = models.bag_data(
    tables, rows, batch, WARMUP + spec["steps"], "zipf"
  )
  stack, names, _, loss = models.bag_models(tables, rows, spec["dim"], batch)
  rng = np.random.default_rng(0)
  per_table = {
    n: (0.05 * rng.standard_normal((rows, spec["dim"]))).astype(np.float32)
    for n in names
  }
  head = models.head_params(tables, spec["dim"], "linear", models.HIDDEN, rng)
  params = jax.tree.map(
    jnp.asarray, {"emb": stack.stack(per_table), "head": head}
  )
  del per_table
  tx = models.STACK_OPTIMIZERS[spec["case"]][0]()
  batches = [
    ({n: gtx.Jagged(b[n][0], b[n][1], b[n][2]) for n in names}, y)
    for b, y in zip(raw, labels, strict=True)
  ]
  return _compiled_runner(
    models.whole_step(loss, tx), params, tx.init(params), batches, lambda b: b
  )


def _gtx_hashed(spec: dict) -> tuple[Any, dict]:
  """The hashed step of ``benchmarks.vocab``: 26 hashed Criteo features,
  batch 2,048, Zipf raw ids, each table as many rows as its distinct ids
  over the 16 batches the steps cycle through; ``stack.admit`` +
  ``gtx.reset_rows`` + loss, gradient and update, params, state and map
  donated, after ``HASHED_FILL`` untimed steps."""
  import jax
  import jax.numpy as jnp

  import gradtx as gtx
  from benchmarks import models
  from benchmarks._common import hlo_op_counts

  names, raw, labels, distinct = models.criteo_raw(2048, 16, 1.2, 0)
  rows = {n: max(64, distinct[n]) for n in names}
  tx = HASHED[spec["case"]](gtx)
  stack, params, step = models.hashed_criteo(names, rows, spec["dim"], tx, True)
  box = [params, tx.init(params), stack.init_vocab(jax.random.key(1))]
  batches = [
    ({n: jnp.asarray(b[n]) for n in names}, jnp.asarray(y))
    for b, y in zip(raw, labels, strict=True)
  ]
  compiled = step.lower(*box, *batches[0]).compile()

  def run(k: int) -> None:
    *box[:], loss = compiled(*box, *batches[k % len(batches)])
    loss.block_until_ready()

  for k in range(HASHED_FILL):
    run(k)
  return run, hlo_op_counts(compiled.as_text())


def _compiled_runner(jitted, params, state, batches, args) -> tuple[Any, dict]:
  """``(run(k), op counts)``: the step compiled once, run on batch ``k``
  with its donated params and state, waiting for the loss."""
  from benchmarks._common import hlo_op_counts

  compiled = jitted.lower(params, state, *args(batches[0])).compile()
  box = [params, state]

  def run(k: int) -> None:
    box[0], box[1], loss = compiled(box[0], box[1], *args(batches[k]))
    loss.block_until_ready()

  return run, hlo_op_counts(compiled.as_text())


def _torch_single(spec: dict) -> tuple[Any, dict]:
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

  return run, {}


def worker(spec: dict) -> dict:
  """Runs one step ``WARMUP`` times, then ``spec["steps"]`` timed times on
  fresh ids: wall and process CPU ms of each, and the op counts."""
  if spec["path"] is None:
    run, ops = _torch_single(spec)
  else:
    sys.path.insert(0, spec["path"])
    make = {"many": _gtx_many, "bags": _gtx_bags, "hashed": _gtx_hashed}.get(
      spec["kind"], _gtx_single
    )
    run, ops = make(spec)
  for k in range(WARMUP):
    run(k)
  wall, cpu = [], []
  for k in range(WARMUP, WARMUP + spec["steps"]):
    clock = Clock()
    run(k)
    wall.append(1e3 * clock.wall())
    cpu.append(1e3 * clock.cpu())
  return {"wall": wall, "cpu": cpu, "ops": ops}


# ----------------------------------------------------------------------------
# the parent: alternating processes


def _spawn(python: str, spec: dict) -> dict:
  env = dict(os.environ, JAX_ENABLE_COMPILATION_CACHE="false")
  out = subprocess.run(
    [python, "-m", "benchmarks.ab_versions", "--worker", json.dumps(spec)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
  )
  if out.returncode:
    raise RuntimeError(f"the step's process failed:\n{out.stderr}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def _p10(xs: list[float]) -> float:
  """The 10th percentile: the steps that ran while the process had the
  cores, less exposed to other programs on a shared machine."""
  return float(np.percentile(xs, 10))


def _spread(xs: list[float]) -> str:
  return f"{min(xs):.2f}-{max(xs):.2f}"


def measure(
  label: str, kind: str, case: str, systems: dict, args: Any
) -> list[list]:
  """Rows for one step: every system in ``systems`` (label -> (python,
  gradtx folder or None for torch)) alternating over ``args.rounds``
  rounds of fresh processes."""
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
  record(
    label,
    {n: [w / 1e3 for x in per[n] for w in x["wall"]] for n in names},
    args.steps,
    rounds=args.rounds,
    processes="one per version and round",
  )
  wall = {n: [statistics.median(x["wall"]) for x in per[n]] for n in names}
  cpu = {n: [statistics.median(x["cpu"]) for x in per[n]] for n in names}
  p10 = {n: [_p10(x["wall"]) for x in per[n]] for n in names}
  base = names[0]
  rows = []
  for n in names:
    ratios = [a / b for a, b in zip(wall[n], wall[base], strict=True)]
    ops = per[n][0]["ops"]
    med = statistics.median(wall[n])
    rows.append(
      [label, n, f"{med:.2f}", _spread(wall[n])]
      + [f"{med / statistics.median(wall[base]):.3f}"]
      + [f"{min(ratios):.2f}-{max(ratios):.2f}"]
      + [f"{statistics.median(x[n]):.2f}" for x in (p10, cpu)]
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
  p.add_argument(
    "--before",
    nargs="+",
    default=[],
    help="earlier git revisions; the first is the baseline of the ratios",
  )
  p.add_argument(
    "--after",
    default=None,
    help="the later version, a git revision (default: this checkout, "
    "uncommitted work included)",
  )
  p.add_argument("--rows", type=int, default=1_000_000)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--ids", type=int, default=8192)
  p.add_argument(
    "--only",
    nargs="+",
    default=None,
    help="run only these steps (names as in the table's first column, "
    "'lazy_adam, 26 tables' for a recsys step)",
  )
  p.add_argument(
    "--tables",
    type=int,
    default=26,
    help="also the DLRM-shaped step of benchmarks.recsys on this many "
    "tables (linear head, Zipf ids); 0 to skip",
  )
  p.add_argument(
    "--bags",
    action="store_true",
    help="also the bags stack step of benchmarks.stacks (Zipf, gtx.Jagged)",
  )
  p.add_argument(
    "--hashed",
    action="store_true",
    help="also the hashed Criteo step of benchmarks.vocab (the id map)",
  )
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
  python = sys.executable
  systems = {
    f"before ({rev})": (python, export_version(rev)) for rev in args.before
  }
  if args.after is None:
    systems[CHECKOUT] = (python, str(ROOT))
  else:
    systems[f"after ({args.after})"] = (python, export_version(args.after))
  torch_python = _torch_python(args)
  rows = []
  for case in SINGLE:
    if args.only and case not in args.only:
      continue
    with_torch = dict(systems)
    if case == "lazy_adam" and torch_python:
      with_torch[TORCH] = (torch_python, None)
    rows += measure(case, "single", case, with_torch, args)
  single = bool(rows)  # the title names the single table's size
  for case in MANY if args.tables else ():
    label = f"{case}, {args.tables} tables"
    if not args.only or label in args.only:
      rows += measure(label, "many", case, systems, args)
  for case in BAGS if args.bags else ():
    label = f"{case}, bags stack"
    if not args.only or label in args.only:
      rows += measure(label, "bags", case, systems, args)
  for case in HASHED if args.hashed else ():
    label = f"{case}, 26 hashed tables"
    if not args.only or label in args.only:
      rows += measure(label, "hashed", case, systems, args)
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
  md = write_results(
    "ab_versions",
    f"Whole step, {versions}"
    + (
      f": {args.rows:,} x {args.dim} table, {args.ids:,} fresh uniform ids "
      "per step"
      if single
      else ""
    ),
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
