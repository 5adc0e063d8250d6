"""Publishing to serving: what a delta costs and saves against the whole
params.

A ``--tables`` x ``--rows`` x ``--dim`` stack (default 4 x 500K x 64: 2M
rows) trained with ``gtx.lazy_adam``, one feature per table, ``--batch``
ids per feature and step, Zipf ids (exponent ``--zipf``, ranks scrambled
over the table's rows) fresh every step. Two measurements:

* ``step``: the whole jitted step (lookup, sparse gradient, lazy_adam,
  apply; params and state donated, on huge pages, host memory reused, as
  in the other whole-step benchmarks) with and without ``gtx.track_changes``
  in the chain, alternated in one process (``time_interleaved``), with
  each run's own params and state; the ratio is what tracking adds.
* ``publish``: the tracked run, publishing every 10 and every 100 steps:
  the delta's bytes (arrays, and the orbax checkpoint on disk), the time
  to build it (``gtx.delta``, which copies the changed rows to the host)
  and to write it with orbax, against writing the whole params with orbax
  (alternated with the delta writes). Every delta is replayed into a
  serving copy, which must equal the params at the end.

Writes ``benchmarks/results/publish.{md,json}``.

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
from benchmarks._timing import Clock, Schedule, time_interleaved

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

  def step(p, s, ids, y):
    value, g = gtx.sparse_value_and_grad(loss)(p, ids, y)
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s, value

  return jax.jit(step, donate_argnums=(0, 1))


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


class Run:
  """One training run on its own donated params and state."""

  def __init__(self, stack, tx, data):
    self.params = stack.init(jax.random.key(SEED))
    self.state = tx.init(self.params)
    gtx.use_huge_pages((self.params, self.state))
    self.step_fn = make_step(stack, tx)
    self.data = data
    self.k = 0

  def step(self):
    ids, y = self.data[self.k % len(self.data)]
    self.k += 1
    self.params, self.state, v = self.step_fn(self.params, self.state, ids, y)
    v.block_until_ready()


def nbytes(tree) -> int:
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


def disk_bytes(path: Path) -> int:
  return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def timed_save(ckptr, path, tree) -> tuple[float, int]:
  clock = Clock()
  ckptr.save(path, tree)
  ckptr.wait_until_finished()
  sec = clock.wall()
  size = disk_bytes(path)
  shutil.rmtree(path)
  return sec, size


def measure_step(args, stack, data):
  """Per round, the median of each system's timed steps; the ratio of the
  two in each round (paired, so the machine's load drifts cancel), then
  their median and quartiles. Also what each compiled step launches."""
  plain = Run(stack, gtx.lazy_adam(1e-3), data)
  tracked = Run(
    stack, optax.chain(gtx.lazy_adam(1e-3), gtx.track_changes()), data
  )
  ids, y = data[0]
  ops = {
    name: hlo_op_counts(
      r.step_fn.lower(r.params, r.state, ids, y).compile().as_text()
    )
    for name, r in (("lazy_adam", plain), ("+ track_changes", tracked))
  }
  # Half the rounds in each order, so neither step always runs first.
  fns = {"lazy_adam": plain.step, "+ track_changes": tracked.step}
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
  del plain, tracked
  return samples, ratios, ops


def measure_publish(args, stack, data, every, tmp: Path):
  tx = optax.chain(gtx.lazy_adam(1e-3), gtx.track_changes())
  run = Run(stack, tx, data)
  serving = jax.tree.map(np.asarray, run.params)
  full_bytes = nbytes(run.params)
  keys = "rows bytes disk build write full_write full_disk"
  rows = {k: [] for k in keys.split()}
  last = None
  with ocp.StandardCheckpointer() as ckptr:
    for n in range(args.publishes):
      for _ in range(every):
        run.step()
      clock = Clock()
      d = gtx.delta(run.params, run.state, since=last)
      rows["build"].append(clock.wall())
      last = d.step
      ((name, change),) = d.params.items()
      rows["rows"].append(0 if change is None else len(change["ids"]))
      rows["bytes"].append(nbytes(d))
      sec, size = timed_save(ckptr, tmp / f"delta{every}_{n}", d)
      rows["write"].append(sec)
      rows["disk"].append(size)
      if n < args.full_saves:
        sec, size = timed_save(ckptr, tmp / f"full{every}_{n}", run.params)
        rows["full_write"].append(sec)
        rows["full_disk"].append(size)
      serving = gtx.apply_delta(serving, d)
      print(
        f"every {every}: publish {n}: {rows['rows'][-1]} rows, "
        f"{rows['bytes'][-1] / 2**20:.1f} MiB, build "
        f"{rows['build'][-1] * 1e3:.0f} ms, write "
        f"{rows['write'][-1] * 1e3:.0f} ms",
        flush=True,
      )
  for k, p in run.params.items():
    assert np.array_equal(serving[k], np.asarray(p)), "serving != params"
  rows["full_bytes"] = full_bytes
  rows["name"] = name
  return rows


def main(argv=None):
  p = parser(__doc__.splitlines()[0], schedule=Schedule(300, 1, 1))
  p.add_argument("--tables", type=int, default=4)
  p.add_argument("--rows", type=int, default=500_000)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--batch", type=int, default=2048)
  p.add_argument("--zipf", type=float, default=1.1)
  p.add_argument("--batches", type=int, default=200)
  p.add_argument("--publishes", type=int, default=6)
  p.add_argument("--full-saves", type=int, default=3)
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
  headers = columns(
    "publish every | changed rows (median) | of the rows | delta MiB "
    "(arrays) | delta MiB (orbax) | whole params MiB (orbax) | delta / "
    "whole bytes | build ms | delta write ms | whole write ms | (build + "
    "write) / whole write"
  )
  table = []
  for every, r in pubs.items():
    med = statistics.median
    # the first build compiles gtx.delta's small programs
    build, write = med(r["build"][1:]), med(r["write"])
    full = med(r["full_write"])
    table.append(
      [f"{every} steps", int(med(r["rows"]))]
      + [f"{med(r['rows']) / total_rows:.2%}"]
      + [f"{med(r[k]) / 2**20:.1f}" for k in ("bytes", "disk", "full_disk")]
      + [f"{med(r['disk']) / med(r['full_disk']):.3f}"]
      + [f"{x * 1e3:.0f}" for x in (build, write, full)]
      + [f"{(build + write) / full:.3f}"]
    )
  step_ms = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
  q1, q2, q3 = statistics.quantiles(ratios, n=4)
  step_headers = columns(
    "step | ms (median) | / lazy_adam (median of paired rounds) | "
    "quartiles | kernels | scatters | fusions"
  )
  step_table = [
    [k, f"{step_ms[k]:.2f}"]
    + (["1", ""] if k == "lazy_adam" else [f"{q2:.3f}", f"{q1:.3f} - {q3:.3f}"])
    + [ops[k][op] for op in ("kernels", "scatter", "fusion")]
    for k in step_ms
  ]
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
    headers,
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
