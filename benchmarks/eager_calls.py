"""A table stack's methods called outside ``jax.jit``, as in a notebook.

One ``gtx.TableStack`` of hashed tables (``--features`` features of
``--rows`` rows, 16 wide) and ``--batch`` raw ids a feature. For
``admit``, ``lookup`` (with the map, read-only) and ``vocab_stats``
(the map as it was made): the call as a user
makes it outside ``jit`` (this version: one program compiled once per
stack and shapes), the same call op by op (what the method did before:
its private body called eagerly; the map's placement loop compiles again
on every call), and the user's own ``jax.jit`` of it. Each call gets new
ids; the first call of each system (its compiling) is timed apart.

Writes ``benchmarks/results/eager_calls.{md,json}``.

  python -m benchmarks.eager_calls [--features 8] [--rows 10000]
      [--batch 256] [--rounds 8]
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

import gradtx as gtx
from benchmarks._common import parse, parser, time_interleaved, write_results
from gradtx._vocab import DEFAULT_MAX_NEW


def systems(stack: Any, params: Any, vocab: Any) -> dict[str, Any]:
  """(method, way) -> a function of the ids."""
  jit_admit = jax.jit(stack.admit)
  jit_lookup = jax.jit(lambda p, i, v: stack.lookup(p, i, vocab=v))
  jit_stats = jax.jit(stack.vocab_stats)
  return {
    ("admit", "outside jit"): lambda i: stack.admit(vocab, i),
    ("admit", "op by op"): lambda i: stack._admit(
      vocab, i, None, DEFAULT_MAX_NEW
    ),
    ("admit", "user's jax.jit"): lambda i: jit_admit(vocab, i),
    ("lookup", "outside jit"): lambda i: stack.lookup(params, i, vocab=vocab),
    ("lookup", "op by op"): lambda i: stack._lookup(
      params, i, None, "sum", False, False, vocab
    ),
    ("lookup", "user's jax.jit"): lambda i: jit_lookup(params, i, vocab),
    ("vocab_stats", "outside jit"): lambda i: stack.vocab_stats(vocab),
    ("vocab_stats", "op by op"): lambda i: stack._vocab_stats(vocab),
    ("vocab_stats", "user's jax.jit"): lambda i: jit_stats(vocab),
  }


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__, rounds=8)
  p.add_argument("--features", type=int, default=8)
  p.add_argument("--rows", type=int, default=10_000)
  p.add_argument("--batch", type=int, default=256)
  args = parse(p, argv, quick=dict(features=2, rows=500, batch=32, rounds=2))
  names = [f"f{t}" for t in range(args.features)]
  stack = gtx.TableStack(
    {n: gtx.TableSpec(args.rows, 16, hashed=True) for n in names}
  )
  vocab = stack.init_vocab(jax.random.key(1))
  params = stack.init(jax.random.key(0))
  rng = np.random.default_rng(0)
  batches = [
    {
      n: jax.device_put(rng.integers(0, 10**6, args.batch).astype(np.int32))
      for n in names
    }
    for _ in range(args.rounds + 4)
  ]
  first, fns = {}, {}
  for key, fn in systems(stack, params, vocab).items():
    t0 = time.perf_counter()
    jax.block_until_ready(fn(batches[0]))
    first[key] = time.perf_counter() - t0
    count = iter(range(1, 10**9))

    def call(fn=fn, count=count):
      jax.block_until_ready(fn(batches[next(count) % len(batches)]))

    fns[key] = call
  t = time_interleaved(
    {f"{m}, {w}": f for (m, w), f in fns.items()},
    warmup=1,
    rounds=args.rounds,
    label="eager calls",
  )
  rows = []
  for method in ("admit", "lookup", "vocab_stats"):
    ours = t[f"{method}, outside jit"]
    for way in ("outside jit", "op by op", "user's jax.jit"):
      ms = t[f"{method}, {way}"] * 1e3
      rows.append(
        [
          method,
          way,
          f"{first[(method, way)]:.2f}",
          f"{ms:.2f}",
          f"{ms / (ours * 1e3):.2f}x",
        ]
      )
  write_results(
    "eager_calls",
    "A table stack's methods called outside jax.jit",
    ["method", "called", "first call s", "later calls ms", "vs outside jit"],
    rows,
    notes=(
      f"{args.features} hashed tables of {args.rows:,} rows, 16 wide, "
      f"{args.batch} raw ids a feature, new ids every call; first call: "
      "its compiling included; later calls: median of "
      f"{args.rounds} interleaved rounds. `op by op`: the method's body "
      "called eagerly, what the methods did before they compiled "
      "themselves outside jit."
    ),
  )


if __name__ == "__main__":
  main()
