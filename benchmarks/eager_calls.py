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
apart. Then the cost of ``lookup(..., bounds_check=True)`` in a jitted
training step (plain tables, ``[--bounds-batch, --bag]`` bags, a linear
head, ``gtx.lazy_adam``, donated), off and on, interleaved on the same
batches.

Writes ``benchmarks/results/eager_calls.{md,json}`` (``--only eager``) and
``benchmarks/results/bounds_check.{md,json}`` (``--only bounds``).

  python -m benchmarks.eager_calls [--features 8] [--rows 10000]
      [--batch 256] [--rounds 8] [--bounds-rounds 15] [--only eager bounds]
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks._common import parse, parser
from benchmarks._results import columns, write_results
from benchmarks._timing import Counter, once, step_runner, time_interleaved
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


def bounds_step(stack, tx, bounds_check: bool):
  def loss(params, ids):
    emb = stack.lookup(
      params["emb"], ids, output="concat", bounds_check=bounds_check
    )
    return jnp.mean((emb @ params["w"]) ** 2)

  @jax.jit(donate_argnums=(0, 1))
  def step(params, state, ids):
    value, grads = gtx.sparse_value_and_grad(loss)(params, ids)
    updates, state = tx.update(grads, state, params)
    return gtx.apply_updates(params, updates), state, value

  return step


def write_bounds(args, names) -> None:
  """results/bounds_check: the step with the bounds check off and on."""
  stack = gtx.TableStack({n: gtx.TableSpec(args.rows, 16) for n in names})
  tx = gtx.lazy_adam(1e-3)
  rng = np.random.default_rng(0)
  shape = (args.bounds_batch, args.bag)
  batches = [
    {n: jnp.asarray(rng.integers(0, args.rows, shape)) for n in names}
    for _ in range(4)
  ]
  fns = {}
  for checked in (False, True):
    params = {
      "emb": stack.init(jax.random.key(0)),
      "w": jnp.ones((16 * args.features,), jnp.float32),
    }
    box = [params, tx.init(params)]
    run = step_runner(
      bounds_step(stack, tx, checked),
      box,
      lambda k: (batches[k % len(batches)],),
    )
    fns["bounds_check=True" if checked else "off (default)"] = Counter(run, 0)
  t = time_interleaved(
    fns, warmup=2, rounds=args.bounds_rounds, label="bounds check"
  )
  base = t["off (default)"]
  write_results(
    "bounds_check",
    "TableStack.lookup's bounds check in a training step",
    ["lookup", "step ms", "vs off"],
    [[k, f"{v * 1e3:.2f}", f"{v / base:.2f}x"] for k, v in t.items()],
    notes=(
      f"{args.features} plain tables of {args.rows:,} rows, 16 wide, "
      f"[{args.bounds_batch}, {args.bag}] bags a feature, a jitted and "
      "donated step (lookup, linear head, sparse_value_and_grad, "
      f"lazy_adam); median of {args.bounds_rounds} interleaved rounds. The "
      "check is a host callback over every id read, before the gather."
    ),
  )


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__, rounds=8)
  p.add_argument("--features", type=int, default=8)
  p.add_argument("--rows", type=int, default=10_000)
  p.add_argument("--batch", type=int, default=256)
  p.add_argument("--bounds-batch", type=int, default=1024)
  p.add_argument("--bag", type=int, default=4)
  p.add_argument("--bounds-rounds", type=int, default=15)
  p.add_argument(
    "--only",
    nargs="+",
    choices=["eager", "bounds"],
    default=["eager", "bounds"],
  )
  quick = dict(features=2, rows=500, batch=32, rounds=2)
  args = parse(p, argv, quick=dict(quick, bounds_batch=64, bounds_rounds=2))
  names = [f"f{t}" for t in range(args.features)]
  if "bounds" in args.only:
    write_bounds(args, names)
  if "eager" in args.only:
    write_eager(args, names)


def write_eager(args, names) -> None:
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
