"""Does quality hold with cheaper optimizers and lower precision?

Two models trained on real data, the Python standard library's source on
this machine (tokenized as ``examples/demo.py`` does it), split by file:
every 10th file in sorted order is held out, the rest is trained on (the
vocabulary comes from the training files only; the corpus and the two
models: ``benchmarks/corpus.py``).

* ``skip-gram``: word2vec with negative sampling, as in the demo: two
  ``[vocab, 64]`` tables (center, context) read as plain ``table[ids]``.
  Held-out loss: the same loss on held-out (center, context) pairs with a
  fixed set of negatives (fixed seed), so every config is scored on the
  same examples.
* ``next-token LM``: the 4 previous tokens' rows of a ``[vocab, 64]`` table,
  concatenated, a ``tanh`` dense layer to 64, a separate (not tied) output
  projection and full softmax over the vocabulary. Held-out loss: mean
  next-token cross entropy on a fixed set of held-out positions.

Every config starts from the same init and sees the same batches in the
same order for the same number of steps, in rounds in one process (each
config trains one eval interval, then the next), so machine noise hits all
alike. Configs (:data:`CONFIGS`): dense ``optax.adam`` (``jax.value_and_grad``),
the gradtx optimizers on ``gtx.sparse_value_and_grad``, and low-precision
variants, each with a float32 twin (the same optimizer in float32): int8
accumulators of ``adagrad`` / ``lazy_sgd``; bf16 tables (rounded to nearest
or stochastically, ``key=fold_in(key, step)``) with float32 moments, or
with ``lazy_adam``'s default moments in each param's dtype; int8 m/v; and
bf16 stochastic + int8 m/v. A state dtype passed to an optimizer applies to
every parameter (in the LM, ``"int8"`` also quantizes ``w``'s and
``w_out``'s state). Reported per task and config: held-out loss every
``steps / evals`` steps and at the end (as a ratio to float32 ``lazy_adam``
and to the float32 twin), where a low-precision variant stops following
its twin (:func:`stall_step`), ``gtx.bytes_per_row`` of the table, and the
whole step's time (median, the first ``SETTLE`` of each round untimed).
Writes ``results/convergence.{md,json,png}``.

Learning rates (:data:`LR`): one peak rate per task and optimizer family,
cosine-decayed to 0 (``--schedule constant`` keeps the peak), the
low-precision variants using their twin's, chosen by a sweep of the
float32 optimizers (``results/convergence_lr_sweep.md``).

  python -m benchmarks.convergence [--quick] [--only NAME ...]
      [--tasks skip-gram lm] [--steps 5000] [--evals 10]
      [--max-tokens 2000000] [--schedule cosine] [--lr FAMILY=VALUE ...]
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradtx as gtx
from benchmarks._common import parse, parser
from benchmarks._results import columns, headline, result_path, write_results
from benchmarks._timing import Clock, record
from benchmarks.corpus import (
  HELD_OUT_EVERY,
  SEED,
  Task,
  lm_task,
  load_corpus,
  skipgram_task,
)
from benchmarks.plots import plot_convergence

SETTLE = 3  # untimed steps at the start of each config's round
STEPS = 5000  # per config and task
MAX_TOKENS = 2_000_000
# Peak learning rate per task and optimizer family (the sweep:
# results/convergence_lr_sweep.md). Adam and row-wise Adagrad are invariant
# to the gradient's scale and share one rate across tasks; Adagrad (its 0.1
# initial accumulator) and SGD are not.
LR = {
  "skip-gram": dict(adam=1e-2, rowwise_adagrad=0.1, adagrad=30.0, sgd=10.0),
  "next-token LM": dict(adam=1e-2, rowwise_adagrad=0.1, adagrad=1.0, sgd=0.3),
}
FAMILIES = list(LR["skip-gram"])


# ----------------------------------------------------------------------------
# configs


class Config(NamedTuple):
  name: str
  family: str  # key of LR
  make: Callable[[float], Any]  # lr -> transformation
  table_dtype: Any = jnp.float32
  dense: bool = False  # jax.value_and_grad + optax.apply_updates
  stochastic: bool = False  # apply_updates(..., key=fold_in(key, step))
  twin: str = ""  # a low-precision variant: its float32 counterpart's name


def _adam(mu_dtype: Any) -> Callable[[float], Any]:
  return lambda lr: gtx.lazy_adam(lr, mu_dtype=mu_dtype, nu_dtype=mu_dtype)


def _sgd(accumulator_dtype: Any = None) -> Callable[[float], Any]:
  return lambda lr: gtx.lazy_sgd(
    lr, momentum=0.9, accumulator_dtype=accumulator_dtype
  )


def _low(name: str, make: Any, dtype: Any = jnp.float32, **kw: Any) -> Config:
  """A low-precision Adam variant, ``lazy_adam`` its float32 twin."""
  return Config(name, "adam", make, dtype, twin="lazy_adam", **kw)


BF16 = jnp.bfloat16
CONFIGS = [
  Config("adam (dense)", "adam", optax.adam, dense=True),
  Config("lazy_adam", "adam", gtx.lazy_adam),
  Config(
    "lazy_adam catch_up", "adam", lambda lr: gtx.lazy_adam(lr, catch_up=True)
  ),
  Config("rowwise_adagrad", "rowwise_adagrad", gtx.rowwise_adagrad),
  Config("adagrad", "adagrad", gtx.adagrad),
  Config(
    "adagrad int8",
    "adagrad",
    lambda lr: gtx.adagrad(lr, accumulator_dtype="int8"),
    twin="adagrad",
  ),
  Config("lazy_sgd momentum", "sgd", _sgd()),
  Config(
    "lazy_sgd momentum int8", "sgd", _sgd("int8"), twin="lazy_sgd momentum"
  ),
  _low("bf16 nearest", _adam(jnp.float32), BF16),
  _low("bf16 stochastic", _adam(jnp.float32), BF16, stochastic=True),
  # moments in each param's dtype: bf16 for the tables only
  _low("bf16 stochastic, bf16 m/v", gtx.lazy_adam, BF16, stochastic=True),
  _low("int8 m/v", _adam("int8")),
  _low("bf16 stochastic + int8 m/v", _adam("int8"), BF16, stochastic=True),
]
NAMES = [c.name for c in CONFIGS]
TWIN = {c.name: c.twin for c in CONFIGS if c.twin}
BASE = "lazy_adam"
CHEAPEST = "bf16 stochastic + int8 m/v"
# task key -> (maker, its sizes, its --quick sizes): vocab, batch, held-out
# examples.
TASKS = {
  "skip-gram": (skipgram_task, (30_000, 1024, 32_768), (5_000, 1024, 8192)),
  "lm": (lm_task, (5_000, 128, 8192), (2_000, 128, 2048)),
}


class Run:
  """One config training on one task: its params, state, step, results."""

  def __init__(self, task: Task, cfg: Config, lr: float, schedule: Any):
    self.cfg, self.lr = cfg, lr
    self.params = {
      k: jnp.asarray(v, cfg.table_dtype if k in task.tables else jnp.float32)
      for k, v in task.params.items()
    }
    self.tx = cfg.make(schedule(lr))
    self.state = self.tx.init(self.params)
    table = task.tables[0]
    path = jax.tree_util.keystr((jax.tree_util.DictKey(table),))
    self.bytes_per_row = gtx.bytes_per_row(self.tx, self.params)[path]
    rows = task.params[table].shape[0]
    self.state_dtypes = ", ".join(
      sorted(
        {
          x.dtype.name
          for k, x in jax.tree_util.tree_flatten_with_path(self.state)[0]
          if path in jax.tree_util.keystr(k) and x.shape[:1] == (rows,)
        }
      )
    )
    self.step = _make_step(task, cfg, self.tx)
    self.count = 0
    self.curve: list[tuple[int, float]] = []
    self.times: list[float] = []

  def train(self, batches: list[Any]) -> None:
    for i, batch in enumerate(batches):
      clock = Clock()
      self.params, self.state, loss = self.step(
        self.params, self.state, batch, self.count
      )
      loss.block_until_ready()
      if i >= SETTLE:
        self.times.append(clock.wall())
      self.count += 1


def _make_step(task: Task, cfg: Config, tx: Any) -> Callable[..., Any]:
  if cfg.dense:
    value_and_grad = jax.value_and_grad(task.loss)
  else:
    tables = tuple(f"['{t}']" for t in task.tables)
    value_and_grad = gtx.sparse_value_and_grad(task.loss, require_sparse=tables)
  key = jax.random.key(SEED)

  def step(params, state, batch, count):
    loss, grads = value_and_grad(params, batch)
    updates, state = tx.update(grads, state, params)
    if cfg.dense:
      params = optax.apply_updates(params, updates)
    else:
      k = jax.random.fold_in(key, count) if cfg.stochastic else None
      params = gtx.apply_updates(params, updates, key=k)
    return params, state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def evaluate(loss_fn: Callable[..., Any], params: Any, batches: list) -> float:
  return float(np.mean([float(loss_fn(params, b)) for b in batches]))


def make_schedule(kind: str, steps: int) -> Callable[[float], Any]:
  """Peak learning rate -> what the optimizers get."""
  if kind == "constant":
    return lambda lr: lr
  return lambda lr: optax.cosine_decay_schedule(lr, steps)


def train_side_by_side(
  task: Task,
  configs: list[Config],
  lrs: dict[str, float],
  steps: int,
  evals: int,
  schedule: str = "cosine",
) -> tuple[dict[str, Run], dict[str, str]]:
  """Trains every config on ``task`` in rounds of ``steps // evals`` steps."""
  runs, failed = {}, {}
  sched = make_schedule(schedule, steps)
  for cfg in configs:
    try:
      runs[cfg.name] = Run(task, cfg, lrs[cfg.family], sched)
    except Exception as e:  # an option this gradtx lacks: reported
      failed[cfg.name] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
      print(f"  {task.name} / {cfg.name}: FAILED {failed[cfg.name]}")
  eval_fn = jax.jit(task.loss)
  eval_batches = [jax.device_put(b) for b in task.eval_batches]
  for run in runs.values():
    run.curve.append((0, evaluate(eval_fn, run.params, eval_batches)))
  rng = np.random.RandomState(SEED + 3)
  bounds = np.linspace(0, steps, evals + 1).astype(int)
  for r, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
    # The same fresh batches for every config, on the device once.
    batches = [jax.device_put(task.sample(rng)) for _ in range(hi - lo)]
    for name, run in list(runs.items()):
      try:
        run.train(batches)
      except Exception as e:  # e.g. no XLA kernel for an option
        failed[name] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
        print(f"  {task.name} / {name}: FAILED {failed[name]}")
        del runs[name]
        continue
      run.curve.append((int(hi), evaluate(eval_fn, run.params, eval_batches)))
    line = ", ".join(f"{k} {v.curve[-1][1]:.4f}" for k, v in runs.items())
    print(f"  {task.name} step {hi} ({r + 1}/{evals}): {line}", flush=True)
  return runs, failed


# ----------------------------------------------------------------------------
# report


def stall_step(curve: list, base: list) -> Any:
  """Where a low-precision run stops following its float32 twin: the first
  evaluation after which, over every later interval in which ``base`` (the
  twin's curve) still improves, and there is one, ``curve`` improves by
  less than half as much; "-" if there is none."""
  stalled, lagged = "-", False
  for i in range(len(curve) - 1, 0, -1):
    base_gain = base[i - 1][1] - base[i][1]
    gain = curve[i - 1][1] - curve[i][1]
    if base_gain > 0:
      if not gain < base_gain / 2:
        break
      lagged = True
    if lagged:
      stalled = curve[i - 1][0]
  return stalled


def _finite(x: float) -> float | None:
  return float(x) if np.isfinite(x) else None


def _curve_table(task: str, runs: dict[str, Run]) -> str:
  steps = [s for s, _ in next(iter(runs.values())).curve]
  lines = ["| config | " + " | ".join(str(s) for s in steps) + " |"]
  lines.append("|" + "|".join("---" for _ in range(len(steps) + 1)) + "|")
  for name, run in runs.items():
    cells = " | ".join(f"{v:.4f}" for _, v in run.curve)
    lines.append(f"| {name} | {cells} |")
  return f"Held-out loss by step, {task}:\n\n" + "\n".join(lines)


def _result_row(task: Task, cfg: Config, runs: dict, failed: dict) -> list:
  dtype = jnp.dtype(cfg.table_dtype).name
  if cfg.name in failed:
    note = f"failed: {failed[cfg.name]}"
    return [task.name, cfg.name, "-", dtype] + ["-"] * 8 + [note]
  run, base, twin = runs[cfg.name], runs.get(BASE), runs.get(cfg.twin)
  start, end = run.curve[0][1], run.curve[-1][1]
  ms = statistics.median(run.times) * 1e3
  base_ms = statistics.median(base.times) * 1e3 if base else None
  return [
    task.name,
    cfg.name,
    run.lr,
    dtype,
    run.state_dtypes,
    run.bytes_per_row,
    round(end, 4),
    round(end / base.curve[-1][1], 4) if base else "-",
    round(end / twin.curve[-1][1], 4) if twin else "-" if cfg.twin else "",
    stall_step(run.curve, twin.curve) if twin else "",
    round(ms, 3),
    round(ms / base_ms, 3) if base else "-",
    "" if np.isfinite(end) and end < start else "diverged",
  ]


def _headline(task: str, runs: dict[str, Run]) -> list[dict[str, Any]]:
  out = []
  for name in reversed(TWIN):  # the cheapest first
    twin = runs.get(TWIN[name])
    if name in runs and twin is not None:
      out.append(
        headline(
          f"{task}: held-out loss, {name} / {TWIN[name]}",
          round(runs[name].curve[-1][1] / twin.curve[-1][1], 4),
          "<= 1.01" if name == CHEAPEST else "",
        )
      )
  base, cheap = runs.get(BASE), runs.get(CHEAPEST)
  if base is not None and cheap is not None:
    out.append(
      headline(
        f"{task}: table bytes/row, {CHEAPEST} vs {BASE}",
        f"{cheap.bytes_per_row:g} vs {base.bytes_per_row:g}",
      )
    )
    ratio = statistics.median(cheap.times) / statistics.median(base.times)
    metric = f"{task}: step time, {CHEAPEST} / {BASE}"
    out.append(headline(metric, round(ratio, 2)))
  return out


def _task_record(task: Task, runs: dict, failed: dict, lrs: dict, wall) -> dict:
  """What the json keeps of one task's runs."""
  examples = sum(len(next(iter(b.values()))) for b in task.eval_batches)
  return {
    "vocab": task.vocab,
    "batch": task.batch,
    "train_tokens": task.tokens[0],
    "held_out_tokens": task.tokens[1],
    "eval_examples": examples,
    "learning_rates": lrs[task.name],
    "wall_s": wall,
    "curves": {
      k: [(x, _finite(y)) for x, y in r.curve] for k, r in runs.items()
    },
    "step_ms": {k: statistics.median(r.times) * 1e3 for k, r in runs.items()},
    "failed": failed,
  }


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__.splitlines()[0], steps=STEPS)
  p.add_argument(
    "--only", nargs="+", choices=NAMES, metavar="NAME", help=f"of {NAMES}"
  )
  p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
  p.add_argument("--evals", type=int, default=10, help="held-out evaluations")
  p.add_argument(
    "--max-tokens", type=int, default=MAX_TOKENS, help="corpus cap"
  )
  p.add_argument(
    "--schedule",
    choices=["cosine", "constant"],
    default="cosine",
    help="learning rate: cosine decay from the peak to 0, or the peak",
  )
  p.add_argument(
    "--lr",
    nargs="+",
    default=[],
    metavar="FAMILY=VALUE",
    help="override a peak learning rate in both tasks (families: "
    f"{', '.join(FAMILIES)})",
  )
  args = parse(p, argv, quick=dict(steps=200, evals=4, max_tokens=200_000))
  steps, evals, max_tokens = args.steps, args.evals, args.max_tokens
  overrides = {}
  for item in args.lr:
    family, _, value = item.partition("=")
    if family not in FAMILIES or not value:
      p.error(f"--lr {item}: expected FAMILY=VALUE, FAMILY one of {FAMILIES}")
    overrides[family] = float(value)
  lrs = {task: {**lr, **overrides} for task, lr in LR.items()}
  configs = [c for c in CONFIGS if args.only is None or c.name in args.only]

  clock = Clock()
  corpus = load_corpus(max_tokens)
  print(
    f"corpus: {len(corpus.train):,} training + {len(corpus.held_out):,} "
    f"held-out tokens from {corpus.files} files "
    f"({clock.wall():.1f}s)",
    flush=True,
  )
  rows, curves, tables, heads, per_task, failed_all = [], {}, [], [], {}, []
  for key in args.tasks:
    make, sizes, quick_sizes = TASKS[key]
    task = make(corpus, *(quick_sizes if args.quick else sizes))
    task_clock = Clock()
    runs, failed = train_side_by_side(
      task, configs, lrs[task.name], steps, evals, args.schedule
    )
    wall = task_clock.wall()
    record(
      f"{task.name} step",
      {k: r.times for k, r in runs.items()},
      max(1, steps // evals - SETTLE),
      evals=evals,
      settle=SETTLE,
    )
    print(f"{task.name}: {wall:.0f}s", flush=True)
    failed_all += [f"{task.name} / {k}" for k in failed]
    curves[task.name] = {k: r.curve for k, r in runs.items()}
    rows += [_result_row(task, cfg, runs, failed) for cfg in configs]
    if runs:
      tables.append(_curve_table(task.name, runs))
    heads += _headline(task.name, runs)
    per_task[task.name] = _task_record(task, runs, failed, lrs, wall)

  png = result_path("convergence", ".png")
  if any(curves.values()):
    plot_convergence({k: v for k, v in curves.items() if v}, TWIN, png)
  task_notes = "; ".join(
    f"{k}: vocab {v['vocab']:,}, batch {v['batch']}, "
    f"{v['eval_examples']:,} held-out examples"
    for k, v in per_task.items()
  )
  schedule = (
    "cosine decay from the peak `lr` to 0"
    if args.schedule == "cosine"
    else "constant `lr`"
  )
  notes = (
    f"Python {sys.version.split()[0]} standard library, {max_tokens:,}-token "
    f"cap, every {HELD_OUT_EVERY}th file held out ({len(corpus.train):,} "
    f"training, {len(corpus.held_out):,} held-out tokens). {steps} steps "
    f"per config, {schedule}, held-out loss every {steps // evals} steps; "
    f"the same init, batches and order for every config. {task_notes}. "
    "`peak lr`: per task and optimizer family, from a sweep of the float32 "
    "optimizers (results/convergence_lr_sweep.md). Adam and row-wise "
    "Adagrad are invariant to the gradient's scale and get the same rate on "
    "both "
    "tasks; Adagrad and SGD are not, skip-gram's per-row gradients being "
    "far smaller than the LM's, and no one rate per family works for both "
    "tasks (the best shared rate in the sweep costs them 7-17%), so they get "
    "one per task. Every low-precision variant uses its float32 twin's "
    "rate, untuned. Low-precision variants and their float32 twin: bf16 "
    "nearest / stochastic (bf16 table, float32 m and v: only the table's "
    "rounding differs), bf16 stochastic with bf16 m/v (lazy_adam's "
    "default: the moments in each param's dtype, so bf16 for the tables "
    "and float32 for the LM's dense layers), int8 m/v and bf16 "
    f"stochastic + int8 m/v against {BASE}; adagrad int8 against adagrad, "
    "lazy_sgd momentum int8 against lazy_sgd momentum. An `int8` state "
    "dtype applies to every parameter: in the LM it also quantizes the "
    "dense weights' state (not the 1-D biases'). "
    "`table state dtypes`, `table bytes/row`: the optimizer state of the "
    "(first) embedding table and `gtx.bytes_per_row` (its row plus that "
    "state). `/ float32 twin`: held-out loss over the float32 twin's. "
    "`stalls at step` (low-precision variants): the first evaluation after "
    "which the variant's held-out loss improves by less than half as much "
    "as its float32 twin's over every later interval in which the twin's "
    "improves, and there is one ('-': none). `step ms`: median whole "
    "jitted step "
    "(forward with the loss returned, backward, optimizer, apply; params "
    f"and state donated; fresh ids), the first {SETTLE} steps of each "
    f"config's round untimed. Plot: {png.name}.\n\n" + "\n\n".join(tables)
  )
  write_results(
    "convergence",
    "Convergence: held-out loss with cheaper optimizers and lower precision",
    columns(
      "task | config | peak lr | table dtype | table state dtypes | table "
      f"bytes/row | held-out loss | / {BASE} | / float32 twin | stalls at "
      f"step | step ms | step / {BASE} | note"
    ),
    rows,
    notes=notes,
    extra={
      "headline": heads,
      "steps": steps,
      "evals": evals,
      "max_tokens": max_tokens,
      "schedule": args.schedule,
      "tasks": per_task,
      "seconds": clock.wall(),
    },
  )
  print(f"total {clock.wall():.0f}s")
  if failed_all:
    raise SystemExit(f"failed: {failed_all}")


if __name__ == "__main__":
  main()
