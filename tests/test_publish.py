"""Publishing to serving: gtx.track_changes, gtx.delta, gtx.apply_delta.

Every check replays the deltas into a serving copy and compares it with the
live params bit for bit, and compares each delta's rows with the rows that
changed (numpy, from snapshots of the params at the publishes) and the rows
the gradients touched since the last publish."""

import checkpoint_worker as worker
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conformance import (
  OPTIMIZERS,
  SHAPES,
  each,
  make_grads,
  make_params,
  together,
  touched_rows,
)

import gradtx as gtx

STEPS = 12
PUBLISH = (2, 3, 7, 8, 11)  # after these steps (0-based), and at the end


def _bits(x):
  x = np.atleast_1d(np.asarray(x))
  return x.view(np.uint8).reshape(x.shape[0], -1)


def _changed_rows(before, now):
  """Rows (or the whole leaf, as [0]) whose bits differ."""
  return set(np.nonzero((_bits(before) != _bits(now)).any(1))[0].tolist())


class _Publisher:
  """Publishes after chosen steps, replays each delta into a serving copy
  (numpy) and checks it against the params and the gradients' rows: every
  changed row is in the delta, and every row in it was carried by a
  gradient since (equal to the changed rows with ``exact_rows``: where no
  update row is zero)."""

  def __init__(self, params, exact_rows=True, window=1):
    self.serving = jax.tree.map(np.asarray, params)
    self.snapshot = jax.tree.map(np.array, params)
    self.steps = []  # per step: the rows each leaf's gradient touched
    self.since = 0  # the first step of the rows an update may apply now
    self.window = window  # gradients an update may hold (accumulate's k)
    self.last = None
    self.exact_rows = exact_rows
    self.deltas = []

  def saw(self, grads):
    rows = {}
    for k, g in grads.items():
      if isinstance(g, gtx.SparseRows):
        rows[k] = set(np.nonzero(touched_rows(g))[0].tolist())
      else:
        rows[k] = set(range(np.shape(g)[0] if np.ndim(g) else 1))
    self.steps.append(rows)

  def touched(self, k):
    out = set()
    for rows in self.steps[max(0, self.since - self.window + 1) :]:
      out |= rows[k]
    return out

  def publish(self, params, state):
    d = gtx.delta(params, state, since=self.last)
    self.deltas.append(d)
    self.last = d.step
    self.serving = gtx.apply_delta(self.serving, d)
    for k, p in params.items():
      assert _bits(self.serving[k]).tobytes() == _bits(p).tobytes(), k
      changed = _changed_rows(self.snapshot[k], p)
      got = d.params[k]
      if isinstance(got, dict):
        ids = got["ids"]
        assert (np.diff(ids) > 0).all(), (k, ids)
        np.testing.assert_array_equal(_bits(got["values"]), _bits(p)[ids])
        rows = set(ids.tolist())
      else:
        rows = set() if got is None else set(range(len(_bits(p))))
      assert changed <= rows, (k, changed - rows)
      assert rows <= self.touched(k), (k, rows - self.touched(k))
      if self.exact_rows:
        assert rows == changed, (k, rows - changed)
    self.snapshot = jax.tree.map(np.array, params)
    self.since = len(self.steps)
    return d


def _grads(i):
  """make_grads, with the tables' gradients all padding every fifth step
  (nothing to change)."""
  g = make_grads(i)
  if i % 5 == 4:
    for k in ("emb", "tab"):  # built in numpy: no eager op to compile
      pad = np.full(g[k].indices.shape, -1, g[k].indices.dtype)
      g[k] = gtx.SparseRows(jnp.asarray(pad), g[k].values, g[k].num_rows)
  return g


def _run(names, txs, publishers, params, steps=STEPS, extra=None, key=None):
  """All cases in one jitted program; publish after the PUBLISH steps."""

  def step_fn(tx):
    def step(p, s, g, i):
      u, s = tx.update(g, s, p, **(extra(i) if extra else {}))
      k = None if key is None else jax.random.fold_in(key, i)
      return gtx.apply_updates(p, u, key=k), s

    return step

  step = jax.jit(together(names, [step_fn(tx) for tx in txs]))
  # every init in one program, not one eager op at a time
  states = jax.jit(lambda p: [tx.init(p) for tx in txs])(params)
  carries = [(params, s) for s in states]
  for i in range(steps):
    g = _grads(i)
    if params["emb"].dtype != jnp.float32:
      g = jax.tree.map(
        lambda x: (
          x.astype(params["emb"].dtype)
          if jnp.issubdtype(x.dtype, jnp.floating)
          else x
        ),
        g,
      )
    carries = step(carries, [(g, jnp.int32(i))] * len(txs))
    for pub in publishers:
      pub.saw(g)
    if i in PUBLISH or i == steps - 1:
      now = carries
      each(names, lambda k, _, now=now: publishers[k].publish(*now[k]))
  return carries


def test_every_optimizer_publishes_exact_deltas():
  names = [c.name for c in OPTIMIZERS]
  txs = [optax.chain(c.make_tx(), gtx.track_changes()) for c in OPTIMIZERS]
  params = make_params()
  # A schedule decayed to 0 writes zero rows: in the delta, unchanged.
  pubs = [_Publisher(params, exact_rows="schedule" not in n) for n in names]
  _run(names, txs, pubs, params)
  # the first delta holds what changed since init only
  for pub in pubs:
    assert pub.deltas[0].step == PUBLISH[0] + 1


ROWS = {"emb": 9, "tab": 9, "w": None, "b": None}
LABELS = {"emb": "sparse", "tab": "sparse", "w": "dense", "b": "dense"}

WRAPPED = {
  "accumulate_outside": lambda: optax.chain(
    gtx.accumulate(gtx.lazy_adam(0.05), 3, rows_per_step=ROWS),
    gtx.track_changes(),
  ),
  "accumulate_inside": lambda: gtx.accumulate(
    optax.chain(gtx.lazy_adam(0.05), gtx.track_changes()),
    3,
    rows_per_step=ROWS,
  ),
  "drop_stale": lambda: optax.chain(
    gtx.drop_stale(gtx.rowwise_adagrad(0.1), 1), gtx.track_changes()
  ),
  "inject_drop_stale": lambda: optax.chain(
    optax.inject_hyperparams(gtx.drop_stale)(
      inner=gtx.lazy_sgd(0.1, momentum=0.9), max_staleness=1
    ),
    gtx.track_changes(),
  ),
  "multi_transform": lambda: optax.chain(
    optax.multi_transform(
      {"sparse": gtx.lazy_adam(0.05), "dense": optax.adam(0.05)}, LABELS
    ),
    gtx.track_changes(),
  ),
  "a_tracker_per_branch": lambda: optax.multi_transform(
    {
      "sparse": optax.chain(gtx.ftrl(0.1), gtx.track_changes()),
      "dense": optax.chain(optax.sgd(0.05), gtx.track_changes()),
    },
    LABELS,
  ),
}


def _lagging(i):
  """``grad_step`` of call ``i``: with max_staleness=1 the calls 2, 5, 8,
  ... are two steps stale and dropped (the step counts accepted calls)."""
  accepted = i - i // 3
  return {"grad_step": jnp.int32(accepted - 2 * (i % 3 == 2))}


def test_nested_trackers_accumulate_drop_stale_multi_transform():
  names = list(WRAPPED)
  txs = [WRAPPED[n]() for n in names]
  params = make_params()
  pubs = [_Publisher(params, window=3 if "acc" in n else 1) for n in names]
  carries = _run(names, txs, pubs, params, extra=_lagging)
  # accumulate's micro-steps and dropped gradients change nothing
  acc = names.index("accumulate_outside")
  assert carries[acc][1][0].num_updates == STEPS // 3
  stale = names.index("drop_stale")
  assert int(carries[stale][1][0].num_dropped) == STEPS // 3


def test_bf16_tables_int8_state_and_stochastic_rounding():
  """A bf16 update may round away: the delta then holds a row whose bits
  did not change (the update touched it), never misses one that did."""
  names = ["lazy_adam_int8", "rowwise_adagrad"]
  txs = [
    optax.chain(
      gtx.lazy_adam(0.01, mu_dtype="int8", nu_dtype="int8"),
      gtx.track_changes(),
    ),
    optax.chain(gtx.rowwise_adagrad(0.01), gtx.track_changes()),
  ]
  params = make_params(dtype=jnp.bfloat16)
  pubs = [_Publisher(params, exact_rows=False) for _ in names]
  _run(names, txs, pubs, params, key=jax.random.key(3))


def test_state_is_four_bytes_a_row_and_bytes_per_row_counts_it():
  params = make_params()
  tx = gtx.lazy_adam(0.1)
  with_tracking = optax.chain(tx, gtx.track_changes())
  a = gtx.bytes_per_row(tx, params)
  b = gtx.bytes_per_row(with_tracking, params)
  assert {k: b[k] - a[k] for k in a} == {k: 4.0 for k in a}
  # the inits and the first step in one program, not op by op
  state = jax.jit(with_tracking.init)(params)[1]
  assert state.changed["emb"].shape == (SHAPES["emb"][0],)
  assert state.changed["emb"].dtype == jnp.int32
  assert state.changed["b"].shape == ()
  # per_row: a tree prefix of bools; a leaf recorded whole is published whole
  whole = optax.chain(
    tx,
    gtx.track_changes(
      per_row={"emb": True, "tab": True, "w": False, "b": False}
    ),
  )

  @jax.jit
  def first(params, grads):
    state = whole.init(params)
    u, after = whole.update(grads, state, params)
    return state, gtx.apply_updates(params, u), after

  state, p, after = first(params, make_grads(0))
  assert state[1].changed["w"].shape == ()
  d = gtx.delta(p, after)
  assert d.params["w"].shape == SHAPES["w"]
  assert d.params["emb"]["ids"].shape[0] < SHAPES["emb"][0]


def test_delta_errors_name_the_fix():
  params = make_params()
  with pytest.raises(ValueError, match="track_changes"):
    gtx.delta(params, jax.jit(gtx.lazy_adam(0.1).init)(params))
  tx = optax.chain(gtx.lazy_sgd(0.1), gtx.track_changes())
  state = jax.jit(tx.init)(params)
  with pytest.raises(ValueError, match="since"):
    gtx.delta(params, state, since=3)
  with pytest.raises(TypeError, match="per_row"):
    gtx.track_changes(per_row={"emb": 1})
  with pytest.raises(ValueError, match="stack"):
    gtx.delta(params, state, vocab={})
  two = optax.chain(
    gtx.accumulate(
      optax.chain(gtx.lazy_sgd(0.1), gtx.track_changes()), 2, rows_per_step=ROWS
    ),
    gtx.track_changes(),
  )
  # the init and the first update in one program, not op by op
  s = jax.jit(lambda p, g: two.update(g, two.init(p), p)[1])(
    params, make_grads(0)
  )
  with pytest.raises(ValueError, match="several"):
    gtx.delta(params, s)


# ----------------------------------------------------------------------------
# resuming from a checkpoint


def test_an_orbax_round_trip_of_the_tracker_mid_run_publishes_the_same(
  tmp_path,
):
  tx = optax.chain(gtx.lazy_adam(0.05), gtx.track_changes())
  step = jax.jit(
    lambda p, s, g: (lambda u, s: (gtx.apply_updates(p, u), s))(
      *tx.update(g, s, p)
    )
  )

  def train(params, state, last, start, stop, save_at=None):
    deltas = []
    for i in range(start, stop):
      params, state = step(params, state, _grads(i))
      if i % 3 == 1:
        d = gtx.delta(params, state, since=last)
        deltas.append(d)
        last = d.step
      if i == save_at:
        worker.save_orbax(
          tmp_path / "ckpt", {"p": params, "s": state, "last": last}
        )
    return deltas

  params = make_params()
  whole = train(params, tx.init(params), None, 0, 10, save_at=5)
  abstract = jax.eval_shape(
    lambda: {"p": params, "s": tx.init(params), "last": jnp.int32(0)}
  )
  back = worker.restore_orbax(tmp_path / "ckpt", abstract)
  resumed = train(back["p"], back["s"], back["last"], 6, 10)
  assert len(resumed) == 1 and len(whole) == 3
  a, b = whole[-1], resumed[-1]
  assert int(a.step) == int(b.step) == 8
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
  # a delta written with orbax and read back without a target applies too
  worker.save_orbax(tmp_path / "delta", a)
  restored = worker.restore_orbax(tmp_path / "delta", None)
  serving = gtx.apply_delta(params, restored)
  want = gtx.apply_delta(params, a)
  for k in params:
    np.testing.assert_array_equal(serving[k], want[k])


# ----------------------------------------------------------------------------
# hashed tables: owners and tombstones

HASHED = {
  "h": gtx.TableSpec(16, 3, hashed=gtx.Hashed(probes=4)),
  "n": gtx.TableSpec(10, 3),
}
HASHED_FEATURES = {"fh": "h", "fn": "n"}


def _live_map(stack, vocab):
  """{(table index, raw id): array row} of the live rows, from the map."""
  ((name, v),) = vocab.items()
  s = stack.stacks[name]
  seen = np.asarray(v.last_seen)
  hi = np.asarray(v.key_hi).astype(np.int64)
  lo = np.asarray(v.key_lo).astype(np.int64)
  out = {}
  for t, spec in stack.tables.items():
    if spec.hashed is None:
      continue
    _, off = stack.location(t)
    for r in s.physical(np.arange(off, off + spec.rows)):
      if seen[r] >= 0:
        out[(list(stack.tables).index(t), int(hi[r] << 32 | lo[r]))] = int(r)
  return out


def _hashed_run(stack, tx, params, vocab, steps, publish, place=None):
  """Trains with new raw ids each step; publishes with owners and
  tombstones into a key-value store keyed by (table, raw id)."""

  @jax.jit
  def step(params, state, vocab, raw, i):
    ids, vocab, fresh = stack.admit(vocab, raw, max_new_fraction=1.0)
    params, state = gtx.reset_rows(tx, state, params, fresh)

    def loss(p):
      emb = stack.lookup(p, ids)
      return jnp.sum(jnp.sin(emb["fh"])) + jnp.sum(emb["fn"] ** 2)

    g = gtx.sparse_grad(loss)(params)
    u, state = tx.update(g, state, params, **_lagging(i))
    return gtx.apply_updates(params, u), state, vocab

  (name,) = stack.stacks
  if place is None:
    state = jax.jit(tx.init)(params)  # one program, not eager ops
  else:
    state = gtx.sharded_init(tx, params)
  serving = jax.tree.map(np.asarray, params)
  kv, last, last_vocab = {}, None, None
  rng = np.random.RandomState(5)
  out = []
  for i in range(steps):
    raw = {
      "fh": jnp.asarray(rng.randint(0, 60, size=5), jnp.int32),
      "fn": jnp.asarray(rng.randint(0, 10, size=5), jnp.int32),
    }
    params, state, vocab = step(params, state, vocab, raw, jnp.int32(i))
    if i not in publish:
      continue
    d = gtx.delta(
      params,
      state,
      since=last,
      stack=stack,
      vocab=vocab,
      since_vocab=last_vocab,
    )
    out.append(d)
    serving = gtx.apply_delta(serving, d)
    np.testing.assert_array_equal(serving[name], params[name])
    m = d.maps[name]
    rows = d.params[name]
    if m is not None:
      if m["tombstones"] is not None:
        dead = m["tombstones"]
        for t, r in zip(dead["tables"], dead["ids"], strict=True):
          del kv[(int(t), int(r))]
      for t, r, v in zip(m["tables"], m["owners"], rows["values"], strict=True):
        if r >= 0:
          kv[(int(t), int(r))] = v
    live = _live_map(stack, vocab)
    assert set(kv) == set(live)
    table = np.asarray(params[name])
    for key, r in live.items():
      np.testing.assert_array_equal(kv[key], table[r])
    last, last_vocab = d.step, jax.tree.map(jnp.copy, vocab)
  return out


def test_hashed_tables_publish_owners_and_tombstones():
  stack = gtx.TableStack(HASHED, features=HASHED_FEATURES)
  tx = optax.chain(gtx.drop_stale(gtx.lazy_adam(0.1), 1), gtx.track_changes())
  params = stack.init(jax.random.key(0))
  vocab = jax.jit(stack.init_vocab)(jax.random.key(1))
  deltas = _hashed_run(stack, tx, params, vocab, 14, {0, 3, 4, 8, 13})
  (name,) = stack.stacks
  tombstones = [d.maps[name]["tombstones"] for d in deltas if d.maps[name]]
  assert sum(t is not None for t in tombstones) >= 2  # ids were evicted
  # the first delta is the whole map: every live row with its owner
  first = deltas[0].maps[name]
  assert (first["owners"] >= 0).sum() == len(set(first["owners"]) - {-1})


def test_hashed_delta_after_a_publish_needs_the_map_of_that_publish():
  stack = gtx.TableStack(HASHED, features=HASHED_FEATURES)
  tx = optax.chain(gtx.lazy_sgd(0.1), gtx.track_changes())
  params = stack.init(jax.random.key(0))
  vocab = jax.jit(stack.init_vocab)(jax.random.key(1))
  state = tx.init(params)
  with pytest.raises(ValueError, match="stack"):
    gtx.delta(params, state, vocab=vocab)
  d = gtx.delta(params, state, stack=stack, vocab=vocab)
  assert d.params == {n: None for n in params}
  state = state[0], state[1]._replace(step=jnp.int32(2))
  with pytest.raises(ValueError, match="since_vocab"):
    gtx.delta(params, state, since=1, stack=stack, vocab=vocab)


# ----------------------------------------------------------------------------
# a row-sharded stack on 8 devices


def test_a_row_sharded_stack_on_8_devices_publishes_exact_deltas():
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  stack = gtx.TableStack(HASHED, features=HASHED_FEATURES, shards=8)
  tx = optax.chain(gtx.drop_stale(gtx.lazy_adam(0.1), 1), gtx.track_changes())
  params = stack.init(jax.random.key(0))
  vocab = jax.jit(stack.init_vocab)(jax.random.key(1))
  want = _hashed_run(stack, tx, params, vocab, 9, {2, 5, 8})
  params = {
    k: jax.device_put(v, NamedSharding(mesh, P("d", None)))
    for k, v in params.items()
  }
  with jax.set_mesh(mesh):
    state = gtx.sharded_init(tx, params)
    assert state[1].changed["float32x3"].sharding.spec == P("d")
    got = _hashed_run(stack, tx, params, vocab, 9, {2, 5, 8}, place=True)
  for a, b in zip(want, got, strict=True):
    (name,) = stack.stacks
    np.testing.assert_array_equal(a.params[name]["ids"], b.params[name]["ids"])
    np.testing.assert_array_equal(
      a.maps[name]["owners"], b.maps[name]["owners"]
    )
