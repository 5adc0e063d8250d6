"""Row-sharded vs replicated tables: collective bytes, memory, step time.

On 8 fake CPU devices (this module sets ``XLA_FLAGS`` before JAX is first
imported: run it as its own process), the training step (a ``gtx.lookup``
bag of embeddings, ``sparse_value_and_grad``, ``lazy_adam``, donated) on an
Explicit mesh, the batch split over the devices, the table replicated
(``P()``) or row-sharded (``P("d", None)``); per table size: the bytes its
collectives move (from the compiled HLO), per-device memory
(``memory_analysis``) and the step's time where the state fits. Also the
two ways to read rows of a sharded table: gradtx's masked local read +
reduce-scatter, and TorchRec's routing of ids to their owners with two
all-to-alls (buckets at the static worst case).

``--mirrored``: the same figures for ``gtx.Mirrored``'s step (``all_reduce``
then ``lazy_adam``), every param replicated, against the hybrid
``Mirrored(shard_rows="emb")``; writes ``results/sharded_mirrored``.

  python -m benchmarks.sharded [--rows 1000000 8000000] [--dim 32]
      [--ids 8192] [--quick] [--mirrored]
"""

from __future__ import annotations

import contextlib
import sys

from benchmarks._common import fake_cpu_devices

DEVICES = 8
fake_cpu_devices(DEVICES)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gradtx as gtx  # noqa: E402
from benchmarks._common import hlo_collectives, memory, parse, parser  # noqa: E402
from benchmarks._results import columns, headline, write_results  # noqa: E402
from benchmarks._timing import time_fn, time_interleaved  # noqa: E402

SEQ = 8  # ids per example


def collective_bytes(hlo: str) -> int:
  """Result bytes of every collective in HLO text (per device)."""
  return sum(b for _, b in hlo_collectives(hlo))


def loss_fn(params, batch):
  pooled = jnp.mean(gtx.lookup(params["emb"], batch["ids"]), axis=1)
  return jnp.mean(jnp.logaddexp(0.0, -batch["labels"] * (pooled @ params["w"])))


TX = gtx.lazy_adam(1e-3)


def train_step(params, state, batch):
  loss, grads = gtx.sparse_value_and_grad(loss_fn)(params, batch)
  updates, state = TX.update(grads, state, params)
  return gtx.apply_updates(params, updates), state, loss


def _abstract(mesh, shape, dtype, *spec):
  return jax.ShapeDtypeStruct(
    shape, dtype, sharding=NamedSharding(mesh, P(*spec))
  )


def compile_step(mesh, rows, dim, n, table_spec):
  params = {
    "emb": _abstract(mesh, (rows, dim), jnp.float32, *table_spec),
    "w": _abstract(mesh, (dim,), jnp.float32),
  }
  batch = {
    "ids": _abstract(mesh, (n // SEQ, SEQ), jnp.int32, "d"),
    "labels": _abstract(mesh, (n // SEQ,), jnp.float32, "d"),
  }
  with jax.set_mesh(mesh):
    state = jax.eval_shape(TX.init, params)
    step = jax.jit(train_step, donate_argnums=(0, 1))
    return step, step.lower(params, state, batch).compile()


def a2a_read(table, ids, mesh):
  """Rows by routing ids to owners with all-to-all (fixed-size buckets)."""
  rows, dim = table.shape
  local_rows = rows // DEVICES

  def body(t, i):
    n = i.shape[0]
    owner = i // local_rows
    # Bucket b holds this device's ids owned by device b (capacity n).
    order = jnp.argsort(owner, stable=True)
    so = owner[order]
    start = jnp.searchsorted(so, jnp.arange(DEVICES), method="scan")
    pos = jnp.arange(n) - start[so]
    send = jnp.full((DEVICES, n), -1, jnp.int32).at[so, pos].set(i[order])
    recv = lax.all_to_all(send, "d", 0, 0, tiled=True)
    local = recv - lax.axis_index("d") * local_rows
    got = t.at[jnp.where(recv >= 0, local, local_rows)].get(
      mode="fill", fill_value=0
    )
    back = lax.all_to_all(got, "d", 0, 0, tiled=True)  # [DEVICES, n, dim]
    out = jnp.zeros((n, dim), t.dtype).at[order].set(back[so, pos])
    return out

  return jax.shard_map(
    body, mesh=mesh, in_specs=(P("d", None), P("d")), out_specs=P("d", None)
  )(table, ids)


def read_methods(mesh, rows, dim, n, rounds):
  """Forward read only: masked + reduce-scatter vs all-to-all routing."""
  rng = np.random.RandomState(1)
  table = jax.device_put(
    rng.normal(size=(rows, dim)).astype(np.float32),
    NamedSharding(mesh, P("d", None)),
  )
  ids = jax.device_put(
    rng.randint(0, rows, size=n).astype(np.int32), NamedSharding(mesh, P("d"))
  )
  with jax.set_mesh(mesh):
    masked = jax.jit(gtx.lookup)
    a2a = jax.jit(lambda t, i: a2a_read(t, i, mesh))
    same = np.array_equal(
      np.asarray(masked(table, ids)), np.asarray(a2a(table, ids))
    )
    assert same, "the two read methods disagree"
    out = []
    times = time_interleaved(
      {
        "masked": lambda: masked(table, ids).block_until_ready(),
        "a2a": lambda: a2a(table, ids).block_until_ready(),
      },
      rounds=rounds,
    )
    for name, fn in (("masked + reduce-scatter", masked), ("all-to-all", a2a)):
      key = "masked" if name.startswith("masked") else "a2a"
      hlo = fn.lower(table, ids).compile().as_text()
      out.append([name, rows, n, collective_bytes(hlo), times[key] * 1e3])
  return out


def _data(rows, dim, n):
  """The params (numpy) and 4 batches of a step's timing."""
  rng = np.random.RandomState(0)
  params = {
    "emb": rng.normal(0, 0.01, size=(rows, dim)).astype(np.float32),
    "w": rng.normal(size=(dim,)).astype(np.float32),
  }
  batches = [
    {
      "ids": rng.randint(0, rows, size=(n // SEQ, SEQ)).astype(np.int32),
      "labels": rng.choice([-1.0, 1.0], size=n // SEQ).astype(np.float32),
    }
    for _ in range(4)
  ]
  return params, batches


def _time(step, params, state, batches, rounds, label, mesh=None):
  """Median seconds of ``step`` on its donated params and state."""
  box = {"p": params, "s": state, "i": 0}

  def one():
    with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
      box["p"], box["s"], loss = step(box["p"], box["s"], batches[box["i"] % 4])
    box["i"] += 1
    loss.block_until_ready()

  return time_fn(one, repeats=rounds, label=label)


def run_step(mesh, rows, dim, n, spec, rounds):
  step, _ = compile_step(mesh, rows, dim, n, spec)
  params, batches = _data(rows, dim, n)
  params = {
    "emb": jax.device_put(params["emb"], NamedSharding(mesh, P(*spec))),
    "w": jax.device_put(params["w"], NamedSharding(mesh, P())),
  }
  with jax.set_mesh(mesh):
    state = jax.jit(TX.init)(params)
  batches = jax.device_put(batches, NamedSharding(mesh, P("d")))
  label = f"{rows:,} rows, {spec or 'replicated'}"
  return _time(step, params, state, batches, rounds, label, mesh)


def mirrored_step(rows, dim, n, hybrid):
  """The Mirrored step (plain or hybrid), its abstract inputs, compiled."""
  m = gtx.Mirrored(shard_rows="emb" if hybrid else None)
  tx = optax.chain(gtx.all_reduce(m.axis_name), TX)

  def fn(params, state, batch):
    loss, grads = gtx.sparse_value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    return (
      gtx.apply_updates(params, updates),
      state,
      m.reduce_in_step(loss, "mean"),
    )

  def at(x):  # table-shaped leaves row-sharded when hybrid
    spec = (m.axis_name,) if hybrid and x.shape[:1] == (rows,) else ()
    return _abstract(m.mesh, x.shape, x.dtype, *spec)

  params = jax.tree.map(
    at,
    {
      "emb": jax.ShapeDtypeStruct((rows, dim), jnp.float32),
      "w": jax.ShapeDtypeStruct((dim,), jnp.float32),
    },
  )
  state = jax.tree.map(at, jax.eval_shape(tx.init, params))
  batch = {
    "ids": _abstract(m.mesh, (n // SEQ, SEQ), jnp.int32, m.axis_name),
    "labels": _abstract(m.mesh, (n // SEQ,), jnp.float32, m.axis_name),
  }
  step = m.step(fn, donate_argnums=(0, 1))
  return m, tx, step, step.lower(params, state, batch).compile()


def run_mirrored(m, tx, step, rows, dim, n, rounds):
  params, batches = _data(rows, dim, n)
  params = m.place(params)
  batches = [m.shard_batch(b) for b in batches]
  state, label = m.init_state(tx, params), f"Mirrored step, {rows:,} rows"
  return _time(step, params, state, batches, rounds, label)


def _row(name, rows, args, compiled, copies, run) -> list:
  """A table row: collective bytes, memory per device, and the step's ms
  where table + m + v on ``copies`` devices fit ``--max-state-gib``."""
  mem = memory(compiled)
  fits = 3 * rows * args.dim * 4 * copies / 2**30 <= args.max_state_gib
  return [
    name,
    rows,
    args.ids,
    collective_bytes(compiled.as_text()),
    round((mem["argument"] + mem["temp"]) / 2**20, 1),
    round(mem["temp"] / 2**20, 2),
    round(run() * 1e3, 2) if fits else "not run (memory)",
  ]


def headers(first: str) -> list[str]:
  return columns(
    f"{first} | rows | ids/step | collective bytes/step | memory MiB/device "
    "| temp MiB/device | step ms"
  )


def main_mirrored(args):
  """Plain (replicated) vs hybrid (row-sharded table) Mirrored steps."""
  out = []
  for rows in args.rows:
    for name, hybrid in (("Mirrored", False), ("Mirrored(shard_rows)", True)):
      m, tx, step, compiled = mirrored_step(rows, args.dim, args.ids, hybrid)

      def run(m=m, tx=tx, step=step, rows=rows):
        return run_mirrored(m, tx, step, rows, args.dim, args.ids, args.rounds)

      copies = 1 if hybrid else DEVICES
      out.append(_row(name, rows, args, compiled, copies, run))
  notes = (
    f"gtx.Mirrored over {DEVICES} fake CPU devices; table [rows, "
    f"{args.dim}] float32, all_reduce + lazy_adam, {args.ids} ids per step "
    "split over the replicas, params and state donated. Mirrored "
    "replicates the table and its m, v on every device; "
    "Mirrored(shard_rows) splits them by rows (the dense params stay "
    "mirrored). Collective bytes: result bytes of every collective in the "
    "compiled step, per device. Memory: arguments + temporaries per device "
    "from memory_analysis. Step time only where table + m + v on all "
    f"devices fit {args.max_state_gib} GiB; the machine was shared, so "
    "compare the step times of one run only."
  )
  write_results(
    "sharded_mirrored",
    "Mirrored: replicated vs row-sharded tables (8 devices)",
    headers("step"),
    out,
    notes=notes,
  )


def main(argv=None):
  p = parser(__doc__.split("\n\n")[0], rounds=10)
  p.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 8_000_000])
  p.add_argument("--dim", type=int, default=32)
  p.add_argument("--ids", type=int, default=8192)
  p.add_argument("--max-state-gib", type=float, default=6.0)
  p.add_argument("--mirrored", action="store_true")
  quick = dict(rows=[65_536, 262_144], ids=1024, rounds=3)
  args = parse(p, argv, quick=quick)
  if args.mirrored:
    main_mirrored(args)
    return
  mesh = jax.make_mesh((DEVICES,), ("d",), axis_types=(AxisType.Explicit,))
  rows_out = []
  for rows in args.rows:
    for name, spec in (("replicated", ()), ("row-sharded", ("d", None))):
      _, compiled = compile_step(mesh, rows, args.dim, args.ids, spec)

      def run(rows=rows, spec=spec):
        return run_step(mesh, rows, args.dim, args.ids, spec, args.rounds)

      copies = DEVICES if name == "replicated" else 1  # table + m + v
      rows_out.append(_row(name, rows, args, compiled, copies, run))
  reads = read_methods(mesh, args.rows[0], args.dim, args.ids, args.rounds)
  by = {(r[0], r[1]): r for r in rows_out}
  big, small = args.rows[-1], args.rows[0]
  heads = [
    headline(
      f"row-sharded collective bytes/step, {big} vs {small} rows",
      f"{by['row-sharded', big][3]} vs {by['row-sharded', small][3]}",
      "equal (does not grow with the table)",
    ),
    headline(
      f"per-device memory row-sharded / replicated at {big} rows",
      round(by["row-sharded", big][4] / by["replicated", big][4], 3),
      "about 1/8",
    ),
  ]
  notes = (
    f"Explicit mesh of {DEVICES} fake CPU devices; table [rows, {args.dim}] "
    f"float32, lazy_adam, {args.ids} ids per step split over the devices, "
    "params and state donated. Collective bytes: result bytes of every "
    "collective in the compiled step, per device. Memory: arguments + "
    "temporaries per device from memory_analysis. Step time only where "
    f"table + m + v on all devices fit {args.max_state_gib} GiB.\n\n"
    "Reading rows of a sharded table (forward only, first table size):\n\n"
    "| method | rows | ids | collective bytes | ms |\n|---|---|---|---|---|\n"
    + "\n".join(
      f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.3g} |" for r in reads
    )
  )
  write_results(
    "sharded",
    "Row-sharded vs replicated tables (8 devices)",
    headers("table"),
    rows_out,
    notes=notes,
    extra={"headline": heads, "reads": reads},
  )


if __name__ == "__main__":
  main(sys.argv[1:])
