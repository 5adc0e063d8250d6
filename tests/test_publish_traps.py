"""Publishing traps: a hashed stack published without its map, a map freed
by donation, a non-finite batch.

The references are independent of gradtx.delta: numpy snapshots of the
params (which rows changed), and a run of the same optimizer that never saw
the non-finite batch."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtx as gtx

TABLES = {
  "h": gtx.TableSpec(12, 3, hashed=gtx.Hashed(probes=4)),
  "n": gtx.TableSpec(6, 3),
  "g": gtx.TableSpec(8, 2, hashed=gtx.Hashed(probes=4)),
}
FEATURES = {"fh": "h", "fn": "n", "fg": "g"}


def _hashed_setup(tx=None, update=True):
  stack = gtx.TableStack(TABLES, features=FEATURES)
  if tx is None:
    tx = optax.chain(gtx.lazy_adam(0.1), gtx.track_changes())
  params = {**stack.init(jax.random.key(0)), "w": jnp.ones(3)}
  vocab = jax.jit(stack.init_vocab)(jax.random.key(1))

  def step(params, state, vocab, raw, x=None):
    x = jnp.ones(4) if x is None else x
    ids, vocab, fresh = stack.admit(vocab, raw, max_new_fraction=1.0)
    params, state = gtx.reset_rows(tx, state, params, fresh)
    if not update:  # the reference of a skipped update
      return params, state, vocab

    def loss(p):
      emb = stack.lookup(p, ids)
      dense = jnp.sin(emb["fh"] @ p["w"]) * x
      return jnp.sum(dense) + jnp.sum(emb["fg"] ** 2)

    u, state = tx.update(gtx.sparse_grad(loss)(params), state, params)
    return gtx.apply_updates(params, u), state, vocab

  return stack, tx, params, vocab, step


def _raw(i):
  rng = np.random.RandomState(i)
  return {
    "fh": jnp.asarray(rng.randint(0, 40, size=4), jnp.int32),
    "fn": jnp.asarray(rng.randint(0, 6, size=4), jnp.int32),
    "fg": jnp.asarray(rng.randint(0, 40, size=4), jnp.int32),
  }


def _changed(before, now):
  """Rows of ``now`` whose bits differ from ``before`` (numpy)."""
  a = np.asarray(before).reshape(np.shape(before)[0], -1)
  b = np.asarray(now).reshape(np.shape(now)[0], -1)
  return set(np.nonzero((a.view(np.uint8) != b.view(np.uint8)).any(1))[0])


# ----------------------------------------------------------------------------
# a hashed stack published without its map


def test_a_hashed_stack_without_its_map_is_refused_with_the_fix():
  stack, tx, params, vocab, step = _hashed_setup()
  step = jax.jit(step)
  state = jax.jit(tx.init)(params)
  # before any row was given out, nothing is lost: a plain delta works
  assert gtx.delta(params, state).maps is None
  start = jax.tree.map(np.array, params)
  for i in range(3):
    params, state, vocab = step(params, state, vocab, _raw(i))
  hashed = sorted(stack.maps)
  assert len(hashed) == 2
  # the rows the map gave out changed in the params; the record alone misses
  # some of them, so a delta without the map would lose rows, not only owners
  with pytest.raises(ValueError, match="vocab=vocab") as e:
    gtx.delta(params, state)
  for name in hashed:
    assert repr(name) in str(e.value)
  assert "skip_hashed=True" in str(e.value)
  # one stack's map is not enough
  with pytest.raises(ValueError, match="no map for"):
    gtx.delta(params, state, stack=stack, vocab={hashed[0]: vocab[hashed[0]]})
  with pytest.raises(ValueError, match="one of the two"):
    gtx.delta(params, state, stack=stack, vocab=vocab, skip_hashed=True)
  with pytest.raises(TypeError, match="skip_hashed"):
    gtx.delta(params, state, skip_hashed="yes")
  # the opt-out publishes the rest, exactly, and no hashed leaf
  d = gtx.delta(params, state, skip_hashed=True)
  assert d.maps is None
  for name in hashed:
    assert d.params[name] is None
  np.testing.assert_array_equal(d.params["w"], params["w"])
  plain = sorted(set(params) - set(hashed) - {"w"})
  for name in plain:
    got = set() if d.params[name] is None else set(d.params[name]["ids"])
    assert got == _changed(start[name], params[name])
  # with the map, every changed row of every stack is there
  d = gtx.delta(params, state, stack=stack, vocab=vocab)
  for name in hashed:
    changed = _changed(start[name], params[name])
    assert changed and changed <= set(d.params[name]["ids"])


def test_the_mark_of_a_hashed_stack_survives_a_checkpoint_round_trip():
  stack, tx, params, vocab, step = _hashed_setup()
  state = jax.jit(tx.init)(params)
  params, state, vocab = jax.jit(step)(params, state, vocab, _raw(0))
  back = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), state)
  with pytest.raises(ValueError, match="vocab=vocab"):
    gtx.delta(params, back)


def test_a_since_vocab_freed_by_donation_is_named_with_the_fix():
  stack, tx, params, vocab, step = _hashed_setup()
  step = jax.jit(step, donate_argnums=(0, 1, 2))
  state = jax.jit(tx.init)(params)
  params, state, vocab = step(params, state, vocab, _raw(0))
  d = gtx.delta(params, state, stack=stack, vocab=vocab)
  last, kept, copied = d.step, vocab, jax.tree.map(jnp.copy, vocab)
  params, state, vocab = step(params, state, vocab, _raw(1))
  assert any(x.is_deleted() for x in jax.tree.leaves(kept))
  with pytest.raises(ValueError, match="since_vocab") as e:
    gtx.delta(
      params, state, since=last, stack=stack, vocab=vocab, since_vocab=kept
    )
  assert "jax.tree.map(jnp.copy, vocab)" in str(e.value)
  with pytest.raises(ValueError, match="`vocab` holds arrays that were"):
    gtx.delta(params, state, since=last, stack=stack, vocab=kept)
  # the copy kept beside `last` works
  gtx.delta(
    params, state, since=last, stack=stack, vocab=vocab, since_vocab=copied
  )


# ----------------------------------------------------------------------------
# a non-finite batch


def _loss(p, ids, x):
  return jnp.mean(jnp.tanh(p["emb"][ids] @ p["w"]) * x)


def _batch(i, bad=False):
  rng = np.random.RandomState(10 + i)
  ids = jnp.asarray(rng.randint(0, 20, size=6), jnp.int32)
  x = rng.normal(size=6).astype(np.float32)
  if bad:
    x[2] = np.nan  # one example's dense feature
  return ids, jnp.asarray(x)


@pytest.mark.parametrize(
  "opt",
  [lambda: gtx.lazy_adam(0.05), lambda: gtx.rowwise_adagrad(0.1)],
  ids=["lazy_adam", "rowwise_adagrad"],
)
def test_apply_if_finite_skips_a_non_finite_step_and_delta_ships_nothing(opt):
  params = {
    "emb": jnp.asarray(np.random.RandomState(0).normal(size=(20, 4))),
    "w": jnp.ones(4),
  }
  params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  guarded = optax.apply_if_finite(optax.chain(opt(), gtx.track_changes()), 5)
  plain = optax.chain(opt(), gtx.track_changes())

  def make_step(tx):
    @jax.jit
    def step(params, state, ids, x):
      g = gtx.sparse_grad(_loss)(params, ids, x)
      u, state = tx.update(g, state, params)
      return gtx.apply_updates(params, u), state

    return step

  step, ref_step = make_step(guarded), make_step(plain)
  p, s = params, guarded.init(params)
  q, r = params, plain.init(params)  # the reference never sees the bad batch
  serving = jax.tree.map(np.asarray, params)
  p, s = step(p, s, *_batch(0))
  q, r = ref_step(q, r, *_batch(0))
  d = gtx.delta(p, s)
  serving = gtx.apply_delta(serving, d)
  g = gtx.sparse_grad(_loss)(p, *_batch(1, bad=True))
  assert not np.isfinite(np.asarray(g["w"])).all()  # the step is non-finite
  before = jax.tree.map(np.array, (p, s.inner_state))
  p, s = step(p, s, *_batch(1, bad=True))
  assert int(s.notfinite_count) == 1
  # the whole step skipped: params, optimizer state and record as before
  for x, y in zip(
    jax.tree.leaves((p, s.inner_state)), jax.tree.leaves(before), strict=True
  ):
    np.testing.assert_array_equal(x, y)
  nothing = gtx.delta(p, s, since=d.step)
  assert nothing.step == d.step
  assert all(v is None for v in nothing.params.values())
  # the next finite step trains and publishes as if the bad batch never came
  p, s = step(p, s, *_batch(2))
  q, r = ref_step(q, r, *_batch(2))
  d2 = gtx.delta(p, s, since=d.step)
  want = gtx.delta(q, r, since=d.step)
  # the same rows; values equal up to rounding (another XLA program)
  assert jax.tree.structure(d2) == jax.tree.structure(want)
  np.testing.assert_array_equal(d2.step, want.step)
  np.testing.assert_array_equal(
    d2.params["emb"]["ids"], want.params["emb"]["ids"]
  )
  for x, y in zip(jax.tree.leaves(d2), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-6)
  serving = gtx.apply_delta(serving, d2)
  for k in params:
    np.testing.assert_array_equal(serving[k], p[k])
    assert np.isfinite(serving[k]).all()


def test_delta_refuses_non_finite_rows_apply_if_finite_let_through():
  params = {"emb": jnp.zeros((20, 4)), "w": jnp.ones(4)}
  # after max_consecutive_errors non-finite steps in a row, optax applies one
  tx = optax.apply_if_finite(
    optax.chain(gtx.lazy_sgd(0.1), gtx.track_changes()), 0
  )
  state = tx.init(params)
  g = gtx.sparse_grad(_loss)(params, *_batch(1, bad=True))
  u, state = tx.update(g, state, params)
  params = gtx.apply_updates(params, u)
  assert not np.isfinite(np.asarray(params["w"])).all()
  with pytest.raises(ValueError, match=r"params\[.w.\].*apply_if_finite"):
    gtx.delta(params, state)


def test_apply_if_finite_in_a_hashed_step_keeps_the_map_and_ships_no_update():
  guarded = optax.apply_if_finite(
    optax.chain(gtx.lazy_adam(0.1), gtx.track_changes()), 5
  )
  stack, tx, params, vocab, step = _hashed_setup(guarded)
  *_, skip = _hashed_setup(guarded, update=False)  # admit and reset only

  @jax.jit  # the step and its reference in one program, compiled once
  def both(params, state, vocab, raw, x):
    return step(params, state, vocab, raw, x), skip(params, state, vocab, raw)

  state = jax.jit(tx.init)(params)
  params, state, vocab = both(params, state, vocab, _raw(0), jnp.ones(4))[0]
  d = gtx.delta(params, state, stack=stack, vocab=vocab)
  last_vocab = jax.tree.map(jnp.copy, vocab)
  before = jax.tree.map(np.array, params)
  x = jnp.array([1.0, np.nan, 1.0, 1.0])
  got, want = both(params, state, vocab, _raw(1), x)
  assert int(got[1].notfinite_count) == 1
  # the ids of the batch keep their rows; no update was applied
  for a, b in zip(
    jax.tree.leaves((got[0], got[1].inner_state, got[2])),
    jax.tree.leaves((want[0], want[1].inner_state, want[2])),
    strict=True,
  ):
    np.testing.assert_array_equal(a, b)
  params, state, vocab = got
  d2 = gtx.delta(
    params,
    state,
    since=d.step,
    stack=stack,
    vocab=vocab,
    since_vocab=last_vocab,
  )
  assert int(d2.step) == int(d.step)
  assert d2.params["w"] is None
  for name in stack.maps:
    rows = d2.params[name]
    # only the rows the map gave out: fresh, finite values
    assert _changed(before[name], params[name]) == set(rows["ids"])
    assert np.isfinite(rows["values"]).all()
    assert (d2.maps[name]["owners"] >= 0).all()
