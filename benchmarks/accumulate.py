"""k-step accumulation: gtx.accumulate against optax.MultiSteps.

One model, a few million dense params plus a ``num_rows x 64`` embedding
table, k micro-steps per update, Adam as the inner optimizer. Every step is
``jit``-ed with params and state donated and applies its updates. Variants:

- ``optax.MultiSteps(optax.adam)``: the table gradient is dense.
- ``gtx.accumulate(optax.adam)``: the same dense gradients (like for like).
- ``gtx.accumulate(gtx.lazy_adam)``: the table gradient is a SparseRows of
  ``n`` rows per micro-step, accumulated in a ``k * n``-row buffer.

Measured: median time of a silent micro-step and of an emitting step, and
the compiled memory (``memory_analysis()``: argument + output + temp bytes)
of the step, plus the compiled memory at k = 1.

``python -m benchmarks.accumulate [--quick]``
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradtx as gtx
from benchmarks._common import memory, parse, parser
from benchmarks._results import columns, headline, write_results
from benchmarks._timing import time_interleaved

DIM = 64


def _params(num_rows: int, hidden: int) -> dict[str, jax.Array]:
  rng = np.random.RandomState(0)
  return {
    "table": jnp.asarray(rng.normal(size=(num_rows, DIM)) * 0.01, jnp.float32),
    "w1": jnp.asarray(rng.normal(size=(DIM * 16, hidden)), jnp.float32),
    "w2": jnp.asarray(rng.normal(size=(hidden, DIM * 16)), jnp.float32),
  }


def _grads(params, n: int, *, sparse: bool) -> dict:
  rng = np.random.RandomState(1)
  num_rows = params["table"].shape[0]
  ids = jnp.asarray(rng.randint(0, num_rows, size=n), jnp.int32)
  rows = jnp.asarray(rng.normal(size=(n, DIM)), jnp.float32)
  g = gtx.SparseRows(ids, rows, num_rows)
  return {
    "table": g if sparse else g.to_dense(),
    "w1": jnp.asarray(rng.normal(size=params["w1"].shape), jnp.float32),
    "w2": jnp.asarray(rng.normal(size=params["w2"].shape), jnp.float32),
  }


def _step(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return gtx.apply_updates(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def _nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


class _Runner:
  """Holds one variant's params and state; runs a step at a chosen phase."""

  def __init__(self, tx, params, grads, set_phase):
    self.tx = tx
    self.params = jax.tree.map(jnp.copy, params)
    self.state = tx.init(self.params)
    self.state_bytes = _nbytes(self.state)
    self.grads = grads
    self.set_phase = set_phase
    self.step = _step(tx)
    self.compiled = self.step.lower(self.params, self.state, grads).compile()

  def run(self, emit: bool) -> None:
    state = self.set_phase(self.state, emit)
    self.params, self.state = self.compiled(self.params, state, self.grads)
    jax.block_until_ready((self.params, self.state))


def _phase(k: int, field: str):
  """Sets the state's micro-step counter ``field`` to emit or not."""

  def set_phase(state, emit):
    count = jnp.asarray(k - 1 if emit else 0, jnp.int32)
    return state._replace(**{field: count})

  return set_phase


def _mib(m: dict) -> list[float]:
  """Total, total less the aliased bytes and temp, MiB."""
  return [x / 2**20 for x in (m["total"], m["total"] - m["alias"], m["temp"])]


def _memory_row(name, compiled) -> dict:
  m = memory(compiled)
  total = m["argument"] + m["output"] + m["temp"]
  return {"variant": name, **m, "total": total}


def _k1_memory(params, grads) -> dict:
  """The compiled memory of the k = 1 steps and of adam alone."""
  small = {}
  for name, tx in [
    ("optax.MultiSteps(adam), k=1", optax.MultiSteps(optax.adam(1e-3), 1)),
    ("gtx.accumulate(adam), k=1", gtx.accumulate(optax.adam(1e-3), 1)),
    ("optax.adam alone", optax.adam(1e-3)),
  ]:
    tx = getattr(tx, "gradient_transformation", lambda tx=tx: tx)()
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
    )
    state = jax.eval_shape(tx.init, abstract)
    compiled = _step(tx).lower(abstract, state, grads).compile()
    small[name] = _memory_row(name, compiled)
  return small


def main(argv=None) -> None:
  p = parser(__doc__.split("\n")[0], rounds=7, fresh_memory=True)
  p.add_argument("--k", type=int, default=4)
  p.add_argument("--rows", type=int, default=1_000_000)
  p.add_argument("--hidden", type=int, default=2048)
  p.add_argument("--ids", type=int, default=4096)
  quick = dict(rows=20_000, hidden=128, ids=256, rounds=3)
  args = parse(p, argv, quick=quick)
  num_rows, hidden, n = args.rows, args.hidden, args.ids
  rounds, k = args.rounds, args.k

  params = _params(num_rows, hidden)
  dense_grads = _grads(params, n, sparse=False)
  sparse_grads = _grads(params, n, sparse=True)
  rows = {"table": n, "w1": None, "w2": None}
  dense_count = params["w1"].size + params["w2"].size
  print(
    f"table {num_rows} x {DIM}, {dense_count / 1e6:.2f}M dense params, "
    f"n={n} rows per micro-step, k={k}"
  )

  multi = optax.MultiSteps(optax.adam(1e-3), k).gradient_transformation()
  lazy = gtx.accumulate(gtx.lazy_adam(1e-3), k, rows_per_step=rows)
  variants = {
    "optax.MultiSteps(adam)": (multi, dense_grads, "mini_step"),
    "gtx.accumulate(adam), dense grads": (
      gtx.accumulate(optax.adam(1e-3), k),
      dense_grads,
      "num_accumulated",
    ),
    "gtx.accumulate(lazy_adam), SparseRows": (
      lazy,
      sparse_grads,
      "num_accumulated",
    ),
  }
  runners = {
    name: _Runner(tx, params, grads, _phase(k, field))
    for name, (tx, grads, field) in variants.items()
  }
  del params

  fns = {}
  for name, r in runners.items():
    fns[(name, False)] = lambda r=r: r.run(False)
    fns[(name, True)] = lambda r=r: r.run(True)
  times = time_interleaved(fns, warmup=1, rounds=rounds)

  base = "optax.MultiSteps(adam)"
  mems = {name: _memory_row(name, r.compiled) for name, r in runners.items()}
  rows_out = []
  for name, r in runners.items():
    silent, emit = times[(name, False)], times[(name, True)]
    m = mems[name]
    rows_out.append(
      [name, silent * 1e3, times[(base, False)] / silent, emit * 1e3]
      + [times[(base, True)] / emit]
      + _mib(m)
      + [r.state_bytes / 2**20]
    )
  acc = runners["gtx.accumulate(lazy_adam), SparseRows"].state.accumulator
  table_buffer = _nbytes(acc["table"])

  # k = 1: compiled memory only (optax#320, #472: MultiSteps at k = 1).
  small = _k1_memory(runners[base].params, dense_grads)
  for name, m in small.items():
    rows_out.append([name, "-", "-", "-", "-", *_mib(m), "-"])

  notes = (
    f"Table {num_rows} x {DIM} float32, {dense_count / 1e6:.2f}M dense "
    f"params, n = {n} rows per micro-step, k = {k}, inner Adam (lr 1e-3). "
    "Steps are jitted with params and state donated and apply their "
    "updates; times are medians over interleaved rounds. Memory is the "
    "compiled step's memory_analysis(): total = argument + output + temp; "
    "'- aliased' subtracts the donated bytes reused for outputs. The "
    f"sparse table's accumulator is {table_buffer / 2**20:.2f} MiB "
    f"(k * n = {k * n} rows of {DIM} float32 + an int32 index each) versus "
    f"{num_rows * DIM * 4 / 2**20:.0f} MiB for a dense one. MultiSteps runs "
    "in this process, which imported gradtx: its host-memory setting (last "
    "paragraph) applies to it too."
  )
  write_results(
    "accumulate",
    "Gradient accumulation: gtx.accumulate vs optax.MultiSteps",
    columns(
      "variant | silent step (ms) | speedup | emitting step (ms) | speedup | "
      "total (MiB) | - aliased (MiB) | temp (MiB) | state (MiB)"
    ),
    rows_out,
    notes=notes,
    extra={
      "times_s": {
        f"{a} | {'emit' if b else 'silent'}": t for (a, b), t in times.items()
      },
      "memory": {**mems, **small},
      "sparse_accumulator_bytes": table_buffer,
      "config": {"num_rows": num_rows, "dim": DIM, "n": n, "k": k},
      "headline": [
        headline(
          f"silent micro-step speed-up vs MultiSteps: {r[0]}",
          round(r[2], 1),
          ">= 2x",
        )
        for r in rows_out
        if r[0].startswith("gtx") and r[2] != "-"
      ]
      + [
        headline(
          f"compiled memory (total) vs MultiSteps(adam): {rows_out[1][0]}",
          round(rows_out[1][5] / rows_out[0][5], 2),
          "<= 1",
        )
      ],
    },
  )


if __name__ == "__main__":
  main()
