"""k-step accumulation: gtx.accumulate against optax.MultiSteps.

Dense params and a ``num_rows x 64`` table, Adam inside, k micro-steps per
update: the silent and the emitting step's time and compiled memory.

``python -m benchmarks.accumulate [--quick]``
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradtx as gtx
from benchmarks import optimizer_steps as runner
from benchmarks._common import memory
from benchmarks._results import headline
from benchmarks._timing import step_runner

DIM = 64
BASE = "optax.MultiSteps(adam)"
LAZY = "gtx.accumulate(lazy_adam), SparseRows"


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


def _nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def _variant(tx, params, grads, k: int) -> tuple[runner.System, ...]:
  """The silent and the emitting step of ``tx`` on its own params and
  state, its micro-step counter set before each step."""
  tx = getattr(tx, "gradient_transformation", lambda: tx)()
  params = jax.tree.map(jnp.copy, params)
  box = [params, tx.init(params)]
  field = "mini_step" if hasattr(box[1], "mini_step") else "num_accumulated"
  compiled = runner.update_step(tx).lower(*box, grads).compile()
  info = dict(compiled=compiled, state_bytes=_nbytes(box[1]))

  def phase(emit: bool) -> runner.System:
    def step(params, state, grads):
      count = jnp.asarray(k - 1 if emit else 0, jnp.int32)
      return compiled(params, state._replace(**{field: count}), grads)

    run_ = step_runner(step, box, lambda i: (grads,))
    return runner.System(lambda: run_(0), (box, info))

  return phase(False), phase(True)


def _mib(m: dict) -> list[float]:
  """Total, total less the aliased bytes and temp, MiB."""
  return [x / 2**20 for x in (m["total"], m["total"] - m["alias"], m["temp"])]


def _memory_row(name, compiled) -> dict:
  m = memory(compiled)
  total = m["argument"] + m["output"] + m["temp"]
  return {"variant": name, **m, "total": total}


def _k1_memory(params, grads) -> dict:
  """The compiled memory of the k = 1 steps and of adam alone."""
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
  )
  small = {}
  for name, tx in [
    ("optax.MultiSteps(adam), k=1", optax.MultiSteps(optax.adam(1e-3), 1)),
    ("gtx.accumulate(adam), k=1", gtx.accumulate(optax.adam(1e-3), 1)),
    ("optax.adam alone", optax.adam(1e-3)),
  ]:
    tx = getattr(tx, "gradient_transformation", lambda tx=tx: tx)()
    state = jax.eval_shape(tx.init, abstract)
    compiled = runner.update_step(tx).lower(abstract, state, grads).compile()
    small[name] = _memory_row(name, compiled)
  return small


def _case(_, ctx):
  k, n, a = ctx.args.k, ctx.args.ids, ctx.args
  params = _params(a.rows, a.hidden)
  dense_grads = _grads(params, n, sparse=False)
  sparse_grads = _grads(params, n, sparse=True)
  ctx.found["dense_count"] = params["w1"].size + params["w2"].size
  rows = {"table": n, "w1": None, "w2": None}
  variants = {
    BASE: (optax.MultiSteps(optax.adam(1e-3), k), dense_grads),
    "gtx.accumulate(adam), dense grads": (
      gtx.accumulate(optax.adam(1e-3), k),
      dense_grads,
    ),
    LAZY: (
      gtx.accumulate(gtx.lazy_adam(1e-3), k, rows_per_step=rows),
      sparse_grads,
    ),
  }
  systems, kept = {}, {}
  for name, (tx, grads) in variants.items():
    silent, emit = _variant(tx, params, grads, k)
    systems[(name, False)], systems[(name, True)] = silent, emit
    kept[name] = silent.keep  # ([params, state], info)
  del params
  ms = ctx.time(systems, warmup=1)
  mems = {m: _memory_row(m, i["compiled"]) for m, (_, i) in kept.items()}
  out = []
  for name, (_, info) in kept.items():
    silent, emit = ms[(name, False)], ms[(name, True)]
    out.append(
      [name, silent, ms[(BASE, False)] / silent, emit]
      + [ms[(BASE, True)] / emit]
      + _mib(mems[name])
      + [info["state_bytes"] / 2**20]
    )
  acc = kept[LAZY][0][1].accumulator
  # k = 1: compiled memory only (optax#320, #472: MultiSteps at k = 1).
  small = _k1_memory(kept[BASE][0][0], dense_grads)
  for name, m in small.items():
    out.append([name, "-", "-", "-", "-", *_mib(m), "-"])
  ctx.found.update(
    ms=ms, memory={**mems, **small}, table_buffer=_nbytes(acc["table"])
  )
  return out


def _finish(rows, ctx):
  a, case = ctx.args, ctx.found
  buffer = case["table_buffer"]
  num_rows, n, k = a.rows, a.ids, a.k
  notes = (
    f"Table {num_rows} x {DIM} float32, {case['dense_count'] / 1e6:.2f}M "
    f"dense params, n = {n} rows per micro-step, k = {k}, inner Adam (lr "
    "1e-3). Steps are jitted with params and state donated and apply their "
    "updates; times are medians over interleaved rounds. Memory is the "
    "compiled step's memory_analysis(): total = argument + output + temp; "
    "'- aliased' subtracts the donated bytes reused for outputs. The "
    f"sparse table's accumulator is {buffer / 2**20:.2f} MiB "
    f"(k * n = {k * n} rows of {DIM} float32 + an int32 index each) versus "
    f"{num_rows * DIM * 4 / 2**20:.0f} MiB for a dense one. MultiSteps runs "
    "in this process, which imported gradtx: its host-memory setting (last "
    "paragraph) applies to it too."
  )
  times = {
    f"{a} | {'emit' if b else 'silent'}": t / 1e3
    for (a, b), t in case["ms"].items()
  }
  heads = runner.row_heads(
    [r for r in rows if r[0].startswith("gtx")],
    ("silent micro-step speed-up vs MultiSteps: {0}", 2, ">= 2x", 1),
  )
  heads.append(
    headline(
      f"compiled memory (total) vs MultiSteps(adam): {rows[1][0]}",
      round(rows[1][5] / rows[0][5], 2),
      "<= 1",
    )
  )
  return notes, {
    "times_s": times,
    "memory": case["memory"],
    "sparse_accumulator_bytes": buffer,
    "config": {"num_rows": num_rows, "dim": DIM, "n": n, "k": k},
    "headline": heads,
  }


SCENARIO = runner.Scenario(
  name="accumulate",
  title="Gradient accumulation: gtx.accumulate vs optax.MultiSteps",
  columns="variant | silent step (ms) | speedup | emitting step (ms) | "
  "speedup | total (MiB) | - aliased (MiB) | temp (MiB) | state (MiB)",
  doc=__doc__.split("\n")[0],
  cases=lambda ctx: [None],
  case=_case,
  finish=_finish,
  flags={"--k": 4, "--rows": 1_000_000, "--hidden": 2048, "--ids": 4096},
  quick=dict(rows=20_000, hidden=128, ids=256, rounds=3),
  options=dict(rounds=7, fresh_memory=True),
)


main = SCENARIO.main

if __name__ == "__main__":
  main()
