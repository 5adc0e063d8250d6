"""Hashed tables (open vocabularies): the id map against a numpy reference,
fresh rows in the table and every optimizer state against numpy references
of the optimizers, read-only lookups, checkpoints, 8 devices."""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import references_lazy_adam as ref_adam
import references_optimizers as ref_opt
import references_partial_rowwise_adam as ref_pra
from references_vocab import NumpyMap, Table

import gradtx as gtx

B = 6
STEPS = 10

MAP_TABLES = {
  "a": gtx.TableSpec(12, 4, hashed=gtx.Hashed(probes=3)),
  "b": gtx.TableSpec(10, 4, hashed=gtx.Hashed(policy="lfu", ttl=2, probes=4)),
  "c": gtx.TableSpec(
    9,
    4,
    hashed=gtx.Hashed(min_count=2, admit_probability=0.7, seed=5),
  ),
  "d": gtx.TableSpec(7, 4),
}
MAP_FEATURES = {"a1": "a", "a2": "a", "b1": "b", "c1": "c", "d1": "d"}


def _raw_batch(rng):
  """Raw ids: int32 (large, negative = padding), bags with weights, 64-bit
  words in a jagged feature, a plain feature."""
  lengths = rng.randint(0, 4, B).astype(np.int32)
  b_ids = rng.randint(0, 25, 14).astype(np.int64) * 3_000_000_019
  return {
    "a1": (rng.randint(-2, 30, B) * 1_000_003).astype(np.int32),
    "a2": rng.randint(-1, 30, (B, 3)).astype(np.int32),
    "b1": gtx.Jagged(
      gtx.Words((b_ids >> 32).astype(np.uint32), b_ids.astype(np.uint32)),
      lengths,
    ),
    "c1": rng.randint(0, 12, B).astype(np.int32),
    "d1": rng.randint(0, 7, B).astype(np.int32),
  }, {"a2": (rng.rand(B, 3) > 0.3).astype(np.float32)}


def _reference_slots(ids, weights):
  """The stack's hashed slots in admit's order: (table index, raw, valid)."""
  lengths = ids["b1"].lengths
  b = ids["b1"].ids
  b_raw = (b.hi.astype(np.int64) << 32) | b.lo.astype(np.int64)
  slots = [(0, int(x), x >= 0) for x in ids["a1"]]
  slots += [
    (0, int(x), x >= 0 and w != 0)
    for x, w in zip(ids["a2"].ravel(), weights["a2"].ravel(), strict=True)
  ]
  slots += [(1, int(x), k < lengths.sum()) for k, x in enumerate(b_raw)]
  slots += [(2, int(x), True) for x in ids["c1"]]
  return slots


def test_the_map_follows_its_numpy_reference():
  """A stack of one row shard and one of three (each shard padded): their
  admits in one program a setting (the kernels they share compile once),
  each with its own map and reference; a failure names its case."""
  cases, vocabs = {}, {}
  for shards in (1, 3):
    stack = gtx.TableStack(MAP_TABLES, features=MAP_FEATURES, shards=shards)
    (layout,) = stack.maps.values()
    ref = NumpyMap(
      [
        Table("a", 0, 12, probes=3),
        Table("b", 12, 10, policy="lfu", ttl=2, probes=4),
        Table("c", 22, 9, min_count=2, admit_probability=0.7, seed=5),
      ],
      layout.size,
      shards,
    )
    cases[shards] = (stack, layout, ref)
    vocabs[shards] = stack.init_vocab(jax.random.key(0))
  # a bound below the new ids some steps (one for every table, or one per
  # table, the others at the default), the default (1/8) others
  settings = [
    {"max_new_fraction": 0.125},
    {"max_new": 5},
    {"max_new": {"a": 3, "c": 2}},
  ]
  admits = [
    jax.jit(
      lambda vs, i, w, m=m: {
        k: cases[k][0].admit(v, i, weights=w, **m) for k, v in vs.items()
      }
    )
    for m in settings
  ]
  per_table = [4 * B, 14, B]  # each hashed table's id slots
  bounds = [
    per_table,  # under 64 slots: all
    [5, 5, 5],
    [3, per_table[1], 2],
  ]
  rng = np.random.RandomState(0)
  sizes = [B, 3 * B, 14, B]
  saw_eviction = dict.fromkeys(cases, False)
  saw_rejection = dict.fromkeys(cases, False)
  for i in range(STEPS):
    ids, weights = _raw_batch(rng)
    out = admits[i % 3](vocabs, ids, weights)
    bound = bounds[i % 3]
    for shards, (_, layout, ref) in cases.items():
      at = f"shards={shards} step {i}"
      got, vocab, fresh = out[shards]
      vocabs[shards] = vocab
      (name,) = vocab
      slots = _reference_slots(ids, weights)
      rows, fresh_ref, stats = ref.step_ids(slots, bound)
      parts = np.split(np.asarray(rows), np.cumsum(sizes)[:-1])
      eq = functools.partial(np.testing.assert_array_equal, err_msg=at)
      eq(got["a1"], parts[0])
      eq(got["a2"], parts[1].reshape(B, 3))
      eq(got["b1"].ids, parts[2])
      eq(got["b1"].lengths, ids["b1"].lengths)
      eq(got["c1"], parts[3])
      eq(got["d1"], ids["d1"])  # not hashed
      want_fresh = [layout.size if r is None else r for r in fresh_ref]
      eq(fresh[name].rows, want_fresh)
      s = jax.tree.map(np.asarray, vocab[name])
      eq(s.last_seen, ref.last)
      eq(s.count, ref.count)
      live = np.asarray(ref.last) >= 0
      eq(s.born[live], np.asarray(ref.born)[live])
      keys = np.stack([s.key_hi, s.key_lo], 1)[live]
      eq(keys, np.asarray(ref.key)[live])
      eq(np.stack([s.inserted, s.evicted, s.rejected], 1), stats)
      eq(s.live, ref.live)
      eq(s.starved, ref.starved)
      assert (s.claim == 2**31 - 1).all(), at
      saw_eviction[shards] |= bool(s.evicted.any())
      saw_rejection[shards] |= bool(s.rejected.any())
      # no two live ids of a table share a row: one key per live row
      for t, off, n in zip(
        layout.tables, layout.offsets, layout.rows, strict=True
      ):
        rows_t = layout.physical(np.arange(off, off + n))
        k = [
          tuple(x)
          for x in np.stack([s.key_hi, s.key_lo], 1)[rows_t][live[rows_t]]
        ]
        assert len(set(k)) == len(k), (t, at)
  for shards, (stack, _, ref) in cases.items():
    at = f"shards={shards}"
    assert saw_eviction[shards] and saw_rejection[shards], at
    st = stack.vocab_stats(vocabs[shards])
    assert set(st) == {"a", "b", "c"}, at
    live_a = int(st["a"]["live"])
    assert live_a == ref.live[0], at
    assert int(st["c"]["starved"]) == ref.starved[2], at
    assert int(st["a"]["age_buckets"].sum()) == live_a, at
    assert int(st["a"]["count_buckets"].sum()) == live_a, at
    np.testing.assert_allclose(st["a"]["occupancy"], live_a / 12, err_msg=at)


# ----------------------------------------------------------------------------
# fresh rows in the params and every optimizer state

H = gtx.TableSpec(
  8, 3, hashed=gtx.Hashed(probes=4), initializer=jax.nn.initializers.zeros
)
NUMPY_CASES = {
  "lazy_adam": (
    gtx.lazy_adam(0.1),
    lambda p: ref_adam.LazyAdam(p, lambda t: 0.1),
  ),
  "lazy_adam_catch_up": (
    gtx.lazy_adam(0.1, catch_up=True),
    lambda p: ref_adam.LazyAdam(p, lambda t: 0.1, catch_up=True),
  ),
  "adagrad": (gtx.adagrad(0.1), lambda p: ref_opt.Adagrad(p, lambda c: 0.1)),
  "rowwise_adagrad": (
    gtx.rowwise_adagrad(0.1),
    lambda p: ref_opt.RowwiseAdagrad(p, lambda c: 0.1),
  ),
  "lazy_sgd_momentum": (
    gtx.lazy_sgd(0.1, momentum=0.9),
    lambda p: ref_opt.LazyMomentumSGD(p, lambda c: 0.1, momentum=0.9),
  ),
  "ftrl": (gtx.ftrl(0.1), lambda p: ref_opt.Ftrl(p, lambda c: 0.1)),
  "partial_rowwise_adam": (
    gtx.partial_rowwise_adam(0.1),
    lambda p: ref_pra.PartialRowwiseAdam(p, lambda c: 0.1),
  ),
}
# against the same transformation on a table with a row for every id ever
# placed (each placement its own row): 8-bit state and the wrappers
GTX_CASES = {
  "lazy_adam_int8": gtx.lazy_adam(0.1, mu_dtype="int8", nu_dtype="int8"),
  "adagrad_int8": gtx.adagrad(0.1, accumulator_dtype="int8"),
  "accumulate": gtx.accumulate(
    gtx.lazy_adam(0.1), 2, rows_per_step={"float32x3": 3 * B}
  ),
  "drop_stale_accumulate": gtx.drop_stale(
    gtx.accumulate(
      gtx.rowwise_adagrad(0.1), 3, rows_per_step={"float32x3": 3 * B}
    ),
    4,
  ),
}


def _one_and_bag(rng):
  """Raw ids of 40 values for the "one" and "bag" features, the bag's
  weights and the loss's coefficients."""
  ids = {
    "one": rng.randint(0, 40, B).astype(np.int32),
    "bag": rng.randint(-1, 40, (B, 2)).astype(np.int32),
  }
  weights = {"bag": rng.rand(B, 2).astype(np.float32)}
  return ids, weights, rng.randn(2, B, 3).astype(np.float32)


def _loss(stack, params, ids, weights, coef):
  """Linear in the rows, so each id's gradient does not depend on them."""
  emb = stack.lookup(params, ids, weights=weights)
  return jnp.sum(emb["one"] * coef[0]) + jnp.sum(emb["bag"] * coef[1])


def test_a_row_given_to_a_new_id_is_fresh_in_every_optimizer_state():
  stack = gtx.TableStack({"h": H}, features={"one": "h", "bag": "h"})
  (name,) = stack.stacks
  opts = {k: tx for k, (tx, _) in NUMPY_CASES.items()} | GTX_CASES
  # the references: one row per placement (an id evicted and placed again
  # is a new row), the gradient computed in numpy
  cap = STEPS * 3 * B

  params0 = stack.init(jax.random.key(1))  # its own program, shared

  @jax.jit
  def init(params0):  # one program, not hundreds of eager ops
    vocab = stack.init_vocab(jax.random.key(2))
    states = {k: (params0, tx.init(params0)) for k, tx in opts.items()}
    zeros = {name: jnp.zeros((cap, 3))}
    return (
      states,
      vocab,
      {k: (zeros, tx.init(zeros)) for k, tx in GTX_CASES.items()},
    )

  states, vocab, gtx_refs = init(params0)

  @jax.jit  # the stack's steps and the references' in one program
  def step(states, gtx_refs, vocab, ids, weights, coef, i, ref_grad):
    ids, vocab, fresh = stack.admit(
      vocab, ids, weights=weights, max_new_fraction=1.0
    )
    out = {}
    for k, tx in opts.items():
      p, s = states[k]
      p, s = gtx.reset_rows(tx, s, p, fresh)
      g = gtx.sparse_grad(lambda p: _loss(stack, p, ids, weights, coef))(p)
      u, s = tx.update(g, s, p, grad_step=i)
      out[k] = (gtx.apply_updates(p, u), s)
    refs = {
      k: _ref_update(tx, gtx_refs[k], ref_grad, i)
      for k, tx in GTX_CASES.items()
    }
    return out, refs, vocab, ids

  zeros = {name: np.zeros((cap, 3))}
  refs = {k: make(zeros) for k, (_, make) in NUMPY_CASES.items()}
  ref_map = NumpyMap([Table("h", 0, 8, probes=4)], 8)
  placement = {}  # row -> its placement's reference row
  rng = np.random.RandomState(3)
  evictions = 0
  for i in range(STEPS):
    ids, weights, coef = _one_and_bag(rng)
    slots = [(0, int(x), x >= 0) for x in ids["one"]]
    slots += [
      (0, int(x), x >= 0 and w != 0)
      for x, w in zip(ids["bag"].ravel(), weights["bag"].ravel(), strict=True)
    ]
    rows, fresh, _ = ref_map.step_ids(slots, len(slots))
    evictions += sum(r in placement for r in fresh if r is not None)
    placement = _renumbered(placement, fresh)
    # each slot's gradient row, at its placement's reference row
    g_rows = [coef[0, b] for b in range(B)]
    g_rows += [
      weights["bag"][b, j] * coef[1, b] for b in range(B) for j in range(2)
    ]
    idx = [placement[r] if r >= 0 else cap for r in rows]
    states, gtx_refs, vocab, got = step(
      states,
      gtx_refs,
      vocab,
      ids,
      weights,
      coef,
      jnp.asarray(i, jnp.int32),
      gtx.SparseRows(jnp.asarray(idx, jnp.int32), jnp.asarray(g_rows), cap),
    )
    np.testing.assert_array_equal(got["one"], rows[:B])
    np.testing.assert_array_equal(got["bag"].ravel(), rows[B:])
    grad = (np.asarray(idx), np.asarray(g_rows, np.float64), cap)
    for ref in refs.values():
      ref.step({name: grad})
    live = [r for r in range(8) if ref_map.last[r] >= 0]
    at = [placement[r] for r in live]
    for k, ref in refs.items():
      np.testing.assert_allclose(
        np.asarray(states[k][0][name])[live],
        ref.p[name][at],
        rtol=2e-4,
        atol=2e-5,
        err_msg=f"{k} at step {i}",
      )
    for k in GTX_CASES:
      np.testing.assert_allclose(
        np.asarray(states[k][0][name])[live],
        np.asarray(gtx_refs[k][0][name])[at],
        rtol=1e-5,
        atol=1e-6,
        err_msg=f"{k} at step {i}",
      )
  assert evictions > 10


def _renumbered(placement, fresh):
  """Gives every row placed this step the next reference row."""
  out = {r: v for r, v in placement.items() if r not in set(fresh)}
  nxt = max(list(placement.values()) + [-1]) + 1
  for r in fresh:
    if r is not None and r not in out:
      out[r] = nxt
      nxt += 1
  return out


def _ref_update(tx, ps, g, i):
  p, s = ps
  (name,) = p
  u, s = tx.update({name: g}, s, p, grad_step=i)
  return gtx.apply_updates(p, u), s


def _threefry2x32(key, x):
  """Threefry-2x32-20 (Salmon et al. 2011, Random123's threefry2x32_20) in
  numpy, for the fresh rows' draw."""
  rot = ((13, 15, 26, 6), (17, 29, 16, 24))
  m = np.uint64(0xFFFFFFFF)
  k0, k1 = (np.asarray(k, np.uint64) for k in key)
  ks = (k0, k1, k0 ^ k1 ^ np.uint64(0x1BD11BDA))
  x0 = (np.asarray(x[0], np.uint64) + ks[0]) & m
  x1 = (np.asarray(x[1], np.uint64) + ks[1]) & m
  for i in range(20):
    r = np.uint64(rot[(i // 4) % 2][i % 4])
    x0 = (x0 + x1) & m
    x1 = ((x1 << r) | (x1 >> (np.uint64(32) - r))) & m
    x1 = x1 ^ x0
    if i % 4 == 3:
      j = i // 4 + 1
      x0 = (x0 + ks[j % 3]) & m
      x1 = (x1 + ks[(j + 1) % 3] + np.uint64(j)) & m
  return x0.astype(np.uint32), x1.astype(np.uint32)


def _fresh_normal(rng, step, rows, dim):
  """The documented draw of a fresh row's default values: element (k, j)
  from word j % 2 of Threefry(step key, (rows[k], j // 2)), the step key
  Threefry(rng, (step, 0)), as a uniform in (-1, 1) through
  sqrt(2) * erfinv."""
  from scipy.special import erfinv

  sk = _threefry2x32((rng[0], rng[1]), (np.uint32(step), np.uint32(0)))
  rows = np.asarray(rows, np.uint32)[:, None]
  blocks = np.arange((dim + 1) // 2, dtype=np.uint32)[None, :]
  w0, w1 = _threefry2x32(sk, np.broadcast_arrays(rows, blocks))
  bits = np.stack([w0, w1], -1).reshape(len(rows), -1)[:, :dim]
  one = ((bits >> np.uint32(9)) | np.uint32(0x3F800000)).view(np.float32)
  low = np.nextafter(np.float32(-1), np.float32(1))
  u = np.maximum(low, (one - np.float32(1)) * (np.float32(1) - low) + low)
  return np.sqrt(2.0) * erfinv(u.astype(np.float64))


def test_threefry_matches_the_published_test_vectors():
  """Random123's known answers for threefry2x32_20, for the numpy
  reference and the unrolled cipher of the fresh rows."""
  from gradtx._fresh_rows import threefry2x32

  u = np.uint32
  for key, x, want in [
    ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
    ((2**32 - 1,) * 2, (2**32 - 1,) * 2, (0x1CB996FC, 0xBB002BE7)),
    (
      (0x13198A2E, 0x03707344),
      (0x243F6A88, 0x85A308D3),
      (0xC4923A9C, 0x483DF7A0),
    ),
  ]:
    key, x = tuple(map(u, key)), tuple(map(u, x))
    assert tuple(map(int, _threefry2x32(key, x))) == want
    assert tuple(map(int, threefry2x32(key, x))) == want


def test_fresh_rows_of_the_default_initializer_are_a_counter_hash():
  """The default fresh values: the documented counter-based draw (numpy
  reference), normal with standard deviation 1 / sqrt(dim) (a KS test),
  a row's values a function of (key, step, row) alone, and no loop and
  no call of JAX's PRNG in admit's program."""
  from scipy import stats

  from gradtx._fresh_rows import fresh_normal

  rng = np.array([7, 2**31 + 5], np.uint32)
  rows = np.arange(0, 4000, 3, dtype=np.int32)
  draw = jax.jit(fresh_normal, static_argnums=3)
  got = np.asarray(draw(rng, jnp.int32(9), rows, 5))
  # float32 erf_inv is a few ulps off float64's erfinv in the tails
  np.testing.assert_allclose(got, _fresh_normal(rng, 9, rows, 5), rtol=2e-5)
  assert stats.kstest(got.ravel(), "norm").pvalue > 0.01
  # a row's values do not depend on the other rows drawn with it; a new
  # step gives new ones
  one = np.asarray(draw(rng, jnp.int32(9), rows[5:6], 5))
  np.testing.assert_array_equal(one[0], got[5])
  assert not np.isclose(
    np.asarray(draw(rng, jnp.int32(10), rows, 5)), got
  ).any()
  stack = gtx.TableStack({"h": gtx.TableSpec(64, 6, hashed=gtx.Hashed())})
  (name,) = stack.stacks
  vocab = stack.init_vocab(jax.random.key(3))
  admit = jax.jit(lambda v, x: stack.admit(v, {"h": x}))
  ids = jnp.arange(10, 42, dtype=jnp.int32)
  text = admit.lower(vocab, ids).as_text()
  assert "threefry" not in text
  assert (
    "while"
    not in jax.jit(fresh_normal, static_argnums=3)
    .lower(rng, jnp.int32(0), rows, 6)
    .as_text()
  )
  _, _, fresh = admit(vocab, ids)
  want = _fresh_normal(np.asarray(vocab[name].rng), 0, fresh[name].rows, 6)
  np.testing.assert_allclose(
    fresh[name].values, want / np.sqrt(6), rtol=1e-6, atol=1e-7
  )


def test_fresh_rows_take_the_initializer_and_lookup_reads_read_only():
  stack = gtx.TableStack(
    {
      "h": gtx.TableSpec(4, 2, hashed=gtx.Hashed(probes=4)),
      "p": gtx.TableSpec(5, 2),
    },
    features={"h": "h", "p": "p"},
  )
  (name,) = stack.stacks
  params = stack.init(jax.random.key(0))
  vocab = jax.jit(stack.init_vocab)(jax.random.key(5))
  ids = {"h": np.array([7, 8, 9, 7, 10, 11], np.int32)}
  admit = jax.jit(stack.admit)  # one program, not hundreds of eager ops
  got, vocab2, fresh = admit(vocab, ids)
  got = jax.tree.map(np.asarray, got)  # numpy: indexing it compiles nothing
  # five distinct ids for four rows: one turned away, the others placed
  assert sorted(got["h"][[0, 1, 2, 4, 5]].tolist()).count(-1) == 1
  np.testing.assert_array_equal(got["h"][0], got["h"][3])

  rows = np.asarray(fresh[name].rows)
  want = _fresh_normal(np.asarray(vocab[name].rng), 0, rows, 2) / np.sqrt(2)
  new, _ = jax.jit(gtx.reset_rows, static_argnums=0)(None, None, params, fresh)
  table = np.asarray(new[name])  # numpy: indexing it compiles nothing
  for k, r in enumerate(rows):
    if r < 4:
      np.testing.assert_allclose(table[r], want[k], rtol=1e-6)
  # read-only: known ids read their rows, unknown ones zeros; nothing placed
  emb = stack.lookup(new, {"h": np.array([8, 99], np.int32)}, vocab=vocab2)
  emb = jax.tree.map(np.asarray, emb)
  row8 = int(got["h"][1])
  np.testing.assert_array_equal(emb["h"][0], table[row8])
  np.testing.assert_array_equal(emb["h"][1], np.zeros(2))


# ids 2**40 + 1 and 2**40 + 2**32 + 1 share their low word; 2**45 and
# 2**63 + 5 have a low word whose top bit is clear but their own top bits
# set; the last, past the int32 range, reads as a negative int32 if cut
BIG = [2**40 + 1, 2**40 + 2**32 + 1, 2**45, 2**63 + 5, 2**64 - 1, 2**40 + 2**31]


@pytest.mark.parametrize("x64", [False, True])
def test_64_bit_ids_are_ids_whichever_way_they_come(x64):
  """numpy int64 / uint64 (split on the host with x64 off), jax int64 /
  uint64 under x64, and gtx.Words (jitted) all give the numpy reference's
  rows: every value of an unsigned type is an id, a negative signed one is
  padding."""
  stack = gtx.TableStack(
    {"h": gtx.TableSpec(16, 2, hashed=gtx.Hashed(probes=16))}
  )
  vocab = jax.jit(stack.init_vocab)(jax.random.key(0))
  unsigned = np.array(BIG, np.uint64)
  signed = np.array([2**40 + 1, -1, 2**40 + 2**32 + 1, 2**50, -(2**40)])
  ref = NumpyMap([Table("h", 0, 16, probes=16)], 16)
  want_u, _, _ = ref.step_ids([(0, int(x), True) for x in BIG], len(BIG))
  want_s, _, _ = ref.step_ids([(0, int(x), x >= 0) for x in signed], 5)
  assert len(set(want_u)) == len(BIG) and min(want_u) >= 0
  admit = jax.jit(stack.admit)
  with jax.enable_x64(x64):
    got_u, v1, _ = stack.admit(vocab, {"h": unsigned})  # eager, numpy
    got_s, v2, _ = stack.admit(v1, {"h": signed})
    np.testing.assert_array_equal(got_u["h"], want_u)
    np.testing.assert_array_equal(got_s["h"], want_s)
    stats = jax.jit(stack.vocab_stats)(v2)
    assert int(stats["h"]["live"]) == len(BIG) + 1  # 2**50
    # jitted: gtx.Words split on the host, or 64-bit arrays under x64
    feed = (lambda x: jnp.asarray(x)) if x64 else gtx.Words.of
    got_u, v1, _ = admit(vocab, {"h": feed(unsigned)})
    np.testing.assert_array_equal(got_u["h"], want_u)
    if x64:
      got_s, _, _ = admit(v1, {"h": jnp.asarray(signed)})
      np.testing.assert_array_equal(got_s["h"], want_s)
  # read-only lookups see the same ids
  params = stack.init(jax.random.key(1))
  emb = stack.lookup(params, {"h": unsigned}, vocab=v2)
  (name,) = params
  np.testing.assert_array_equal(emb["h"], np.asarray(params[name])[want_u])


def test_64_bit_ids_are_never_truncated():
  """A traced 64-bit id with x64 off cannot be split: refused, naming
  gtx.Words and jax_enable_x64; Words.of refuses negative ids."""
  stack = gtx.TableStack({"h": gtx.TableSpec(4, 2, hashed=gtx.Hashed())})
  vocab = stack.init_vocab(jax.random.key(0))

  def narrowed(x):
    with jax.enable_x64(False):
      return stack.admit(vocab, {"h": x})[0]

  with jax.enable_x64(True):
    with pytest.raises(TypeError, match="gradtx.Words.*jax_enable_x64"):
      jax.jit(narrowed)(np.array([2**40], np.int64))
  with pytest.raises(ValueError, match="weight 0"):
    gtx.Words.of(np.array([3, -1], np.int64))


def test_the_map_survives_an_orbax_round_trip_bit_for_bit(tmp_path):
  import checkpoint_worker

  stack = gtx.TableStack(MAP_TABLES, features=MAP_FEATURES)
  vocab = stack.init_vocab(jax.random.key(0))
  rng = np.random.RandomState(1)
  admit = jax.jit(stack.admit)
  for _ in range(3):
    ids, weights = _raw_batch(rng)
    _, vocab, _ = admit(vocab, ids, weights=weights)
  # and a stack of default settings (no admission sketch)
  plain = gtx.TableStack({"u": gtx.TableSpec(6, 2, hashed=gtx.Hashed())})
  vocab = {"map": vocab, "plain": plain.init_vocab(jax.random.key(3))}
  checkpoint_worker.save_orbax(tmp_path / "vocab", vocab)
  got = checkpoint_worker.restore_orbax(
    tmp_path / "vocab", jax.tree.map(jnp.zeros_like, vocab)
  )
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(vocab), strict=True):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


@functools.cache
def _row_sharded():
  """The row-sharded stack, lazy_adam, its jitted step (donating) and its
  initial map (a fresh copy each call)."""
  stack = gtx.TableStack(MAP_TABLES, features=MAP_FEATURES, shards=8)
  tx = gtx.lazy_adam(0.1)

  def step(params, state, vocab, ids, weights):
    ids, vocab, fresh = stack.admit(vocab, ids, weights=weights)
    params, state = gtx.reset_rows(tx, state, params, fresh)

    def loss(p):
      emb = stack.lookup(p, ids, weights=weights)
      return sum(jnp.sum(v) for v in emb.values())

    g = gtx.sparse_grad(loss)(params)
    u, state = tx.update(g, state, params)
    return gtx.apply_updates(params, u), state, vocab

  f = jax.jit(step, donate_argnums=(0, 1, 2))
  return stack, tx, f, jax.jit(lambda: stack.init_vocab(jax.random.key(1)))


def _row_sharded_run(params, vocab, init):
  _, _, f, _ = _row_sharded()
  state = init(params)
  rng = np.random.RandomState(4)
  for _ in range(3):
    ids, weights = _raw_batch(rng)
    params, state, vocab = f(params, state, vocab, ids, weights)
  return params, vocab


@functools.cache
def _row_sharded_one_device():
  """The 1-device run both kinds compare with (computed once)."""
  stack, tx, _, init_vocab = _row_sharded()
  params = stack.init(jax.random.key(0))
  return _row_sharded_run(params, init_vocab(), jax.jit(tx.init))


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_a_row_sharded_stack_with_its_map_on_8_devices_equals_one_device(kind):
  """Auto axes: the map split like the rows; Explicit: the params split,
  the map replicated (a split one is refused with the fix)."""
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  stack, tx, _, init_vocab = _row_sharded()
  axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
  mesh = jax.make_mesh((8,), ("d",), axis_types=(axis_type,))
  want = _row_sharded_one_device()
  rows = NamedSharding(mesh, P("d"))

  def split(tree):
    return jax.tree.map(
      lambda x: jax.device_put(x, rows) if x.ndim and x.shape[0] > 8 else x,
      tree,
    )

  params, vocab = stack.init(jax.random.key(0)), init_vocab()
  with jax.set_mesh(mesh):
    params = split(params)
    if kind == "explicit":
      with pytest.raises(ValueError, match="replicated"):
        _row_sharded_run(params, split(init_vocab()), tx.init)
      vocab = jax.device_put(vocab, NamedSharding(mesh, P()))
    else:
      vocab = split(vocab)
    got = _row_sharded_run(params, vocab, lambda p: gtx.sharded_init(tx, p))
  (name,) = got[0]
  assert got[0][name].sharding.spec[0] == "d"
  if kind == "auto":
    assert got[1][name].key_hi.sharding.spec[0] == "d"
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


def test_bad_input_names_the_argument():
  with pytest.raises(ValueError, match="policy"):
    gtx.Hashed(policy="fifo")
  with pytest.raises(ValueError, match="admit_probability"):
    gtx.Hashed(admit_probability=0)
  with pytest.raises(ValueError, match="ttl"):
    gtx.Hashed(ttl=-1)
  with pytest.raises(TypeError, match="hashed"):
    gtx.TableSpec(4, 2, hashed="lru")
  stack = gtx.TableStack(MAP_TABLES, features=MAP_FEATURES)
  with pytest.raises(ValueError, match="init_vocab"):
    stack.admit({}, {"a1": np.zeros(2, np.int32)})
  plain = gtx.TableStack({"d": gtx.TableSpec(3, 2)})
  with pytest.raises(ValueError, match="hashed"):
    plain.init_vocab(jax.random.key(0))
  params = stack.init(jax.random.key(0))
  w = gtx.Words(np.zeros(2, np.uint32), np.ones(2, np.uint32))
  with pytest.raises(TypeError, match="vocab="):
    stack.lookup(params, {"a1": w})
  with pytest.raises(TypeError, match="uint32"):
    stack.admit(
      stack.init_vocab(jax.random.key(0)),
      {"a1": gtx.Words(np.zeros(2, np.int32), np.ones(2, np.uint32))},
    )
  with pytest.raises(TypeError, match="float32"):
    stack.admit(stack.init_vocab(jax.random.key(0)), {"a1": np.zeros(2)})
  # the input forms' errors are lookup's, named for admit
  jag = gtx.Jagged(np.zeros(3, np.int32), np.ones(2, np.int32))
  for ids, weights, match in (
    ({"a1": jag}, {"a1": np.ones(3)}, "admit: feature 'a1' is Jagged"),
    (
      {"a1": np.zeros((2, 3), np.int32)},
      {"a1": np.ones((2, 2))},
      r"admit: `weights\['a1'\]` must have the ids' shape \(2, 3\)",
    ),
    ({"a1": np.zeros((2, 3, 1), np.int32)}, None, "admit: .* has ids of shape"),
    ({"a1": jag._replace(lengths=np.ones(2))}, None, "`lengths` of dtype"),
  ):
    with pytest.raises((ValueError, TypeError), match=match):
      stack.admit(stack.init_vocab(jax.random.key(0)), ids, weights=weights)
  for bad, match in (
    ({"max_new": 0}, "`max_new` must be an int"),
    ({"max_new": "4"}, "`max_new` must be an int"),
    ({"max_new": 1.5}, "`max_new_fraction` must be a float"),
    ({"max_new_fraction": 1.5}, "`max_new_fraction` must be a float"),
    ({"max_new_fraction": {"a": 0.0}}, "`max_new_fraction` must be"),
    ({"max_new": {"d": 4}}, "`max_new` names .* not hashed"),
    ({"max_new_fraction": {"d": 0.5}}, "`max_new_fraction` names"),
    ({"max_new": 4, "max_new_fraction": {"a": 0.5}}, "by both"),
  ):
    with pytest.raises(ValueError, match=match):
      stack.admit(
        stack.init_vocab(jax.random.key(0)),
        {"a1": np.zeros(2, np.int32)},
        **bad,
      )
  with pytest.raises(ValueError, match="prefix"):
    gtx.reset_rows(
      None,
      None,
      params,
      {"nope": None}
      | {"x": gtx.FreshRows(jnp.zeros(1, jnp.int32), jnp.zeros((1, 4)))},
    )


def _churn(orders):
  """Three steps of 512 user ids, all new, and 512 reads of 40 query ids,
  for a stack of each order of the features (their admits in one program
  a step, their stats in another: the kernels they share compile once):
  each order's steps' rows, stats and distinct query ids."""
  tables = {
    "user": gtx.TableSpec(1024, 2, hashed=gtx.Hashed()),
    "query": gtx.TableSpec(256, 2, hashed=gtx.Hashed()),
  }
  stacks = [
    gtx.TableStack(tables, features={f: f for f in order}) for order in orders
  ]
  vocabs = jax.jit(lambda k: [s.init_vocab(k) for s in stacks])(
    jax.random.key(0)
  )
  admit = jax.jit(
    lambda vs, raw: [s.admit(v, raw) for s, v in zip(stacks, vs, strict=True)]
  )
  stats = jax.jit(
    lambda vs: [s.vocab_stats(v) for s, v in zip(stacks, vs, strict=True)]
  )
  rng = np.random.RandomState(0)
  queries = rng.randint(0, 2**31 - 1, 40).astype(np.int32)
  out = [[] for _ in orders]
  for step in range(3):
    raw = {
      "user": (np.arange(512) + 512 * step).astype(np.int32),
      "query": queries[rng.randint(0, 40, 512)],
    }
    got = admit(vocabs, raw)
    vocabs = [vocab for _, vocab, _ in got]
    for o, (ids, _, _), st in zip(out, got, stats(vocabs), strict=True):
      o.append((ids, st, len(set(raw["query"]))))
  return out


def test_a_churning_table_does_not_starve_another():
  """Every user id is new each step, and the user feature comes first: the
  query table still places all of its ids in the first step, each table
  within its own bound, whatever the features' order."""
  first, other = _churn([["user", "query"], ["query", "user"]])
  for step, (_, st, _) in enumerate(first):
    # the user table's own bound: 1/8 of its 512 slots
    assert int(st["user"]["inserted"]) == 64
    assert int(st["user"]["live"]) == 64 * (step + 1)
    # the query table's: its first 64 new slots (duplicates included)
    assert int(st["query"]["inserted"]) > 0 or step > 0
    assert int(st["query"]["starved"]) == 0
  ids, st, distinct = first[-1]
  assert distinct == 40
  assert int(st["query"]["live"]) == 40
  assert int(st["query"]["rejected"]) == 0
  assert (np.asarray(ids["query"]) >= 0).all()
  # the same rows with the features in the other order
  for (a, _, _), (b, _, _) in zip(first, other, strict=True):
    np.testing.assert_array_equal(a["user"], b["user"])
    np.testing.assert_array_equal(a["query"], b["query"])


def test_vocab_stats_counts_the_steps_a_table_is_starved():
  """min_count=3 turns a new id away twice while the table has room: two
  starved steps, then the id gets its row and the count is back to 0."""
  stack = gtx.TableStack(
    {"q": gtx.TableSpec(8, 2, hashed=gtx.Hashed(min_count=3, probes=8))}
  )
  vocab = jax.jit(stack.init_vocab)(jax.random.key(0))
  stats = jax.jit(stack.vocab_stats)
  starved = []
  for _ in range(4):
    _, vocab, _ = stack.admit(vocab, {"q": np.array([5], np.int32)})
    starved.append(int(stats(vocab)["q"]["starved"]))
  assert starved == [1, 2, 0, 0]


def test_a_vocab_of_another_stack_or_state_of_another_optimizer_is_refused():
  """A map of 32 rows for a stack of 164 (admit, read-only lookup), and an
  optimizer state given with another optimizer: each error names the
  argument and the fix."""
  big = gtx.TableStack(
    {
      "u": gtx.TableSpec(100, 4, hashed=gtx.Hashed()),
      "q": gtx.TableSpec(64, 4, hashed=gtx.Hashed()),
    }
  )
  small = gtx.TableStack({"u": gtx.TableSpec(32, 4, hashed=gtx.Hashed())})
  other = small.init_vocab(jax.random.key(0))
  raw = {"u": np.array([7, 8], np.int32)}
  with pytest.raises(ValueError, match=r"`vocab\['float32x4'\]`.*init_vocab"):
    big.admit(other, raw)
  params = big.init(jax.random.key(0))
  with pytest.raises(ValueError, match=r"164 rows.*got a map of 32 rows"):
    big.lookup(params, raw, vocab=other)
  with pytest.raises(ValueError, match=r"`vocab\['float32x4'\]`"):
    jax.jit(big.admit)(
      {"float32x4": tuple(big.init_vocab(jax.random.key(0))["float32x4"])},
      raw,
    )
  # the same tables, another plan: each row shard padded
  sharded = gtx.TableStack(
    {
      "u": gtx.TableSpec(100, 4, hashed=gtx.Hashed()),
      "q": gtx.TableSpec(64, 4),
    },
    shards=3,
  )
  with pytest.raises(ValueError, match="init_vocab"):
    sharded.admit(big.init_vocab(jax.random.key(0)), raw)
  vocab = big.init_vocab(jax.random.key(0))
  ids, _, fresh = big.admit(vocab, raw)
  adam, adagrad = gtx.lazy_adam(0.1), gtx.adagrad(0.1)
  with pytest.raises(ValueError, match="`opt_state`.*`optimizer`"):
    gtx.reset_rows(adam, adagrad.init(params), params, fresh)
  with pytest.raises(ValueError, match="`opt_state`.*`optimizer`"):
    gtx.reset_rows(adam, adam.init({"x": jnp.zeros((3, 4))}), params, fresh)
  with pytest.raises(TypeError, match="`optimizer`"):
    gtx.reset_rows(None, adam.init(params), params, fresh)
  # the right pairs pass
  gtx.reset_rows(adam, adam.init(params), params, fresh)
  big.lookup(params, raw, vocab=vocab)


def _dp_batch(rng, n=16):
  """A data-parallel batch of raw ids: [n] ids, [n, 3] bags with weights,
  64-bit Words, plain ids, labels."""
  b = rng.randint(0, 25, n).astype(np.uint64) * np.uint64(3_000_000_019)
  raw = {
    "a1": (rng.randint(-2, 30, n) * 1_000_003).astype(np.int32),
    "a2": rng.randint(-1, 30, (n, 3)).astype(np.int32),
    "b1": gtx.Words.of(b),
    "c1": rng.randint(0, 12, n).astype(np.int32),
    "d1": rng.randint(0, 7, n).astype(np.int32),
  }
  weights = {"a2": (rng.rand(n, 3) > 0.3).astype(np.float32)}
  return raw, weights, (rng.rand(n) > 0.5).astype(np.float32)


@functools.cache
def _data_parallel():
  """The open-vocabularies guide's step (admit, reset_rows, the loss's
  sparse gradient, multi_transform), jitted, and its initial params,
  optimizer state and map."""
  import optax

  stack = gtx.TableStack(MAP_TABLES, features=MAP_FEATURES)
  tx = optax.multi_transform(
    {"sparse": gtx.lazy_adam(0.1), "dense": optax.adam(0.01)},
    {"emb": "sparse", "w": "dense"},
  )

  def loss(p, ids, weights, labels):
    emb = stack.lookup(p["emb"], ids, weights=weights)
    x = jnp.stack([emb[f] for f in MAP_FEATURES], 1)
    logit = jnp.sum(x * p["w"][None], axis=(1, 2))
    return jnp.mean(optax.sigmoid_binary_cross_entropy(logit, labels))

  @jax.jit
  def step(params, opt_state, vocab, raw, weights, labels):
    ids, vocab, fresh = stack.admit(vocab, raw, weights=weights)
    params, opt_state = gtx.reset_rows(tx, opt_state, params, {"emb": fresh})
    value, grads = gtx.sparse_value_and_grad(loss)(params, ids, weights, labels)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = gtx.apply_updates(params, updates)
    return params, opt_state, vocab, value, ids

  @jax.jit
  def init(emb):  # no step donates: each run starts from these
    params = {"emb": emb, "w": jnp.full((len(MAP_FEATURES), 4), 0.1)}
    return params, tx.init(params), stack.init_vocab(jax.random.key(1))

  return step, init(stack.init(jax.random.key(0)))


def _data_parallel_run(place=lambda x: x, replicate=lambda x: x):
  step, initial = _data_parallel()
  params, opt_state, vocab = replicate(initial)
  rng = np.random.RandomState(7)
  out = []
  for _ in range(4):
    batch = place(_dp_batch(rng))
    params, opt_state, vocab, value, ids = step(
      params, opt_state, vocab, *batch
    )
    out.append((value, ids))
  return params, vocab, out


@functools.cache
def _data_parallel_one_device():
  """The 1-device run both kinds compare with (computed once)."""
  return _data_parallel_run()


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_a_data_parallel_batch_on_8_devices_equals_one_device(kind):
  """The open-vocabularies guide's step (admit, reset_rows, the loss's
  sparse gradient, multi_transform) with the raw ids, weights and labels
  split over the batch, P("d"), the params and maps replicated."""
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  want = _data_parallel_one_device()
  mesh = jax.make_mesh(
    (8,),
    ("d",),
    axis_types=(AxisType.Explicit if kind == "explicit" else AxisType.Auto,),
  )
  with jax.set_mesh(mesh):
    got = _data_parallel_run(
      lambda t: jax.device_put(t, NamedSharding(mesh, P("d"))),
      lambda t: jax.device_put(t, NamedSharding(mesh, P())),
    )
  if kind == "explicit":  # the ids admit returns keep the batch's split
    assert jax.typeof(got[2][-1][1]["a1"]).sharding.spec == P("d")
  # the batch's sums run in another order on 8 devices: an element near 0
  # that is a difference of O(1) terms keeps their rounding (atol)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-8
    )


STALE = ("drop_stale", "drop_stale_accumulate")


def _stale_tx(wrap):
  inner = gtx.lazy_adam(0.1)
  if wrap == "drop_stale_accumulate":
    inner = gtx.accumulate(inner, 2, rows_per_step={"float32x3": 3 * B})
  return gtx.drop_stale(inner, 3)


def test_a_stale_gradient_never_lands_on_a_new_owner():
  """Gradients applied two steps late (drop_stale, and drop_stale around
  accumulate), their rows given to new ids meanwhile: drop_reassigned
  drops exactly the rows that FreshRows said were given out after the
  gradient's step, so the update equals the same transformation given the
  gradient without them. Both wrappers' steps run in one program (the
  kernels they share compile once), each with its own map and states."""
  txs = {w: _stale_tx(w) for w in STALE}
  stack = gtx.TableStack({"h": H}, features={"one": "h", "bag": "h"})
  (name,) = stack.stacks
  params = stack.init(jax.random.key(1))
  vocab = stack.init_vocab(jax.random.key(2))

  @jax.jit
  def mapped(cases, ids, weights, coef):
    out = {}
    for w, (states, vocab) in cases.items():
      tx = txs[w]
      got, vocab, fresh = stack.admit(
        vocab, ids, weights=weights, max_new_fraction=1.0
      )
      states = {
        k: gtx.reset_rows(tx, s, p, fresh) for k, (p, s) in states.items()
      }
      g = gtx.sparse_grad(
        lambda p, got=got: _loss(stack, p, got, weights, coef)
      )(states["got"][0])
      out[w] = (states, vocab, fresh, g)
    return out

  @jax.jit
  def apply(cases):
    out = {}
    for w, (states, g, g_ref, vocab, since, grad_step) in cases.items():
      tx = txs[w]
      out[w] = {}
      for k, grad in (
        ("got", stack.drop_reassigned(g, vocab, since)),
        ("want", g_ref),
      ):
        p, s = states[k]
        u, s = tx.update(grad, s, p, grad_step=grad_step)
        out[w][k] = (gtx.apply_updates(p, u), s)
    return out

  cases = {
    w: ({k: (params, tx.init(params)) for k in ("got", "want")}, vocab)
    for w, tx in txs.items()
  }
  # the step each row was last given out, by fresh
  given = {w: np.full(8, -1) for w in STALE}
  rng = np.random.RandomState(5)
  pending = {w: [] for w in STALE}
  dropped = dict.fromkeys(STALE, 0)
  last = {}
  for i in range(STEPS):
    ids, weights, coef = _one_and_bag(rng)
    since = {w: int(cases[w][1][name].step) for w in STALE}
    out = mapped(cases, ids, weights, coef)
    late = {}
    for w in STALE:
      states, vocab, fresh, g = out[w]
      cases[w] = (states, vocab)
      for r in np.asarray(fresh[name].rows):
        if r < 8:
          given[w][r] = i
      pending[w].append((since[w], g))
      if len(pending[w]) > 2:  # two steps late
        s, g = pending[w].pop(0)
        last[w] = s
        sr = g[name]
        idx = np.asarray(sr.indices)
        gone = (idx < 8) & (given[w][np.minimum(idx, 7)] > s)
        dropped[w] += int(gone.sum())
        ref = gtx.SparseRows(
          jnp.asarray(np.where(gone, 8, idx), sr.indices.dtype),
          jnp.asarray(np.where(gone[:, None], 0, sr.values)),
          8,
        )
        late[w] = (states, g, {name: ref}, vocab, s, jnp.int32(s))
    if late:
      done = apply(late)
      for w, states in done.items():
        cases[w] = (states, cases[w][1])
        np.testing.assert_array_equal(
          states["got"][0][name],
          states["want"][0][name],
          err_msg=f"{w} at step {i}",
        )
  for w in STALE:
    assert dropped[w] > 5, w
    # a dense gradient of the stack: the rows given out since zeroed
    s = last[w]
    dense = stack.drop_reassigned({name: jnp.ones((8, 3))}, cases[w][1], s)
    np.testing.assert_array_equal(dense[name][:, 0], given[w] <= s, err_msg=w)


def test_calls_outside_jit_run_as_one_compiled_program():
  """admit, lookup and vocab_stats called outside jit (as in a notebook)
  compile once
  per stack and shapes: later calls on new ids compile nothing (op by op,
  the map's placement loop compiled again on every call), and they give
  what the same calls give under jax.jit."""
  stack = gtx.TableStack(
    {"h": gtx.TableSpec(32, 4, hashed=gtx.Hashed()), "u": gtx.TableSpec(8, 4)}
  )
  vocab = jax.jit(stack.init_vocab)(jax.random.key(0))
  params = stack.init(jax.random.key(1))
  rng = np.random.default_rng(0)
  batches = [
    {
      "h": jax.device_put(rng.integers(0, 10**6, 16).astype(np.int32)),
      "u": jax.device_put(rng.integers(0, 8, 16).astype(np.int32)),
    }
    for _ in range(3)
  ]
  ids, v1, _ = stack.admit(vocab, batches[0])
  stack.lookup(params, ids)
  stack.vocab_stats(v1)
  with _compilations() as compiled:
    ids, v2, fresh = stack.admit(v1, batches[1])
    emb = stack.lookup(params, ids)
    _, v3, _ = stack.admit(v2, batches[2])
    stats = stack.vocab_stats(v3)
    stack.vocab_stats(v2)
  assert compiled == []
  want = jax.jit(stack.admit)(v1, batches[1])
  got = (ids, v2, fresh)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)
  want_stats = jax.jit(stack.vocab_stats)(v3)
  pairs = zip(jax.tree.leaves(stats), jax.tree.leaves(want_stats), strict=True)
  for a, b in pairs:
    np.testing.assert_array_equal(a, b)
  want_emb = jax.jit(stack.lookup)(params, ids)
  for f in emb:
    np.testing.assert_array_equal(emb[f], want_emb[f])


def test_numpy_64_bit_ids_outside_jit_run_as_one_compiled_program():
  """numpy's default int64 ids (a notebook's) given to admit and lookup
  outside jit with x64 off: made fit on the host, then one compiled
  program per call, not op by op. Raw ids past 32 bits give the rows of
  their gtx.Words under jax.jit; a row id past int32 raises, naming the
  feature (it would read as padding here and wrap under jax.jit); the
  features that are not hashed come back as given."""
  stack = gtx.TableStack(
    {"h": gtx.TableSpec(32, 4, hashed=gtx.Hashed()), "u": gtx.TableSpec(8, 4)}
  )
  vocab = jax.jit(stack.init_vocab)(jax.random.key(0))
  params = jax.jit(stack.init)(jax.random.key(1))
  raw = np.array([3, 2**40 + 3, 2**33, 7, 2**40 + 3, 2**63 + 1], np.uint64)
  rows = np.array([1, 2**32 + 1, 7, 0, 2**31, 3])  # int64, two past int32
  fits = np.where(rows < 2**31, rows, -1)  # int64, each fits int32
  small = np.array([3, -1, 7, 2**31 - 1])  # int64, each fits int32
  bag = gtx.Jagged(small, np.array([1, 1, 0, 1, 1, 0]))  # int64 lengths
  with _compilations() as compiled, jax.enable_x64(False):
    ids, v1, fresh = stack.admit(vocab, {"h": raw, "u": rows})
    emb = stack.lookup(params, {"h": bag, "u": fits}, vocab=v1)
  assert len(compiled) <= 2, f"{len(compiled)} compilations: op by op"
  assert ids["u"] is rows
  with pytest.raises(ValueError, match="feature 'u' has row id 4294967297"):
    stack.lookup(params, {"h": bag, "u": rows}, vocab=v1)
  want = jax.jit(stack.admit)(vocab, {"h": gtx.Words.of(raw)})
  got = (ids["h"], v1, fresh)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)
  by_hand = {  # the words split by hand, the padding as weight 0
    "h": gtx.Jagged(
      gtx.Words.of(np.maximum(small, 0)), bag.lengths, 1.0 * (small >= 0)
    ),
    "u": fits.astype(np.int32),
  }
  want_emb = jax.jit(lambda p, i, v: stack.lookup(p, i, vocab=v))(
    params, by_hand, v1
  )
  for f in emb:
    np.testing.assert_array_equal(emb[f], want_emb[f])
  np.testing.assert_array_equal(np.asarray(emb["u"])[1], 0.0)  # not row 1
  assert np.abs(np.asarray(emb["h"])[[0, 3]]).min() > 0  # 3 and 7 read rows


@contextlib.contextmanager
def _compilations():
  """The XLA compilations (persistent-cache hits included) made inside."""
  compiled, active = [], [True]

  def count(event, duration, **kwargs):
    if active[0] and event == "/jax/core/compile/backend_compile_duration":
      compiled.append(event)

  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    yield compiled
  finally:
    active[0] = False


def test_a_stack_that_ran_outside_jit_still_pickles_and_copies():
  """The compiled programs of calls outside jit stay with the process: a
  pickled or deep-copied stack leaves them behind and compiles its own."""
  import copy
  import pickle

  stack = gtx.TableStack({"h": gtx.TableSpec(16, 2, hashed=gtx.Hashed())})
  vocab = jax.jit(stack.init_vocab)(jax.random.key(0))
  ids = {"h": jax.device_put(np.arange(4, dtype=np.int32) * 1000)}
  want = stack.admit(vocab, ids)[0]["h"]
  for other in (pickle.loads(pickle.dumps(stack)), copy.deepcopy(stack)):
    assert "_programs" not in vars(other)
    np.testing.assert_array_equal(other.admit(vocab, ids)[0]["h"], want)
    assert repr(other) == repr(stack)


def test_calls_outside_jit_keep_a_count_and_a_fraction_apart():
  """max_new=1 (one new id) and max_new_fraction=1.0 (all the id slots)
  compile their own programs outside jit, as under jax.jit."""
  stack = gtx.TableStack({"h": gtx.TableSpec(128, 2, hashed=gtx.Hashed())})
  vocab = jax.jit(stack.init_vocab)(jax.random.key(0))
  ids = {"h": jax.device_put(np.arange(100, dtype=np.int32) * 7919)}
  settings = (
    {"max_new": 1},
    {"max_new_fraction": 1.0},
    {"max_new": {"h": 1}},
    {"max_new_fraction": {"h": 1.0}},
  )
  got = [stack.admit(vocab, ids, **m)[0]["h"] for m in settings]
  # the four under jax.jit in one program (the kernels they share compile
  # once)
  wants = jax.jit(
    lambda v, i: [stack.admit(v, i, **m)[0]["h"] for m in settings]
  )(vocab, ids)
  for m, g, want in zip(settings, got, wants, strict=True):
    np.testing.assert_array_equal(g, want, err_msg=str(m))
  assert np.sum(np.asarray(got[0]) >= 0) == 1
  assert np.sum(np.asarray(got[1]) >= 0) > 1  # all compete for rows
