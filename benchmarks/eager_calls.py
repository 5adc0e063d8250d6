"""A table stack's methods called outside ``jax.jit``, as in a notebook.

One ``gtx.TableStack`` of hashed tables (``--features`` features of
``--rows`` rows, 16 wide) and ``--batch`` raw ids a feature, given two
ways: int32 device arrays, and numpy's default ``int64`` arrays of ids
past 32 bits (a notebook's ids; with ``jax_enable_x64`` off). For
``admit``, ``lookup`` (with the map, read-only) and ``vocab_stats``
(the map as it was made): the call as a user makes it outside ``jit``
(this version: one program compiled once per stack and shapes, numpy
64-bit ids made fit on the host first), the same call op by op (what the
method did before: its private body called eagerly; the map's placement
loop compiles again on every call), and the user's own ``jax.jit`` of it
(64-bit ids as ``gtx.Words``, as a jitted step must take them). Each call
gets new ids; the first call of each system (its compiling) is timed
apart.

Writes ``benchmarks/results/eager_calls.{md,json}``.

  python -m benchmarks.eager_calls [--features 8] [--rows 10000]
      [--batch 256] [--rounds 8]
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import gradtx as gtx
from benchmarks._common import parse, parser
from benchmarks._results import columns, write_results
from benchmarks._timing import Counter, once, time_interleaved
from gradtx import _admission, _pooled
from gradtx._plan import feature_combiners

WAYS = ("outside jit", "op by op", "user's jax.jit")
FORMS = ("int32 jax", "int64 numpy")


def systems(stack: Any, params: Any, vocab: Any, form: str) -> dict:
  """(method, way) -> a function of the ids given as ``form``."""
  jit_admit = jax.jit(stack.admit)
  jit_lookup = jax.jit(lambda p, i, v: stack.lookup(p, i, vocab=v))
  jit_stats = jax.jit(stack.vocab_stats)
  # the bodies TableStack compiles as one program, called op by op
  none, combiners = (None, None), feature_combiners(stack.plan, None)

  def jitted(i):  # a jitted step takes 64-bit ids as gtx.Words
    return (
      i if form == "int32 jax" else {f: gtx.Words.of(x) for f, x in i.items()}
    )

  out = {
    ("admit", "outside jit"): lambda i: stack.admit(vocab, i),
    ("admit", "op by op"): lambda i: _admission._admit(
      stack.plan, vocab, i, None, _admission.new_id_bounds(stack.plan, *none)
    ),
    ("admit", "user's jax.jit"): lambda i: jit_admit(vocab, jitted(i)),
    ("lookup", "outside jit"): lambda i: stack.lookup(params, i, vocab=vocab),
    ("lookup", "op by op"): lambda i: _pooled._read(
      stack.plan, params, i, None, combiners, "dict", vocab, False
    ),
    ("lookup", "user's jax.jit"): lambda i: jit_lookup(
      params, jitted(i), vocab
    ),
  }
  if form == "int32 jax":  # vocab_stats takes no ids
    out.update(
      {
        ("vocab_stats", "outside jit"): lambda i: stack.vocab_stats(vocab),
        ("vocab_stats", "op by op"): lambda i: stack._vocab_stats(vocab),
        ("vocab_stats", "user's jax.jit"): lambda i: jit_stats(vocab),
      }
    )
  return out


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__, rounds=8)
  p.add_argument("--features", type=int, default=8)
  p.add_argument("--rows", type=int, default=10_000)
  p.add_argument("--batch", type=int, default=256)
  args = parse(p, argv, quick=dict(features=2, rows=500, batch=32, rounds=2))
  names = [f"f{t}" for t in range(args.features)]
  stack = gtx.TableStack(
    {n: gtx.TableSpec(args.rows, 16, hashed=gtx.Hashed()) for n in names}
  )
  vocab = stack.init_vocab(jax.random.key(1))
  params = stack.init(jax.random.key(0))
  rng = np.random.default_rng(0)
  draws = [
    {n: rng.integers(0, 10**6, args.batch) for n in names}
    for _ in range(args.rounds + 4)
  ]
  batches = {
    "int32 jax": [
      {n: jax.device_put(x.astype(np.int32)) for n, x in d.items()}
      for d in draws
    ],
    "int64 numpy": [
      {n: x * 3_000_000_019 for n, x in d.items()} for d in draws
    ],
  }
  first, fns = {}, {}
  for form in FORMS:
    for (method, way), fn in systems(stack, params, vocab, form).items():
      key = f"{method}, {form}, {way}"
      first[key] = once(
        lambda fn=fn, b=batches[form][0]: jax.block_until_ready(fn(b))
      )
      fns[key] = Counter(
        lambda k, fn=fn, b=batches[form]: jax.block_until_ready(
          fn(b[k % len(b)])
        )
      )
  t = time_interleaved(fns, warmup=1, rounds=args.rounds, label="eager calls")
  rows = []
  for method in ("admit", "lookup", "vocab_stats"):
    for form in FORMS:
      if f"{method}, {form}, outside jit" not in t:
        continue
      ours = t[f"{method}, {form}, outside jit"]
      for way in WAYS:
        key = f"{method}, {form}, {way}"
        ids = "-" if method == "vocab_stats" else form
        rows.append([method, ids, way, f"{first[key]:.2f}"])
        rows[-1] += [f"{t[key] * 1e3:.2f}", f"{t[key] / ours:.2f}x"]
  write_results(
    "eager_calls",
    "A table stack's methods called outside jax.jit",
    columns(
      "method | ids | called | first call s | later calls ms | vs outside jit"
    ),
    rows,
    notes=(
      f"{args.features} hashed tables of {args.rows:,} rows, 16 wide, "
      f"{args.batch} raw ids a feature, new ids every call; `int64 numpy`: "
      "numpy's default integers, ids past 32 bits (x64 off), `gtx.Words` "
      "under the user's jax.jit. First call: its compiling included; later "
      f"calls: median of {args.rounds} interleaved rounds. `op by op`: the "
      "method's body called eagerly, what the methods did before they "
      "compiled themselves outside jit (and, for numpy int64 ids, before "
      "they made them fit on the host)."
    ),
  )


if __name__ == "__main__":
  main()
