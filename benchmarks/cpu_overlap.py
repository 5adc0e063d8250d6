"""Does XLA:CPU run independent row updates side by side?

A table stack's lanes (``gtx.TableStack(..., lanes=2)``) are two chains of
kernels with no data between them; per-table leaves are many small ones.
This times, in one jitted program each, donated, side by side in one
process:

- ``one table``: an Adam-like row update (gather the state rows, compute,
  scatter state and params) of ``--ids`` unique rows of a ``--rows`` x D
  table, ``--chunk`` rows a trip of a ``fori_loop`` (as the row engine's
  loop over a stack's unique rows);
- ``two tables, two loops``: the same on two tables in one program;
- ``two tables, one loop``: both tables' chunks in one loop trip;
- ``one table, unrolled`` and ``two tables, unrolled``: the trips written
  out, no loop.

Two tables at 2.0x one table's time means the two chains ran one after
the other; 1.0x, side by side. ``cores busy`` is the process's CPU time
over the wall time of 20 more calls of each program (XLA:CPU splits big
kernels over its threads; threads that wait by spinning count too). Run
it pinned to one core (``taskset -c 0``) to see what the second core
adds to one chain.

Writes ``benchmarks/results/cpu_overlap.{md,json}``.

  python -m benchmarks.cpu_overlap [--rows 400000] [--dim 64]
      [--ids 16384] [--chunk 2048]
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks._common import parse, parser
from benchmarks._results import write_results
from benchmarks._timing import Clock, Schedule


def _trip(k, carry, ids, chunk):
  """One chunk of an Adam-like row update on (m, v, p)."""
  m, v, p = carry
  i = lax.dynamic_slice(ids, (k * chunk,), (chunk,))
  g = jnp.sin(i.astype(jnp.float32))[:, None] * jnp.ones((1, m.shape[1]))
  mr = m[i] * 0.9 + g
  vr = v[i] * 0.99 + g * g
  u = -mr / (jnp.sqrt(vr) + 1e-8)
  return (
    m.at[i].set(mr, unique_indices=True),
    v.at[i].set(vr, unique_indices=True),
    p.at[i].add(u, unique_indices=True),
  )


def programs(trips: int, chunk: int) -> dict:
  """name -> f(a, b, ia, ib) returning (a, b), a and b (m, v, p) triples."""

  def loop(c, ids):
    return lax.fori_loop(0, trips, lambda k, c: _trip(k, c, ids, chunk), c)

  def unrolled(c, ids):
    for k in range(trips):
      c = _trip(k, c, ids, chunk)
    return c

  def one_loop(a, b, ia, ib):
    def trip(k, c):
      return _trip(k, c[0], ia, chunk), _trip(k, c[1], ib, chunk)

    return lax.fori_loop(0, trips, trip, (a, b))

  return {
    "one table": lambda a, b, ia, ib: (loop(a, ia), b),
    "two tables, two loops": lambda a, b, ia, ib: (loop(a, ia), loop(b, ib)),
    "two tables, one loop": one_loop,
    "one table, unrolled": lambda a, b, ia, ib: (unrolled(a, ia), b),
    "two tables, unrolled": lambda a, b, ia, ib: (
      unrolled(a, ia),
      unrolled(b, ib),
    ),
  }


def cores_busy(fn, calls: int = 20) -> float:
  """The process's CPU time over the wall time of ``calls`` calls."""
  clock = Clock()
  for _ in range(calls):
    fn()
  return clock.cpu() / clock.wall()


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__, schedule=Schedule(rounds=10, burst=10, settle=2))
  p.add_argument("--rows", type=int, default=400_000)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--ids", type=int, default=16_384)
  p.add_argument("--chunk", type=int, default=2048)
  args = parse(p, argv, quick=dict(rows=4_000, ids=256, chunk=64, rounds=2))
  sched = Schedule.from_args(args)
  rng = np.random.default_rng(0)
  ia, ib = (
    jax.device_put(rng.permutation(args.rows)[: args.ids].astype(np.int32))
    for _ in range(2)
  )
  fns = {}
  for name, f in programs(args.ids // args.chunk, args.chunk).items():
    step = jax.jit(f, donate_argnums=(0, 1))
    box = [
      tuple(jnp.zeros((args.rows, args.dim)) for _ in range(3))
      for _ in range(2)
    ]

    def run(step=step, box=box):
      box[0], box[1] = step(box[0], box[1], ia, ib)
      jax.block_until_ready(box)

    fns[name] = run
  t = sched.time(fns, label="overlap")
  busy = {name: cores_busy(fn) for name, fn in fns.items()}
  base = {"loop": t["one table"], "unrolled": t["one table, unrolled"]}
  rows = []
  for name, sec in t.items():
    ref = base["unrolled" if "unrolled" in name else "loop"]
    rows.append(
      [name, f"{sec * 1e3:.2f}", f"{sec / ref:.2f}x", f"{busy[name]:.2f}"]
    )
  write_results(
    "cpu_overlap",
    f"Independent row updates in one program: {args.ids:,} unique rows "
    f"of a {args.rows:,} x {args.dim} table, {args.chunk:,} a trip",
    ["program", "ms", "vs one table", "cores busy"],
    rows,
    notes=(
      f"{sched.describe()}; all in one process, params and state donated. "
      "`vs one table`: against the one-table program of the same form "
      "(loop or unrolled); 2.00x: the two tables' chains ran one after "
      "the other. `cores busy`: the process's CPU time over the wall time "
      "of 20 more calls (threads that wait by spinning count too). "
      f"Cores this process may run on: {len(os.sched_getaffinity(0))}."
    ),
  )


if __name__ == "__main__":
  main()
