"""gtx.OpenVocab, the open-vocabulary step as one object, against the bare
calls it stands for (TableStack.admit, reset_rows, drop_reassigned, the
optimizer's update, delta with stack=/vocab=/since_vocab=): bit for bit,
with evictions, late gradients, a padded short batch, every gradtx
optimizer, inside optax.multi_transform, through orbax, on 8 devices."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from checkpoint_worker import restore_orbax, save_orbax

import gradtx as gtx

B = 6
L = 3
STEPS = 8
TABLES = {
  "user": gtx.TableSpec(5, 3, hashed=gtx.Hashed(probes=3)),
  "item": gtx.TableSpec(6, 3, hashed=gtx.Hashed(policy="lfu", probes=4)),
  "country": gtx.TableSpec(3, 3),
}
FEATURES = {"user_id": "user", "history": "item", "country": "country"}
FEATURE_ORDER = list(FEATURES)
# the rows one gradient of the stack carries: user_id, history, country
ROWS_PER_STEP = {"emb": {"float32x3": B * (1 + L + 1)}, "w": None}


def _stack():
  return gtx.TableStack(TABLES, features=FEATURES)


def _params(stack):
  return {
    "emb": stack.init(jax.random.key(0)),
    "w": jnp.linspace(-1.0, 1.0, 3 * 3).reshape(3, 3).astype(jnp.float32),
  }


def _batch(rng, short=False):
  """Raw ids drawn from more ids than rows (evictions), and a short batch
  padded to B (its mask marks the real examples)."""
  batch = _global_batch(rng, B, short=B - 4 if short else 0)
  return batch, batch.pop("mask")


def _loss(stack, p, ids, weights, labels, mask):
  emb = stack.lookup(p["emb"], ids, weights=weights)
  x = jnp.stack([emb[f] for f in FEATURE_ORDER], 1)  # [B, 3, dim]
  logit = jnp.sum(x * p["w"][None], axis=(1, 2))
  per = optax.sigmoid_binary_cross_entropy(logit, labels)
  return jnp.sum(mask * per) / jnp.maximum(jnp.sum(mask), 1.0)


def _split(batch):
  raw = {f: batch[f] for f in FEATURE_ORDER}
  return raw, {"history": batch["weights"]}, batch["labels"]


def _inner_states(state):
  """The optimizer state with each OpenVocabState replaced by the state it
  wraps: the hand-wired state's tree."""
  return jax.tree.map(
    lambda x: x.inner_state if isinstance(x, gtx.OpenVocabState) else x,
    state,
    is_leaf=lambda x: isinstance(x, gtx.OpenVocabState),
  )


def _equal(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(la, lb, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


OPTIMIZERS = {
  "lazy_adam": lambda: gtx.lazy_adam(0.05),
  "lazy_adam_catch_up": lambda: gtx.lazy_adam(0.05, catch_up=True),
  "rowwise_adagrad": lambda: gtx.rowwise_adagrad(0.1),
  "adagrad": lambda: gtx.adagrad(0.1),
  "ftrl": lambda: gtx.ftrl(0.1),
  "lazy_sgd": lambda: gtx.lazy_sgd(0.1, momentum=0.9),
  "partial_rowwise_adam": lambda: gtx.partial_rowwise_adam(0.05),
  "accumulate": lambda: gtx.accumulate(
    gtx.lazy_adam(0.05), 2, rows_per_step=ROWS_PER_STEP
  ),
}


def _transforms(stack, sparse, where):
  """(object's tx, OpenVocab, hand-wired tx): the OpenVocab inside
  optax.multi_transform beside adam for the dense head, each with its
  tracker ("inside"), or around a multi_transform of the whole params and
  one tracker after it ("around")."""
  key = jax.random.key(1)
  labels = {"emb": "sparse", "w": "dense"}
  if where == "inside":
    sparse = optax.chain(sparse, gtx.track_changes())
    dense = optax.chain(optax.adam(1e-2), gtx.track_changes())
    wired = optax.multi_transform({"sparse": sparse, "dense": dense}, labels)
    ov = gtx.OpenVocab(stack, sparse, at="emb", key=key)
    tx = optax.multi_transform({"sparse": ov, "dense": dense}, labels)
  else:
    wired = optax.chain(
      optax.multi_transform(
        {"sparse": sparse, "dense": optax.adam(1e-2)}, labels
      ),
      gtx.track_changes(),
    )
    ov = gtx.OpenVocab(stack, wired, at="emb", key=key)
    tx = ov
  return tx, ov, wired


CASES = [(name, "inside") for name in OPTIMIZERS] + [("lazy_adam", "around")]


class _Case:
  """One case's object and hand-wired runs: their params, states and map,
  serving's copy and store, and the last published step."""

  def __init__(self, stack, opt, where):
    self.label = f"{opt}-{where}"
    self.tx, self.ov, self.wired = _transforms(stack, OPTIMIZERS[opt](), where)
    self.params = _params(stack)
    self.state = self.tx.init(self.params)
    self.h_params = jax.tree.map(jnp.copy, self.params)
    self.h_state = self.wired.init(self.h_params)
    self.h_vocab = stack.init_vocab(jax.random.key(1))
    self.serving = jax.tree.map(np.asarray, self.params)
    self.kv = {}  # serving's store of the hashed rows: (table, raw id) -> row
    self.last, self.last_vocab = None, None
    self.evicted = 0

  def carry(self):
    return self.params, self.state, self.h_params, self.h_state, self.h_vocab


def test_the_step_and_publish_equal_the_hand_wired_calls():
  """Every case (an optimizer inside optax.multi_transform, or lazy_adam
  around it) against its hand-wired calls, bit for bit. The cases' steps
  run in one jitted program (XLA compiles the kernels they share once);
  each case's two runs read their own params, states and map."""
  stack = _stack()
  (name,) = stack.stacks
  cases = [_Case(stack, opt, where) for opt, where in CASES]

  def step(case, params, state, batch, mask):
    raw, weights, labels = _split(batch)
    ids, params, state = case.ov.admit(state, params, raw, weights=weights)
    value, grads = gtx.sparse_value_and_grad(_loss, argnums=1)(
      stack, params, ids, weights, labels, mask
    )
    updates, state = case.tx.update(grads, state, params)
    return gtx.apply_updates(params, updates), state, value

  def wired_step(case, params, state, vocab, batch, mask):
    raw, weights, labels = _split(batch)
    ids, vocab, fresh = stack.admit(vocab, raw, weights=weights)
    params, state = gtx.reset_rows(case.wired, state, params, {"emb": fresh})
    value, grads = gtx.sparse_value_and_grad(_loss, argnums=1)(
      stack, params, ids, weights, labels, mask
    )
    updates, state = case.wired.update(grads, state, params)
    return gtx.apply_updates(params, updates), state, vocab, value

  @jax.jit(donate_argnums=0)
  def steps(carries, batch, mask):
    out = []
    for case, (p, s, hp, hs, hv) in zip(cases, carries, strict=True):
      out.append(
        (
          step(case, p, s, batch, mask),
          wired_step(case, hp, hs, hv, batch, mask),
        )
      )
    return out

  rng = np.random.RandomState(3)
  for i in range(STEPS):
    batch, mask = _batch(rng, short=i == STEPS - 1)
    out = steps([c.carry() for c in cases], batch, mask)
    for c, ((p, s, value), (hp, hs, hv, h_value)) in zip(
      cases, out, strict=True
    ):
      c.params, c.state, c.h_params, c.h_state, c.h_vocab = p, s, hp, hs, hv
      np.testing.assert_array_equal(value, h_value, err_msg=c.label)
      _equal(p, hp)
      _equal(_inner_states(s), hs)
      _equal(c.ov.vocab(s), hv)
      c.evicted += sum(
        int(v["evicted"]) for v in stack.vocab_stats(hv).values()
      )
      if i % 3 == 2 or i == STEPS - 1:
        _publish(stack, name, c)
  for c in cases:
    assert c.evicted > 0, c.label
    _store_holds_the_live_ids(stack, name, c)


def _publish(stack, name, c):
  """The object's publish against gtx.delta of the hand-wired run, applied
  to serving's copy and its store of the hashed rows."""
  d, c.state = c.ov.publish(c.params, c.state)
  want = gtx.delta(
    c.h_params,
    c.h_state,
    since=c.last,
    stack=stack,
    vocab={"emb": c.h_vocab},
    since_vocab=None if c.last_vocab is None else {"emb": c.last_vocab},
  )
  c.last, c.last_vocab = want.step, jax.tree.map(jnp.copy, c.h_vocab)
  _equal(d, want)
  c.serving = gtx.apply_delta(c.serving, d)
  _equal(c.serving, jax.tree.map(np.asarray, c.params))
  m, rows = d.maps[name], d.params["emb"][name]
  if m is not None:
    if m["tombstones"] is not None:
      for t, raw_id in zip(*m["tombstones"].values(), strict=True):
        del c.kv[int(t), int(raw_id)]
    for t, raw_id, r in zip(
      m["tables"], m["owners"], rows["values"], strict=True
    ):
      if raw_id >= 0:
        c.kv[int(t), int(raw_id)] = r


def _store_holds_the_live_ids(stack, name, c):
  """Serving's store holds exactly the live ids, with their rows."""
  v = c.ov.vocab(c.state)[name]
  table = np.asarray(c.params["emb"][name])
  tables = list(stack.tables)
  live = {}
  for t in ("user", "item"):
    lo = stack.stacks[name].offsets[tables.index(t)]
    for r in range(lo, lo + TABLES[t].rows):
      if int(v.last_seen[r]) >= 0:
        live[tables.index(t), int(v.key_lo[r])] = table[r]
  assert set(c.kv) == set(live), c.label
  for k, r in live.items():
    np.testing.assert_array_equal(c.kv[k], r, err_msg=c.label)


class _LateCase:
  """One wrapper's object and hand-wired runs: their params and states,
  the hand-wired map, the gradients pending and the rows dropped."""

  def __init__(self, stack, wrap):
    self.label = wrap
    inner = gtx.lazy_adam(0.05)
    if wrap == "drop_stale_accumulate":
      inner = gtx.accumulate(inner, 2, rows_per_step=ROWS_PER_STEP)
    self.tx = gtx.drop_stale(inner, 3)
    self.ov = gtx.OpenVocab(stack, self.tx, at="emb", key=jax.random.key(1))
    self.params = _params(stack)
    self.state = self.ov.init(self.params)
    self.h_params, self.h_state = self.params, self.tx.init(self.params)
    self.h_vocab = stack.init_vocab(jax.random.key(1))
    self.pending, self.dropped = [], 0


def test_late_gradients_are_dropped_as_drop_reassigned_drops_them():
  """Gradients applied two steps late: the object's update, given the
  mapping step of the gradient's ids (`mapped_at`), drops the rows given
  out since, as the hand-wired drop_reassigned does, bit for bit; around
  lazy_adam (drop_stale) and around accumulate (drop_stale_accumulate).
  Both wrappers' calls run in one jitted program (XLA compiles the
  kernels they share once); a failure names its wrapper."""
  stack = _stack()
  (name,) = stack.stacks
  cases = [_LateCase(stack, w) for w in ("drop_stale", "drop_stale_accumulate")]

  def mapped_one(c, params, state, h_params, h_state, h_vocab, batch, mask):
    raw, weights, labels = _split(batch)
    ids, params, state = c.ov.admit(state, params, raw, weights=weights)
    h_ids, h_vocab, fresh = stack.admit(h_vocab, raw, weights=weights)
    h_params, h_state = gtx.reset_rows(c.tx, h_state, h_params, {"emb": fresh})
    g = gtx.sparse_grad(_loss, argnums=1)(
      stack, params, ids, weights, labels, mask
    )
    return params, state, h_params, h_state, h_vocab, g, c.ov.mapped_at(state)

  def apply_one(c, params, state, h_params, h_state, h_vocab, g, stamp, step):
    u, state = c.ov.update(g, state, params, mapped_at=stamp, grad_step=step)
    params = gtx.apply_updates(params, u)
    kept = {**g, "emb": stack.drop_reassigned(g["emb"], h_vocab, stamp)}
    u, h_state = c.tx.update(kept, h_state, h_params, grad_step=step)
    return params, state, gtx.apply_updates(h_params, u), h_state

  @jax.jit
  def mapped(carries, batch, mask):
    return [
      mapped_one(c, *carry, batch, mask)
      for c, carry in zip(cases, carries, strict=True)
    ]

  @jax.jit
  def apply(args):
    return [apply_one(c, *a) for c, a in zip(cases, args, strict=True)]

  rng = np.random.RandomState(5)
  for i in range(STEPS + 2):
    batch, mask = _batch(rng)
    step = jnp.int32(i)
    out = mapped(
      [(c.params, c.state, c.h_params, c.h_state, c.h_vocab) for c in cases],
      batch,
      mask,
    )
    for c, (p, s, hp, hs, hv, g, stamp) in zip(cases, out, strict=True):
      c.params, c.state, c.h_params, c.h_state, c.h_vocab = p, s, hp, hs, hv
      c.pending.append((g, stamp, step))
    if len(cases[0].pending) > 2:
      args = []
      for c in cases:
        g, stamp, grad_step = c.pending.pop(0)
        born = np.asarray(c.h_vocab[name].born)
        idx = np.asarray(g["emb"][name].indices)
        live = idx < born.shape[0]
        c.dropped += int((born[idx[live]] > int(stamp[name])).sum())
        args.append(
          (
            c.params,
            c.state,
            c.h_params,
            c.h_state,
            c.h_vocab,
            g,
            stamp,
            grad_step,
          )
        )
      out = apply(args)
      for c, (p, s, hp, hs) in zip(cases, out, strict=True):
        c.params, c.state, c.h_params, c.h_state = p, s, hp, hs
        try:
          _equal(p, hp)
          _equal(_inner_states(s), hs)
        except AssertionError as e:
          raise AssertionError(f"{c.label} step {i}: {e}") from e
  for c in cases:
    assert c.dropped > 0, c.label


def test_resume_through_orbax_gives_the_same_next_step_and_publish(tmp_path):
  stack = _stack()
  tx = optax.chain(gtx.lazy_adam(0.05), gtx.track_changes())
  ov = gtx.OpenVocab(stack, tx, at="emb", key=jax.random.key(1))
  params = _params(stack)
  state = ov.init(params)

  @jax.jit
  def step(params, state, batch, mask):
    raw, weights, labels = _split(batch)
    ids, params, state = ov.admit(state, params, raw, weights=weights)
    grads = gtx.sparse_grad(_loss, argnums=1)(
      stack, params, ids, weights, labels, mask
    )
    updates, state = ov.update(grads, state, params)
    return gtx.apply_updates(params, updates), state

  rng = np.random.RandomState(7)
  batches = [_batch(rng) for _ in range(5)]
  for batch, mask in batches[:3]:
    params, state = step(params, state, batch, mask)
  _, state = ov.publish(params, state)
  save_orbax(tmp_path / "ckpt", {"params": params, "state": state})
  abstract = {
    "params": jax.eval_shape(lambda: params),
    "state": jax.eval_shape(ov.init, params),
  }
  back = restore_orbax(tmp_path / "ckpt", abstract)
  assert isinstance(back["state"], gtx.OpenVocabState)
  _equal(back, {"params": params, "state": state})
  runs = []
  for p, s in ((params, state), (back["params"], back["state"])):
    for batch, mask in batches[3:]:
      p, s = step(p, s, batch, mask)
    d, s = ov.publish(p, s)
    runs.append((p, s, d))
  _equal(runs[0], runs[1])
  assert runs[1][2].maps is not None and int(runs[1][2].step) == 5


def test_errors_name_the_argument_and_the_fix():
  stack = _stack()
  with pytest.raises(TypeError, match="`stack` must be a gradtx.TableStack"):
    gtx.OpenVocab(
      gtx.TableStack({"a": gtx.TableSpec(3, 2)}),
      gtx.lazy_sgd(1.0),
      key=jax.random.key(0),
    )
  with pytest.raises(TypeError, match="`at` must be None"):
    gtx.OpenVocab(stack, gtx.lazy_sgd(1.0), at=["emb"], key=jax.random.key(0))
  ov = gtx.OpenVocab(
    stack, gtx.lazy_sgd(1.0), at="tables", key=jax.random.key(0)
  )
  with pytest.raises(ValueError, match="no stack params at `at`='tables'"):
    ov.init(_params(stack))
  ov = gtx.OpenVocab(stack, gtx.lazy_sgd(1.0), at="emb", key=jax.random.key(0))
  with pytest.raises(ValueError, match="must hold one OpenVocabState"):
    ov.admit({"a": 1}, _params(stack), {})
  # a tracker outside the object would keep the old owners' record
  params = _params(stack)
  tx = optax.chain(
    optax.multi_transform(
      {"sparse": ov, "dense": optax.adam(1e-2)}, {"emb": "sparse", "w": "dense"}
    ),
    gtx.track_changes(),
  )
  with pytest.raises(ValueError, match="Put the tracker in the OpenVocab"):
    ov.admit(tx.init(params), params, {"user_id": jnp.array([3])})


def _eight_device_run(kind):
  """The object's step and publish and the hand-wired ones on a stack
  split by rows over 8 devices (map rows split on an Auto mesh,
  replicated on an Explicit one), or on one device (kind None)."""
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  stack = gtx.TableStack(TABLES, features=FEATURES, shards=8)
  (name,) = stack.stacks
  size = stack.stacks[name].size
  tx, ov, wired = _transforms(stack, gtx.lazy_adam(0.05), "around")
  params = _params(stack)
  vocab = stack.init_vocab(jax.random.key(1))
  if kind is None:
    mesh = None
    state, h_state = ov.init(params), wired.init(params)
  else:
    axis = AxisType.Auto if kind == "auto" else AxisType.Explicit
    mesh = jax.make_mesh((8,), ("d",), axis_types=(axis,))

    def rows(x):
      split = kind == "auto" and x.ndim and x.shape[0] == size
      return jax.device_put(x, NamedSharding(mesh, P("d") if split else P()))

    with jax.set_mesh(mesh):
      params = {
        "emb": {name: rows(params["emb"][name])},
        "w": jax.device_put(params["w"], NamedSharding(mesh, P())),
      }
      state = gtx.sharded_init(ov, params)
      state = state._replace(
        vocab=jax.tree.map(rows, state.vocab),
        published_vocab=jax.tree.map(rows, state.published_vocab),
      )
      h_state = gtx.sharded_init(wired, params)
      vocab = jax.tree.map(rows, vocab)
  h_params = params

  def step(params, state, batch, mask):
    raw, weights, labels = _split(batch)
    ids, params, state = ov.admit(state, params, raw, weights=weights)
    grads = gtx.sparse_grad(_loss, argnums=1)(
      stack, params, ids, weights, labels, mask
    )
    updates, state = tx.update(grads, state, params)
    return gtx.apply_updates(params, updates), state

  def wired_step(params, state, vocab, batch, mask):
    raw, weights, labels = _split(batch)
    ids, vocab, fresh = stack.admit(vocab, raw, weights=weights)
    params, state = gtx.reset_rows(wired, state, params, {"emb": fresh})
    grads = gtx.sparse_grad(_loss, argnums=1)(
      stack, params, ids, weights, labels, mask
    )
    updates, state = wired.update(grads, state, params)
    return gtx.apply_updates(params, updates), state, vocab

  # both steps in one jitted program (the kernels they share compile once)
  @jax.jit
  def steps(params, state, h_params, h_state, vocab, batch, mask):
    return (
      *step(params, state, batch, mask),
      *wired_step(h_params, h_state, vocab, batch, mask),
    )

  rng = np.random.RandomState(11)
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    for i in range(5):
      batch, mask = _batch(rng, short=i == 4)
      params, state, h_params, h_state, vocab = steps(
        params, state, h_params, h_state, vocab, batch, mask
      )
    d, state = ov.publish(params, state)
    want = gtx.delta(h_params, h_state, stack=stack, vocab={"emb": vocab})
  return (params, _inner_states(state), ov.vocab(state), d), (
    h_params,
    h_state,
    vocab,
    want,
  )


@functools.cache
def _one_device_run():
  """The one-device run both kinds compare with, run once."""
  return _eight_device_run(None)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_a_row_sharded_stack_on_8_devices(kind):
  """On 8 devices the object equals the hand-wired calls bit for bit, and
  both equal the one-device run to rounding (8 devices sum in another
  order: atol for the values near 0)."""
  got, wired = _eight_device_run(kind)
  _equal(got, wired)
  one, _ = _one_device_run()
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(one), strict=True):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7
    )


@pytest.mark.parametrize("wrapper", ["accumulate", "drop_stale"])
def test_a_wrapper_around_the_object_is_refused(wrapper):
  """accumulate or drop_stale around the object would hand its update
  gradients of ids mapped before later admits: refused, with the fix."""
  stack = _stack()
  ov = gtx.OpenVocab(stack, gtx.lazy_adam(0.1), at="emb", key=jax.random.key(1))
  tx = (
    gtx.accumulate(ov, 2) if wrapper == "accumulate" else gtx.drop_stale(ov, 1)
  )
  params = _params(stack)
  state = tx.init(params)
  with pytest.raises(ValueError, match=f"inside gradtx.{wrapper}.*Put gradtx"):
    ov.admit(state, params, {"user_id": jnp.array([3])})
  with pytest.raises(ValueError, match=f"inside gradtx.{wrapper}"):
    ov.publish(params, state)
  # inside it, as the guides show, is the way
  ov = gtx.OpenVocab(
    stack,
    gtx.accumulate(gtx.lazy_adam(0.1), 2),
    at="emb",
    key=jax.random.key(1),
  )
  ov.admit(ov.init(params), params, {"user_id": jnp.array([3])})


def _global_batch(rng, n, short):
  """A global batch of ``n`` examples, the last ``short`` ones padding."""
  real = n - short
  batch = {
    "user_id": rng.randint(0, 12, real).astype(np.int32) * 1_000_003,
    "history": rng.randint(-1, 14, (real, L)).astype(np.int32) * 7_919,
    "country": rng.randint(0, 3, real).astype(np.int32),
    "weights": (rng.rand(real, L) > 0.2).astype(np.float32),
    "labels": (rng.rand(real) > 0.5).astype(np.float32),
  }
  padded, mask = gtx.pad_batch(batch, n)
  return {**padded, "mask": mask.astype(np.float32)}


def _summed_loss(stack, p, ids, weights, labels, mask):
  emb = stack.lookup(p["emb"], ids, weights=weights)
  x = jnp.stack([emb[f] for f in FEATURE_ORDER], 1)
  logit = jnp.sum(x * p["w"][None], axis=(1, 2))
  return jnp.sum(mask * optax.sigmoid_binary_cross_entropy(logit, labels))


@pytest.mark.parametrize("axis", ["given", "the step's", "rows sharded"])
def test_mirrored_replicas_keep_one_map_of_the_global_batch(axis):
  """Every replica of a Mirrored step maps the global batch (the axis
  given, or taken from the step; the stack mirrored or split by rows over
  the replicas): the maps are the one-device run's exactly (placement,
  evictions, fresh rows), and params and state equal it to rounding (the
  replicas' gradients are summed in another order)."""
  if axis == "rows sharded":
    m = gtx.Mirrored(
      shard_rows=lambda path, x: "emb" in jax.tree_util.keystr(path)
    )
    stack = gtx.TableStack(TABLES, features=FEATURES, shards=m.num_replicas)
  else:
    m = gtx.Mirrored()
    stack = _stack()
  n = 2 * m.num_replicas
  key = jax.random.key(1)
  one = gtx.OpenVocab(stack, gtx.lazy_adam(0.05), at="emb", key=key)
  mirrored = gtx.OpenVocab(
    stack,
    optax.chain(gtx.all_reduce(m.axis_name, "sum"), gtx.lazy_adam(0.05)),
    at="emb",
    key=key,
    axis_name=m.axis_name if axis == "given" else None,
  )

  def step_of(ov):
    def step(params, state, batch):
      raw, weights, labels = _split(batch)
      ids, params, state = ov.admit(state, params, raw, weights=weights)
      grads = gtx.sparse_grad(_summed_loss, argnums=1)(
        stack, params, ids, weights, labels, batch["mask"]
      )
      updates, state = ov.update(grads, state, params)
      return gtx.apply_updates(params, updates), state

    return step

  params = _params(stack)
  one_params, one_state = params, one.init(params)
  m_params = m.place(params)
  m_state = m.init_state(mirrored, m_params)
  one_step = jax.jit(step_of(one))
  m_step = m.step(step_of(mirrored))
  rng = np.random.RandomState(5)
  for i in range(6):
    batch = _global_batch(rng, n, short=5 if i == 5 else 0)
    one_params, one_state = one_step(one_params, one_state, batch)
    m_params, m_state = m_step(m_params, m_state, m.shard_batch(batch))
  _equal(mirrored.vocab(m_state), one.vocab(one_state))
  stats = stack.vocab_stats(one.vocab(one_state))
  assert int(stats["user"]["live"]) == 5  # the table is full: evictions
  for a, b in zip(
    jax.tree.leaves((m_params, m_state.inner_state[1])),
    jax.tree.leaves((one_params, one_state.inner_state)),
    strict=True,
  ):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6
    )


def test_mirrored_refuses_jagged_features_and_a_bad_axis_name():
  stack = _stack()
  with pytest.raises(TypeError, match="`axis_name` must be None"):
    gtx.OpenVocab(stack, gtx.lazy_sgd(1.0), key=jax.random.key(0), axis_name=3)
  m = gtx.Mirrored()
  ov = gtx.OpenVocab(
    stack,
    gtx.lazy_sgd(1.0),
    at="emb",
    key=jax.random.key(0),
    axis_name=m.axis_name,
  )
  params = _params(stack)

  def step(params, state, batch):
    ids, params, state = ov.admit(state, params, batch)
    return params, state

  batch = {
    "user_id": gtx.Jagged(
      jnp.arange(2 * m.num_replicas, dtype=jnp.int32),
      jnp.ones(2 * m.num_replicas, jnp.int32),
    )
  }
  with pytest.raises(ValueError, match="gradtx.Jagged or gradtx.KeyedJagged"):
    m.step(step)(
      m.replicate(params), m.replicate(ov.init(params)), m.shard_batch(batch)
    )
