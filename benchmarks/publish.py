"""Publishing to serving: what a delta costs and saves against the whole
params, on a ``--tables`` x ``--rows`` x ``--dim`` stack trained with
``gtx.lazy_adam`` on fresh Zipf ids (exponent ``--zipf``). ``step``: the
whole step with and without ``gtx.track_changes``, alternated in one
process; ``publish``: publishing every 10 and 100 steps, the delta's bytes,
build and orbax write against writing the whole params, every delta
replayed into a serving copy that must equal the params at the end. The
results' notes say what each measures.

  python -m benchmarks.publish [--quick]
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

import gradtx as gtx
from benchmarks._common import hlo_op_counts, parse, parser
from benchmarks._results import (
  columns,
  headline,
  markdown_table,
  oversubscribed,
  write_results,
)
from benchmarks._timing import (
  Clock,
  Counter,
  Schedule,
  step_runner,
  time_interleaved,
)
from benchmarks.models import whole_step

SEED = 0


def zipf_ids(rng, n, rows, a):
  """``n`` ids in ``[0, rows)``: Zipf ranks (exponent ``a``), scrambled by
  a multiplicative hash so the hot rows are spread over the table."""
  rank = np.minimum(rng.zipf(a, n), 2**40).astype(np.int64)
  return ((rank * 2654435761) % rows).astype(np.int32)


def make_stack(args):
  specs = {
    f"t{i}": gtx.TableSpec(args.rows, args.dim) for i in range(args.tables)
  }
  return gtx.TableStack(
    specs, features={f"f{i}": f"t{i}" for i in range(args.tables)}
  )


def make_step(stack, tx):
  def loss(p, ids, y):
    emb = stack.lookup(p, ids)
    logit = sum(e.sum(-1) for e in emb.values()) * 0.01
    return jnp.mean(jax.nn.softplus(logit) - y * logit)

  return whole_step(loss, tx)


def batches(args):
  rng = np.random.default_rng(SEED)
  out = []
  for _ in range(args.batches):
    ids = {
      f"f{i}": jnp.asarray(zipf_ids(rng, args.batch, args.rows, args.zipf))
      for i in range(args.tables)
    }
    y = jnp.asarray((rng.random(args.batch) < 0.25).astype(np.float32))
    out.append((ids, y))
  return out


def train(stack, tx, data):
  """One run on its own donated params and state, on huge pages: ``(step,
  [params, state], the jitted step)``."""
  box = [stack.init(jax.random.key(SEED))]
  box.append(tx.init(box[0]))
  gtx.use_huge_pages(tuple(box))
  jitted = make_step(stack, tx)
  feed = lambda i: data[i % len(data)]  # noqa: E731
  return Counter(step_runner(jitted, box, feed), 0), box, jitted


def nbytes(tree) -> int:
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


def timed_save(ckptr, path, tree) -> tuple[float, int]:
  """Seconds to save ``tree`` with orbax until finished, and its bytes on
  disk (the checkpoint directory's files, removed after)."""
  clock = Clock()
  ckptr.save(path, tree)
  ckptr.wait_until_finished()
  sec = clock.wall()
  size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
  shutil.rmtree(path)
  return sec, size


def measure_step(args, stack, data):
  """Per round, the median of each system's timed steps; the ratio of the
  two in each round (paired, so the machine's load drifts cancel). Also
  what each compiled step launches."""
  tracked = optax.chain(gtx.lazy_adam(1e-3), gtx.track_changes())
  runs = {"lazy_adam": gtx.lazy_adam(1e-3), "+ track_changes": tracked}
  runs = {k: train(stack, tx, data) for k, tx in runs.items()}
  ids, y = data[0]
  ops = {
    k: hlo_op_counts(jitted.lower(*box, ids, y).compile().as_text())
    for k, (_, box, jitted) in runs.items()
  }
  # Half the rounds in each order, so neither step always runs first.
  fns = {k: run for k, (run, _, _) in runs.items()}
  samples, ratios = {k: [] for k in fns}, []
  b, half = args.burst, max(1, args.rounds // 2)
  for order in (list(fns), list(fns)[::-1]):
    got = {}
    time_interleaved(
      {k: fns[k] for k in order},
      rounds=half,
      burst=b,
      settle=args.settle,
      samples=got,
    )
    per_round = {
      k: [statistics.median(v[r * b : (r + 1) * b]) for r in range(half)]
      for k, v in got.items()
    }
    pairs = zip(*(per_round[k] for k in fns), strict=True)
    ratios += [t / p for p, t in pairs]
    for k, v in got.items():
      samples[k] += v
  del runs, fns
  return samples, ratios, ops


def measure_publish(args, stack, data, every, tmp: Path):
  tx = optax.chain(gtx.lazy_adam(1e-3), gtx.track_changes())
  step, box, _ = train(stack, tx, data)
  serving = jax.tree.map(np.asarray, box[0])
  keys = "rows bytes disk build write full_write full_disk"
  rows = {k: [] for k in keys.split()}
  last = None
  with ocp.StandardCheckpointer() as ckptr:
    for n in range(args.publishes):
      for _ in range(every):
        step()
      clock = Clock()
      d = gtx.delta(box[0], box[1], since=last)
      rows["build"].append(clock.wall())
      last = d.step
      ((name, change),) = d.params.items()
      rows["rows"].append(0 if change is None else len(change["ids"]))
      rows["bytes"].append(nbytes(d))
      saves = [("", d)] + [("full_", box[0])] * (n < args.full_saves)
      for kind, tree in saves:
        sec, size = timed_save(ckptr, tmp / f"{kind}{every}_{n}", tree)
        rows[f"{kind}write"].append(sec)
        rows[f"{kind}disk"].append(size)
      serving = gtx.apply_delta(serving, d)
      last_ = {k: v[-1] for k, v in rows.items() if len(v) > n}
      print(f"every {every}: publish {n}:", last_, flush=True)
  for k, p in box[0].items():
    assert np.array_equal(serving[k], np.asarray(p)), "serving != params"
  return {**rows, "full_bytes": nbytes(box[0]), "name": name}


def publish_row(every, r, total_rows):
  med = statistics.median
  # the first build compiles gtx.delta's small programs
  build, write, full = (
    med(r["build"][1:]),
    med(r["write"]),
    med(r["full_write"]),
  )
  return (
    [f"{every} steps", int(med(r["rows"]))]
    + [f"{med(r['rows']) / total_rows:.2%}"]
    + [f"{med(r[k]) / 2**20:.1f}" for k in ("bytes", "disk", "full_disk")]
    + [f"{med(r['disk']) / med(r['full_disk']):.3f}"]
    + [f"{x * 1e3:.0f}" for x in (build, write, full)]
    + [f"{(build + write) / full:.3f}"]
  )


def main(argv=None):
  p = parser(__doc__.splitlines()[0], schedule=Schedule(300, 1, 1))
  sizes = dict(tables=4, rows=500_000, dim=64, batch=2048, batches=200)
  for k, v in dict(sizes, publishes=6, full_saves=3).items():
    p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
  p.add_argument("--zipf", type=float, default=1.1)
  quick = dict(rows=20_000, batches=20, rounds=8, publishes=2, full_saves=1)
  args = parse(p, argv, quick=quick)
  gtx.reuse_host_memory()
  stack = make_stack(args)
  data = batches(args)
  samples, ratios, ops = measure_step(args, stack, data)
  tmp = Path(tempfile.mkdtemp(prefix="gtx_publish_"))
  try:
    pubs = {e: measure_publish(args, stack, data, e, tmp) for e in (10, 100)}
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  total_rows = args.tables * args.rows
  table = [publish_row(every, r, total_rows) for every, r in pubs.items()]
  step_ms = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
  q1, q2, q3 = statistics.quantiles(ratios, n=4)
  step_table = [
    [k, f"{step_ms[k]:.2f}"]
    + (["1", ""] if k == "lazy_adam" else [f"{q2:.3f}", f"{q1:.3f} - {q3:.3f}"])
    + [ops[k][op] for op in ("kernels", "scatter", "fusion")]
    for k in step_ms
  ]
  step_headers = columns(
    "step | ms (median) | / lazy_adam (median of paired rounds) | "
    "quartiles | kernels | scatters | fusions"
  )
  notes = (
    "The training step with and without gtx.track_changes:\n\n"
    + markdown_table(step_headers, step_table)
    + "\n\n"
    f"A stack of {args.tables} tables x {args.rows} rows x {args.dim} "
    f"float32 ({total_rows} rows), one feature per table, {args.batch} Zipf "
    f"ids (exponent {args.zipf}) per feature and step, fresh ids every step "
    f"({args.batches} batches cycled), gtx.lazy_adam(1e-3); params and "
    "state on huge pages (gtx.use_huge_pages) and gtx.reuse_host_memory, "
    "as in the other whole-step benchmarks. Publishing: "
    f"{args.publishes} publishes at each interval (the first counts from "
    "init); the whole params written with orbax at the first "
    f"{args.full_saves} of them, alternated with the delta writes; on-disk "
    "bytes are the checkpoint directory's files. Build = gtx.delta (the "
    "changed rows copied to the host), median of the publishes after the "
    "first (which compiles its programs: in the JSON); write = orbax "
    "StandardCheckpointer save until finished. Every delta was replayed "
    "into a serving copy, equal to the params bit for bit at the end. "
    f"Step: time_interleaved, {args.rounds} rounds x {args.burst} timed "
    f"step(s) of each after {args.settle} untimed (half the rounds in each "
    "order), each run with its own "
    "donated params and state; the ratio is taken per round (the median "
    "of the round's steps of each), then its median and quartiles over "
    "the rounds. Kernels, scatters and fusions: what each compiled step "
    "launches (hlo_op_counts), which does not depend on the machine's "
    "load." + oversubscribed("so the times (not the byte counts) are noisy.")
  )
  write_results(
    "publish",
    "Publishing deltas: bytes and time against the whole params",
    columns(
      "publish every | changed rows (median) | of the rows | delta MiB "
      "(arrays) | delta MiB (orbax) | whole params MiB (orbax) | delta / "
      "whole bytes | build ms | delta write ms | whole write ms | (build + "
      "write) / whole write"
    ),
    table,
    notes=notes,
    extra={
      "args": vars(args),
      "step_seconds": samples,
      "step_ratios": ratios,
      "step_ops": ops,
      "publish": {str(k): v for k, v in pubs.items()},
      "headline": [
        headline(
          "step with track_changes / without (lazy_adam, 2M x 64)",
          f"{statistics.median(ratios):.3f}",
          "<= 1.03",
        ),
        headline(
          "delta / whole params bytes, publish every 10 / 100 steps",
          " / ".join(row[6] for row in table[:2]),
        ),
      ],
    },
  )


if __name__ == "__main__":
  main()
