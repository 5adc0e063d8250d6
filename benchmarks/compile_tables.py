"""Trace and compile time against the number of tables (issue 29).

A DLRM-shaped model as users write it (one leaf per table, a linear logit
per feature, ``gtx.lazy_adam``, the whole step under one donated
``jax.jit``) on Criteo's cardinalities capped at ``--cap`` rows, beside the
same tables stacked by hand in one leaf and ``jax.value_and_grad`` of the
per-table model: wall and CPU seconds to trace, lower and compile each
program on abstract arguments, nothing cached.

  python -m benchmarks.compile_tables [--tables 26 52 104] [--repeats 1]

``--forms`` times instead the whole step of one ``gtx.TableStack`` for
each input and output form users write (:func:`form_programs`, issue 48),
each form in a fresh process (``results/compile_tables_forms.md``).

  python -m benchmarks.compile_tables --forms [--tables 26 500]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp

import gradtx as gtx
from benchmarks._common import compile_phases, parse, parser
from benchmarks._results import columns, headline, write_results
from benchmarks.models import abstract_params, bce, table_rows, whole_step


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


# each per-table program and the stacked program it is compared with
STACKED_TWIN = {
  "jax.value_and_grad": "stacked grad",
  "per-table grad": "stacked grad",
  "per-table step": "stacked step",
}
# compile_phases' wall seconds of each phase, then their CPU seconds
PHASES = ["trace_s", "lower_s", "compile_s"]
PHASES += ["trace_cpu_s", "lower_cpu_s", "compile_cpu_s"]
HEAD_ALONE = "the per-feature head alone, on a [B, F, dim] array (no table)"
FORM_RESULT = "FORM-RESULT "  # the line a form's own process prints
SMALL = (2, 10, 4, 8)  # tables, cap, dim, batch: JAX's own first calls


def _shape(*shape: int, dtype=jnp.int32) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype)


def programs(tables: int, cap: int, dim: int, batch: int) -> dict:
  """name -> (a new jitted function, its abstract arguments)."""
  rows = table_rows(tables, cap)
  ids, y = _shape(batch, tables), _shape(batch, dtype=jnp.float32)
  tx = gtx.lazy_adam(1e-3)
  out = {}
  for kind, loss, stacked in (
    ("per-table", per_table_loss(tables), False),
    ("stacked", stacked_loss(rows), True),
  ):
    p = abstract_params(rows, dim, stacked)
    if kind == "per-table":
      out["jax.value_and_grad"] = (jax.jit(jax.value_and_grad(loss)), p, ids, y)
    grad = jax.jit(gtx.sparse_value_and_grad(loss))
    out[f"{kind} grad"] = (grad, p, ids, y)
    s = jax.eval_shape(tx.init, p)
    out[f"{kind} step"] = (whole_step(loss, tx), p, s, ids, y)
  return out


def form_programs(features: int, cap: int, dim: int, batch: int) -> dict:
  """form -> (its whole step, abstract arguments): one gtx.TableStack of
  Criteo's capped tables (made with the batch size, as the recommenders
  guide makes it) read from each input form into each output form."""
  names = [f"f{i}" for i in range(features)]
  rows = dict(zip(names, table_rows(features, cap), strict=True))
  stack = gtx.TableStack(
    {n: gtx.TableSpec(r, dim) for n, r in rows.items()}, batch_size=batch
  )
  f32 = jnp.float32
  head = {"w": _shape(features, dim, dtype=f32), "b": _shape(dtype=f32)}
  p = {"emb": jax.eval_shape(stack.init, jax.random.key(0)), **head}
  matrix = _shape(batch, features)
  per_dict = {n: _shape(batch) for n in names}
  jagged = (_shape(features * batch), _shape(features, batch))  # 1 id a bag
  pooled = _shape(batch, features, dim, dtype=f32)

  def concat(p, emb_ids):
    x = stack.lookup(p["emb"], emb_ids, output="concat")
    x = x.reshape(batch, features, dim)  # in concat order: names
    return jnp.einsum("bfd,fd->b", x, p["w"]) + p["b"]

  def per_feature(p, emb):
    logit = p["b"]
    for i, n in enumerate(names):
      logit = logit + emb[n] @ p["w"][i]
    return logit

  def keyed(p, m):
    out = stack.lookup(p["emb"], gtx.Keyed(names, m), output="keyed")
    return jnp.einsum("bfd,fd->b", out.values, p["w"]) + p["b"]

  def sliced(m):
    return {n: m[:, i] for i, n in enumerate(names)}

  forms = {  # form -> (its logit, its input)
    "dict of [B], concat": (lambda p, x: concat(p, x), per_dict),
    "[B, F] sliced to a dict, concat": (
      lambda p, m: concat(p, sliced(m)), matrix
    ),
    "[B, F] sliced to a dict, dict out per feature": (
      lambda p, m: per_feature(p, stack.lookup(p["emb"], sliced(m))), matrix
    ),
    "gtx.Keyed [B, F], concat": (
      lambda p, m: concat(p, gtx.Keyed(names, m)), matrix
    ),
    "gtx.Keyed [B, F], keyed out per feature": (keyed, matrix),
    "gtx.KeyedJagged, concat": (
      lambda p, j: concat(p, gtx.KeyedJagged(names, *j)), jagged
    ),
  }  # fmt: skip
  tx, y = gtx.lazy_adam(1e-3), _shape(batch, dtype=f32)
  out = {}
  for form, (logit, x) in forms.items():

    def loss(p, x, y, logit=logit):
      return bce(logit(p, x), y)

    out[form] = (whole_step(loss, tx), p, jax.eval_shape(tx.init, p), x, y)

  def head_loss(p, x, y):  # the head alone: what dict out adds per feature
    return bce(per_feature(p, {n: x[:, i] for i, n in enumerate(names)}), y)

  state = jax.eval_shape(tx.init, head)
  out[HEAD_ALONE] = (whole_step(head_loss, tx), head, state, pooled, y)
  return out


def _medians(runs: list[dict], keys) -> dict:
  return {k: statistics.median(r[k] for r in runs) for k in keys}


def form_samples(args: argparse.Namespace) -> None:
  """In a process of its own: form number ``args.form`` at each size, the
  sizes alternating within a repeat; prints the samples as one json line."""
  small = form_programs(*SMALL)
  form = list(small)[args.form]
  compile_phases(*small[form])
  samples: dict[int, list] = {t: [] for t in args.tables}
  for _ in range(args.repeats):
    for t in args.tables:
      fn, *xs = form_programs(t, args.cap, args.dim, args.batch)[form]
      r = compile_phases(fn, *xs)
      samples[t].append(r)
      print(t, form, {k: r[k] for k in ("total_s", "cpu_s", "kernels")})
  print(FORM_RESULT + json.dumps([form, samples]), flush=True)


def forms_main(args: argparse.Namespace) -> None:
  """The ``--forms`` table: each form in a fresh process, as a user's
  program compiles its one step (one process for all forms charges the
  later forms with the caches of the earlier: results/harness_notes.md)."""
  results: dict[int, dict[str, dict]] = {t: {} for t in args.tables}
  for i in range(len(form_programs(*SMALL))):
    cmd = [sys.executable, "-m", "benchmarks.compile_tables", "--forms"]
    cmd += ["--form", str(i), "--repeats", str(args.repeats)]
    cmd += ["--cap", str(args.cap), "--dim", str(args.dim)]
    cmd += ["--batch", str(args.batch), "--tables", *map(str, args.tables)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith(FORM_RESULT))
    form, samples = json.loads(line[len(FORM_RESULT) :])
    print(out.stdout.replace(line, "").strip(), flush=True)
    for t, runs in samples.items():
      results[int(t)][form] = _medians(runs, runs[0])
  base, last = args.tables[0], args.tables[-1]
  rows = []
  for form in results[base]:
    a, z = results[base][form], results[last][form]
    rows.append(
      [form]
      + [f"{x[k]:.2f}" for k in ("total_s", "cpu_s") for x in (a, z)]
      + [f"{z['cpu_s'] / a['cpu_s']:.2f}"]
      + [x[k] for k in ("kernels", "hlo_lines") for x in (a, z)]
    )
  notes = (
    f"One gtx.TableStack of Criteo's cardinalities capped at {args.cap:,} "
    f"rows, {args.dim} wide, batch {args.batch}, gtx.lazy_adam, the whole "
    "step (sparse_value_and_grad, update, apply_updates, donated) traced, "
    f"lowered and compiled on abstract arguments, median of {args.repeats} "
    f"runs ({base} and {last} alternating), each form in a fresh process "
    "of its own; `s`: wall seconds, `cpu s`: their CPU seconds, every "
    "thread of the form's process (the ratio is of CPU seconds); kernels: "
    "the compiled step's launches (`benchmarks._common.hlo_op_counts`). "
    f"The jagged form holds {args.batch} ids a feature (capacity F x B). "
    f"{args.note}"
  ).strip()
  write_results(
    "compile_tables_forms",
    "Trace and compile time of a stack's step, by input and output form",
    columns(
      f"form | {base} s | {last} s | {base} cpu s | {last} cpu s | "
      f"{last}/{base} cpu | kernels {base} | kernels {last} | HLO lines "
      f"{base} | HLO lines {last}"
    ),
    rows,
    notes=notes,
    extra={"results": {str(t): r for t, r in results.items()}},
  )


def tables_main(args: argparse.Namespace) -> None:
  """The table against the number of tables, medians of ``args.repeats``."""
  for fn, *xs in programs(*SMALL).values():  # JAX's own first calls
    compile_phases(fn, *xs)
  results = {}
  for t in args.tables:
    samples: dict[str, list] = {}
    for _ in range(args.repeats):
      for name, (fn, *xs) in programs(
        t, args.cap, args.dim, args.batch
      ).items():
        samples.setdefault(name, []).append(compile_phases(fn, *xs))
    results[t] = {
      n: tuple(_medians(runs, PHASES).values()) for n, runs in samples.items()
    }
    cpu_s = {k: round(float(sum(v[3:])), 2) for k, v in results[t].items()}
    print(t, "tables, CPU s:", cpu_s, flush=True)
  base, last = args.tables[0], args.tables[-1]

  def cpu(t, name):
    return sum(results[t][name][3:])

  rows = []
  for t in args.tables:
    for name, (tr, lo, co, trace_cpu, *_) in results[t].items():
      total, twin = cpu(t, name), STACKED_TWIN.get(name)
      rows.append(
        [t, name]
        + [f"{x:.2f}" for x in (tr, lo, co, tr + lo + co, trace_cpu, total)]
        + [f"{total / cpu(base, name):.2f}"]
        + [f"{total / cpu(t, twin):.2f}" if twin else ""]
      )
  step = "per-table step"
  heads = [
    headline(
      f"per-table step trace+compile (CPU s), {last} vs {base} tables",
      round(cpu(last, step) / cpu(base, step), 2),
      "<= 1.5",
    ),
    headline(
      f"per-table / stacked step trace+compile (CPU s) at {last} tables",
      round(cpu(last, step) / cpu(last, "stacked step"), 2),
      "<= 2",
    ),
  ]
  notes = (
    f"Criteo's cardinalities capped at {args.cap:,} rows, {args.dim} wide, "
    f"batch {args.batch}, gtx.lazy_adam; wall seconds, then CPU seconds "
    f"(trace, and trace + lower + compile), median of {args.repeats}; "
    f"`vs {base}`: CPU total against the same program at {base} tables; "
    "`vs stacked`: against the same tables stacked by hand in one leaf. "
    f"{args.note}"
  ).strip()
  seconds = {
    str(t): {k: list(v) for k, v in r.items()} for t, r in results.items()
  }
  write_results(
    "compile_tables",
    "Trace and compile time against the number of tables",
    columns(
      "tables | program | trace s | lower s | compile s | total s | trace "
      f"cpu s | total cpu s | vs {base} | vs stacked"
    ),
    rows,
    notes=notes,
    extra={"seconds": seconds, "headline": heads},
  )


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__)
  p.add_argument("--tables", type=int, nargs="+", default=[26, 52, 104])
  p.add_argument("--cap", type=int, default=20_000)
  p.add_argument("--dim", type=int, default=32)
  p.add_argument("--batch", type=int, default=1024)
  p.add_argument("--repeats", type=int, default=1)
  p.add_argument(
    "--forms", action="store_true", help="a stack's input and output forms"
  )
  p.add_argument("--note", default="", help="a sentence on the machine's state")
  p.add_argument("--form", type=int, help=argparse.SUPPRESS)  # forms_main
  args = parse(p, argv, quick=dict(tables=[4, 8], batch=64))
  jax.config.update("jax_enable_compilation_cache", False)
  if args.forms and args.tables == [26, 52, 104]:
    args.tables = [26, 500]
  if not args.forms:
    tables_main(args)
  elif args.form is None:
    forms_main(args)
  else:
    form_samples(args)


if __name__ == "__main__":
  main()
