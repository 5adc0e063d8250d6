"""Trace and compile time against the number of tables (issue 29).

A DLRM-shaped model as users write it: one leaf per table, each read as
``p[f"t{i}"][ids[:, i]]``, a linear logit per feature
(``rows @ p["w"][i]``), a logistic loss; one optimizer (``gtx.lazy_adam``)
over every leaf; ``gtx.sparse_value_and_grad`` + ``tx.update`` +
``gtx.apply_updates`` under one donated ``jax.jit``. Criteo's 26
categorical cardinalities capped at ``--cap`` rows (20k), ``--dim`` wide
(32), batch ``--batch`` (1024), replicated x2 and x4 for 52 and 104
tables. Beside it the same tables stacked by hand into one leaf (ids
shifted by each table's row offset, one read), and ``jax.value_and_grad``
of the per-table model (JAX's own trace of the same loss: the floor of the
rewrite).

Per program: ``trace`` (``jax.jit(f).trace``: Python, the rewrite, the
optimizer's Python), ``lower`` (to StableHLO) and ``compile`` (XLA), in
seconds of wall clock, on abstract arguments (no table is allocated); and
the CPU seconds of the three (``time.process_time``, every thread of this
process), which a shared machine's load inflates far less: the ratios are
of CPU seconds. Nothing is cached between programs: each is a new
function, the persistent compilation cache is off.

  python -m benchmarks.compile_tables [--tables 26 52 104] [--repeats 1]
      [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks._common import load_note, write_results

# Criteo Kaggle's 26 categorical cardinalities (DLRM's dlrm_s_criteo_kaggle)
CRITEO = (
  1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593,
  3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105,
  142572,
)  # fmt: skip


def cardinalities(tables: int, cap: int) -> list[int]:
  """Criteo's cardinalities capped at ``cap``, repeated to ``tables``."""
  return [min(CRITEO[i % len(CRITEO)], cap) for i in range(tables)]


def per_table_loss(tables: int):
  def loss(p, ids, y):
    logit = p["b"]
    for i in range(tables):
      logit = logit + p[f"t{i}"][ids[:, i]] @ p["w"][i]
    return jnp.mean(jnp.logaddexp(0.0, -y * logit))

  return loss


def stacked_loss(rows: list[int]):
  offsets = jnp.asarray([sum(rows[:i]) for i in range(len(rows))], jnp.int32)

  def loss(p, ids, y):
    h = p["emb"][ids + offsets[None, :]]  # [batch, tables, dim]
    logit = p["b"] + jnp.einsum("btd,td->b", h, p["w"])
    return jnp.mean(jnp.logaddexp(0.0, -y * logit))

  return loss


def abstract_params(rows: list[int], dim: int, stacked: bool) -> dict:
  f32 = jnp.float32
  p = {
    "w": jax.ShapeDtypeStruct((len(rows), dim), f32),
    "b": jax.ShapeDtypeStruct((), f32),
  }
  if stacked:
    p["emb"] = jax.ShapeDtypeStruct((sum(rows), dim), f32)
  else:
    p.update(
      {f"t{i}": jax.ShapeDtypeStruct((v, dim), f32) for i, v in enumerate(rows)}
    )
  return p


# each per-table program and the stacked program it is compared with
STACKED_TWIN = {
  "jax.value_and_grad": "stacked grad",
  "per-table grad": "stacked grad",
  "per-table step": "stacked step",
}


def whole_step(loss, tx):
  def step(p, s, ids, y):
    value, g = gtx.sparse_value_and_grad(loss)(p, ids, y)
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s, value

  return jax.jit(step, donate_argnums=(0, 1))


def timed(jitted, *args) -> tuple[float, ...]:
  """Wall seconds to trace, lower and compile ``jitted(*args)``, then the
  CPU seconds of each."""
  w, c = [time.perf_counter()], [time.process_time()]
  traced = jitted.trace(*args)
  w.append(time.perf_counter())
  c.append(time.process_time())
  lowered = traced.lower()
  w.append(time.perf_counter())
  c.append(time.process_time())
  lowered.compile()
  w.append(time.perf_counter())
  c.append(time.process_time())
  return tuple(np.diff(w)) + tuple(np.diff(c))


def programs(tables: int, cap: int, dim: int, batch: int) -> dict:
  """name -> (a new jitted function, its abstract arguments)."""
  rows = cardinalities(tables, cap)
  ids = jax.ShapeDtypeStruct((batch, tables), jnp.int32)
  y = jax.ShapeDtypeStruct((batch,), jnp.float32)
  tx = gtx.lazy_adam(1e-3)
  out = {}
  for kind, loss, stacked in (
    ("per-table", per_table_loss(tables), False),
    ("stacked", stacked_loss(rows), True),
  ):
    p = abstract_params(rows, dim, stacked)
    s = jax.eval_shape(tx.init, p)
    if kind == "per-table":
      out["jax.value_and_grad"] = (jax.jit(jax.value_and_grad(loss)), p, ids, y)
    out[f"{kind} grad"] = (
      jax.jit(gtx.sparse_value_and_grad(loss)),
      p,
      ids,
      y,
    )
    out[f"{kind} step"] = (whole_step(loss, tx), p, s, ids, y)
  return out


def measure(tables: int, args: argparse.Namespace) -> dict:
  """name -> median :func:`timed` over ``args.repeats``."""
  samples: dict[str, list] = {}
  for _ in range(args.repeats):
    for name, (fn, *xs) in programs(
      tables, args.cap, args.dim, args.batch
    ).items():
      samples.setdefault(name, []).append(timed(fn, *xs))
  return {
    name: tuple(statistics.median(s[k] for s in runs) for k in range(6))
    for name, runs in samples.items()
  }


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--tables", type=int, nargs="+", default=[26, 52, 104])
  parser.add_argument("--cap", type=int, default=20_000)
  parser.add_argument("--dim", type=int, default=32)
  parser.add_argument("--batch", type=int, default=1024)
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--quick", action="store_true", help="4 and 8 tables")
  parser.add_argument(
    "--note", default="", help="a sentence on the machine's state"
  )
  args = parser.parse_args(argv)
  if args.quick:
    args.tables, args.batch = [4, 8], 64
  jax.config.update("jax_enable_compilation_cache", False)
  for fn, *xs in programs(2, 10, 4, 8).values():  # JAX's own first calls
    timed(fn, *xs)

  results = {}
  for t in args.tables:
    results[t] = measure(t, args)
    cpu_s = {k: round(float(sum(v[3:])), 2) for k, v in results[t].items()}
    print(t, "tables, CPU s:", cpu_s, flush=True)
  base = args.tables[0]

  def cpu(t, name):
    return sum(results[t][name][3:])

  rows = []
  for t in args.tables:
    for name, (tr, lo, co, *_) in results[t].items():
      stacked = STACKED_TWIN.get(name)
      rows.append(
        [
          t,
          name,
          f"{tr:.2f}",
          f"{lo:.2f}",
          f"{co:.2f}",
          f"{tr + lo + co:.2f}",
          f"{results[t][name][3]:.2f}",
          f"{cpu(t, name):.2f}",
          f"{cpu(t, name) / cpu(base, name):.2f}",
          f"{cpu(t, name) / cpu(t, stacked):.2f}" if stacked else "",
        ]
      )
  last = args.tables[-1]
  headline = [
    {
      "metric": f"per-table step trace+compile (CPU s), {last} vs {base} "
      "tables",
      "value": round(
        cpu(last, "per-table step") / cpu(base, "per-table step"), 2
      ),
      "target": "<= 1.5",
    },
    {
      "metric": f"per-table / stacked step trace+compile (CPU s) at {last} "
      "tables",
      "value": round(
        cpu(last, "per-table step") / cpu(last, "stacked step"), 2
      ),
      "target": "<= 2",
    },
  ]
  notes = (
    f"Criteo's cardinalities capped at {args.cap:,} rows, {args.dim} wide, "
    f"batch {args.batch}, gtx.lazy_adam; wall seconds, then CPU seconds "
    f"(trace, and trace + lower + compile), median of {args.repeats}; "
    f"`vs {base}`: CPU total against the same program at {base} tables; "
    "`vs stacked`: against the same tables stacked by hand in one leaf. "
    f"Load average {load_note()}. {args.note}"
  ).strip()
  write_results(
    "compile_tables",
    "Trace and compile time against the number of tables",
    [
      "tables",
      "program",
      "trace s",
      "lower s",
      "compile s",
      "total s",
      "trace cpu s",
      "total cpu s",
      f"vs {base}",
      "vs stacked",
    ],
    rows,
    notes=notes,
    extra={
      "seconds": {
        str(t): {k: list(v) for k, v in r.items()} for t, r in results.items()
      },
      "headline": headline,
    },
  )


if __name__ == "__main__":
  main()
