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

import itertools

import jax
import numpy as np
import optax

import gradtx as gtx
from benchmarks import models
from benchmarks._results import headline, oversubscribed
from benchmarks._timing import Counter, Schedule, step_runner
from benchmarks.optimizer_steps import (
  Scenario,
  System,
  floor_ms,
  jax_table,
  parse_args,
  run,
  torch_table,
  update_step,
)

LR = 1e-3


def _opt_only(tx, data, box):
  """``update`` + ``apply_updates`` alone on pre-built gradients of the
  step's ids, on the gtx step's donated buffers ``box``."""
  rows, dim = data.table.shape
  vals = np.random.default_rng(2).standard_normal((len(data.ct), dim))
  grads = [
    {"emb": gtx.SparseRows(i, vals.astype(np.float32), rows)} for i in data.ids
  ]
  args_of = lambda i: (grads[i % len(grads)],)  # noqa: E731
  return System(Counter(step_runner(update_step(tx), box, args_of), 0))


def _case(case, ctx):
  rows, dist, loss = case
  dim, n, linear = ctx.args.dim, ctx.args.ids, loss == "linear"
  loss = "linear" if linear else "tanh"
  data = models.one_table(rows, dim, n, dist, ctx.sched.steps)
  s = {}
  for name, catch_up in (("gtx", False), ("gtx catch_up", True)):
    tx = gtx.lazy_adam(LR, catch_up=catch_up)
    s[name] = jax_table(tx, data, 0, linear=linear, lookup=True)
    if not catch_up:
      s["gtx opt only"] = _opt_only(tx, data, s[name].keep)
  used = 6 * rows * dim * 4
  if ctx.torch:
    s["torch"] = torch_table("SparseAdam", data, 0, linear=linear, lr=LR)
    used += 3 * rows * dim * 4
  if used + 4 * rows * dim * 4 <= ctx.mem:
    s["optax"] = jax_table(optax.adam(LR), data, 0, linear=linear, dense=True)
  unique = data.unique()
  del data
  ms = ctx.time(s, f"{rows:,} x {dim}, {dist}, {loss}")
  floor = floor_ms(unique, dim, n, ctx.bandwidth)
  g, t, o, opt = (
    ms["gtx"],
    ms.get("torch", "-"),
    ms.get("optax", "-"),
    ms["gtx opt only"],
  )
  return [
    [f"{rows:,} x {dim}", dist, loss, n, round(unique), g, ms["gtx catch_up"]]
    + [t, o, t / g if t != "-" else "-", o / g if o != "-" else "-"]
    + [opt, floor, opt / floor, g / floor]
    + [f"{s['gtx'].copies}/{s['gtx catch_up'].copies}"]
    + [s["optax"].copies if "optax" in s else "-"]
  ]


def _finish(rows, ctx):
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
    for r in rows
    if isinstance(r[9], float)
  ]
  worst = round(max(r[13] for r in rows), 2)
  heads.append(
    headline("optimizer part / bandwidth floor (worst)", worst, "<= 8x")
  )
  notes = (
    f"Forward (loss returned) + backward + optimizer + apply, "
    f"{ctx.args.ids:,} fresh ids every step (pre-generated), "
    f"{ctx.sched.describe()} (machine noise hits all "
    "alike; consecutive steps are a training loop's steady state: torch's "
    "OpenMP workers, spinning after torch's step, slow the next system's "
    "first steps). gtx and optax jitted with params "
    "and state donated; torch `nn.Embedding(sparse=True)` + `SparseAdam`, "
    "2 threads. `gtx opt only` = `lazy_adam.update` + `apply_updates` on a"
    " SparseRows of the same fresh ids. floor = (read + write the touched "
    "rows of params, m, v; read the gradient rows) / warm copy bandwidth "
    f"({ctx.bandwidth / 1e9:.1f} GB/s, `np.copyto` into a pre-faulted "
    "buffer, read + write counted). Table copies = `copy` instructions "
    f"producing a table-shaped value in the compiled step.{caution}"
  )
  return notes, {"headline": heads, "warm_copy_bandwidth": ctx.bandwidth}


SCENARIO = Scenario(
  name="train_step",
  title="Whole training step: gradtx lazy_adam vs torch SparseAdam vs "
  "optax.adam",
  columns="table | ids | loss | ids/step | unique rows | gtx ms | gtx "
  "catch_up ms | torch SparseAdam ms | optax.adam ms | torch / gtx | optax "
  "/ gtx | gtx opt only ms | floor ms | opt only / floor | step / floor | "
  "gtx table copies (lazy/catch_up) | optax table copies",
  doc=__doc__,
  cases=lambda ctx: itertools.product(
    ctx.args.rows, ctx.args.dists, ctx.args.losses
  ),
  case=_case,
  finish=_finish,
  flags={
    **{"--rows": [100_000, 10**6, 4 * 10**6], "--dim": 64, "--ids": 8192},
    "--dists": ["uniform", "zipf"],
    "--losses": ["linear", "tanh"],
    "--no-torch": False,
    "--profile": dict(
      action="store_true",
      help="print the per-thunk time of the gtx step (first --rows, uniform "
      "ids, each --losses) instead of the comparison",
    ),
  },
  quick=dict(rows=[5_000], ids=256, rounds=3),
  options=dict(schedule=Schedule(), huge_pages=True),
  mem_gib=10,
  floor=True,
  torch=True,
)


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
  run_, _, _ = models.one_table_step(gtx.lazy_adam(LR), data, linear=linear)
  run_(0)
  run_(1)
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for i in range(2, steps + 2):
        run_(i)
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


def main(argv: list[str] | None = None) -> None:
  args = parse_args(SCENARIO, argv)
  if not args.profile:
    run(SCENARIO, args=args)
    return
  for loss in args.losses:
    print(f"\n{args.rows[0]:,} x {args.dim}, {args.ids} ids, {loss} loss")
    for ms, calls, name in profile(
      args.rows[0], args.dim, args.ids, loss == "linear"
    )[:30]:
      print(f"{ms:9.3f} ms/step  x{calls:5.1f}  {name[:70]}")


if __name__ == "__main__":
  main()
