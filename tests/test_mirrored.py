"""Mirrored replication and all_reduce: against numpy and single-device runs,
in shard_map, pmap, Mirrored.step and across two real processes."""

import jax
import jax.numpy as jnp
import mirrored_worker as worker
import numpy as np
import optax
import procs
import pytest
from conformance import each, together
from jax.sharding import PartitionSpec as P

import gradtx as gtx

R = 8  # conftest fakes 8 CPU devices
NUM_ROWS = 40
DIM = 3


def _replica_grads(seed=0, n=5):
  """Per-replica gradients stacked on a leading axis of R: a SparseRows with
  duplicates (within and across replicas) and a padding id, and a dense
  leaf."""
  rng = np.random.RandomState(seed)
  ids = rng.randint(0, NUM_ROWS, size=(R, n)).astype(np.int32)
  ids[:, 1] = ids[:, 0]
  ids[2, -1] = NUM_ROWS  # padding
  ids[3, 0] = ids[4, 0]  # duplicate across replicas
  vals = rng.normal(size=(R, n, DIM)).astype(np.float32)
  dense = rng.normal(size=(R, DIM, 2)).astype(np.float32)
  return ids, vals, dense


def _np_dense(ids, vals):
  """numpy: the dense [NUM_ROWS, DIM] array of one replica's rows."""
  out = np.zeros((NUM_ROWS, DIM), np.float64)
  for i, v in zip(ids, vals, strict=True):
    if 0 <= i < NUM_ROWS:
      out[i] += v
  return out


def _tree(ids, vals, dense):
  return {"emb": gtx.SparseRows(ids, vals, NUM_ROWS), "w": dense}


def _shard_map(f, *args):
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  mapped = jax.shard_map(
    f, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False
  )
  return jax.jit(mapped)(*args)


def _pmap(f, *args):
  return jax.pmap(f, axis_name="d")(*args)


# ----------------------------------------------------------------------------
# gtx.all_reduce


@pytest.mark.parametrize("mapper", ["shard_map", "pmap"])
def test_all_reduce_matches_numpy(mapper):
  ids, vals, dense = _replica_grads()
  ops = ("mean", "sum")
  txs = [gtx.all_reduce("d", op=op) for op in ops]

  def f(i, v, d):
    if mapper == "shard_map":  # blocks of one replica: drop the block axis
      i, v, d = i[0], v[0], d[0]
    out = []
    for tx in txs:
      u, state = tx.update(_tree(i, v, d), tx.init(None))
      assert state == optax.EmptyState()
      out.append((u["emb"].indices, u["emb"].values, u["w"]))
    return (
      jax.tree.map(lambda x: x[None], out) if mapper == "shard_map" else out
    )

  run = _shard_map if mapper == "shard_map" else _pmap
  for op, (got_idx, got_val, got_w) in zip(
    ops, run(f, ids, vals, dense), strict=True
  ):
    scale = 1.0 / R if op == "mean" else 1.0
    want_w = dense.astype(np.float64).sum(0) * scale
    want_table = sum(_np_dense(i, v) for i, v in zip(ids, vals, strict=True))
    for r in range(R):  # every replica holds the same reduced values
      np.testing.assert_allclose(got_w[r], want_w, rtol=1e-5, atol=1e-6)
      # all-gather: every replica's rows, in replica order, R * n of them
      np.testing.assert_array_equal(got_idx[r], ids.reshape(-1))
      np.testing.assert_allclose(
        got_val[r], vals.reshape(-1, DIM) * scale, rtol=1e-6
      )
      table = _np_dense(got_idx[r], got_val[r])
      np.testing.assert_allclose(
        table, want_table * scale, rtol=1e-5, atol=1e-6
      )


def test_all_reduce_sparse_under_shard_map_type_checks():
  # With check_vma=True the gathered rows are typed as the same on every
  # replica, so they may leave shard_map as one replicated (P()) value.
  ids, vals, _ = _replica_grads()
  tx = gtx.all_reduce("d", op="sum")
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))

  def f(i, v):
    u, _ = tx.update(gtx.SparseRows(i[0], v[0], NUM_ROWS), optax.EmptyState())
    return u.indices, u.values

  mapped = jax.shard_map(
    f, mesh=mesh, in_specs=P("d"), out_specs=P(), check_vma=True
  )
  got_idx, got_val = jax.jit(mapped)(ids, vals)
  np.testing.assert_array_equal(got_idx, ids.reshape(-1))
  np.testing.assert_array_equal(got_val, vals.reshape(-1, DIM))


_REDUCTIONS = {
  "psum": lambda g: jax.lax.psum(g, "d"),
  "pmean": lambda g: jax.lax.pmean(g, "d"),
  "pmax": lambda g: jax.lax.pmax(g, "d"),
  "pmin": lambda g: jax.lax.pmin(g, "d"),
  "psum_scatter": lambda g: jax.lax.psum_scatter(g, "d", tiled=True),
}


@pytest.mark.parametrize("check_vma", [False, True])
@pytest.mark.parametrize("name", sorted(_REDUCTIONS))
def test_lax_reductions_refuse_sparse_rows_and_name_all_reduce(name, check_vma):
  # lax.psum would add the replicas' row ids together ([1, 2] + [7, 8] ->
  # [8, 10]); every elementwise reduction refuses, naming the fix and line.
  ids, vals, dense = _replica_grads()
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  line = _REDUCTIONS[name].__code__.co_firstlineno

  def f(i, v, d):
    return _REDUCTIONS[name](_tree(i[0], v[0], d[0]))["w"]

  mapped = jax.shard_map(
    f, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=check_vma
  )
  with pytest.raises(TypeError) as info:
    jax.jit(mapped)(ids, vals, dense)
  msg = str(info.value)
  assert f"`jax.lax.{name}`" in msg and "gtx.all_reduce(axis_name)" in msg
  assert f"{__file__}:{line}" in msg, msg


def test_all_reduce_called_on_a_tree_is_the_pmean_drop_in():
  # The hand-written step of Flax's WMT train.py: grads = lax.pmean(grads,
  # "batch"); with SparseRows, gtx.all_reduce("batch")(grads).
  ids, vals, dense = _replica_grads()

  def f(i, v, d):
    g = gtx.all_reduce("d")(_tree(i[0], v[0], d[0]))
    s = gtx.all_reduce("d", "sum")(_tree(i[0], v[0], d[0]))
    return jax.tree.map(
      lambda x: x[None], (g["emb"].to_dense(), g["w"], s["w"])
    )

  got_t, got_w, got_s = _shard_map(f, ids, vals, dense)
  want_t = sum(_np_dense(i, v) for i, v in zip(ids, vals, strict=True)) / R
  for r in range(R):
    np.testing.assert_allclose(got_t[r], want_t, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_w[r], dense.mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_s[r], dense.sum(0), rtol=1e-5, atol=1e-6)


def test_row_preserving_collectives_keep_sparse_rows_whole():
  # all_gather(tiled) concatenates every replica's rows (the same sum), and
  # ppermute moves a SparseRows whole: both stay right, so both are allowed.
  ids, vals, _ = _replica_grads()

  def f(i, v):
    g = gtx.SparseRows(i[0], v[0], NUM_ROWS)
    gathered = jax.lax.all_gather(g, "d", tiled=True)
    moved = jax.lax.ppermute(g, "d", [(r, (r + 1) % R) for r in range(R)])
    return jax.tree.map(
      lambda x: x[None], (gathered.to_dense(), moved.indices, moved.values)
    )

  got_t, got_i, got_v = _shard_map(f, ids, vals)
  want_t = sum(_np_dense(i, v) for i, v in zip(ids, vals, strict=True))
  for r in range(R):
    np.testing.assert_allclose(got_t[r], want_t, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got_i[r], ids[(r - 1) % R])
    np.testing.assert_array_equal(got_v[r], vals[(r - 1) % R])


def test_all_reduce_keeps_dtype_and_none():
  ids, vals, dense = _replica_grads()
  tx = gtx.all_reduce("d")

  def f(i, v, d):
    g = {"emb": gtx.SparseRows(i, v.astype(jnp.bfloat16), NUM_ROWS), "n": None}
    g["w"] = d.astype(jnp.bfloat16)
    u, _ = tx.update(g, optax.EmptyState())
    assert u["n"] is None
    return u["emb"].values, u["w"]

  v, w = _pmap(f, ids, vals, dense)
  assert v.dtype == w.dtype == jnp.bfloat16
  assert v.shape == (R, R * ids.shape[1], DIM)


def test_all_reduce_bad_inputs():
  with pytest.raises(ValueError, match="`op` must be one of 'mean', 'sum'"):
    gtx.all_reduce("d", op="max")
  with pytest.raises(ValueError, match="`op` must be one of"):
    gtx.all_reduce("d", op="first")  # "first" is for values, not gradients
  with pytest.raises(TypeError, match="hashable axis name"):
    gtx.all_reduce(["d"])
  tx = gtx.all_reduce("nope")
  with pytest.raises(NameError, match="axis name 'nope' is not bound"):
    jax.jit(lambda g: tx.update(g, optax.EmptyState()))(jnp.ones(3))
  tx = gtx.all_reduce("d")
  params = {"a": jnp.ones(2), "b": jnp.ones(2)}
  with pytest.raises(ValueError, match="does not have the tree structure"):
    _pmap(
      lambda g: tx.update({"a": g}, optax.EmptyState(), params)[0],
      jnp.ones((R, 2)),
    )


# all_reduce alone; its chains with optimizers run in the Mirrored tests.
# ----------------------------------------------------------------------------
# Mirrored: construction, placement, reductions


def test_mirrored_properties_and_placement():
  m = gtx.Mirrored()
  assert m.num_replicas == R and m.axis_name == "replica"
  assert m.mesh.axis_names == ("replica",)
  assert list(m.mesh.devices) == jax.devices()
  sub = gtx.Mirrored(jax.devices()[2:6], axis_name="data")
  assert sub.num_replicas == 4 and sub.axis_name == "data"
  assert "num_replicas=4" in repr(sub)

  g = gtx.SparseRows(jnp.array([1, 3]), jnp.ones((2, DIM)), NUM_ROWS)
  tree = {"emb": jnp.arange(12.0).reshape(4, 3), "g": g, "c": 2}
  rep = m.replicate(tree)
  assert isinstance(rep["g"], gtx.SparseRows) and rep["g"].num_rows == NUM_ROWS
  for x in jax.tree.leaves(rep):
    assert x.sharding.is_fully_replicated and len(x.sharding.device_set) == R
  np.testing.assert_array_equal(rep["emb"], tree["emb"])

  batch = m.shard_batch({"x": np.arange(32.0).reshape(16, 2)})
  assert batch["x"].sharding.spec == P("replica")
  shards = sorted(batch["x"].addressable_shards, key=lambda s: s.index[0].start)
  np.testing.assert_array_equal(shards[1].data, [[4.0, 5.0], [6.0, 7.0]])


def test_mirrored_bad_construction():
  with pytest.raises(ValueError, match="must not be empty"):
    gtx.Mirrored([])
  with pytest.raises(ValueError, match="duplicates"):
    gtx.Mirrored([jax.devices()[0]] * 2)
  with pytest.raises(TypeError, match="jax.Device"):
    gtx.Mirrored(["cpu:0"])
  with pytest.raises(TypeError, match="axis_name"):
    gtx.Mirrored(axis_name=("a", "b"))


def test_replicate_copies_so_donation_keeps_the_input():
  m = gtx.Mirrored()
  params = {"w": jnp.ones((4, 3)), "v": np.ones(3, np.float32)}
  rep = m.replicate(params)
  for x, y in zip(jax.tree.leaves(rep), jax.tree.leaves(params), strict=True):
    if isinstance(y, jax.Array):
      ptrs = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
      assert y.unsafe_buffer_pointer() not in ptrs
  step = m.step(lambda p, s, b: (p, s), donate_argnums=(0, 1))
  step(rep, (), m.shard_batch(jnp.zeros((R, 1))))
  assert rep["w"].is_deleted()  # donated, and no "not usable" warning
  np.testing.assert_array_equal(params["w"], np.ones((4, 3)))  # not deleted


def test_shard_batch_errors_name_the_leaf():
  m = gtx.Mirrored()
  with pytest.raises(ValueError, match=r"batch\['y'\].*leading size 10.*8"):
    m.shard_batch({"x": np.zeros((16, 2)), "y": np.zeros((10,))})
  with pytest.raises(ValueError, match=r"batch\['s'\].*scalar"):
    m.shard_batch({"s": 1.0})


def test_step_errors():
  m = gtx.Mirrored()
  step = m.step(lambda p, s, b: (p, s))
  with pytest.raises(ValueError, match=r"batch\[0\].*leading size 12.*8"):
    step(jnp.ones(2), (), (jnp.zeros((12, 2)),))
  with pytest.raises(TypeError, match="takes \\(params, opt_state, batch"):
    step(jnp.ones(2), ())
  with pytest.raises(TypeError, match="must be callable"):
    m.step(3)
  with pytest.raises(TypeError, match="`donate_argnums` must be an int"):
    m.step(lambda p, s, b: p, donate_argnums=("0",))
  batch = m.shard_batch(jnp.zeros((R, 1)))
  with pytest.raises(ValueError, match="out of range for a step returning 2"):
    m.step(lambda p, s, b: (p, s), per_replica_outputs=2)(1.0, (), batch)
  with pytest.raises(TypeError, match="needs the step to return a tuple"):
    m.step(lambda p, s, b: p, per_replica_outputs=0)(1.0, (), batch)


def test_all_reduce_and_reduce_ops():
  m = gtx.Mirrored()
  rng = np.random.RandomState(3)
  x = rng.normal(size=(R * 2, 3)).astype(np.float32)
  ids = rng.randint(0, NUM_ROWS, size=(R * 2,)).astype(np.int32)
  flags = np.arange(R * 2) % 3 == 0

  def fn(params, state, batch):
    x, ids, flags = batch
    local = {
      "x": x.sum(0),
      "g": gtx.SparseRows(ids, jnp.ones((2, DIM)) * x[:, :1], NUM_ROWS),
      "n": ids[0],
      "flag": flags[0],
    }
    out = {op: m.reduce_in_step(local, op) for op in ("sum", "mean", "first")}
    return params, state, out, local

  step = m.step(fn, per_replica_outputs=3)
  _, _, got, per = step(1.0, (), m.shard_batch((x, ids, flags)))
  xs = x.reshape(R, 2, 3).astype(np.float64).sum(1)  # per-replica sums
  np.testing.assert_allclose(got["sum"]["x"], xs.sum(0), rtol=1e-5)
  np.testing.assert_allclose(got["mean"]["x"], xs.mean(0), rtol=1e-5)
  np.testing.assert_array_equal(got["first"]["x"], x[:2].sum(0))
  assert int(got["sum"]["n"]) == ids[::2].sum()
  assert got["mean"]["n"].dtype == jnp.float32  # mean of ints is a float
  assert int(got["first"]["n"]) == ids[0]
  assert got["first"]["flag"].dtype == jnp.bool_
  assert bool(got["first"]["flag"]) == flags[0]
  # SparseRows: sum/mean gather every replica's rows; first is replica 0's
  vals = np.ones((R * 2, DIM)) * x[:, :1]
  np.testing.assert_array_equal(got["sum"]["g"].indices, ids)
  np.testing.assert_allclose(got["sum"]["g"].values, vals, rtol=1e-6)
  np.testing.assert_allclose(got["mean"]["g"].values, vals / R, rtol=1e-6)
  np.testing.assert_array_equal(got["first"]["g"].indices, ids[:2])
  np.testing.assert_allclose(got["first"]["g"].values, vals[:2], rtol=1e-6)

  # per-replica outputs: a leading replica axis, combined by reduce
  assert per["x"].shape == (R, 3) and per["g"].indices.shape == (R, 2)
  np.testing.assert_allclose(per["x"], xs, rtol=1e-5)
  for op in ("sum", "mean", "first"):
    red = m.reduce(per, op)
    np.testing.assert_allclose(red["x"], got[op]["x"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(red["g"].indices, got[op]["g"].indices)
    np.testing.assert_allclose(red["g"].values, got[op]["g"].values, rtol=1e-6)
    assert red["x"].sharding.is_fully_replicated


def test_reduction_bad_inputs():
  m = gtx.Mirrored()
  with pytest.raises(ValueError, match="`op` must be one of 'sum', 'mean'"):
    m.reduce(jnp.ones((R,)), "max")
  with pytest.raises(ValueError, match=r"tree\['a'\].*leading size 3.*8"):
    m.reduce({"a": jnp.ones((3,))}, "sum")
  with pytest.raises(ValueError, match="`op` must be one of"):
    m.step(lambda p, s, b: (m.reduce_in_step(p, "avg"), s))(
      1.0, (), m.shard_batch(jnp.zeros((R,)))
    )
  with pytest.raises(NameError, match="inside the function given to"):
    m.reduce_in_step(jnp.ones(2), "sum")


def test_all_reduce_method_is_a_deprecated_alias():
  # Mirrored.all_reduce(tree, op) was renamed reduce_in_step (gtx.all_reduce
  # is the transformation); the old name warns and reduces the same way.
  m = gtx.Mirrored()

  def fn(p, s, b):
    with pytest.warns(DeprecationWarning, match=r"Mirrored\.reduce_in_step"):
      total = m.all_reduce(b.sum(), "sum")
    return p, s, total

  _, _, got = m.step(fn)(1.0, (), m.shard_batch(jnp.ones((R,))))
  assert float(got) == R


# ----------------------------------------------------------------------------
# Mirrored training equals single-device training on the whole batch


def _batches(steps, batch=32, seed=0):
  rng = np.random.RandomState(seed)
  return [
    {
      "ids": rng.randint(0, NUM_ROWS, size=(batch, 2)).astype(np.int32),
      "x": rng.normal(size=(batch, DIM)).astype(np.float32),
      "y": rng.normal(size=(batch,)).astype(np.float32),
    }
    for _ in range(steps)
  ]


def _params():
  rng = np.random.RandomState(7)
  return {
    "emb": rng.normal(size=(NUM_ROWS, DIM)).astype(np.float32),
    "w": rng.normal(size=(DIM,)).astype(np.float32),
  }


def _loss(p, batch, lookup=gtx.lookup):
  h = lookup(p["emb"], batch["ids"]).sum(1) + batch["x"]
  return jnp.mean(jnp.square(jnp.tanh(h) @ p["w"] - batch["y"]))


def _train_step(tx, grad_fn, m=None):
  def train_step(params, opt_state, batch, *args):
    loss, grads = grad_fn(_loss)(params, batch)
    kwargs = dict(zip(("grad_step",), args, strict=False))
    updates, opt_state = tx.update(grads, opt_state, params, **kwargs)
    if m is not None:
      loss = m.reduce_in_step(loss, "mean")
    return gtx.apply_updates(params, updates), opt_state, loss

  return train_step


def _mirrored_run(m, tx, batches, grad_fn, extra=lambda i: ()):
  step = m.step(_train_step(tx, grad_fn, m), donate_argnums=(0, 1))
  params = m.replicate(_params())
  state = m.replicate(tx.init(_params()))
  losses = []
  for i, b in enumerate(batches):
    params, state, loss = step(params, state, m.shard_batch(b), *extra(i))
    losses.append(float(loss))
  assert step._cache_size() == 1
  return params, state, losses


def _runs_together(names, txs, grad_fns, batches, extras, m=None):
  """Each case's run (``names[k]``: ``txs[k]``, ``grad_fns[k]``, the
  ``batches[k]`` and ``extras[k](i)`` of call ``i``), every case's step in
  one program (compiled once: the kernels they share compile once): the
  Mirrored step with ``m`` (donating), else plain jit.
  ``[(params, state, losses)]``."""
  steps = [_train_step(tx, g, m) for tx, g in zip(txs, grad_fns, strict=True)]
  each_step = together(names, steps)

  def step(params, states, batch, args):
    carries = zip(params, states, batch, strict=True)
    return tuple(map(list, zip(*each_step(list(carries), args), strict=True)))

  if m is None:
    step = jax.jit(step)
    params = [jax.tree.map(jnp.asarray, _params()) for _ in names]
    states = [tx.init(p) for tx, p in zip(txs, params, strict=True)]
    place = lambda b: b  # noqa: E731
  else:
    step = m.step(step, donate_argnums=(0, 1))
    params = [m.replicate(_params()) for _ in names]
    states = [m.replicate(tx.init(_params())) for tx in txs]
    place = m.shard_batch
  (num_calls,) = {len(b) for b in batches}
  losses = [[] for _ in names]
  for i in range(num_calls):
    params, states, loss = step(
      params,
      states,
      [place(b[i]) for b in batches],
      [extra(i) for extra in extras],
    )
    for k, x in enumerate(loss):
      losses[k].append(float(x))
  assert step._cache_size() == 1
  return list(zip(params, states, losses, strict=True))


def _single_run(tx, batches, grad_fn, extra=lambda i: {}):
  @jax.jit
  def step(params, opt_state, batch, kwargs):
    loss, grads = grad_fn(_loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params, **kwargs)
    return gtx.apply_updates(params, updates), opt_state, loss

  params = jax.tree.map(jnp.asarray, _params())
  state = tx.init(params)
  losses = []
  for i, b in enumerate(batches):
    params, state, loss = step(params, state, b, extra(i))
    losses.append(float(loss))
  return params, state, losses


def _dense_grad(f):
  # the independent path: plain JAX autodiff through an ordinary gather
  return jax.value_and_grad(lambda p, b: f(p, b, lookup=lambda t, i: t[i]))


def _assert_tree_close(a, b, rtol=2e-5):
  jax.tree.map(
    lambda x, y: np.testing.assert_allclose(
      np.asarray(x), np.asarray(y), rtol=rtol, atol=rtol
    ),
    a,
    b,
  )


def test_mirrored_runs_equal_single_device():
  # Each case's Mirrored run (all_reduce in front) against the same chain
  # on one device on the whole batch; every case's Mirrored step in one
  # program, every single-device step in another.
  m = gtx.Mirrored()
  n = 16 // R * 2  # ids per replica of the accumulate case: rows of 2 ids
  inner = gtx.lazy_adam(0.05)
  read_at = [0, 0, 0, 2]  # staleness 0, 1, 2 (dropped), 0
  rows = {"emb": R * n, "w": None}
  sparse = gtx.sparse_value_and_grad
  cases = {
    # name: (tx on one device, grad_fn, batches, grad_step of call i)
    "dense_adam": (optax.adam(0.05), _dense_grad, _batches(4), None),
    "sparse_lazy_adam": (gtx.lazy_adam(0.05), sparse, _batches(4), None),
    "accumulate_lazy_adam": (
      gtx.accumulate(inner, 2, rows_per_step=rows),
      sparse,
      _batches(4, batch=16),
      None,
    ),
    "drop_stale": (
      gtx.drop_stale(gtx.lazy_adam(0.05), 1),
      sparse,
      _batches(4),
      read_at,
    ),
  }
  names = list(cases)
  txs, grad_fns, batches, reads = zip(*cases.values(), strict=True)
  txs_m = [optax.chain(gtx.all_reduce(m.axis_name), tx) for tx in txs]
  mirrored = _runs_together(
    names,
    txs_m,
    grad_fns,
    batches,
    [
      (lambda i, r=r: (jnp.int32(r[i]),)) if r else (lambda i: ())
      for r in reads
    ],
    m,
  )
  single = _runs_together(
    names,
    txs,
    grad_fns,
    batches,
    [(lambda i, r=r: (r[i],)) if r else (lambda i: ()) for r in reads],
  )

  def check(k, name):
    (got, state, losses), (want, want_state, want_losses) = (
      mirrored[k],
      single[k],
    )
    _assert_tree_close(got, want)
    if name == "dense_adam":
      np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
      # the run moved the params: the comparison is not vacuous
      assert np.max(np.abs(np.asarray(got["emb"]) - _params()["emb"])) > 0.05
    if name == "sparse_lazy_adam":
      _assert_tree_close(state[1], want_state)
      np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    if name == "drop_stale":
      assert int(state[1].num_dropped) == int(want_state.num_dropped) == 1

  each(names, check)


def test_mirrored_sparse_sgd_equals_dense_optax_sgd():
  # sparse all-gather + gradtx sgd against optax.sgd on jax.grad's dense grads
  m = gtx.Mirrored()
  batches = _batches(3)
  tx_m = optax.chain(
    gtx.all_reduce(m.axis_name), gtx.scale_by_learning_rate(0.3)
  )
  got, _, _ = _mirrored_run(m, tx_m, batches, gtx.sparse_value_and_grad)
  want, _, _ = _single_run(optax.sgd(0.3), batches, _dense_grad)
  _assert_tree_close(got, want)


def test_pmap_step_equals_single_device():
  # legacy pmap code: sparse gradients reduced by gtx.all_reduce, against
  # optax.sgd on jax.grad's dense gradients of the whole batch
  batches = _batches(3)
  tx = optax.chain(gtx.all_reduce("i"), gtx.scale_by_learning_rate(0.3))

  def train_step(params, opt_state, batch):
    grads = gtx.sparse_grad(_loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return gtx.apply_updates(params, updates), opt_state

  pstep = jax.pmap(train_step, axis_name="i", donate_argnums=(0, 1))
  params = jax.tree.map(lambda x: np.stack([x] * R), _params())
  state = jax.pmap(tx.init)(params)
  for b in batches:
    local = jax.tree.map(lambda x: x.reshape((R, -1) + x.shape[1:]), b)
    params, state = pstep(params, state, local)
  want, _, _ = _single_run(optax.sgd(0.3), batches, _dense_grad)
  for r in (0, 5):
    _assert_tree_close(jax.tree.map(lambda x, r=r: x[r], params), want)


# ----------------------------------------------------------------------------
# two real processes x 2 CPU devices


def test_two_processes_equal_single_process_four_devices(tmp_path):
  out = ["--out", str(tmp_path)]
  with procs.launched("mirrored_worker.py", out, tmp_path, timeout=90):
    # the reference, while they run: one process, 4 of the 8 local devices
    want, want_losses = worker.train(gtx.Mirrored(jax.devices()[:4]))

  for i in range(2):
    got = np.load(tmp_path / f"process_{i}.npz")
    assert int(got["num_replicas"]) == 4 and int(got["local_devices"]) == 2
    for k, v in want.items():
      np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["losses"], want_losses, rtol=1e-5)
  assert np.max(np.abs(want["emb"] - worker.init_params()["emb"])) > 0.05


def test_all_reduce_in_a_type_checked_shard_map_step():
  # What following the lax.pmean error's advice gives in a hand-written
  # data-parallel step under shard_map's default check_vma=True: replicated
  # params, a sharded batch, out_specs=P(). JAX's autodiff already sums a
  # replicated parameter's gradient (and sparse_value_and_grad gathers its
  # rows); all_reduce reduces it as lax.pmean / lax.psum reduce the dense
  # gradient, and what it returns stays typed replicated.
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("i",))
  params = {
    "emb": jnp.linspace(-1.0, 1.0, NUM_ROWS * DIM).reshape(NUM_ROWS, DIM),
    "w": jnp.arange(1.0, DIM + 1.0) / DIM,
  }
  ids = jnp.asarray(np.arange(2 * R, dtype=np.int32) * 7 % NUM_ROWS)

  def loss(p, ids):
    return jnp.mean(jnp.tanh(p["emb"][ids] @ p["w"]))

  def step(params, ids):
    tx, dense_tx = gtx.lazy_adam(1e-2), optax.adam(1e-2)
    _, grads = gtx.sparse_value_and_grad(loss)(params, ids)
    mean, total = gtx.all_reduce("i")(grads), gtx.all_reduce("i", "sum")(grads)
    updates, _ = tx.update(mean, tx.init(params), params)
    # the reference: JAX's dense gradient, lax.pmean / psum, optax.adam
    dense = jax.grad(loss)(params, ids)
    want_mean, want_total = jax.lax.pmean(dense, "i"), jax.lax.psum(dense, "i")
    want_updates, _ = dense_tx.update(want_mean, dense_tx.init(params), params)
    got = (
      gtx.apply_updates(params, updates),
      mean["emb"].to_dense(),
      total["emb"].to_dense(),
      (mean["w"], total["w"]),
    )
    want = (
      optax.apply_updates(params, want_updates),
      want_mean["emb"],
      want_total["emb"],
      (want_mean["w"], want_total["w"]),
    )
    return got, want

  mapped = jax.shard_map(
    step, mesh=mesh, in_specs=(P(), P("i")), out_specs=P(), check_vma=True
  )
  got, want = jax.jit(mapped)(params, ids)
  _assert_tree_close(got, want)
