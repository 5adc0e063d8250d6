"""Nothing silent at the input (issue 60): 64-bit ids in every input form,
jagged lengths past their capacity, a bounds check for plain ids, wide row
ids eagerly, and short batches of 64-bit ids. Each test compares with an
independent reference: the same ids as a dict, gtx.Words under jax.jit,
or numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import gradtx as gtx

BIG = np.array([2**40 + 5, 2**41 + 5, 3, 4], np.int64)  # uid, uid, ctry, ctry


def _stack():
  return gtx.TableStack(
    {
      "user": gtx.TableSpec(16, 4, hashed=gtx.Hashed(probes=16)),
      "country": gtx.TableSpec(5, 4),
    },
    features={"uid": "user", "ctry": "country"},
  )


def _same(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def _jagged_rows(x):
  """The rows of a jagged feature's bags (the slots up to sum(lengths))."""
  return np.asarray(x.ids)[: int(np.sum(x.lengths))]


# -- 1. 64-bit ids in every input form ----------------------------------------
def test_keyed_jagged_of_numpy_int64_ids_splits_them_as_a_dict_does():
  """The issue's repro: a KeyedJagged of numpy int64 ids, a hashed feature
  beside a plain one, gives the dict's rows (two ids, two rows), not one
  merged id."""
  st = _stack()
  v0 = st.init_vocab(jax.random.key(0))
  kj = gtx.KeyedJagged(["uid", "ctry"], BIG, np.array([[1, 1], [1, 1]]))
  rows, v, fresh = st.admit(v0, kj)
  as_dict = {
    "uid": gtx.Jagged(BIG[:2], np.array([1, 1])),
    "ctry": gtx.Jagged(BIG[2:].astype(np.int32), np.array([1, 1])),
  }
  want, want_v, want_fresh = st.admit(v0, as_dict)
  np.testing.assert_array_equal(_jagged_rows(rows["uid"]), want["uid"].ids)
  np.testing.assert_array_equal(_jagged_rows(rows["ctry"]), [3, 4])
  _same(v, want_v)  # the same map (fresh rows: the keyed capacity's 4 slots)
  placed = np.asarray(fresh["float32x4"].rows) < 21
  np.testing.assert_array_equal(
    np.asarray(fresh["float32x4"].rows)[placed], want_fresh["float32x4"].rows
  )
  assert int(st.vocab_stats(v)["user"]["live"]) == 2
  # the same ids as gtx.Words inside jax.jit
  words = gtx.KeyedJagged(
    ["uid", "ctry"], gtx.Words.of(BIG), np.array([[1, 1], [1, 1]])
  )
  jitted, jv, jfresh = jax.jit(st.admit)(v0, words)
  _same((jitted, jv, jfresh), (rows, v, fresh))
  # and the pooled rows of the mapped ids, eager and jitted
  params = st.init(jax.random.key(1))
  _same(st.lookup(params, rows), jax.jit(st.lookup)(params, jitted))
  want_emb = st.lookup(params, want)
  got_emb = st.lookup(params, kj, vocab=v)
  jit_emb = jax.jit(lambda p, i, v: st.lookup(p, i, vocab=v))(params, words, v)
  _same(got_emb, want_emb)
  _same(jit_emb, want_emb)


def test_keyed_of_numpy_int64_ids_splits_them_as_a_dict_does():
  """A [B, F] Keyed of numpy int64 ids (a hashed feature's raw 64-bit ids
  beside a plain feature's row ids) gives the rows of the dict of its
  columns, and of its gtx.Words under jax.jit."""
  st = _stack()
  v0 = st.init_vocab(jax.random.key(0))
  values = BIG.reshape(2, 2).T.copy()  # [[uid, ctry], [uid, ctry]]
  rows, v, _ = st.admit(v0, gtx.Keyed(["uid", "ctry"], values))
  want, want_v, _ = st.admit(
    v0, {"uid": values[:, 0], "ctry": values[:, 1].astype(np.int32)}
  )
  np.testing.assert_array_equal(rows["uid"], want["uid"])
  np.testing.assert_array_equal(rows["ctry"], [3, 4])
  _same(v, want_v)
  words = gtx.Keyed(["uid", "ctry"], gtx.Words.of(values))
  jitted, jv, _ = jax.jit(st.admit)(v0, words)
  _same((jitted, jv), (rows, v))
  assert len(set(np.asarray(rows["uid"]).tolist())) == 2


def test_a_keyed_input_of_words_reads_plain_row_ids_without_a_vocab():
  """gtx.Words of plain features' row ids in a keyed input read the rows of
  the same int32 ids (jitted); words of a hashed feature's raw ids are
  refused without `vocab=`."""
  st = gtx.TableStack({"a": gtx.TableSpec(6, 2), "b": gtx.TableSpec(4, 2)})
  params = st.init(jax.random.key(0))
  ids = np.array([5, 0, 2, 3, 1], np.int64)
  lengths = np.array([[2, 1], [1, 1]])
  want = st.lookup(params, gtx.KeyedJagged(["a", "b"], ids, lengths))
  words = gtx.KeyedJagged(["a", "b"], gtx.Words.of(ids), lengths)
  _same(jax.jit(st.lookup)(params, words), want)
  hashed = _stack()
  hp = hashed.init(jax.random.key(0))
  kj = gtx.KeyedJagged(["uid", "ctry"], gtx.Words.of(BIG), [[1, 1], [1, 1]])
  with pytest.raises(TypeError, match="hashed features \\['uid'\\]"):
    jax.jit(hashed.lookup)(hp, kj)


def test_a_keyed_input_keeps_a_plain_features_padding_beside_wide_ids():
  """-1 of a plain feature in a numpy int64 KeyedJagged that also holds a
  hashed feature's 64-bit ids stays padding (a zero row), as in a dict;
  the hashed ids keep their dict rows."""
  st = _stack()
  v0 = st.init_vocab(jax.random.key(0))
  params = st.init(jax.random.key(1))
  flat = np.array([2**40 + 5, 2**41 + 5, -1, 4])
  kj = gtx.KeyedJagged(["uid", "ctry"], flat, np.array([[1, 1], [1, 1]]))
  rows, v, _ = st.admit(v0, kj)
  want, want_v, _ = st.admit(v0, {"uid": flat[:2], "ctry": flat[2:]})
  np.testing.assert_array_equal(_jagged_rows(rows["uid"]), want["uid"])
  np.testing.assert_array_equal(_jagged_rows(rows["ctry"]), [-1, 4])
  _same(v, want_v)
  got = st.lookup(params, kj, vocab=v)
  _same(got, st.lookup(params, want))
  np.testing.assert_array_equal(got["ctry"][0], 0.0)


# -- 2. jagged lengths checked ------------------------------------------------
@pytest.mark.parametrize("what", ["lookup", "admit"])
def test_jagged_lengths_past_the_capacity_raise_outside_jit(what):
  """The issue's KeyedJagged needs 6 ids and holds 4; a Jagged with lengths
  [2, 3] holds 3; a negative length: each raises, naming the feature, the
  sum and the capacity, where today's code dropped ids without a word."""
  hashed = what == "admit"
  spec = gtx.TableSpec(8, 2, hashed=gtx.Hashed(probes=8) if hashed else None)
  st = gtx.TableStack({"t": spec}, features={"fa": "t", "fb": "t"})
  if hashed:
    vocab = st.init_vocab(jax.random.key(0))
    call = lambda ids: st.admit(vocab, ids)  # noqa: E731
  else:
    params = st.init(jax.random.key(0))
    call = lambda ids: st.lookup(params, ids)  # noqa: E731
  kj = gtx.KeyedJagged(["fa", "fb"], jnp.array([1, 2, 3, 4]), [[2, 2], [1, 1]])
  with pytest.raises(
    ValueError, match=r"'fb'.*sum to 6\), past the capacity 4"
  ):
    call(kj)
  jag = {"fa": gtx.Jagged(jnp.array([1, 2, 3]), jnp.array([2, 3]))}
  with pytest.raises(
    ValueError, match=r"'fa'.*sum to 5\), past the capacity 3"
  ):
    call(jag)
  neg = {"fa": gtx.Jagged(np.array([1, 2, 3]), np.array([2, -1]))}
  with pytest.raises(ValueError, match="'fa' has a negative length -1"):
    call(neg)
  # lengths that fit still run
  call({"fa": gtx.Jagged(jnp.array([1, 2, 3]), jnp.array([2, 1]))})


def test_jagged_lengths_past_the_capacity_are_a_checkify_error_under_jit():
  """Inside jax.jit the ids that did not fit are counted by a checkify
  check that the user turns on; the pooled rows are those of the ids that
  fit (numpy reference), and a batch that fits has no error."""
  st = gtx.TableStack(
    {"t": gtx.TableSpec(8, 2)}, features={"fa": "t", "fb": "t"}
  )
  params = st.init(jax.random.key(0))
  step = jax.jit(
    checkify.checkify(lambda p, i: st.lookup(p, i), errors=checkify.user_checks)
  )
  over = gtx.KeyedJagged(
    ["fa", "fb"], jnp.array([1, 2, 3, 4]), [[2, 2], [1, 1]]
  )
  err, emb = step(params, over)
  assert err.get() is not None
  assert "sum to 6, past the capacity 4 of the ids: 2 ids dropped" in err.get()
  table = np.asarray(params["float32x2"])
  np.testing.assert_allclose(
    emb["fa"], [table[1] + table[2], table[3] + table[4]]
  )
  np.testing.assert_array_equal(emb["fb"], 0.0)  # nothing of fb fit
  fits = gtx.KeyedJagged(
    ["fa", "fb"], jnp.array([1, 2, 3, 4]), [[1, 1], [1, 1]]
  )
  err, _ = step(params, fits)
  assert err.get() is None
  # without checkify the check costs nothing and the step runs
  jax.jit(st.lookup)(params, over)


def test_admit_counts_the_ids_past_the_capacity_under_checkify():
  st = _stack()
  v0 = st.init_vocab(jax.random.key(0))
  words = gtx.Words.of(np.array([2**40 + 5, 2**41 + 5, 3, 4], np.uint64))
  over = gtx.KeyedJagged(["uid", "ctry"], words, jnp.array([[2, 1], [1, 1]]))
  admit = checkify.checkify(st.admit, errors=checkify.user_checks)
  err, _ = jax.jit(admit)(v0, over)
  assert "sum to 5, past the capacity 4 of the ids: 1 ids dropped" in err.get()


# -- 3. a bounds check for plain ids ------------------------------------------
def _bounded():
  st = gtx.TableStack(
    {"a": gtx.TableSpec(5, 2), "b": gtx.TableSpec(7, 2)},
    features={"fa": "a", "fb": "b"},
  )
  return st, st.init(jax.random.key(0))


@pytest.mark.parametrize("jit", [False, True])
def test_bounds_check_raises_naming_the_feature_and_the_id(jit):
  """With bounds_check=True an id past its table's rows raises, naming the
  feature and the id, eagerly (ValueError) and under jax.jit (the host
  check fails the computation); without it the id reads zeros."""
  st, params = _bounded()
  ids = {
    "fa": jnp.array([1, -1, 4]),
    "fb": jnp.array([[0, 7], [1, 2], [3, -1]]),
  }
  out = st.lookup(params, ids)
  np.testing.assert_array_equal(out["fa"][1], 0.0)  # off by default
  lookup = lambda p, i: st.lookup(p, i, bounds_check=True)  # noqa: E731
  error = Exception if jit else ValueError
  with pytest.raises(error, match=r"feature 'fb' has id 7, outside .*\[0, 7\)"):
    jax.block_until_ready((jax.jit(lookup) if jit else lookup)(params, ids))
  neg = {"fa": jnp.array([1, -2, 4])}
  with pytest.raises(error, match="feature 'fa' has id -2"):
    jax.block_until_ready((jax.jit(lookup) if jit else lookup)(params, neg))


@pytest.mark.parametrize("jit", [False, True])
def test_bounds_check_passes_padding_and_reads_as_without_it(jit):
  """-1, ids of weight 0 and jagged slots past the bags are padding under
  the check; in-range ids read as without it, in every input form."""
  st, params = _bounded()
  lookup = lambda p, i, w=None: st.lookup(p, i, weights=w, bounds_check=True)  # noqa: E731
  lookup = jax.jit(lookup) if jit else lookup
  forms = [
    ({"fa": jnp.array([1, -1, 4]), "fb": jnp.array([[0, 9], [6, -1], [3, 2]])},
     {"fb": jnp.array([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])}),
    ({"fa": gtx.Jagged(jnp.array([1, 4, 99]), jnp.array([1, 1, 0]))}, None),
    (gtx.Keyed(["fa", "fb"], jnp.array([[1, 6], [-1, 0], [4, -1]])), None),
    (gtx.KeyedJagged(["fa", "fb"], jnp.array([1, 4, 6, 99]), [[1, 1], [1, 0]]),
     None),
  ]  # fmt: skip
  for ids, w in forms:
    _same(lookup(params, ids, w), st.lookup(params, ids, weights=w))


def test_bounds_check_of_a_keyed_input_names_its_feature():
  st, params = _bounded()
  kj = gtx.KeyedJagged(["fa", "fb"], jnp.array([1, 4, 6, 5]), [[1, 1], [1, 1]])
  with pytest.raises(
    ValueError, match=r"feature 'fa' has id 6, .* \(2 such id"
  ):
    st.lookup(
      params,
      gtx.KeyedJagged(["fb", "fa"], kj.ids, kj.lengths),
      bounds_check=True,
    )


# -- 4. wide row ids never read a row silently --------------------------------
def test_a_wide_numpy_row_id_raises_outside_jit_naming_the_feature():
  """A plain feature's numpy int64 row id past int32 raised nothing and read
  as padding (zeros) eagerly while jax.jit wraps it onto another row; now
  it raises, in a dict, a Keyed and a KeyedJagged."""
  st, params = _bounded()
  wide = np.array([2**32 + 1, 2], np.int64)
  with pytest.raises(ValueError, match="feature 'fa' has row id 4294967297"):
    st.lookup(params, {"fa": wide})
  keyed = gtx.Keyed(["fb", "fa"], np.stack([np.array([1, 2]), wide], 1))
  with pytest.raises(ValueError, match="feature 'fa' has row id 4294967297"):
    st.lookup(params, keyed)
  kj = gtx.KeyedJagged(
    ["fb", "fa"], np.array([1, 2, 2**32 + 1, 2]), [[1, 1], [1, 1]]
  )
  with pytest.raises(ValueError, match="feature 'fa' has row id 4294967297"):
    st.lookup(params, kj)
  # ids that fit an int32 read their rows, as int32 ids do
  fits = np.array([4, 2], np.int64)
  _same(
    st.lookup(params, {"fa": fits}),
    st.lookup(params, {"fa": fits.astype(np.int32)}),
  )


# -- 6. short batches of 64-bit ids -------------------------------------------
def test_pad_batch_pads_words_by_length_or_weight():
  """A Jagged of Words (lengths 1, one id per example) and a Keyed of Words
  with weights pad to the step's batch; admit then gives the short batch's
  rows and map (numpy: padded examples take no row)."""
  st = gtx.TableStack(
    {"user": gtx.TableSpec(16, 4, hashed=gtx.Hashed(probes=16))},
    features={"uid": "user", "vid": "user"},
  )
  v0 = st.init_vocab(jax.random.key(0))
  raw = np.array([2**40 + 5, 2**41 + 5, 2**40 + 5], np.uint64)
  jag = gtx.Jagged(gtx.Words.of(raw), np.ones(3, np.int32))
  short = {"uid": jag}
  padded, mask = gtx.pad_batch(short, 5)
  np.testing.assert_array_equal(padded["uid"].lengths, [1, 1, 1, 0, 0])
  np.testing.assert_array_equal(mask, [1, 1, 1, 0, 0])
  rows, v, _ = jax.jit(st.admit)(v0, padded)
  want, want_v, _ = st.admit(v0, {"uid": raw})
  np.testing.assert_array_equal(_jagged_rows(rows["uid"]), want["uid"])
  _same(v, want_v)
  keyed = gtx.Keyed(["uid"], gtx.Words.of(raw[:, None]), np.ones((3, 1)))
  (pk,), _ = gtx.pad_batch((keyed,), 5)
  np.testing.assert_array_equal(pk.weights[:, 0], [1, 1, 1, 0, 0])
  rows, v, _ = jax.jit(st.admit)(v0, pk)
  np.testing.assert_array_equal(rows["uid"][:3], want["uid"])
  np.testing.assert_array_equal(rows["uid"][3:], -1)
  _same(v, want_v)


def test_pad_batch_refuses_words_it_cannot_pad_and_names_the_form():
  words = gtx.Words.of(np.array([2**40 + 5, 7], np.uint64))
  with pytest.raises(
    TypeError, match=r"gtx.Jagged\(gtx.Words.of\(ids\), lengths\)"
  ):
    gtx.pad_batch({"uid": words}, 4)
  with pytest.raises(TypeError, match="Keyed of gradtx.Words without weights"):
    gtx.pad_batch(gtx.Keyed(["uid"], gtx.Words.of(np.array([[5], [7]]))), 4)
