"""The cost of ``TableStack.lookup(..., bounds_check=True)`` in a step.

One ``gtx.TableStack`` of ``--features`` plain tables (``--rows`` rows, 16
wide), ``[B, L]`` bags of ``--bag`` ids, a jitted training step (the
lookup, a linear head, ``gtx.sparse_value_and_grad``, ``gtx.lazy_adam``,
donated), with the bounds check off (the default) and on (a host
callback checks every id read before the gather). Both steps run
interleaved, on the same batches.

Writes ``benchmarks/results/bounds_check.{md,json}``.

  python -m benchmarks.bounds_check [--features 8] [--rows 10000]
      [--batch 1024] [--bag 4] [--rounds 15]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks._common import parse, parser
from benchmarks._results import write_results
from benchmarks._timing import Counter, step_runner, time_interleaved


def make_step(stack, tx, bounds_check: bool):
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


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__, rounds=15)
  p.add_argument("--features", type=int, default=8)
  p.add_argument("--rows", type=int, default=10_000)
  p.add_argument("--batch", type=int, default=1024)
  p.add_argument("--bag", type=int, default=4)
  args = parse(p, argv, quick=dict(features=2, rows=500, batch=64, rounds=2))
  names = [f"f{t}" for t in range(args.features)]
  stack = gtx.TableStack({n: gtx.TableSpec(args.rows, 16) for n in names})
  tx = gtx.lazy_adam(1e-3)
  rng = np.random.default_rng(0)
  batches = [
    {
      n: jnp.asarray(rng.integers(0, args.rows, (args.batch, args.bag)))
      for n in names
    }
    for _ in range(4)
  ]
  fns = {}
  for checked in (False, True):
    key = "bounds_check=True" if checked else "off (default)"
    params = {
      "emb": stack.init(jax.random.key(0)),
      "w": jnp.ones((16 * args.features,), jnp.float32),
    }
    step = make_step(stack, tx, checked)
    box = [params, tx.init(params)]
    run = step_runner(step, box, lambda k: (batches[k % len(batches)],))
    fns[key] = Counter(run, 0)
  t = time_interleaved(fns, warmup=2, rounds=args.rounds, label="bounds check")
  base = t["off (default)"]
  rows = [[k, f"{v * 1e3:.2f}", f"{v / base:.2f}x"] for k, v in t.items()]
  write_results(
    "bounds_check",
    "TableStack.lookup's bounds check in a training step",
    ["lookup", "step ms", "vs off"],
    rows,
    notes=(
      f"{args.features} plain tables of {args.rows:,} rows, 16 wide, "
      f"[{args.batch}, {args.bag}] bags a feature, a jitted and donated "
      "step (lookup, linear head, sparse_value_and_grad, lazy_adam); "
      f"median of {args.rounds} interleaved rounds. The check is a host "
      "callback over every id read, before the gather."
    ),
  )


if __name__ == "__main__":
  main()
