"""Row-sharded tables on the 8 fake CPU devices (Auto and Explicit meshes,
hybrid Mirrored), across two processes, and restored onto 4 devices.

The donated training step with the table placed ``P("d", None)`` -- a plain
jitted step on a mesh, or the per-replica step of a ``Mirrored`` with
``shard_rows`` -- equals the single-device step, keeps the table and every
``[V, ...]`` state leaf row-sharded, moves no table-sized data between
devices (read from the compiled HLO) and needs less temporary memory than
one table shard. The model, the batches and the chains are
``sharded_worker``'s, shared with the two-process run. Each configuration
is compiled once and its run shared by every assertion about it.
"""

import functools
import re

import checkpoint_worker
import jax
import jax.numpy as jnp
import numpy as np
import optax
import procs
import pytest
import sharded_worker as worker
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradtx as gtx
from gradtx import _rowio

V, D = worker.NUM_ROWS, worker.DIM
STEPS, SAVE_AT = worker.STEPS, worker.SAVE_AT
COLLECTIVES = (
  "all-gather",
  "all-reduce",
  "all-to-all",
  "collective-permute",
  "reduce-scatter",
)
CHAIN = "stale_accumulate_clip_adam"


def _params():
  return worker.init_params()


def _index_loss(p, batch):
  # The unmodified read: JAX clips out-of-range ids, so mask the padding.
  ids = batch["ids"]
  valid = (ids >= 0) & (ids < V)
  bag = (p["emb"][jnp.clip(ids, 0, V - 1)] * valid[..., None]).sum(axis=1)
  return jnp.mean(jnp.square(bag @ p["w"] + p["b"] - batch["y"]))


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


LAYOUTS = {
  "explicit_same_axis": lambda: _Layout(AxisType.Explicit),
  "explicit_other_axis": lambda: _Layout(
    AxisType.Explicit, "b", (4, 2), ("d", "b")
  ),
  "auto_same_axis": lambda: _Layout(AxisType.Auto),
  "auto_other_axis": lambda: _Layout(AxisType.Auto, "b", (4, 2), ("d", "b")),
}


def _compile_and_train(step, params, state, place, stop=STEPS):
  """Compiles ``step`` once, runs calls ``0 .. stop - 1`` of the executable.

  Returns params, state, losses, the compiled step and the shardings of
  params and state before the first call.
  """
  batch = place(worker.global_batch(0))
  compiled = step.lower(params, state, batch, jnp.int32(0)).compile()
  before = _shardings((params, state))
  params, state, losses = worker.train(params, state, 0, stop, compiled, place)
  return params, state, losses, compiled, before


_RUNS = {}


def _cached(key, run):
  if key not in _RUNS:
    _RUNS[key] = run()
  return _RUNS[key]


# The chains and losses the single-device runs are compared with.
REFERENCES = (
  (CHAIN, worker.loss_fn),
  ("lazy_adamw", worker.loss_fn),
  ("lazy_adamw", _index_loss),
)


@functools.cache
def _references():
  """Every single-device run of REFERENCES, each one's step in one jitted
  program (compiled once: the kernels they share compile once)."""
  txs = [worker.make_tx(None, chain) for chain, _ in REFERENCES]
  steps = [
    worker.step_fn(tx, None, loss)
    for tx, (_, loss) in zip(txs, REFERENCES, strict=True)
  ]

  def step(params, states, batch, grad_steps):
    out = [
      f(p, s, batch, g)
      for f, p, s, g in zip(steps, params, states, grad_steps, strict=True)
    ]
    return tuple(map(list, zip(*out, strict=True)))

  step = jax.jit(step, donate_argnums=(0, 1))
  params = [jax.tree.map(jnp.asarray, _params()) for _ in REFERENCES]
  states = [tx.init(p) for tx, p in zip(txs, params, strict=True)]
  losses = [[] for _ in REFERENCES]
  for t in range(STEPS):
    grad_steps = [worker.call_grad_step(s, t) for s in states]
    batch = jax.tree.map(jnp.asarray, worker.global_batch(t))
    params, states, loss = step(params, states, batch, grad_steps)
    for k, x in enumerate(loss):
      losses[k].append(np.asarray(x).item())
  assert step._cache_size() == 1
  runs = zip(params, states, losses, strict=True)
  return dict(zip(REFERENCES, runs, strict=True))


def _reference(chain, loss=worker.loss_fn):
  """The single-device run: params, state and losses."""
  return _references()[chain, loss]


def _layout_run(chain, layout_name, loss=worker.loss_fn):
  """The plain jitted step on a mesh, state from ``gtx.sharded_init``."""
  layout = LAYOUTS[layout_name]()

  def run():
    tx = worker.make_tx(None, chain)
    params = layout.params(_params())
    with jax.set_mesh(layout.mesh):
      step = worker.make_step(tx, None, loss)
      state = gtx.sharded_init(tx, params)
      return _compile_and_train(step, params, state, layout.batch)

  return layout, _cached(("layout", chain, layout_name, loss), run)


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


def _check_run(run, reference, axis, mesh):
  """``run`` equals the single-device ``reference``, kept the table and its
  state split over ``axis``, moved no table-sized data and needed less
  temporary memory than a table shard."""
  params, state, losses, compiled, before = run
  want_params, want_state, want_losses = reference
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  for got, want in zip(
    jax.tree.leaves((params, state)),
    jax.tree.leaves((want_params, want_state)),
    strict=True,
  ):
    np.testing.assert_allclose(
      np.asarray(got), np.asarray(want), rtol=2e-5, atol=1e-6
    )
  # Moved: the table really trained.
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


def _hybrid(ckpt):
  """The hybrid Mirrored run on 8 devices, saved with orbax to ``ckpt`` at
  SAVE_AT (inside an accumulation window) and continued to STEPS."""
  m = gtx.Mirrored(shard_rows="emb")
  tx = worker.make_tx(m.axis_name)
  start = worker.fresh(m, tx)
  params, state, losses, compiled, before = _compile_and_train(
    worker.make_step(tx, m),
    start["params"],
    start["opt_state"],
    m.shard_batch,
    SAVE_AT,
  )
  saved = {"params": params, "opt_state": state}
  checkpoint_worker.save_orbax(ckpt, saved)
  host = jax.tree.map(np.asarray, saved)
  params, state, more = worker.train(
    params, state, SAVE_AT, STEPS, compiled, m.shard_batch
  )
  run = (params, state, losses + more, compiled, before)
  return {"m": m, "run": run, "saved": host}


# ----------------------------------------------------------------------------
# Two processes x 2 devices, and an 8-device checkpoint restored onto them


def _close(got, want, rtol=2e-5):
  for g, w in zip(got, jax.tree.leaves(want), strict=True):
    w = np.asarray(w)
    if np.issubdtype(w.dtype, np.integer):
      np.testing.assert_array_equal(g, w)
    else:
      np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-6)


def test_hybrid_mirrored_and_two_processes(tmp_path):
  # On 8 devices: the hybrid Mirrored run (dense params mirrored, the batch
  # split over the 8 replicas, the table and its state row-sharded over the
  # same devices) equals the single-device run of the chain with the
  # cross-replica reduction in front; it is saved mid accumulation window.
  # Meanwhile 2 processes x 2 devices run it from scratch, then restore the
  # 8-device checkpoint row-sharded onto their 4 devices and continue. (One
  # test: the 8-device run, its checkpoint and the reference are computed
  # once.)
  args = ["--ready", str(tmp_path / "ready"), "--out", str(tmp_path)]
  with procs.launched("sharded_worker.py", args, tmp_path, timeout=180):
    ckpt = tmp_path / "hybrid_ckpt"
    hybrid = _hybrid(ckpt)
    # Written whole, then renamed: a worker never reads half a path.
    (tmp_path / "ready.tmp").write_text(str(ckpt))
    (tmp_path / "ready.tmp").rename(tmp_path / "ready")
    reference = _reference(CHAIN)  # while they run
    _check_hybrid(hybrid, reference)
    params, state, want_losses = reference

  want = {"params": params, "opt_state": (optax.EmptyState(), state)}
  count = len(jax.tree.leaves(want))
  for i in range(2):
    with np.load(tmp_path / f"process_{i}.npz") as f:
      got = dict(f)
    assert int(got["num_replicas"]) == 4 and int(got["local_devices"]) == 2
    # The 8-device rows were restored onto 4 devices: V / 4 rows each.
    assert tuple(got["emb_shard"]) == tuple(got["mu_shard"]) == (V // 4, D)
    assert str(got["emb_spec"]).startswith("P('replica'")
    leaves = lambda name, g=got: [g[f"{name}_{j}"] for j in range(count)]  # noqa: E731
    saved = jax.tree.leaves(hybrid["saved"])
    for g, w in zip(leaves("restored"), saved, strict=True):
      np.testing.assert_array_equal(g, w)  # bit for bit
    # From scratch on 2 processes, and resumed from the 8-device
    # checkpoint: both equal the uninterrupted single-device run.
    _close(leaves("full"), want)
    _close(leaves("resumed"), want)
    np.testing.assert_allclose(got["full_losses"], want_losses, rtol=1e-5)
    np.testing.assert_allclose(
      got["resumed_losses"], want_losses[SAVE_AT:], rtol=1e-5
    )


@pytest.mark.parametrize(
  "chain, layout_name, loss",
  [
    # Every row-touching transformation, through gradtx's owner-local reads
    # and writes (the Auto-mesh run of this chain is the hybrid Mirrored's).
    (CHAIN, "explicit_same_axis", worker.loss_fn),
    # Ids split along another mesh axis than the table's rows; AdamW reads
    # the param rows for the decay.
    ("lazy_adamw", "explicit_other_axis", worker.loss_fn),
    # Unmodified ``table[ids]`` reads, left to XLA's partitioner.
    ("lazy_adamw", "auto_other_axis", _index_loss),
  ],
  ids=["chain-explicit", "adamw-explicit-other-axis", "adamw-auto-index"],
)
def test_row_sharded_step_equals_single_device(chain, layout_name, loss):
  layout, run = _layout_run(chain, layout_name, loss)
  batch = worker.global_batch(0)
  grads = jax.eval_shape(gtx.sparse_grad(loss), _params(), batch)
  # Every layout, the unmodified read included, must give a row gradient.
  assert isinstance(grads["emb"], gtx.SparseRows), grads["emb"]
  _check_run(run, _reference(chain, loss), "d", layout.mesh)


def _check_hybrid(hybrid, reference):
  m, run = hybrid["m"], hybrid["run"]
  _check_run(run, reference, m.axis_name, m.mesh)
  params, state = run[:2]
  assert params["emb"].addressable_shards[0].data.shape == (V // 8, D)
  # Everything but the table's [V, ...] / [V] leaves stays mirrored.
  for leaf in jax.tree.leaves((params, state)):
    assert leaf.shape[:1] == (V,) or leaf.sharding.is_fully_replicated
  # The checkpoint was taken inside an accumulation window, after a drop.
  saved = hybrid["saved"]["opt_state"][1]
  assert int(saved.inner_state.num_accumulated) == 1
  assert int(saved.num_dropped) == 1


def test_hybrid_mirrored_checks_outputs_and_placement():
  m = gtx.Mirrored(shard_rows=lambda path, x: path == "['emb']")
  host = {"emb": np.ones((64, 2), np.float32), "w": np.ones(2, np.float32)}
  with pytest.raises(ValueError, match=r"`shard_rows` names \["):
    gtx.Mirrored(shard_rows=["emb", "nope"]).place(host)
  with pytest.raises(ValueError, match="Pad it to a multiple of 8 rows"):
    gtx.Mirrored(shard_rows="emb").place({"emb": np.zeros((12, 2))})
  with pytest.raises(TypeError, match="`shard_rows` must be"):
    gtx.Mirrored(shard_rows=3)
  y = np.arange(16, dtype=np.float32)
  placed = m.place(host)
  assert placed["emb"].sharding.spec[0] == "replica"
  assert placed["w"].sharding.is_fully_replicated
  nested = gtx.Mirrored(shard_rows="['t']['emb']").place({"t": host})
  assert nested["t"]["emb"].sharding.spec[0] == "replica"
  assert nested["t"]["w"].sharding.is_fully_replicated
  # place copies: a step that donates its result leaves the input intact.
  table = jnp.arange(128.0).reshape(64, 2)
  bump = m.step(lambda p, s, b: (p + 1.0, s), donate_argnums=(0,))
  out, _ = bump(m.place({"emb": table})["emb"], (), m.shard_batch({"y": y}))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(table) + 1.0)
  np.testing.assert_array_equal(np.asarray(table)[-1], [126.0, 127.0])
  # A per-replica value returned as replicated is an error (the plain
  # shard_map step cannot tell); per_replica_outputs stacks it.
  batch = m.shard_batch({"y": y})
  step = m.step(lambda p, s, b: (p, s, jnp.sum(b["y"])))
  with pytest.raises(ValueError, match="differs across replicas"):
    step(placed, (), batch)
  step = m.step(lambda p, s, b: (p, s, jnp.sum(b["y"])), per_replica_outputs=2)
  _, _, sums = step(placed, (), batch)
  np.testing.assert_allclose(sums, y.reshape(8, -1).sum(1), rtol=1e-6)


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
    with jax.set_mesh(layout.mesh):
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
  with jax.set_mesh(layout.mesh):
    added = jax.jit(
      lambda t, i, r: _rowio.scatter_rows(t, i, r, add=True, unique=False)
    )(table, ids, rows)
  want = host.copy()
  np.add.at(
    want,
    np.array([3, 3, 63, 9, 10, 11]),
    np.arange(16.0).reshape(8, 2)[[0, 1, 2, 5, 6, 7]],
  )
  np.testing.assert_array_equal(np.asarray(added), want)
  assert added.sharding.spec == P("d", None)
