"""Does quality hold with cheaper optimizers and lower precision?

Two models (``benchmarks/corpus.py``) trained on the Python standard
library's source, every config (:data:`CONFIGS`) from the same init on the
same batches, in rounds in one process (each config trains one eval
interval, then the next). Writes ``results/convergence.{md,json,png}``;
their notes end with the next paragraph.

`peak lr`: per task and optimizer family, from a sweep of the float32
optimizers (results/convergence_lr_sweep.md). Adam and row-wise Adagrad are
invariant to the gradient's scale and get the same rate on both tasks;
Adagrad and SGD are not, skip-gram's per-row gradients being far smaller
than the LM's, and no one rate per family works for both tasks (the best
shared rate in the sweep costs them 7-17%), so they get one per task. Every
low-precision variant uses its float32 twin's rate, untuned. Low-precision
variants and their float32 twin: bf16 nearest / stochastic (bf16 table,
float32 m and v: only the table's rounding differs), bf16 stochastic with
bf16 m/v (lazy_adam's default: the moments in each param's dtype, so bf16
for the tables and float32 for the LM's dense layers), int8 m/v and bf16
stochastic + int8 m/v against lazy_adam; adagrad int8 against adagrad,
lazy_sgd momentum int8 against lazy_sgd momentum. An `int8` state dtype
applies to every parameter: in the LM it also quantizes the dense weights'
state (not the 1-D biases'). `table state dtypes`, `table bytes/row`: the
optimizer state of the (first) embedding table and `gtx.bytes_per_row` (its
row plus that state). `/ float32 twin`: held-out loss over the float32
twin's. `stalls at step` (low-precision variants): the first evaluation
after which the variant's held-out loss improves by less than half as much
as its float32 twin's over every later interval in which the twin's
improves, and there is one ('-': none). `step ms`: median whole jitted step
(forward with the loss returned, backward, optimizer, apply; params and
state donated; fresh ids), the first 3 steps of each config's round
untimed.

  python -m benchmarks.convergence [--quick] [--only NAME ...]
      [--tasks skip-gram lm] [--steps 5000] [--evals 10]
      [--max-tokens 2000000] [--schedule cosine] [--lr FAMILY=VALUE ...]
"""

from __future__ import annotations

import statistics
import sys
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.tree_util import DictKey, keystr, tree_flatten_with_path

import gradtx as gtx
from benchmarks import corpus
from benchmarks._common import parse, parser
from benchmarks._results import (
  columns,
  headline,
  markdown_table,
  result_path,
  write_results,
)
from benchmarks._timing import Clock, record
from benchmarks.corpus import lm_task, skipgram_task
from benchmarks.plots import plot_convergence

COLUMNS_NOTE = " ".join(__doc__.split("\n\n")[2].split())  # the notes' end
SETTLE = 3  # untimed steps at the start of each config's round
STEPS = 5000  # per config and task
MAX_TOKENS = 2_000_000
# Peak learning rate per task and optimizer family (the sweep:
# results/convergence_lr_sweep.md).
LR = {
  "skip-gram": dict(adam=1e-2, rowwise_adagrad=0.1, adagrad=30.0, sgd=10.0),
  "next-token LM": dict(adam=1e-2, rowwise_adagrad=0.1, adagrad=1.0, sgd=0.3),
}
FAMILIES = list(LR["skip-gram"])


class Config(NamedTuple):
  name: str
  family: str  # key of LR
  make: Any  # lr -> transformation
  table_dtype: Any = jnp.float32
  dense: bool = False  # jax.value_and_grad + optax.apply_updates
  stochastic: bool = False  # apply_updates(..., key=fold_in(key, step))
  twin: str = ""  # a low-precision variant: its float32 counterpart's name


def _low(name, make, dtype=jnp.float32, stochastic=False) -> Config:
  """A low-precision Adam variant, ``lazy_adam`` its float32 twin."""
  return Config(name, "adam", make, dtype, stochastic=stochastic, twin=BASE)


BASE = "lazy_adam"
BF16 = jnp.bfloat16
ADAM_INT8 = partial(gtx.lazy_adam, mu_dtype="int8", nu_dtype="int8")
ADAM_F32 = partial(gtx.lazy_adam, mu_dtype=jnp.float32, nu_dtype=jnp.float32)
SGD = partial(gtx.lazy_sgd, momentum=0.9, accumulator_dtype=None)
ADAGRAD_INT8 = partial(gtx.adagrad, accumulator_dtype="int8")
SGD_INT8 = partial(SGD, accumulator_dtype="int8")
CONFIGS = [
  Config("adam (dense)", "adam", optax.adam, dense=True),
  Config(BASE, "adam", gtx.lazy_adam),
  Config("lazy_adam catch_up", "adam", partial(gtx.lazy_adam, catch_up=True)),
  Config("rowwise_adagrad", "rowwise_adagrad", gtx.rowwise_adagrad),
  Config("adagrad", "adagrad", gtx.adagrad),
  Config("adagrad int8", "adagrad", ADAGRAD_INT8, twin="adagrad"),
  Config("lazy_sgd momentum", "sgd", SGD),
  Config("lazy_sgd momentum int8", "sgd", SGD_INT8, twin="lazy_sgd momentum"),
  _low("bf16 nearest", ADAM_F32, BF16),
  _low("bf16 stochastic", ADAM_F32, BF16, stochastic=True),
  # moments in each param's dtype: bf16 for the tables only
  _low("bf16 stochastic, bf16 m/v", gtx.lazy_adam, BF16, stochastic=True),
  _low("int8 m/v", ADAM_INT8),
  _low("bf16 stochastic + int8 m/v", ADAM_INT8, BF16, stochastic=True),
]
NAMES = [c.name for c in CONFIGS]
TWIN = {c.name: c.twin for c in CONFIGS if c.twin}
CHEAPEST = "bf16 stochastic + int8 m/v"
# task key -> (maker, its sizes, its --quick sizes): vocab, batch, held-out
# examples.
TASKS = {
  "skip-gram": (skipgram_task, (30_000, 1024, 32_768), (5_000, 1024, 8192)),
  "lm": (lm_task, (5_000, 128, 8192), (2_000, 128, 2048)),
}


def _ms(run) -> float:
  return statistics.median(run.times) * 1e3


class Run:
  """One config training on one task: its params, state, step, results."""

  def __init__(self, task, cfg: Config, lr: float, schedule):
    self.cfg, self.lr, self.count = cfg, lr, 0
    self.curve: list[tuple[int, float]] = []
    self.times: list[float] = []
    self.params = {
      k: jnp.asarray(v, cfg.table_dtype if k in task.tables else jnp.float32)
      for k, v in task.params.items()
    }
    self.tx = cfg.make(schedule(lr))
    self.state = self.tx.init(self.params)
    path = keystr((DictKey(task.tables[0]),))
    self.bytes_per_row = gtx.bytes_per_row(self.tx, self.params)[path]
    rows = (task.params[task.tables[0]].shape[0],)
    own = [
      x for k, x in tree_flatten_with_path(self.state)[0] if path in keystr(k)
    ]
    dtypes = sorted({x.dtype.name for x in own if x.shape[:1] == rows})
    self.state_dtypes = ", ".join(dtypes)
    self.step = _make_step(task, cfg, self.tx)

  def train(self, batches) -> None:
    for i, batch in enumerate(batches):
      clock = Clock()
      self.params, self.state, loss = self.step(
        self.params, self.state, batch, self.count
      )
      loss.block_until_ready()
      if i >= SETTLE:
        self.times.append(clock.wall())
      self.count += 1


def _make_step(task, cfg: Config, tx):
  if cfg.dense:
    value_and_grad = jax.value_and_grad(task.loss)
  else:
    tables = tuple(f"['{t}']" for t in task.tables)
    value_and_grad = gtx.sparse_value_and_grad(task.loss, require_sparse=tables)
  key = jax.random.key(corpus.SEED)

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


def _failure(task, name: str, e: Exception, failed: dict) -> None:
  failed[name] = f"{type(e).__name__}: {e}".splitlines()[0][:160]
  print(f"  {task.name} / {name}: FAILED {failed[name]}")


def train_side_by_side(task, configs, lrs, steps, evals, schedule="cosine"):
  """Trains every config on ``task`` in rounds of ``steps // evals`` steps:
  the runs and, by config, why one failed."""
  runs, failed = {}, {}
  decay = partial(optax.cosine_decay_schedule, decay_steps=steps)
  sched = decay if schedule == "cosine" else lambda lr: lr
  for cfg in configs:
    try:
      runs[cfg.name] = Run(task, cfg, lrs[cfg.family], sched)
    except Exception as e:  # an option this gradtx lacks: reported
      _failure(task, cfg.name, e, failed)
  eval_fn = jax.jit(task.loss)
  eval_batches = [jax.device_put(b) for b in task.eval_batches]

  def evaluate(params) -> float:
    return float(np.mean([float(eval_fn(params, b)) for b in eval_batches]))

  for run in runs.values():
    run.curve.append((0, evaluate(run.params)))
  rng = np.random.RandomState(corpus.SEED + 3)
  bounds = np.linspace(0, steps, evals + 1).astype(int)
  for r, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
    # The same fresh batches for every config, on the device once.
    batches = [jax.device_put(task.sample(rng)) for _ in range(hi - lo)]
    for name, run in list(runs.items()):
      try:
        run.train(batches)
      except Exception as e:  # e.g. no XLA kernel for an option
        _failure(task, name, e, failed)
        del runs[name]
        continue
      run.curve.append((int(hi), evaluate(run.params)))
    line = ", ".join(f"{k} {v.curve[-1][1]:.4f}" for k, v in runs.items())
    print(f"  {task.name} step {hi} ({r + 1}/{evals}): {line}", flush=True)
  return runs, failed


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


def _result_row(task, cfg: Config, runs: dict, failed: dict) -> list:
  row = [task.name, cfg.name]
  dtype = jnp.dtype(cfg.table_dtype).name
  if cfg.name in failed:
    return [*row, "-", dtype] + ["-"] * 8 + [f"failed: {failed[cfg.name]}"]
  run, base, twin = runs[cfg.name], runs.get(BASE), runs.get(cfg.twin)
  start, end = run.curve[0][1], run.curve[-1][1]
  row += [run.lr, dtype, run.state_dtypes, run.bytes_per_row, round(end, 4)]
  row.append(round(end / base.curve[-1][1], 4) if base else "-")
  row.append(
    round(end / twin.curve[-1][1], 4) if twin else "-" if cfg.twin else ""
  )
  row.append(stall_step(run.curve, twin.curve) if twin else "")
  row += [round(_ms(run), 3), round(_ms(run) / _ms(base), 3) if base else "-"]
  return row + ["" if np.isfinite(end) and end < start else "diverged"]


def _headlines(task: str, runs: dict) -> list[dict]:
  loss = {k: r.curve[-1][1] for k, r in runs.items()}
  out = [
    headline(
      f"{task}: held-out loss, {name} / {twin}",
      round(loss[name] / loss[twin], 4),
      "<= 1.01" if name == CHEAPEST else "",
    )
    for name, twin in reversed(TWIN.items())  # the cheapest first
    if name in runs and twin in runs
  ]
  base, cheap = runs.get(BASE), runs.get(CHEAPEST)
  if base is not None and cheap is not None:
    out.append(
      headline(
        f"{task}: table bytes/row, {CHEAPEST} vs {BASE}",
        f"{cheap.bytes_per_row:g} vs {base.bytes_per_row:g}",
      )
    )
    metric = f"{task}: step time, {CHEAPEST} / {BASE}"
    out.append(headline(metric, round(_ms(cheap) / _ms(base), 2)))
  return out


def _task_record(task, runs: dict, failed: dict, lrs: dict, wall) -> dict:
  """What the json keeps of one task's runs."""
  finite = lambda y: float(y) if np.isfinite(y) else None  # noqa: E731
  curves = {k: [(x, finite(y)) for x, y in r.curve] for k, r in runs.items()}
  return dict(
    vocab=task.vocab,
    batch=task.batch,
    train_tokens=task.tokens[0],
    held_out_tokens=task.tokens[1],
    eval_examples=sum(len(next(iter(b.values()))) for b in task.eval_batches),
    learning_rates=lrs[task.name],
    wall_s=wall,
    curves=curves,
    step_ms={k: _ms(r) for k, r in runs.items()},
    failed=failed,
  )


def _notes(args, text, per_task, tables, png) -> str:
  steps, evals = args.steps, args.evals
  task_notes = "; ".join(
    f"{k}: vocab {v['vocab']:,}, batch {v['batch']}, "
    f"{v['eval_examples']:,} held-out examples"
    for k, v in per_task.items()
  )
  schedule = "constant `lr`"
  if args.schedule == "cosine":
    schedule = "cosine decay from the peak `lr` to 0"
  return (
    f"Python {sys.version.split()[0]} standard library, "
    f"{args.max_tokens:,}-token cap, every {corpus.HELD_OUT_EVERY}th file "
    f"held out ({len(text.train):,} training, {len(text.held_out):,} "
    f"held-out tokens). {steps} steps per config, {schedule}, held-out loss "
    f"every {steps // evals} steps; the same init, batches and order for "
    f"every config. {task_notes}. {COLUMNS_NOTE} Plot: {png.name}.\n\n"
    + "\n\n".join(tables)
  )


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__.splitlines()[0], steps=STEPS)
  p.add_argument("--only", nargs="+", choices=NAMES, metavar="NAME")
  p.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
  p.add_argument("--evals", type=int, default=10, help="held-out evaluations")
  p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
  p.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
  p.add_argument("--lr", nargs="+", default=[], metavar="FAMILY=VALUE")
  args = parse(p, argv, quick=dict(steps=200, evals=4, max_tokens=200_000))
  steps, evals = args.steps, args.evals
  overrides = {}
  for item in args.lr:
    family, _, value = item.partition("=")
    if family not in FAMILIES or not value:
      p.error(f"--lr {item}: expected FAMILY=VALUE, FAMILY one of {FAMILIES}")
    overrides[family] = float(value)
  lrs = {task: {**lr, **overrides} for task, lr in LR.items()}
  configs = [c for c in CONFIGS if args.only is None or c.name in args.only]

  clock = Clock()
  text = corpus.load_corpus(args.max_tokens)
  print(
    f"corpus: {len(text.train):,} training + {len(text.held_out):,} "
    f"held-out tokens from {text.files} files ({clock.wall():.1f}s)",
    flush=True,
  )
  rows, curves, tables, heads, per_task, failed_all = [], {}, [], [], {}, []
  for key in args.tasks:
    make, sizes, quick_sizes = TASKS[key]
    task = make(text, *(quick_sizes if args.quick else sizes))
    task_clock = Clock()
    runs, failed = train_side_by_side(
      task, configs, lrs[task.name], steps, evals, args.schedule
    )
    wall = task_clock.wall()
    times = {k: r.times for k, r in runs.items()}
    burst = max(1, steps // evals - SETTLE)
    record(f"{task.name} step", times, burst, evals=evals, settle=SETTLE)
    print(f"{task.name}: {wall:.0f}s", flush=True)
    failed_all += [f"{task.name} / {k}" for k in failed]
    curves[task.name] = {k: r.curve for k, r in runs.items()}
    rows += [_result_row(task, cfg, runs, failed) for cfg in configs]
    if runs:
      steps_at = [s for s, _ in next(iter(runs.values())).curve]
      table = markdown_table(
        ["config", *map(str, steps_at)],
        [[k, *(f"{v:.4f}" for _, v in r.curve)] for k, r in runs.items()],
      )
      tables.append(f"Held-out loss by step, {task.name}:\n\n{table}")
    heads += _headlines(task.name, runs)
    per_task[task.name] = _task_record(task, runs, failed, lrs, wall)

  png = result_path("convergence", ".png")
  if any(curves.values()):
    plot_convergence({k: v for k, v in curves.items() if v}, TWIN, png)
  write_results(
    "convergence",
    "Convergence: held-out loss with cheaper optimizers and lower precision",
    columns(
      "task | config | peak lr | table dtype | table state dtypes | table "
      f"bytes/row | held-out loss | / {BASE} | / float32 twin | stalls at "
      f"step | step ms | step / {BASE} | note"
    ),
    rows,
    notes=_notes(args, text, per_task, tables, png),
    extra=dict(
      headline=heads,
      **{
        k: vars(args)[k] for k in ("steps", "evals", "max_tokens", "schedule")
      },
      tasks=per_task,
      seconds=clock.wall(),
    ),
  )
  print(f"total {clock.wall():.0f}s")
  if failed_all:
    raise SystemExit(f"failed: {failed_all}")


if __name__ == "__main__":
  main()
