"""Row-sharded vs replicated tables: collective bytes, memory, step time.

On 8 fake CPU devices (``XLA_FLAGS`` set before JAX is imported: run it as
its own process), the step of a ``gtx.lookup`` bag (``sparse_value_and_grad``,
``lazy_adam``, donated), the batch split over the devices, per table size:
the table replicated or row-sharded on an Explicit mesh (``--mirrored``:
``gtx.Mirrored``'s step, plain or ``shard_rows="emb"``, written to
``results/sharded_mirrored``); and two ways to read rows of a sharded table
(masked local read + reduce-scatter, all-to-all routing of ids to owners).

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
from benchmarks._timing import Counter, step_runner, time_interleaved  # noqa: E402

SEQ = 8  # ids per example
TX = gtx.lazy_adam(1e-3)
SHARDED = ("row-sharded", "Mirrored(shard_rows)")  # one copy of the table
READS = {"masked": "masked + reduce-scatter", "a2a": "all-to-all"}


def collective_bytes(compiled) -> int:
  """Result bytes of every collective in a compiled step (per device)."""
  return sum(b for _, b in hlo_collectives(compiled.as_text()))


def loss_fn(params, batch):
  pooled = jnp.mean(gtx.lookup(params["emb"], batch["ids"]), axis=1)
  return jnp.mean(jnp.logaddexp(0.0, -batch["labels"] * (pooled @ params["w"])))


def make_step(tx, reduce_loss=None):
  """The step on ``loss_fn``: sparse gradients, ``tx``, apply; the loss
  through ``reduce_loss`` where given (a Mirrored step's mean)."""

  def train_step(params, state, batch):
    loss, grads = gtx.sparse_value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params)
    params = gtx.apply_updates(params, updates)
    return params, state, reduce_loss(loss) if reduce_loss else loss

  return train_step


def data(rows, dim, examples, seq, batches):
  """Host params and ``batches`` batches of ``examples`` bags of ``seq``."""
  rng = np.random.RandomState(0)
  params = {
    "emb": rng.normal(0, 0.01, size=(rows, dim)).astype(np.float32),
    "w": rng.normal(size=(dim,)).astype(np.float32),
  }
  return params, [
    {
      "ids": rng.randint(0, rows, size=(examples, seq)).astype(np.int32),
      "labels": rng.choice([-1.0, 1.0], size=examples).astype(np.float32),
    }
    for _ in range(batches)
  ]


def _abstract(mesh, shape, dtype, *spec):
  return jax.ShapeDtypeStruct(
    shape, dtype, sharding=NamedSharding(mesh, P(*spec))
  )


def system(kind, rows, dim, n):
  """``kind``'s step (``replicated`` or ``row-sharded`` on an Explicit mesh,
  ``Mirrored`` or ``Mirrored(shard_rows)``) compiled on abstract inputs,
  and ``run(rounds)``: its median seconds on real ones."""
  mirrored, hybrid = kind.startswith("Mirrored"), kind in SHARDED
  if mirrored:
    m = gtx.Mirrored(shard_rows="emb" if hybrid else None)
    mesh, axis, spec = m.mesh, m.axis_name, (m.axis_name,)
    tx = optax.chain(gtx.all_reduce(axis), TX)
    fn = make_step(tx, lambda loss: m.reduce_in_step(loss, "mean"))
    step = m.step(fn, donate_argnums=(0, 1))
    scope = contextlib.nullcontext
    label = f"Mirrored step, {rows:,} rows"
  else:
    mesh = jax.make_mesh((DEVICES,), ("d",), axis_types=(AxisType.Explicit,))
    axis, spec, tx = "d", ("d", None), TX
    step = jax.jit(make_step(TX), donate_argnums=(0, 1))
    scope = lambda: jax.set_mesh(mesh)  # noqa: E731
    label = f"{rows:,} rows, {spec if hybrid else 'replicated'}"

  def at(x):  # table-shaped leaves row-sharded where the table is
    s = spec if hybrid and x.shape[:1] == (rows,) else ()
    return _abstract(mesh, x.shape, x.dtype, *s)

  host = {"emb": (rows, dim), "w": (dim,)}
  params = {
    k: at(jax.ShapeDtypeStruct(s, jnp.float32)) for k, s in host.items()
  }
  batch = {
    "ids": _abstract(mesh, (n // SEQ, SEQ), jnp.int32, axis),
    "labels": _abstract(mesh, (n // SEQ,), jnp.float32, axis),
  }
  with scope():
    state = jax.eval_shape(tx.init, params)
    state = jax.tree.map(at, state) if mirrored else state
    compiled = step.lower(params, state, batch).compile()

  def run(rounds):
    host, batches = data(rows, dim, n // SEQ, SEQ, 4)
    with scope():
      if mirrored:
        p = m.place(host)
        box = [p, m.init_state(tx, p)]
        batches = [m.shard_batch(b) for b in batches]
      else:
        p = jax.device_put(host, jax.tree.map(lambda a: a.sharding, params))
        box = [p, jax.jit(tx.init)(p)]
        batches = jax.device_put(batches, NamedSharding(mesh, P("d")))
      one = step_runner(step, box, lambda i: (batches[i % 4],))
      return time_interleaved(
        {label: Counter(one, start=0)}, rounds=rounds, label=label
      )[label]

  return compiled, run


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


def read_methods(rows, dim, n, rounds):
  """Forward read only: masked + reduce-scatter vs all-to-all routing."""
  mesh = jax.make_mesh((DEVICES,), ("d",), axis_types=(AxisType.Explicit,))
  rng = np.random.RandomState(1)
  table = rng.normal(size=(rows, dim)).astype(np.float32)
  ids = rng.randint(0, rows, size=n).astype(np.int32)
  specs = NamedSharding(mesh, P("d", None)), NamedSharding(mesh, P("d"))
  table, ids = jax.device_put((table, ids), specs)
  with jax.set_mesh(mesh):
    fns = {
      "masked": jax.jit(gtx.lookup),
      "a2a": jax.jit(lambda t, i: a2a_read(t, i, mesh)),
    }
    masked, a2a = (np.asarray(f(table, ids)) for f in fns.values())
    assert np.array_equal(masked, a2a), "the two read methods disagree"
    calls = {
      k: lambda f=f: f(table, ids).block_until_ready() for k, f in fns.items()
    }
    times = time_interleaved(calls, rounds=rounds)
    compiled = {k: f.lower(table, ids).compile() for k, f in fns.items()}
  return [
    [name, rows, n, collective_bytes(compiled[k]), times[k] * 1e3]
    for k, name in READS.items()
  ]


def _row(kind, rows, args) -> list:
  """A table row: collective bytes, memory per device, and the step's ms
  where table + m + v on all their devices fit ``--max-state-gib``."""
  compiled, run = system(kind, rows, args.dim, args.ids)
  mem = memory(compiled)
  mib = (mem["argument"] + mem["temp"]) / 2**20, mem["temp"] / 2**20
  copies = 1 if kind in SHARDED else DEVICES
  fits = 3 * rows * args.dim * 4 * copies / 2**30 <= args.max_state_gib
  ms = round(run(args.rounds) * 1e3, 2) if fits else "not run (memory)"
  row = [kind, rows, args.ids, collective_bytes(compiled)]
  return row + [round(mib[0], 1), round(mib[1], 2), ms]


# --mirrored: results file, title, first column, systems, the notes' parts
SCENARIOS = {
  False: (
    "sharded",
    "Row-sharded vs replicated tables (8 devices)",
    "table",
    ("replicated", "row-sharded"),
    f"Explicit mesh of {DEVICES} fake CPU devices; ",
    ("lazy_adam", "devices", "", "."),
  ),
  True: (
    "sharded_mirrored",
    "Mirrored: replicated vs row-sharded tables (8 devices)",
    "step",
    ("Mirrored", "Mirrored(shard_rows)"),
    f"gtx.Mirrored over {DEVICES} fake CPU devices; ",
    (
      "all_reduce + lazy_adam",
      "replicas",
      "Mirrored replicates the table and its m, v on every device; "
      "Mirrored(shard_rows) splits them by rows (the dense params stay "
      "mirrored). ",
      "; the machine was shared, so compare the step times of one run only.",
    ),
  ),
}


def main(argv=None):
  p = parser(__doc__.split("\n\n")[0], rounds=10)
  p.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 8_000_000])
  p.add_argument("--dim", type=int, default=32)
  p.add_argument("--ids", type=int, default=8192)
  p.add_argument("--max-state-gib", type=float, default=6.0)
  p.add_argument("--mirrored", action="store_true")
  quick = dict(rows=[65_536, 262_144], ids=1024, rounds=3)
  args = parse(p, argv, quick=quick)
  name, title, first, kinds, where, (tx, over, layout, end) = SCENARIOS[
    args.mirrored
  ]
  out = [_row(kind, rows, args) for rows in args.rows for kind in kinds]
  notes = (
    f"{where}table [rows, {args.dim}] float32, {tx}, {args.ids} ids per step "
    f"split over the {over}, params and state donated. {layout}Collective "
    "bytes: result bytes of every collective in the compiled step, per "
    "device. Memory: arguments + temporaries per device from "
    "memory_analysis. Step time only where table + m + v on all devices fit "
    f"{args.max_state_gib} GiB{end}"
  )
  extra = None
  if not args.mirrored:
    reads = read_methods(args.rows[0], args.dim, args.ids, args.rounds)
    notes += (
      "\n\nReading rows of a sharded table (forward only, first table size):"
      "\n\n| method | rows | ids | collective bytes | ms |\n"
      "|---|---|---|---|---|\n"
      + "\n".join(
        f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.3g} |" for r in reads
      )
    )
    by = {(r[0], r[1]): r for r in out}
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
    extra = {"headline": heads, "reads": reads}
  headers = columns(
    f"{first} | rows | ids/step | collective bytes/step | memory MiB/device "
    "| temp MiB/device | step ms"
  )
  write_results(name, title, headers, out, notes=notes, extra=extra)


if __name__ == "__main__":
  main(sys.argv[1:])
