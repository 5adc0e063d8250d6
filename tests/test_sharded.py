"""Row-sharded tables on the 8 fake CPU devices (Auto and Explicit meshes).

The jitted, donated training step with the table placed ``P("d", None)``
equals the single-device step, keeps the table and every ``[V, ...]`` state
leaf row-sharded, moves no table-sized data between devices (read from the
compiled HLO) and needs less temporary memory than one table shard.
"""

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import checkpoint_worker
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import sharded_worker as worker
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradtx as gtx
from gradtx import _sharded

V, D = 16384, 16  # one shard of 8: 2048 x 16 float32 = 128 KiB
B, L = 16, 3  # ids [B, L]: 48 rows read per step
STEPS = 3
COLLECTIVES = (
  "all-gather",
  "all-reduce",
  "all-to-all",
  "collective-permute",
  "reduce-scatter",
)


def _params():
  rng = np.random.RandomState(0)
  return {
    "emb": rng.normal(size=(V, D)).astype(np.float32),
    "w": rng.normal(size=(D,)).astype(np.float32),
    "b": np.zeros((), np.float32),
  }


def _batch(step):
  """Ids with duplicates and padding (-1 and V read zero rows)."""
  rng = np.random.RandomState(100 + step)
  ids = rng.randint(0, V, size=(B, L)).astype(np.int32)
  ids[1, 0] = ids[0, 0]
  ids[2, 1] = -1
  ids[3, 2] = V
  return {"ids": ids, "y": rng.normal(size=(B,)).astype(np.float32)}


def _lookup_loss(p, batch):
  bag = gtx.lookup(p["emb"], batch["ids"]).sum(axis=1)
  return jnp.mean(jnp.square(bag @ p["w"] + p["b"] - batch["y"]))


def _index_loss(p, batch):
  # The unmodified read: padding is clipped by JAX, so keep ids in range.
  ids = jnp.clip(batch["ids"], 0, V - 1)
  bag = p["emb"][ids].sum(axis=1)
  return jnp.mean(jnp.square(bag @ p["w"] + p["b"] - batch["y"]))


ROWS = {"emb": B * L, "w": None, "b": None}
TXS = {
  # Every row-touching transformation in one chain: drop_stale drops step
  # 1's gradient, accumulate emits at step 2, clipping takes a global norm
  # across the shards, lazy Adam catches up skipped rows.
  "stale_accumulate_clip_catch_up": lambda: gtx.drop_stale(
    gtx.accumulate(
      optax.chain(
        gtx.clip_by_global_norm(0.05), gtx.lazy_adam(0.05, catch_up=True)
      ),
      2,
      rows_per_step=ROWS,
    ),
    1,
  ),
  "lazy_adamw": lambda: gtx.lazy_adamw(0.05, weight_decay=0.1),
}
# The step each gradient was computed at (drop_stale drops step 1's).
READ_AT = (0, -1, 2)


def _step_fn(tx, loss_fn, reduce=lambda loss: loss):
  def step(params, state, batch, grad_step):
    loss, grads = gtx.sparse_value_and_grad(loss_fn)(params, batch)
    updates, state = tx.update(grads, state, params, grad_step=grad_step)
    return gtx.apply_updates(params, updates), state, reduce(loss)

  return step


def _make_step(tx, loss_fn):
  return jax.jit(_step_fn(tx, loss_fn), donate_argnums=(0, 1))


def _mesh(kind, shape=(8,), names=("d",)):
  return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


class _Layout:
  """Where the table, the dense params and the batch go on a mesh."""

  def __init__(self, kind, batch_axis="d", shape=(8,), names=("d",)):
    self.mesh = _mesh(kind, shape, names)
    self.batch_axis = batch_axis
    self.kind = kind

  def put(self, x, *spec):
    return jax.device_put(x, NamedSharding(self.mesh, P(*spec)))

  def params(self, host):
    return {
      "emb": self.put(host["emb"], "d", None),
      "w": self.put(host["w"]),
      "b": self.put(host["b"]),
    }

  def batch(self, host):
    return jax.tree.map(lambda x: self.put(x, self.batch_axis), host)

  def context(self):
    return jax.set_mesh(self.mesh)


LAYOUTS = {
  "explicit_same_axis": lambda: _Layout(AxisType.Explicit),
  "explicit_replicated_ids": lambda: _Layout(AxisType.Explicit, None),
  "explicit_other_axis": lambda: _Layout(
    AxisType.Explicit, "b", (4, 2), ("d", "b")
  ),
  "auto_same_axis": lambda: _Layout(AxisType.Auto),
  "auto_other_axis": lambda: _Layout(AxisType.Auto, "b", (4, 2), ("d", "b")),
}


def _train(tx_name, layout=None, loss_fn=_lookup_loss):
  """STEPS donated steps; returns params, state, losses, compiled step."""
  tx = TXS[tx_name]()
  step = _make_step(tx, loss_fn)
  host = _params()
  if layout is None:
    params = jax.tree.map(jnp.asarray, host)
    state = tx.init(params)
    place = lambda b: jax.tree.map(jnp.asarray, b)  # noqa: E731
    ctx = None
  else:
    params = layout.params(host)
    state = gtx.sharded_init(tx, params)
    place = layout.batch
    ctx = layout.context()
  with ctx if ctx is not None else _null():
    return _loop(step, params, state, place)


def _loop(step, params, state, place):
  """Compiles ``step`` once and runs STEPS calls of the executable."""
  losses, compiled, before = [], None, None
  for s in range(STEPS):
    batch = place(_batch(s))
    grad_step = jnp.asarray(s + READ_AT[s] if READ_AT[s] < 0 else s)
    if compiled is None:
      compiled = step.lower(params, state, batch, grad_step).compile()
      before = _shardings((params, state))
    params, state, loss = compiled(params, state, batch, grad_step)
    losses.append(float(loss))
  return params, state, losses, compiled, before


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def _shardings(tree):
  def spec(x):
    s = tuple(getattr(x.sharding, "spec", ()))
    return s + (None,) * (x.ndim - len(s))

  return [(x.shape, spec(x)) for x in jax.tree.leaves(tree)]


def _table_sized_collectives(hlo, rows):
  """Collectives in ``hlo`` with an operand or result of ``rows`` rows."""
  bad = []
  for line in hlo.splitlines():
    if not any(f" {c}(" in line or f" {c}-start(" in line for c in COLLECTIVES):
      continue
    for dims in re.findall(r"\[([0-9,]+)\]", line):
      first = int(dims.split(",")[0]) if dims else 0
      if first in rows:
        bad.append(line.strip()[:200])
  return bad


_REFERENCE = {}


def _reference(tx_name, loss_fn=_lookup_loss):
  key = (tx_name, loss_fn)
  if key not in _REFERENCE:
    _REFERENCE[key] = _train(tx_name, None, loss_fn)
  return _REFERENCE[key]


@pytest.mark.parametrize(
  "tx_name, layout_name",
  [
    ("stale_accumulate_clip_catch_up", "explicit_same_axis"),
    ("stale_accumulate_clip_catch_up", "auto_other_axis"),
    ("lazy_adamw", "explicit_other_axis"),
    ("lazy_adamw", "explicit_replicated_ids"),
  ],
)
def test_row_sharded_step_equals_single_device(tx_name, layout_name):
  layout = LAYOUTS[layout_name]()
  _check_run(_train(tx_name, layout), _reference(tx_name), "d", layout.mesh)


def _check_run(run, reference, axis, mesh):
  """``run`` equals the single-device ``reference``, kept the table and its
  state split over ``axis``, moved no table-sized data and needed less
  temporary memory than a table shard."""
  params, state, losses, compiled, before = run
  want_params, want_state, want_losses, _, _ = reference
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  for got, want in zip(
    jax.tree.leaves((params, state)),
    jax.tree.leaves((want_params, want_state)),
    strict=True,
  ):
    np.testing.assert_allclose(
      np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-6
    )
  # Moved: the table really trained, and differently per row.
  assert np.max(np.abs(np.asarray(params["emb"]) - _params()["emb"])) > 0.01
  # The table and every [V, ...] / [V] state leaf stay row-sharded.
  after = _shardings((params, state))
  assert after == before
  table_like = [(s, p) for s, p in after if s and s[0] == V]
  assert len(table_like) >= 3  # the table and (at least) m and v
  for shape, spec in table_like:
    assert spec[0] == axis, (shape, spec)
  # No collective moves a table-sized (or shard-sized) block.
  hlo = compiled.as_text()
  assert not _table_sized_collectives(hlo, {V, V // 8, V // 4})
  # Temporary memory per device stays below one table shard.
  shard_bytes = V // mesh.shape[axis] * D * 4
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < shard_bytes, (temp, shard_bytes)


def _hybrid_train(m, tx):
  """STEPS of the per-replica step under ``m`` (a Mirrored with shard_rows)."""
  fn = _step_fn(tx, _lookup_loss, lambda loss: m.all_reduce(loss, "mean"))
  step = m.step(fn, donate_argnums=(0, 1))
  params = m.place(_params())
  return _loop(step, params, m.init_state(tx, params), m.shard_batch)


def test_hybrid_mirrored_equals_single_device():
  # Dense params mirrored, the batch split over the 8 replicas, the table
  # and its state row-sharded over the same devices; the chain of the
  # single-device run with the cross-replica reduction in front.
  m = gtx.Mirrored(shard_rows="emb")
  tx = optax.chain(
    gtx.all_reduce(m.axis_name), TXS["stale_accumulate_clip_catch_up"]()
  )
  run = _hybrid_train(m, tx)
  _check_run(
    run, _reference("stale_accumulate_clip_catch_up"), "replica", m.mesh
  )
  params, state = run[:2]
  assert params["emb"].addressable_shards[0].data.shape == (V // 8, D)
  assert params["w"].sharding.is_fully_replicated
  # Everything but the table's [V, ...] / [V] leaves stays mirrored.
  for leaf in jax.tree.leaves((params, state)):
    assert leaf.shape[:1] == (V,) or leaf.sharding.is_fully_replicated


def test_hybrid_mirrored_checks_outputs_and_placement():
  m = gtx.Mirrored(shard_rows=lambda path, x: path == "['emb']")
  host = _params()
  with pytest.raises(ValueError, match=r"`shard_rows` names \["):
    gtx.Mirrored(shard_rows=["emb", "nope"]).place(host)
  with pytest.raises(ValueError, match="Pad it to a multiple of 8 rows"):
    gtx.Mirrored(shard_rows="emb").place({"emb": np.zeros((12, 2))})
  with pytest.raises(TypeError, match="`shard_rows` must be"):
    gtx.Mirrored(shard_rows=3)
  placed = m.place(host)
  assert placed["emb"].sharding.spec[0] == "replica"
  # A per-replica value returned as replicated is an error (the plain
  # shard_map step cannot tell), and per_replica_outputs stacks it.
  step = m.step(lambda p, s, b: (p, s, jnp.sum(b["y"])))
  batch = m.shard_batch(_batch(0))
  with pytest.raises(ValueError, match="differs across replicas"):
    step(placed, (), batch)
  step = m.step(lambda p, s, b: (p, s, jnp.sum(b["y"])), per_replica_outputs=2)
  _, _, sums = step(placed, (), batch)
  np.testing.assert_allclose(
    sums, _batch(0)["y"].reshape(8, -1).sum(1), rtol=1e-6
  )


def test_unmodified_reads_on_an_auto_mesh():
  layout = LAYOUTS["auto_same_axis"]()
  want = _reference("lazy_adamw", _index_loss)
  got = _train("lazy_adamw", layout, loss_fn=_index_loss)
  np.testing.assert_allclose(got[2], want[2], rtol=1e-5)
  np.testing.assert_allclose(
    np.asarray(got[0]["emb"]), np.asarray(want[0]["emb"]), rtol=2e-5, atol=1e-6
  )
  assert got[0]["emb"].sharding.spec[0] == "d"
  assert got[1][0].mu["emb"].sharding.spec[0] == "d"
  grads = jax.eval_shape(gtx.sparse_grad(_index_loss), _params(), _batch(0))
  if isinstance(grads["emb"], gtx.SparseRows):  # reads recognised as rows
    assert not _table_sized_collectives(got[3].as_text(), {V, V // 8})


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_init_under_jit_keeps_row_shardings(kind):
  layout = _Layout(kind)
  params = layout.params(_params())
  tx = gtx.lazy_adam(0.1, catch_up=True)
  state = gtx.sharded_init(tx, params)
  adam = state[0]
  for leaf in (adam.mu["emb"], adam.nu["emb"]):
    assert leaf.sharding.spec == P("d", None)
    assert leaf.sharding.mesh == layout.mesh
  for leaf in (adam.last_step["emb"], adam.future_sum["emb"]):
    assert leaf.sharding.spec == P("d")
  # Each device holds 1/8 of each moment.
  assert adam.mu["emb"].addressable_shards[0].data.shape == (V // 8, D)
  if kind == AxisType.Explicit:
    # On an Explicit mesh plain jit(tx.init) keeps them as well.
    with layout.context():
      state = jax.jit(tx.init)(params)
    assert state[0].mu["emb"].sharding.spec == P("d", None)
    assert state[0].last_step["emb"].sharding.spec == P("d")


def test_read_rows_matches_numpy_and_pads():
  layout = _Layout(AxisType.Explicit)
  host = _params()["emb"]
  ids = np.array([[0, V - 1, -1], [V, 5, 5], [2047, 2048, 4000]] * 8, np.int32)
  ids = ids.reshape(8, 9)
  table = layout.put(host, "d", None)
  want = np.where(((ids >= 0) & (ids < V))[..., None], host[ids % V], 0)
  for spec in ((), ("d",), (None, None)):
    got = jax.jit(gtx.lookup)(table, layout.put(ids, *spec) if spec else ids)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_write_rows_sets_and_adds_owner_rows():
  layout = _Layout(AxisType.Explicit)
  host = np.zeros((64, 2), np.float32)
  table = layout.put(host, "d", None)
  ids = layout.put(np.array([3, 3, 63, -1, 64, 9, 10, 11], np.int32), "d")
  rows = layout.put(np.arange(16, dtype=np.float32).reshape(8, 2), "d")
  with layout.context():
    added = jax.jit(
      lambda t, i, r: _sharded.scatter_rows(
        t, i, r, add=True, sorted_unique=False
      )
    )(table, ids, rows)
  want = host.copy()
  np.add.at(
    want,
    np.array([3, 3, 63, 9, 10, 11]),
    np.arange(16.0).reshape(8, 2)[[0, 1, 2, 5, 6, 7]],
  )
  np.testing.assert_array_equal(np.asarray(added), want)
  assert added.sharding.spec == P("d", None)


# ----------------------------------------------------------------------------
# Two processes x 2 devices, and an 8-device checkpoint restored onto them


def _free_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def _close(got, want, rtol=2e-5):
  for g, w in zip(got, jax.tree.leaves(want), strict=True):
    w = np.asarray(w)
    if np.issubdtype(w.dtype, np.integer):
      np.testing.assert_array_equal(g, w)
    else:
      np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-6)


def test_two_processes_and_eight_to_four_device_restore(tmp_path):
  # 8 devices: the hybrid run up to SAVE_AT (mid accumulation window), saved.
  m8 = gtx.Mirrored(shard_rows="emb")
  tx8 = worker.make_tx(m8.axis_name)
  start = worker.fresh(m8, tx8)
  params, state, _ = worker.train(
    start["params"],
    start["opt_state"],
    0,
    worker.SAVE_AT,
    worker.make_step(tx8, m8),
    m8,
  )
  saved = {"params": params, "opt_state": state}
  assert int(state[1].inner_state.num_accumulated) == 1
  assert int(state[1].num_dropped) == 1
  mu = state[1].inner_state.inner_state[1][0].mu["emb"]
  assert mu.addressable_shards[0].data.shape == (worker.NUM_ROWS // 8, 4)
  checkpoint_worker.save_orbax(tmp_path / "ckpt", saved)
  saved = jax.tree.map(np.asarray, saved)

  env = dict(
    os.environ,
    XLA_FLAGS="--xla_force_host_platform_device_count=2",
    JAX_PLATFORMS="cpu",
  )
  script = str(Path(__file__).with_name("sharded_worker.py"))
  port = str(_free_port())
  procs, logs = [], []
  try:
    for i in range(2):
      cmd = [sys.executable, script, "--port", port, "--num-processes", "2"]
      cmd += ["--process-id", str(i), "--ckpt", str(tmp_path / "ckpt")]
      cmd += ["--out", str(tmp_path)]
      # Logs go to files: a full pipe could stall one process in a
      # collective the other waits on.
      logs.append(tmp_path / f"log_{i}.txt")
      with open(logs[-1], "wb") as log:
        procs.append(
          subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        )
    # The single-device reference, while they run.
    tx1 = worker.make_tx()
    host = jax.tree.map(jnp.asarray, worker.init_params())
    p1, s1, want_losses = worker.train(
      host, tx1.init(host), 0, worker.STEPS, worker.make_step(tx1, None)
    )
    for p in procs:
      p.wait(timeout=180)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, log in zip(procs, logs, strict=True):
    assert p.returncode == 0, log.read_text(errors="replace")[-4000:]

  want = {"params": p1, "opt_state": (optax.EmptyState(), s1)}
  moved = np.abs(np.asarray(p1["emb"]) - worker.init_params()["emb"]).max()
  assert moved > 0.05
  for i in range(2):
    with np.load(tmp_path / f"process_{i}.npz") as f:
      got = dict(f)
    assert int(got["num_replicas"]) == 4 and int(got["local_devices"]) == 2
    # The 8-device rows were restored onto 4 devices, 16 rows each.
    assert tuple(got["emb_shard"]) == tuple(got["mu_shard"]) == (16, 4)
    assert str(got["emb_spec"]).startswith("P('replica'")
    leaves = lambda name, g=got: [  # noqa: E731
      g[f"{name}_{j}"] for j in range(len(jax.tree.leaves(want)))
    ]
    for g, w in zip(leaves("restored"), jax.tree.leaves(saved), strict=True):
      np.testing.assert_array_equal(g, w)  # bit for bit
    # From scratch on 2 processes, and resumed from the 8-device
    # checkpoint: both equal the uninterrupted single-device run.
    _close(leaves("full"), want)
    _close(leaves("resumed"), want)
    np.testing.assert_allclose(got["full_losses"], want_losses, rtol=1e-5)
    np.testing.assert_allclose(
      got["resumed_losses"], want_losses[worker.SAVE_AT :], rtol=1e-5
    )
