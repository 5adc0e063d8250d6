"""Trace and compile time against the number of tables (issue 29).

A DLRM-shaped model as users write it (one leaf per table read
``p[f"t{i}"][ids[:, i]]``, a linear logit per feature, a logistic loss,
``gtx.lazy_adam`` over every leaf, the whole step under one donated
``jax.jit``) on Criteo's cardinalities capped at ``--cap`` rows, replicated
for 52 and 104 tables; beside it the same tables stacked by hand into one
leaf, and ``jax.value_and_grad`` of the per-table model (JAX's own trace:
the floor of the rewrite). Per program, on abstract arguments with nothing
cached: wall seconds to trace, lower and compile, and their CPU seconds
(every thread of the process; a shared machine's load inflates them far
less: the ratios are of CPU seconds).

  python -m benchmarks.compile_tables [--tables 26 52 104] [--repeats 1]

``--forms`` times instead the whole step of one ``gtx.TableStack`` over
the same tables for each input and output form users write (issue 48: a
dict of ``[B]`` inputs, a ``[B, F]`` matrix sliced into that dict or passed
as a ``gtx.Keyed``, jagged features as a ``gtx.KeyedJagged``; the pooled
rows as one ``output="concat"`` array or per feature), at 26 and 500
features, each form in a fresh process as a user's program compiles its
step (``results/compile_tables_forms.md``).

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


def programs(tables: int, cap: int, dim: int, batch: int) -> dict:
  """name -> (a new jitted function, its abstract arguments)."""
  rows = table_rows(tables, cap)
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
    grad = jax.jit(gtx.sparse_value_and_grad(loss))
    out[f"{kind} grad"] = (grad, p, ids, y)
    out[f"{kind} step"] = (whole_step(loss, tx), p, s, ids, y)
  return out


def measure(tables: int, args: argparse.Namespace) -> dict:
  """name -> the median :data:`PHASES` over ``args.repeats``."""
  samples: dict[str, list] = {}
  for _ in range(args.repeats):
    made = programs(tables, args.cap, args.dim, args.batch)
    for name, (fn, *xs) in made.items():
      samples.setdefault(name, []).append(compile_phases(fn, *xs))
  return {
    name: tuple(statistics.median(r[k] for r in runs) for k in PHASES)
    for name, runs in samples.items()
  }


def form_programs(features: int, cap: int, dim: int, batch: int) -> dict:
  """form -> (its whole step, abstract arguments): one gtx.TableStack of
  Criteo's capped tables, each input and output form."""
  rows = table_rows(features, cap)
  names = [f"f{i}" for i in range(features)]
  # made as the recommenders guide makes it, with the batch size
  stack = gtx.TableStack(
    {n: gtx.TableSpec(r, dim) for n, r in zip(names, rows, strict=True)},
    batch_size=batch,
  )
  p = {
    "emb": jax.eval_shape(stack.init, jax.random.key(0)),
    "w": jax.ShapeDtypeStruct((features, dim), jnp.float32),
    "b": jax.ShapeDtypeStruct((), jnp.float32),
  }
  tx = gtx.lazy_adam(1e-3)
  s = jax.eval_shape(tx.init, p)
  y = jax.ShapeDtypeStruct((batch,), jnp.float32)
  matrix = jax.ShapeDtypeStruct((batch, features), jnp.int32)
  per_dict = {n: jax.ShapeDtypeStruct((batch,), jnp.int32) for n in names}
  cap_ = features * batch  # one id a bag on average
  jagged = (
    jax.ShapeDtypeStruct((cap_,), jnp.int32),
    jax.ShapeDtypeStruct((features, batch), jnp.int32),
  )

  def concat_head(p, emb_ids):
    x = stack.lookup(p["emb"], emb_ids, output="concat")
    x = x.reshape(batch, features, dim)  # in concat order: names
    return jnp.einsum("bfd,fd->b", x, p["w"]) + p["b"]

  def per_feature_head(p, emb):
    logit = p["b"]
    for i, n in enumerate(names):
      logit = logit + emb[n] @ p["w"][i]
    return logit

  def sliced(m):
    return {n: m[:, i] for i, n in enumerate(names)}

  losses = {
    "dict of [B], concat": (lambda p, x, y: concat_head(p, x), per_dict),
    "[B, F] sliced to a dict, concat": (
      lambda p, m, y: concat_head(p, sliced(m)),
      matrix,
    ),
    "[B, F] sliced to a dict, dict out per feature": (
      lambda p, m, y: per_feature_head(p, stack.lookup(p["emb"], sliced(m))),
      matrix,
    ),
    "gtx.Keyed [B, F], concat": (
      lambda p, m, y: concat_head(p, gtx.Keyed(names, m)),
      matrix,
    ),
    "gtx.Keyed [B, F], keyed out per feature": (
      lambda p, m, y: (
        jnp.einsum(
          "bfd,fd->b",
          stack.lookup(p["emb"], gtx.Keyed(names, m), output="keyed").values,
          p["w"],
        )
        + p["b"]
      ),
      matrix,
    ),
    "gtx.KeyedJagged, concat": (
      lambda p, j, y: concat_head(p, gtx.KeyedJagged(names, *j)),
      jagged,
    ),
  }
  out = {}
  for form, (logit, x) in losses.items():

    def loss(p, x, y, logit=logit):
      return bce(logit(p, x, y), y)

    out[form] = (whole_step(loss, tx), p, s, x, y)
  # the per-feature head's own ops, without a table: what the user's code
  # adds per feature to the dict-out form
  head = {k: p[k] for k in ("w", "b")}
  pooled = jax.ShapeDtypeStruct((batch, features, dim), jnp.float32)

  def head_loss(p, x, y):
    return bce(
      per_feature_head(p, {n: x[:, i] for i, n in enumerate(names)}), y
    )

  head_state = jax.eval_shape(tx.init, head)
  out[HEAD_ALONE] = (whole_step(head_loss, tx), head, head_state, pooled, y)
  return out


HEAD_ALONE = "the per-feature head alone, on a [B, F, dim] array (no table)"


FORM_RESULT = "FORM-RESULT "  # the line a form's own process prints


def form_samples(args: argparse.Namespace) -> None:
  """In a process of its own: one form (``args.form``, its index) at each
  size, the sizes alternating within a repeat; prints the samples as one
  json line."""
  form = list(form_programs(2, 10, 4, 8))[args.form]
  fn, *xs = form_programs(2, 10, 4, 8)[form]  # JAX's own first calls
  compile_phases(fn, *xs)
  samples: dict[int, list] = {t: [] for t in args.tables}
  for _ in range(args.repeats):
    for t in args.tables:
      fn, *xs = form_programs(t, args.cap, args.dim, args.batch)[form]
      r = compile_phases(fn, *xs)
      samples[t].append(r)
      print(t, form, {k: r[k] for k in ("total_s", "cpu_s", "kernels")})
  print(FORM_RESULT + json.dumps([form, samples]), flush=True)


def forms_main(args: argparse.Namespace) -> None:
  """The ``--forms`` table (see the module docstring): each form in a
  fresh process, as a user's program compiles its one step (one process
  for all forms charges the later forms with the caches of the earlier:
  results/harness_notes.md)."""
  results: dict[int, dict[str, dict]] = {t: {} for t in args.tables}
  for i in range(len(form_programs(2, 10, 4, 8))):
    cmd = [sys.executable, "-m", "benchmarks.compile_tables", "--forms"]
    cmd += ["--form", str(i), "--repeats", str(args.repeats)]
    cmd += ["--cap", str(args.cap), "--dim", str(args.dim)]
    cmd += ["--batch", str(args.batch), "--tables", *map(str, args.tables)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith(FORM_RESULT))
    form, samples = json.loads(line[len(FORM_RESULT) :])
    print(out.stdout.replace(line, "").strip(), flush=True)
    for t, runs in samples.items():
      results[int(t)][form] = {
        k: statistics.median(r[k] for r in runs) for k in runs[0]
      }
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
    "of its own; `s`: wall "
    "seconds, `cpu s`: their CPU seconds, every thread of the form's "
    "process (the ratio is of CPU "
    f"seconds); kernels: the compiled step's launches "
    "(`benchmarks._common.hlo_op_counts`). The jagged form holds "
    f"{args.batch} ids a feature (capacity F x B). {args.note}"
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
  if args.forms:
    if args.tables == [26, 52, 104]:
      args.tables = [26, 500]
    if args.form is not None:
      form_samples(args)
      return
    forms_main(args)
    return
  for fn, *xs in programs(2, 10, 4, 8).values():  # JAX's own first calls
    compile_phases(fn, *xs)

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
      total, vs = cpu(t, name), ""
      if stacked:
        vs = f"{total / cpu(t, stacked):.2f}"
      rows.append(
        [t, name]
        + [f"{x:.2f}" for x in (tr, lo, co, tr + lo + co, results[t][name][3])]
        + [f"{total:.2f}", f"{total / cpu(base, name):.2f}", vs]
      )
  last = args.tables[-1]
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
  write_results(
    "compile_tables",
    "Trace and compile time against the number of tables",
    columns(
      "tables | program | trace s | lower s | compile s | total s | trace "
      f"cpu s | total cpu s | vs {base} | vs stacked"
    ),
    rows,
    notes=notes,
    extra={
      "seconds": {
        str(t): {k: list(v) for k, v in r.items()} for t, r in results.items()
      },
      "headline": heads,
    },
  )


if __name__ == "__main__":
  main()
