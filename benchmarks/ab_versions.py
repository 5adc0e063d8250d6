"""Whole-step speed of this checkout against an earlier commit, in one run.

The earlier commit's ``gradtx`` package is materialized from git into a
temporary folder as ``gradtx_before`` (its imports renamed), so both
versions run side by side in one process: the whole training step users
run (forward with the loss returned, sparse backward, optimizer, apply;
jitted and donated; fresh uniform ids every step), alternating in rounds.
``--after REV`` takes the later version from git too (``gradtx_after``),
so that uncommitted work in the checkout stays out of the comparison.

Every built-in optimizer runs, and a user-written one: the guide's lazy
Lion (docs/guides/custom_optimizer.md) through ``gtx.row_transformation``.

  python -m benchmarks.ab_versions --before REV [--after REV]
      [--rows 1000000] [--dim 64] [--ids 8192]
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import re
import subprocess
import sys
import tempfile
from typing import Any

import jax.numpy as jnp
import numpy as np

import gradtx
from benchmarks._common import (
  Schedule,
  add_schedule_args,
  hlo_op_counts,
  ratio_rows,
  table_runner,
  table_step,
  uniform_batches,
  write_results,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_version(rev: str, name: str = "gradtx_before") -> Any:
  """``gradtx`` as of ``rev``, imported as ``name``."""
  out = pathlib.Path(tempfile.mkdtemp()) / name
  out.mkdir()
  names = subprocess.run(
    ["git", "ls-tree", "--name-only", rev, "gradtx/"],
    cwd=ROOT,
    check=True,
    capture_output=True,
    text=True,
  ).stdout.split()
  for name in names:
    if not name.endswith(".py"):
      continue
    text = subprocess.run(
      ["git", "show", f"{rev}:{name}"],
      cwd=ROOT,
      check=True,
      capture_output=True,
      text=True,
    ).stdout
    text = re.sub(r"\bgradtx\b(?=[._ ])", out.name, text)
    (out / pathlib.Path(name).name).write_text(text)
  sys.path.insert(0, str(out.parent))
  return importlib.import_module(out.name)


def lazy_lion(
  gtx: Any, learning_rate: float, b1=0.9, b2=0.99, weight_decay=0.0
) -> Any:
  """The guide's lazy Lion, a user's rule on ``gtx.row_transformation``."""

  def init(p):
    return (jnp.zeros_like(p),)

  def rule(g, p, m):
    c = b1 * m + (1 - b1) * g
    update = -learning_rate * (jnp.sign(c) + weight_decay * p)
    return update, (1 - b2) * g + b2 * m

  return gtx.row_transformation(rule, init, needs_params=True)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--before", required=True)
  parser.add_argument(
    "--after",
    default=None,
    help="the later version, a git revision (default: this checkout)",
  )
  parser.add_argument("--rows", type=int, default=1_000_000)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--ids", type=int, default=8192)
  parser.add_argument(
    "--only",
    default="",
    help="run only the optimizers whose name contains this text",
  )
  parser.add_argument(
    "--tables",
    type=int,
    default=26,
    help="also the DLRM-shaped step of benchmarks.recsys on this many "
    "tables (linear head, Zipf ids); 0 to skip",
  )
  add_schedule_args(parser)
  args = parser.parse_args(argv)
  sched = Schedule.from_args(args)
  versions = {f"before ({args.before})": load_version(args.before)}
  if args.after is None:
    now = "this checkout"
    versions["now"] = gradtx
  else:
    now = args.after
    versions[f"after ({now})"] = load_version(now, "gradtx_after")
  rng = np.random.RandomState(0)
  batches = uniform_batches(rng, args.rows, args.ids)
  makers = {
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
  rows = []
  for name, make in makers.items():
    if args.only not in name:
      continue
    fns, ops = {}, {}
    for label, gtx in versions.items():
      tx = make(gtx)
      table = jnp.asarray(rng.normal(size=(args.rows, args.dim)), jnp.float32)
      step = table_step(gtx, tx)
      ops[label] = _ops(step, {"emb": table}, tx, batches[0])
      fns[label] = table_runner(step, tx, table, batches)
    rows += _with_ops(ratio_rows(name, fns, sched), ops)
  if args.tables:
    rows += _many_tables(versions, args, sched)
  write_results(
    "ab_versions",
    f"Whole step, {now} vs {args.before}: {args.rows:,} x "
    f"{args.dim} table, {args.ids:,} fresh uniform ids per step",
    ["optimizer", "version", "step ms", "vs before", "kernels", "scatters"],
    rows,
    notes=sched.describe() + "; both versions in one process. kernels, "
    "scatters: what the compiled step launches (benchmarks._common."
    "hlo_op_counts), the same on every machine.",
  )


def _ops(step: Any, params: Any, tx: Any, *args: Any) -> dict[str, int]:
  """Static op counts of ``step``'s compiled program on these arguments."""
  import jax

  state = jax.eval_shape(tx.init, params)
  return hlo_op_counts(step.lower(params, state, *args).compile().as_text())


def _with_ops(rows: list, ops: dict[str, dict[str, int]]) -> list:
  """``rows`` of :func:`ratio_rows` with each version's kernels and
  scatters appended."""
  return [
    row + [ops[row[1]]["kernels"], ops[row[1]]["scatter"]] for row in rows
  ]


def _many_tables(versions: dict, args: Any, sched: Schedule) -> list:
  """The recsys step (one leaf per table, Criteo's cardinalities capped at
  100k, 64 wide, batch 2048, Zipf ids, linear head) for each version."""
  import jax

  from benchmarks import recsys

  makers = [
    (name, make)
    for name, make in (
      ("lazy_adam", lambda g: g.lazy_adam(1e-3)),
      ("rowwise_adagrad", lambda g: g.rowwise_adagrad(1e-2)),
    )
    if args.only in name
  ]
  if not makers:
    return []
  table_rows = recsys.table_rows(args.tables, 100_000)
  data = recsys.make_data(table_rows, 2048, 8, "zipf")
  params_np = recsys.init_params(table_rows, 64, "linear", 0)
  loss = recsys.per_table_loss(args.tables)
  rows = []
  for name, make in makers:
    fns, ops = {}, {}
    for label, gtx in versions.items():
      tx = make(gtx)

      def step(p, s, ids, y, gtx=gtx, tx=tx):
        value, g = gtx.sparse_value_and_grad(loss)(p, ids, y)
        u, s = tx.update(g, s, p)
        return gtx.apply_updates(p, u), s, value

      jitted = jax.jit(step, donate_argnums=(0, 1))
      box = {"p": jax.tree.map(jnp.asarray, params_np), "k": 0}
      box["s"] = tx.init(box["p"])
      ops[label] = _ops(jitted, box["p"], tx, data.ids[0], data.labels[0])

      def run(box=box, jitted=jitted):
        box["k"] = (box["k"] + 1) % len(data.ids)
        k = box["k"]
        box["p"], box["s"], v = jitted(
          box["p"], box["s"], data.ids[k], data.labels[k]
        )
        v.block_until_ready()

      fns[label] = run
    rows += _with_ops(
      ratio_rows(f"{name}, {args.tables} tables", fns, sched), ops
    )
  return rows


if __name__ == "__main__":
  main()
