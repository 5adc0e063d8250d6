"""gtx.TableStack: lookups and gradients against per-table ``jax.grad``,
every optimizer against its per-table run, the plan, params round trips."""

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conformance import OPTIMIZERS, each, together

import gradtx as gtx
from gradtx import _rows

B = 6
TABLES = {
  "user": gtx.TableSpec(40, 4),
  "item": gtx.TableSpec(30, 4),
  "country": gtx.TableSpec(3, 4),
  "tag": gtx.TableSpec(20, 2, dtype=jnp.float32),
}
FEATURES = {
  "user_id": "user",
  "item_id": "item",
  "history": "item",
  "country": "country",
  "tags": "tag",
  "clicks": "item",
}
ORDER = tuple(FEATURES)


def _stack(**kw):
  return gtx.TableStack(TABLES, features=FEATURES, **kw)


def _batch(seed):
  """One-hot ids (some out of range), weighted bags with padding, an
  unweighted bag, a jagged feature; duplicates everywhere."""
  rng = np.random.RandomState(seed)
  lengths = rng.randint(0, 4, B)
  lengths[0] = 0  # an empty bag
  ids = {
    "user_id": rng.randint(-2, 43, B),
    "item_id": rng.randint(0, 30, B),
    "history": rng.randint(-1, 30, (B, 5)),
    "country": rng.randint(0, 3, B),
    "tags": rng.randint(0, 20, (B, 3)),
    "clicks": gtx.Jagged(
      rng.randint(0, 30, 16).astype(np.int32),
      lengths.astype(np.int32),
      rng.rand(16).astype(np.float32),
    ),
  }
  weights = {
    "history": (rng.rand(B, 5) * (rng.rand(B, 5) > 0.3)).astype(np.float32)
  }
  return ids, weights


def _dense_bags(x, w, shape):
  """The numpy reference's form of every feature: ``[B, L]`` ids (-1:
  padding) and weights."""
  if isinstance(x, gtx.Jagged):
    ids, lengths = np.asarray(x.ids), np.asarray(x.lengths)
    cap = ids.shape[0]
    mat, wm = np.full((B, cap), -1), np.zeros((B, cap), np.float32)
    start = 0
    for b in range(B):
      for j in range(lengths[b]):
        if start + j < cap:
          mat[b, j] = ids[start + j]
          wm[b, j] = np.asarray(x.weights)[start + j]
      start += lengths[b]
    return mat, wm
  x = np.asarray(x)
  if x.ndim == 1:
    return x[:, None], np.ones((B, 1), np.float32)
  return x, np.ones(x.shape, np.float32) if w is None else np.asarray(w)


def _reference_lookup(per_table, ids, weights, combiner, features=ORDER):
  """Per table, plain ``table[ids]`` reads and numpy-built masks;
  ``combiner``: one for every feature, or a dict feature -> combiner."""
  out = {}
  for f in features:
    c = combiner if isinstance(combiner, str) else combiner[f]
    t = per_table[FEATURES[f]]
    x, w = _dense_bags(ids[f], weights.get(f), None)
    valid = (x >= 0) & (x < t.shape[0]) & (w != 0)
    w = np.where(valid, w, 0.0)
    rows = t[jnp.asarray(np.where(valid, x, 0))] * jnp.asarray(w)[..., None]
    total = rows.sum(1)
    norm = w.sum(1) if c == "mean" else np.sqrt((w * w).sum(1))
    if c != "sum":
      total = total / jnp.asarray(np.where(norm > 0, norm, 1.0))[:, None]
    out[f] = total
  return out


def _head(emb):
  """A loss of every feature looked up (each its own weight)."""
  return sum(
    jnp.sum(jnp.tanh(emb[f]) * (k + 1)) for k, f in enumerate(ORDER) if f in emb
  )


def test_lookup_and_gradient_equal_per_table_reads_and_jax_grad():
  stack = _stack()
  params = stack.init(jax.random.key(0))
  ids, weights = _batch(0)

  def loss(p, ids, combiner):
    return _head(stack.lookup(p, ids, weights=weights, combiner=combiner))

  def ref(per_table, ids, combiner):
    return _head(_reference_lookup(per_table, ids, weights, combiner))

  nnz = {}  # per gradient leaf, its static number of rows

  @jax.jit
  def run(p, ids):
    out = []
    for c in gtx_combiners():
      value, grads = gtx.sparse_value_and_grad(loss)(p, ids, c)
      for name, g in grads.items():
        assert isinstance(g, gtx.SparseRows), (c, name)
        nnz[name] = g.nnz
      dense = stack.unstack({k: g.to_dense() for k, g in grads.items()})
      out.append((value, dense))
    return out

  @jax.jit
  def reference(per_table):  # the ids are numpy: built into the program
    return [jax.value_and_grad(ref)(per_table, ids, c) for c in gtx_combiners()]

  got, want = run(params, ids), reference(stack.unstack(params))
  for c, (value, grads), (want_v, want_g) in zip(
    gtx_combiners(), got, want, strict=True
  ):
    # a sum of terms of order one, in another order: atol for cancellation
    np.testing.assert_allclose(value, want_v, rtol=1e-5, atol=1e-5, err_msg=c)
    for t in TABLES:
      np.testing.assert_allclose(
        grads[t], want_g[t], rtol=1e-5, atol=1e-6, err_msg=f"{c} {t}"
      )
  # one SparseRows per stack: every feature of the stack in one read
  assert set(nnz) == {"float32x4", "float32x2"}
  slots = 3 * B + 5 * B + 16  # three one-hot features, a bag, jagged ids
  assert nnz["float32x4"] == slots


def gtx_combiners():
  return ("sum", "mean", "sqrtn")


def _mixed_stack():
  """The stack with combiners of its own: item's features by mean, tag's
  by sqrtn, the others by sum unless the lookup says otherwise."""
  tables = dict(TABLES)
  tables["item"] = dataclasses.replace(TABLES["item"], combiner="mean")
  tables["tag"] = dataclasses.replace(TABLES["tag"], combiner="sqrtn")
  return gtx.TableStack(tables, features=FEATURES)


# the lookup's per-feature combiners over the tables', and the result
PER_CALL = {"user_id": "sqrtn", "clicks": "sqrtn"}
MIXED = {
  "user_id": "sqrtn",
  "item_id": "mean",
  "history": "mean",
  "country": "sum",
  "tags": "sqrtn",
  "clicks": "sqrtn",
}


def _scatters(fn, *args):
  """The segment sums (scatter-adds) of ``fn``'s program."""
  text = str(jax.make_jaxpr(fn)(*args))
  return text.count("scatter-add") + text.count("scatter_add")


def test_combiners_per_table_and_feature_pool_each_feature_in_one_read():
  stack = _mixed_stack()
  params = stack.init(jax.random.key(3))
  ids, weights = _batch(3)
  one_hot = ["user_id", "item_id", "country"]

  def lookup(p, ids, combiner=PER_CALL):
    return stack.lookup(p, ids, weights=weights, combiner=combiner)

  def loss(p, ids):
    return _head(lookup(p, ids))

  # the jitted calls in one program, the references in another (op by op
  # each would compile for its shapes); the eager call below stays eager
  @jax.jit
  def jitted_calls(p, ids):
    value, grads = gtx.sparse_value_and_grad(loss)(p, ids)
    dense = stack.unstack({k: g.to_dense() for k, g in grads.items()})
    return (
      lookup(p, ids),
      {c: lookup(p, ids, c) for c in gtx_combiners()},
      # one-hot features alone: pooled with no segment sum
      stack.lookup(p, {f: ids[f] for f in one_hot}, combiner=PER_CALL),
      (value, grads, dense),
    )

  @jax.jit
  def reference(p):  # the ids are numpy: built into the program
    per_table = stack.unstack(p)
    return (
      _reference_lookup(per_table, ids, weights, MIXED),
      _reference_lookup(per_table, ids, {}, MIXED, one_hot),
      # the gradient, against jax.value_and_grad of the per-table reference
      jax.value_and_grad(
        lambda t: _head(_reference_lookup(t, ids, weights, MIXED))
      )(per_table),
    )

  want, want_one_hot, (want_v, want_g) = reference(params)
  eager = lookup(params, ids)
  jitted, each_alone, got, (value, grads, dense) = jitted_calls(params, ids)
  for f in ORDER:
    np.testing.assert_allclose(eager[f], want[f], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jitted[f], eager[f], rtol=1e-6, atol=1e-7)
    # mixed in one call: the call of the feature's combiner for all
    np.testing.assert_allclose(
      eager[f], each_alone[MIXED[f]][f], rtol=1e-6, atol=1e-7, err_msg=f
    )
  for f in one_hot:
    np.testing.assert_allclose(got[f], want_one_hot[f], rtol=1e-6, atol=1e-7)

  assert all(isinstance(g, gtx.SparseRows) for g in grads.values())
  np.testing.assert_allclose(value, want_v, rtol=1e-5, atol=1e-5)
  for t in TABLES:
    np.testing.assert_allclose(dense[t], want_g[t], rtol=1e-5, atol=1e-6)
  # one segment sum a stack, as with one combiner for every feature: the
  # norms are columns of it
  assert _scatters(lookup, params, ids) == _scatters(
    functools.partial(lookup, combiner="sum"), params, ids
  )


def test_a_weighted_one_hot_feature_pools_as_a_bag_of_one():
  """A keyed [B, F] matrix with weights (one-hot, no segment sum) pools
  as the [B, F, 1] bags of the same ids (a segment sum), per combiner."""
  stack = _mixed_stack()
  params = stack.init(jax.random.key(4))
  rng = np.random.RandomState(4)
  names = ["user_id", "item_id", "country"]
  m = np.stack([rng.randint(-1, 3, B) for _ in names], 1)
  w = (rng.rand(B, 3) * (rng.rand(B, 3) > 0.3) - 0.2).astype(np.float32)
  combiner = {"user_id": "sqrtn", "country": "mean"}  # item's: mean
  one_hot = stack.lookup(
    params, gtx.Keyed(names, m, w), combiner=combiner, output="keyed"
  )
  bags = stack.lookup(
    params,
    gtx.Keyed(names, m[..., None], w[..., None]),
    combiner=combiner,
    output="keyed",
  )
  np.testing.assert_allclose(one_hot.values, bags.values, rtol=1e-6)


def test_lookup_outputs_shapes_dtypes_and_padding():
  stack = gtx.TableStack({"a": gtx.TableSpec(5, 3, dtype=jnp.bfloat16)})
  params = stack.stack({"a": jnp.arange(15, dtype=jnp.float32).reshape(5, 3)})
  assert params["bfloat16x3"].dtype == jnp.bfloat16
  out = stack.lookup(params, {"a": jnp.array([[4, -1, 9], [0, 0, 1]])})
  assert out["a"].dtype == jnp.bfloat16 and out["a"].shape == (2, 3)
  np.testing.assert_array_equal(
    np.asarray(out["a"], np.float32), [[12, 13, 14], [3, 6, 9]]
  )
  mean = stack.lookup(
    params, {"a": jnp.array([[4, -1], [-1, -1]])}, combiner="mean"
  )
  np.testing.assert_array_equal(
    np.asarray(mean["a"], np.float32), [[12, 13, 14], [0, 0, 0]]
  )


def test_the_plan_prints_stacks_offsets_and_the_dense_stack():
  stack = _stack(batch_size=16)
  text = str(stack)
  assert "stack 'float32x4': 70 rows x 4 float32" in text
  assert "user: rows 0..39" in text and "item: rows 40..69" in text
  assert "['item_id', 'history', 'clicks']" in text
  # read 16 times for 3 rows: in the dense stack of its width
  assert (
    "stack 'float32x4_dense': 3 rows x 4 float32, 48 B: read at least 4 "
    "times a row a step at batch_size 16, one dense gradient" in text
  )
  assert stack.stacks["float32x4_dense"].dense
  assert not stack.outside
  assert stack.location("item") == ("float32x4", 40)
  assert stack.location("country") == ("float32x4_dense", 0)
  params = stack.init(jax.random.key(1))
  assert {k: v.shape for k, v in params.items()} == {
    "float32x4": (70, 4),
    "float32x2": (20, 2),
    "float32x4_dense": (3, 4),
  }
  # the rows of a table do not depend on the plan (unstacked in numpy)
  plain = _stack()
  other = plain.unstack(jax.device_get(plain.init(jax.random.key(1))))
  for t, x in stack.unstack(jax.device_get(params)).items():
    np.testing.assert_array_equal(x, other[t])
  # a table of the dense stack is looked up as before
  ids, weights = _batch(1)

  @jax.jit
  def both(p):
    a = stack.lookup(p, ids, weights=weights)
    return a, plain.lookup(plain.stack(stack.unstack(p)), ids, weights=weights)

  a, b = both(params)
  for f in ORDER:
    np.testing.assert_allclose(a[f], b[f], rtol=1e-6)


def test_stack_and_unstack_round_trip_and_a_grown_stack():
  stack = _stack()
  per_table = stack.unstack(stack.init(jax.random.key(2)))
  again = stack.unstack(stack.stack(per_table))
  for t in TABLES:
    np.testing.assert_array_equal(again[t], per_table[t])
  # one more table of the same width, built from the old tables
  grown = gtx.TableStack(
    {**TABLES, "city": gtx.TableSpec(7, 4)}, features={**FEATURES, "c": "city"}
  )
  fresh = grown.unstack(grown.init(jax.random.key(3)))
  params = grown.stack({**per_table, "city": fresh["city"]})
  assert params["float32x4"].shape == (80, 4)
  np.testing.assert_array_equal(
    grown.unstack(params)["item"], per_table["item"]
  )


def test_init_draws_every_default_table_in_one_pass():
  # 3 or 40 tables of distinct sizes: the same program, the rows of the
  # default initializer from their own keys; a table's own initializer kept
  def plan(n):
    tables = {f"t{i}": gtx.TableSpec(50 + i, 4) for i in range(n)}
    tables["z"] = gtx.TableSpec(60, 4, initializer=jax.nn.initializers.ones)
    # tiny and read often: in the dense stack of width 3
    tables.update({f"h{i}": gtx.TableSpec(2 + i % 4, 3) for i in range(n)})
    return gtx.TableStack(tables, batch_size=64)

  def draws(n):
    jaxpr = jax.make_jaxpr(plan(n).init)(jax.random.key(0))
    return str(jaxpr).count("random_bits[")

  assert draws(40) == draws(3) == 2  # one per width
  stack = plan(3)
  key = jax.random.key(8)
  per_table = stack.unstack(stack.init(key))
  assert stack.stacks["float32x3_dense"].tables == ("h0", "h1", "h2")
  for i, t in enumerate(stack.tables):
    spec = stack.tables[t]
    if t == "z":
      np.testing.assert_array_equal(per_table[t], np.ones((60, 4)))
      continue
    t_key = jax.random.fold_in(key, i)
    want = [
      jax.random.normal(jax.random.fold_in(t_key, r), (spec.dim,))
      / np.sqrt(spec.dim)
      for r in range(spec.rows)
    ]
    np.testing.assert_allclose(per_table[t], np.stack(want), rtol=1e-6)


def test_bad_input_names_the_argument():
  with pytest.raises(ValueError, match="`features` name tables"):
    gtx.TableStack(TABLES, features={"x": "nope"})
  with pytest.raises(ValueError, match="`rows` must be a positive int"):
    gtx.TableSpec(0, 4)
  with pytest.raises(TypeError, match=r"`tables\['a'\]` must be"):
    gtx.TableStack({"a": (3, 4)})
  stack = _stack()
  params = stack.init(jax.random.key(0))
  with pytest.raises(ValueError, match="`combiner` must be one of"):
    stack.lookup(params, {"user_id": jnp.zeros(2, jnp.int32)}, combiner="max")
  with pytest.raises(ValueError, match="for feature 'user_id'"):
    stack.lookup(
      params, {"user_id": jnp.zeros(2, jnp.int32)}, combiner={"user_id": "max"}
    )
  with pytest.raises(ValueError, match="`combiner` names unknown features"):
    stack.lookup(
      params, {"user_id": jnp.zeros(2, jnp.int32)}, combiner={"nope": "mean"}
    )
  with pytest.raises(ValueError, match="TableSpec `combiner` must be one of"):
    gtx.TableSpec(3, 4, combiner="max")
  with pytest.raises(ValueError, match="`output` must be one of"):
    stack.lookup(params, {"user_id": jnp.zeros(2, jnp.int32)}, output="list")
  with pytest.raises(ValueError, match="unknown features"):
    stack.lookup(params, {"nope": jnp.zeros(2, jnp.int32)})
  with pytest.raises(ValueError, match="batch sizes differ"):
    stack.lookup(
      params,
      {"user_id": jnp.zeros(2, jnp.int32), "item_id": jnp.zeros(3, jnp.int32)},
    )
  with pytest.raises(TypeError, match="'user_id' `ids` must be integer row"):
    stack.lookup(params, {"user_id": jnp.zeros(2)})
  with pytest.raises(ValueError, match="`weights\\['history'\\]` must have"):
    stack.lookup(
      params,
      {"history": jnp.zeros((2, 3), jnp.int32)},
      weights={"history": jnp.ones((2, 2))},
    )
  with pytest.raises(ValueError, match="has shape"):
    stack.stack({t: jnp.zeros((2, 2)) for t in TABLES})


# ----------------------------------------------------------------------------
# every optimizer: a stack updates as its tables would one by one


def _extra_cases():
  rows_stack = {"float32x4": 3 * B + 5 * B + 16}
  rows_tables = {
    "user": B,
    "item": B + 5 * B + 16 * B,  # the jagged bag padded to [B, 16]
    "country": B,
  }
  return (
    [
      (
        "accumulate_lazy_adam",
        lambda rows: gtx.accumulate(gtx.lazy_adam(0.05), 2, rows_per_step=rows),
      ),
      (
        "drop_stale_lazy_adam_int8",
        lambda rows: gtx.drop_stale(
          gtx.lazy_adam(0.05, mu_dtype="int8", nu_dtype="int8"), 1
        ),
      ),
    ],
    rows_stack,
    rows_tables,
  )


# Options of the conformance cases that another case here covers.
_COVERED = (
  "lazy_adamw_schedule_catch_up",
  "lazy_adam_mu_bf16_nu_int8",
  "adagrad",
  "lazy_sgd",
)


def test_every_optimizer_updates_a_stack_as_its_tables_one_by_one(monkeypatch):
  # the 4-wide tables: three tables in one stack (the 2-wide stack, one
  # table, would add a third of the program for nothing new)
  wide = {t: spec for t, spec in TABLES.items() if spec.dim == 4}
  features = {f: t for f, t in FEATURES.items() if t in wide}
  stack = gtx.TableStack(wide, features=features)
  params = stack.init(jax.random.key(4))
  per_table = stack.unstack(params)
  batches = []
  for i in range(3):
    ids, weights = _batch(10 + i)
    batches.append(({f: ids[f] for f in features}, weights))

  def stack_loss(p, ids, weights):
    return _head(stack.lookup(p, ids, weights=weights))

  def table_loss(p, inputs, unused):
    del unused
    return _head(_reference_gtx_lookup(p, inputs))

  # The same gradients in both forms (a row per read, however many reads
  # per row), made once: the optimizers run on them alone.
  def grads(loss, p, feeds):
    g = gtx.sparse_grad(loss, require_sparse=lambda path: True)
    return [g(p, *f) for f in feeds]

  refs = [(_reference_inputs(*b), {}) for b in batches]
  g_stack = jax.jit(functools.partial(grads, stack_loss))(params, batches)
  g_table = jax.jit(functools.partial(grads, table_loss))(per_table, refs)
  # The 4-wide stack takes the engine's loop over its unique rows, 8 a
  # trip (several trips and a zeroed tail); the tables alone the pass over
  # every id slot: the two paths checked against each other on every
  # optimizer.
  stack_rows = max(g.num_rows for g in g_stack[0].values())
  loops = _rows._loops
  monkeypatch.setattr(_rows, "LOOP_CHUNK", 8)
  monkeypatch.setattr(_rows, "LOOP_MIN_IDS", 0)
  monkeypatch.setattr(
    _rows, "_loops", lambda g, *a: g.num_rows == stack_rows and loops(g, *a)
  )
  looped = []
  unique = _rows._update_unique

  def counted(*args):
    out = unique(*args)
    looped.append(out is not None)
    return out

  monkeypatch.setattr(_rows, "_update_unique", counted)

  extra, rows_stack, rows_tables = _extra_cases()
  # every built-in once (8-bit state, catch-up, Nesterov, a schedule), a
  # user's rule and the two wrappers
  cases = [c for c in OPTIMIZERS if c.name not in _COVERED]
  names = [c.name for c in cases] + [n for n, _ in extra]
  makers = [lambda rows, c=c: c.make_tx() for c in cases]
  makers += [m for _, m in extra]
  txs = [m(rows_stack) for m in makers] + [m(rows_tables) for m in makers]

  def one(tx):
    def step(p, s, g, i):
      u, s = tx.update(g, s, p, grad_step=i)
      return gtx.apply_updates(p, u), s

    return step

  carries = [(params, tx.init(params)) for tx in txs[: len(names)]]
  carries += [(per_table, tx.init(per_table)) for tx in txs[len(names) :]]
  step = jax.jit(together(names + names, [one(tx) for tx in txs]))
  for i in range(len(batches)):
    feeds = [(g_stack[i], jnp.int32(i))] * len(names)
    feeds += [(g_table[i], jnp.int32(i))] * len(names)
    carries = step(carries, feeds)
  got = [c[0] for c in carries[: len(names)]]
  want = [c[0] for c in carries[len(names) :]]
  # every optimizer with a state of whole rows took the loop (all but
  # rowwise_adagrad's)
  assert sum(looped) >= len(names) - 2, looped

  def check(k, name):
    un = stack.unstack(got[k])
    for t in wide:
      np.testing.assert_allclose(
        un[t], want[k][t], rtol=1e-5, atol=1e-6, err_msg=t
      )

  each(names, check)


def _reference_inputs(ids, weights):
  """Per feature, ``[B, L]`` ids with -1 at padding (out of range, an id of
  weight 0) and the weights, built in numpy outside the jitted steps."""
  out = {}
  for f in ORDER:
    if f not in ids:
      continue
    rows = TABLES[FEATURES[f]].rows
    x, w = _dense_bags(ids[f], weights.get(f), None)
    valid = (x >= 0) & (x < rows) & (w != 0)
    out[f] = (np.where(valid, x, -1), np.where(valid, w, 0.0))
  return out


def _reference_gtx_lookup(per_table, inputs):
  """Per table through ``gtx.lookup``, so each table gets its own
  SparseRows (padding ids give no gradient rows), summed bags."""
  return {
    f: (gtx.lookup(per_table[FEATURES[f]], x) * w[..., None]).sum(1)
    for f, (x, w) in inputs.items()
  }


def test_an_optax_chain_and_multi_transform_take_a_stack():
  stack = _stack(batch_size=16)  # "country" outside: its own leaf
  params = stack.init(jax.random.key(5))
  ids, weights = _batch(6)

  def loss(p, ids):
    return _head(stack.lookup(p, ids, weights=weights))

  labels = gtx.sparse_labels(loss)(params, ids)
  assert set(labels.values()) == {"sparse"}
  tx = optax.chain(gtx.clip_by_global_norm(1.0), gtx.rowwise_adagrad(0.1))

  @jax.jit
  def step(p, s, ids):
    value, g = gtx.sparse_value_and_grad(loss)(p, ids)
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s, value

  p, s, v0 = step(params, tx.init(params), ids)
  _, _, v1 = step(p, s, ids)
  assert float(v1) < float(v0)


# ----------------------------------------------------------------------------
# row-sharded stacks on 8 devices


def test_shards_spread_every_table_over_the_devices():
  stack = _stack(shards=8)
  s = stack.stacks["float32x4"]
  assert s.size == 80 and s.rows == 73  # 7 padding rows
  assert "spread over 8 shards (7 padding rows)" in str(stack)
  for t in ("user", "item", "country"):
    _, off = stack.location(t)
    rows = np.arange(off, off + TABLES[t].rows)
    per_shard = np.bincount(s.physical(rows) // (s.size // 8), minlength=8)
    assert per_shard.max() - per_shard.min() <= 1, (t, per_shard)
  per_table = _stack().unstack(_stack().init(jax.random.key(7)))
  params = stack.stack(per_table)
  assert params["float32x4"].shape == (80, 4)
  for t, x in stack.unstack(params).items():
    np.testing.assert_array_equal(x, per_table[t])
  # the lookup reads the same rows whatever the layout
  ids, weights = _batch(8)
  a = stack.lookup(params, ids, weights=weights)
  b = _stack().lookup(_stack().stack(per_table), ids, weights=weights)
  for f in ORDER:
    np.testing.assert_allclose(a[f], b[f], rtol=1e-6)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_a_row_sharded_stack_trains_as_on_one_device(kind):
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
  mesh = jax.make_mesh((8,), ("d",), axis_types=(axis_type,))
  stack = _stack(shards=8)
  per_table = _stack().unstack(_stack().init(jax.random.key(9)))
  batches = [_batch(20 + i) for i in range(2)]

  def loss(p, ids, weights):
    return _head(stack.lookup(p, ids, weights=weights))

  tx = gtx.lazy_adam(0.05)

  def step(p, s, ids, weights):
    g = gtx.sparse_grad(loss)(p, ids, weights)
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s

  host = stack.stack(per_table)
  want_p, want_s = host, tx.init(host)
  one = jax.jit(step)
  for ids, weights in batches:
    want_p, want_s = one(want_p, want_s, ids, weights)
  params = {
    k: jax.device_put(v, NamedSharding(mesh, P("d", None)))
    for k, v in host.items()
  }
  with jax.set_mesh(mesh):
    state = gtx.sharded_init(tx, params)
    sharded = jax.jit(step, donate_argnums=(0, 1))
    for ids, weights in batches:
      params, state = sharded(params, state, ids, weights)
  for k in host:
    assert params[k].sharding.spec[0] == "d", k
    np.testing.assert_allclose(
      np.asarray(params[k]), np.asarray(want_p[k]), rtol=1e-5, atol=1e-6
    )


# ----------------------------------------------------------------------------
# checkpoints, optimizer splits and model libraries


def test_orbax_round_trips_a_stack_and_a_per_table_checkpoint(tmp_path):
  import checkpoint_worker

  stack = _stack(batch_size=16)
  params = stack.init(jax.random.key(11))
  tx = gtx.rowwise_adagrad(0.1)
  ids, weights = _batch(12)

  @jax.jit
  def step(p, s):
    g = gtx.sparse_grad(lambda p: _head(stack.lookup(p, ids, weights=weights)))(
      p
    )
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s

  params, state = step(params, tx.init(params))
  tree = {"params": params, "opt_state": state}
  checkpoint_worker.save_orbax(tmp_path / "stack", tree)
  got = checkpoint_worker.restore_orbax(
    tmp_path / "stack", jax.tree.map(jnp.zeros_like, tree)
  )
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(tree), strict=True):
    np.testing.assert_array_equal(a, b)
  # a per-table checkpoint restored into a stack, and into a bigger one
  checkpoint_worker.save_orbax(tmp_path / "tables", stack.unstack(params))
  per_table = checkpoint_worker.restore_orbax(
    tmp_path / "tables", jax.tree.map(jnp.zeros_like, stack.unstack(params))
  )
  again = stack.stack(per_table)
  for k in params:
    np.testing.assert_array_equal(again[k], params[k])
  grown = gtx.TableStack(
    {**TABLES, "city": gtx.TableSpec(7, 4)},
    features={**FEATURES, "c": "city"},
    shards=4,
  )
  city = grown.unstack(grown.init(jax.random.key(0)))["city"]
  bigger = grown.unstack(grown.stack({**per_table, "city": city}))
  for t in TABLES:
    np.testing.assert_array_equal(bigger[t], per_table[t])


def test_a_different_optimizer_per_stack():
  stack = _stack(batch_size=16)  # "country" in the dense stack, own leaf
  params = {"emb": stack.init(jax.random.key(13)), "w": jnp.ones(3)}
  ids, weights = _batch(14)

  def loss(p, ids):
    emb = stack.lookup(p["emb"], ids, weights=weights)
    return _head(emb) * p["w"][0]

  labels = gtx.sparse_labels(loss)(params, ids)
  assert labels == {
    "emb": {
      "float32x4": "sparse",
      "float32x2": "sparse",
      "float32x4_dense": "sparse",
    },
    "w": "dense",
  }
  labels["emb"]["float32x2"] = "rowwise"
  tx = optax.multi_transform(
    {
      "sparse": gtx.lazy_adam(0.05),
      "rowwise": gtx.rowwise_adagrad(0.05),
      "dense": optax.adam(0.05),
    },
    labels,
  )
  solo = {"a": gtx.lazy_adam(0.05)}

  @jax.jit
  def step(p, s, sa, sb):
    g = gtx.sparse_grad(loss)(p, ids)
    u, s = tx.update(g, s, p)
    # the reference: each stack alone through its own optimizer
    ua, sa = solo["a"].update(g["emb"]["float32x4"], sa, p["emb"]["float32x4"])
    ub, sb = gtx.rowwise_adagrad(0.05).update(
      g["emb"]["float32x2"], sb, p["emb"]["float32x2"]
    )
    return gtx.apply_updates(p, u), s, ua, ub

  sa = solo["a"].init(params["emb"]["float32x4"])
  sb = gtx.rowwise_adagrad(0.05).init(params["emb"]["float32x2"])
  new, _, ua, ub = step(params, tx.init(params), sa, sb)
  np.testing.assert_allclose(
    new["emb"]["float32x4"],
    gtx.apply_updates(params["emb"]["float32x4"], ua),
    rtol=1e-5,
    atol=1e-7,
  )
  np.testing.assert_allclose(
    new["emb"]["float32x2"],
    gtx.apply_updates(params["emb"]["float32x2"], ub),
    rtol=1e-5,
    atol=1e-7,
  )


def test_an_nnx_model_holding_a_stack_trains_with_nnx_optimizer():
  from flax import nnx

  stack = gtx.TableStack(
    {"user": gtx.TableSpec(40, 4), "tag": gtx.TableSpec(20, 2)},
    features={"user_id": "user", "tags": "tag"},
  )

  class Model(nnx.Module):
    def __init__(self):
      self.tables = nnx.Param(stack.init(jax.random.key(0)))
      self.w = nnx.Param(jnp.ones(6))

    def __call__(self, ids):
      emb = stack.lookup(self.tables.get_value(), ids)
      return jnp.concatenate([emb["user_id"], emb["tags"]], -1) @ (
        self.w.get_value()
      )

  model = Model()
  ids = {
    "user_id": jnp.array([3, 7, 3]),
    "tags": jnp.array([[1, 2], [2, -1], [0, 0]]),
  }

  def loss(model, ids):
    return jnp.sum(jnp.tanh(model(ids)))

  opt = nnx.Optimizer(model, gtx.lazy_adam(0.1), wrt=nnx.Param)
  before = stack.unstack(jax.tree.map(np.asarray, model.tables.get_value()))

  @nnx.jit
  def step(model, opt, ids):
    value, g = gtx.sparse_value_and_grad(loss)(model, ids)
    opt.update(model, g)
    return value

  v0 = step(model, opt, ids)
  v1 = step(model, opt, ids)
  assert float(v1) < float(v0)
  after = stack.unstack(model.tables.get_value())
  moved = np.any(np.asarray(after["user"]) != before["user"], 1)
  np.testing.assert_array_equal(np.flatnonzero(moved), [3, 7])
  moved = np.any(np.asarray(after["tag"]) != before["tag"], 1)
  np.testing.assert_array_equal(np.flatnonzero(moved), [0, 1, 2])


def test_concat_gives_the_features_as_one_array_in_concat_order():
  stack = _stack(batch_size=16)  # two stacks and a table outside
  params = stack.init(jax.random.key(15))
  ids, weights = _batch(16)
  order = stack.concat_order(ids)
  assert order == [
    "user_id", "item_id", "history", "clicks", "tags", "country"
  ]  # fmt: skip
  both = jax.jit(
    lambda p: (
      stack.lookup(p, ids, weights=weights),
      stack.lookup(p, ids, weights=weights, output="concat"),
    )
  )
  by_feature, flat = both(params)
  assert flat.shape == (B, 4 + 4 + 4 + 4 + 2 + 4)
  np.testing.assert_array_equal(
    flat, jnp.concatenate([by_feature[f] for f in order], -1)
  )


def test_the_plan_is_a_public_object_made_without_arrays(monkeypatch):
  # No JAX array is made while planning: jnp.asarray / zeros would fail.
  def refuse(*a, **k):
    raise AssertionError("the plan made a JAX array")

  monkeypatch.setattr(jnp, "asarray", refuse)
  monkeypatch.setattr(jnp, "zeros", refuse)
  stack = _stack(batch_size=16, shards=2)
  text = str(stack)
  monkeypatch.undo()
  plan = stack.plan
  assert isinstance(plan, gtx.StackPlan) and str(plan) == text
  assert all(isinstance(s, gtx.StackSpec) for s in plan.stacks.values())
  assert stack.stacks is plan.stacks and not plan.outside
  assert plan.stacks["float32x4_dense"].shards == 1  # never spread
  s = plan.stacks["float32x4"]
  assert s.tables == ("user", "item") and s.offsets == (0, 40)
  assert (s.rows, s.size) == (70, 70)
  # round robin over 2 shards: logical row p at (p % 2) * 35 + p // 2
  assert [int(s.physical(p)) for p in (0, 1, 2, 69)] == [0, 35, 1, 69]
  assert plan.location("item") == ("float32x4", 40) == stack.location("item")
  assert plan.location("country") == ("float32x4_dense", 0)


def test_lanes_spread_a_width_over_stacks_and_train_as_one_stack():
  # 6 tables, 8 features (two read "a"): lanes balance the features that
  # read each table, then rows; each lane keeps the declared order.
  specs = {t: gtx.TableSpec(20 + 3 * i, 4) for i, t in enumerate("abcdef")}
  features = {**{t: t for t in "abcdef"}, "a2": "a", "b2": "b"}
  one = gtx.TableStack(specs, features)
  three = gtx.TableStack(specs, features, lanes=3)
  assert list(three.stacks) == [
    "float32x4",
    "float32x4_lane1",
    "float32x4_lane2",
  ]
  assert [s.tables for s in three.stacks.values()] == [
    ("b", "c"),
    ("a", "d"),
    ("e", "f"),
  ]
  assert "float32x4_lane2" in str(three)
  # more lanes than tables: a lane per table
  assert len(gtx.TableStack(specs, lanes=9).stacks) == 6
  with pytest.raises(ValueError, match="`lanes` must be a positive int"):
    gtx.TableStack(specs, lanes=0)

  rng = np.random.default_rng(0)
  ids = {f: jnp.asarray(rng.integers(0, 20, 5)) for f in features}
  tx = gtx.lazy_adam(0.1)

  def trained(stack):
    params = stack.init(jax.random.key(1))

    def loss(p):
      return sum(jnp.sum(jnp.sin(e)) for e in stack.lookup(p, ids).values())

    @jax.jit
    def step(p, s):
      v, g = gtx.sparse_value_and_grad(loss)(p)
      u, s = tx.update(g, s, p)
      return gtx.apply_updates(p, u), s, v

    state = tx.init(params)
    values = []
    for _ in range(2):
      params, state, v = step(params, state)
      values.append(float(v))
    return stack.unstack(params), values

  (p1, v1), (p3, v3) = trained(one), trained(three)
  np.testing.assert_allclose(v3, v1, rtol=1e-6)
  for t in specs:
    np.testing.assert_allclose(p3[t], p1[t], rtol=1e-6, atol=1e-7)


def test_concat_order_is_the_declared_order_eagerly_and_under_jit():
  # declared zeta first; a dict's insertion order and jit's sorted keys
  # both differ from it
  stack = gtx.TableStack(
    {"t": gtx.TableSpec(10, 2)},
    features={"zeta": "t", "mid": "t", "alpha": "t"},
  )
  params = stack.init(jax.random.key(0))
  ids = {
    "alpha": np.array([1, 2]),
    "zeta": np.array([3, 4]),
    "mid": np.array([5, 6]),
  }
  table = np.asarray(params["float32x2"])
  want = np.concatenate([table[ids[f]] for f in ("zeta", "mid", "alpha")], 1)
  assert stack.concat_order(ids) == ["zeta", "mid", "alpha"]
  seen = []

  def concat(p, x):
    seen.append(stack.concat_order(x))
    return stack.lookup(p, x, output="concat")

  np.testing.assert_array_equal(concat(params, ids), want)
  np.testing.assert_array_equal(jax.jit(concat)(params, ids), want)
  assert seen == [["zeta", "mid", "alpha"]] * 2


def _jagged_parts(seed, keys, cap):
  """Per key a gtx.Jagged of ``cap`` slots, and the same bags as one
  gtx.KeyedJagged (key-major, padded to ``len(keys) * cap``)."""
  rng = np.random.RandomState(seed)
  lengths = rng.randint(0, 4, (len(keys), B)).astype(np.int32)
  lengths[:, 1] = 0  # empty bags
  per, flat, flat_w = {}, [], []
  for k, f in enumerate(keys):
    n = int(lengths[k].sum())
    ids = rng.randint(-1, 20, n).astype(np.int32)
    w = rng.rand(n).astype(np.float32)
    pad = cap - n
    per[f] = gtx.Jagged(
      np.concatenate([ids, rng.randint(0, 20, pad)]).astype(np.int32),
      lengths[k],
      np.concatenate([w, np.ones(pad, np.float32)]),
    )
    flat.append(ids)
    flat_w.append(w)
  ids, w = np.concatenate(flat), np.concatenate(flat_w)
  pad = len(keys) * cap - ids.shape[0]
  keyed = gtx.KeyedJagged(
    keys,
    np.concatenate([ids, rng.randint(0, 20, pad)]).astype(np.int32),
    lengths,
    np.concatenate([w, np.ones(pad, np.float32)]),
  )
  return keyed, per


def _keyed_cases():
  """(name, stack, keyed input, the same features as a dict, weights)."""
  ids, weights = _batch(21)
  one_hot = ["country", "item_id", "user_id"]  # not the declared order
  cases = []
  for kw in ({}, {"batch_size": 16}):  # country stacked, then outside
    cases.append(
      (
        f"one-hot {kw}",
        _stack(**kw),
        gtx.Keyed(one_hot, np.stack([ids[f] for f in one_hot], 1)),
        {f: ids[f] for f in one_hot},
        {},
      )
    )
  tags = np.concatenate([ids["tags"], np.full((B, 2), -1)], 1)
  bag_w = {"history": weights["history"], "tags": np.ones((B, 5), np.float32)}
  cases.append(
    (
      "bags",
      _stack(),
      gtx.Keyed(
        ["tags", "history"],
        np.stack([tags, ids["history"]], 1),
        np.stack([bag_w["tags"], bag_w["history"]], 1),
      ),
      {"tags": tags, "history": ids["history"]},
      bag_w,
    )
  )
  # clicks before user_id: not the declared order; tags: another stack
  keyed, per = _jagged_parts(22, ["clicks", "user_id", "tags"], 18)
  cases.append(("jagged", _stack(), keyed, per, {}))
  keyed, per = _jagged_parts(23, ["user_id", "history"], 18)
  cases.append(("jagged in order", _stack(), keyed, per, {}))
  return cases


@pytest.mark.parametrize("case", range(5))
def test_a_keyed_input_gives_the_dict_forms_loss_and_gradients(case):
  name, stack, keyed, as_dict, weights = _keyed_cases()[case]
  params = stack.init(jax.random.key(case))

  def loss(p, x, w, combiner):
    emb = stack.lookup(p, x, weights=w, combiner=combiner)
    return sum(
      jnp.sum(jnp.tanh(emb[f]) * (k + 1)) for k, f in enumerate(sorted(as_dict))
    )

  order = stack.concat_order(as_dict)
  assert order == stack.concat_order(keyed)
  one_dim = len({stack.tables[stack.features[f]].dim for f in order}) == 1

  def dense(g):
    return {
      k: v.to_dense() if isinstance(v, gtx.SparseRows) else v
      for k, v in g.items()
    }

  @jax.jit
  def run(p, keyed, as_dict, weights):
    """Every comparison's two sides, in one program."""
    out = {}
    for c in (*gtx_combiners(), MIXED):  # MIXED: a combiner per feature
      vg = gtx.sparse_value_and_grad(functools.partial(loss, combiner=c))
      v, g = vg(p, keyed, {})
      want_v, want_g = vg(p, as_dict, weights)
      assert set(g) == set(want_g)
      out[c if isinstance(c, str) else "mixed"] = (
        v,
        want_v,
        dense(g),
        dense(want_g),
      )
    # the pooled rows as one array, in concat order
    out["flat"] = stack.lookup(p, as_dict, weights=weights, output="concat")
    out["keyed"] = stack.lookup(p, keyed, output="concat")
    if name != "bags":  # as a mapping: the dict form, feature by feature
      out["mapping"] = stack.lookup(p, dict(keyed), output="concat")
    if one_dim:
      out["as keyed"] = stack.lookup(p, keyed, output="keyed")
    return out

  out = run(params, keyed, as_dict, weights)
  for c in (*gtx_combiners(), "mixed"):
    v, want_v, g, want_g = out[c]
    np.testing.assert_allclose(v, want_v, rtol=1e-6, err_msg=name)
    for k in g:
      np.testing.assert_allclose(
        g[k], want_g[k], rtol=1e-6, atol=1e-7, err_msg=name
      )
  if name != "bags":
    np.testing.assert_allclose(out["mapping"], out["keyed"], rtol=1e-6)
  flat = out["flat"]
  if one_dim:
    got = out["as keyed"]
    assert isinstance(got, gtx.Keyed) and list(got.keys()) == order
    np.testing.assert_allclose(
      got.values.reshape(B, -1), flat, rtol=1e-6, err_msg=name
    )
    np.testing.assert_array_equal(got[order[-1]], got.values[:, -1])
  else:
    with pytest.raises(ValueError, match="output='concat'"):
      stack.lookup(params, keyed, output="keyed")


@pytest.mark.parametrize("form", ["one-hot", "bags", "jagged"])
@pytest.mark.parametrize("combiners", ["sum", "per table"])
def test_a_keyed_lookup_traces_the_same_program_for_any_number_of_features(
  form, combiners
):
  every = ("sum",) if combiners == "sum" else gtx_combiners()

  def eqns(nf):
    stack = gtx.TableStack(
      {
        f"t{i}": gtx.TableSpec(10 + i, 4, combiner=every[i % len(every)])
        for i in range(nf)
      }
    )
    names = list(stack.features)[::-1]  # any order
    if form == "one-hot":
      x = gtx.Keyed(names, jnp.zeros((B, nf), jnp.int32))
    elif form == "bags":
      x = gtx.Keyed(
        names, jnp.zeros((B, nf, 3), jnp.int32), jnp.ones((B, nf, 3))
      )
    else:
      x = gtx.KeyedJagged(
        names, jnp.zeros(7 * nf, jnp.int32), jnp.ones((nf, B), jnp.int32)
      )
    params = jax.eval_shape(stack.init, jax.random.key(0))

    def loss(p, x):
      return jnp.sum(stack.lookup(p, x, output="keyed").values ** 2)

    jaxpr = jax.make_jaxpr(gtx.sparse_value_and_grad(loss))(params, x)
    return len(jaxpr.eqns)

  assert eqns(3) == eqns(40)


def _short_batches():
  """name -> (ids, weights) of a batch of 4 examples, the step's B = 6."""
  ids, weights = _batch(31)
  clicks = ids["clicks"]
  short_jagged = clicks._replace(lengths=clicks.lengths[:4])
  as_dict = {
    "user_id": ids["user_id"][:4],
    "history": ids["history"][:4],
    "clicks": short_jagged,
  }
  keyed, _ = _jagged_parts(32, ["clicks", "user_id"], 18)
  return {
    "dict": (as_dict, {"history": weights["history"][:4]}),
    "keyed": (
      gtx.Keyed(
        ["item_id", "user_id"],
        np.stack([ids["item_id"][:4], ids["user_id"][:4]], 1),
      ),
      {},
    ),
    "keyed jagged": (
      gtx.KeyedJagged(
        keyed.names, keyed.ids, keyed.lengths[:, :4], keyed.weights
      ),
      {},
    ),
  }


def test_a_padded_short_batch_gives_the_short_batchs_loss_and_updates():
  # every form's short and padded steps in one program (the optimizer's
  # kernels, on the same stack, compile once)
  forms = ["dict", "keyed", "keyed jagged"]
  stack = _stack()
  batches = _short_batches()
  emb = stack.init(jax.random.key(1))
  labels = np.array([1.0, 0.0, 1.0, 1.0], np.float32)
  tx = gtx.lazy_adam(0.1)  # Adam on the dense leaves

  def loss(p, ids, weights, labels, mask):
    x = stack.lookup(p["emb"], ids, weights=weights, output="concat")
    logit = jnp.tanh(x) @ p["w"] + p["b"]
    per_example = jax.nn.softplus(logit) - labels * logit
    return jnp.sum(mask * per_example) / jnp.sum(mask)

  def step(p, s, ids, weights, labels, mask):
    value, g = gtx.sparse_value_and_grad(loss)(p, ids, weights, labels, mask)
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s, value

  carries, feeds, masks = [], [], []
  for form in forms:
    ids, weights = batches[form]
    width = 4 * len(ids)
    params = {
      "emb": emb,
      "w": 0.3 * jax.random.normal(jax.random.key(2), (width,)),
      "b": jnp.asarray(0.1),
    }
    state = tx.init(params)
    padded, mask = gtx.pad_batch((ids, weights, labels), B)
    masks.append(mask)
    # the short batch, then the padded one, from the same params and state
    carries += [(params, state)] * 2
    feeds += [(ids, weights, labels, np.ones(4, bool)), (*padded, mask)]
  names = [f"{form} {batch}" for form in forms for batch in ("short", "padded")]
  out = jax.jit(together(names, [step] * len(names)))(carries, feeds)

  def check(k, form):
    np.testing.assert_array_equal(masks[k], [True] * 4 + [False] * 2)
    want, got = out[2 * k], out[2 * k + 1]
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)

  each(forms, check)


def test_pad_batch_refuses_what_it_cannot_pad():
  with pytest.raises(ValueError, match="more than `batch_size`"):
    gtx.pad_batch({"a": np.zeros(5, np.int32)}, 4)
  with pytest.raises(ValueError, match="different leading"):
    gtx.pad_batch({"a": np.zeros(3, np.int32), "b": np.zeros(2)}, 4)
  with pytest.raises(TypeError, match="weights"):
    gtx.pad_batch({"a": np.zeros(3, np.uint32)}, 4)
  with pytest.raises(ValueError, match="batch_size"):
    gtx.pad_batch({"a": np.zeros(3, np.int32)}, 0)


def test_admit_and_a_read_only_lookup_take_a_keyed_input_as_its_dict():
  stack = gtx.TableStack(
    {"h": gtx.TableSpec(16, 2, hashed=gtx.Hashed()), "t": gtx.TableSpec(8, 2)},
    features={"user": "h", "page": "t"},
  )
  params = stack.init(jax.random.key(0))
  vocab = stack.init_vocab(jax.random.key(1))
  m = np.array([[1000, 3], [2000, 5], [1000, 7]], np.int32)
  keyed = gtx.Keyed(["user", "page"], m)
  as_dict = {"user": m[:, 0], "page": m[:, 1]}

  @jax.jit
  def both(params, vocab):  # the two forms in one program
    out = []
    for x in (keyed, as_dict):
      rows, v1, _ = stack.admit(vocab, x)
      out.append((rows, v1, stack.lookup(params, x, vocab=v1, output="concat")))
    return out

  (rows, v1, out), (want_rows, want_v1, want) = both(params, vocab)
  for f in as_dict:
    np.testing.assert_array_equal(rows[f], want_rows[f])
  for a, b in zip(jax.tree.leaves(v1), jax.tree.leaves(want_v1), strict=True):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(out, want)


def _warns_here(fn, match):
  """``fn()``, which must warn once, a DeprecationWarning naming the new
  spelling, attributed to this file (the caller's line)."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = fn()
  assert [type(w.message) for w in caught] == [DeprecationWarning], caught
  assert match in str(caught[0].message), caught[0].message
  assert caught[0].filename == __file__, caught[0].filename
  return out


def test_each_old_spelling_warns_and_gives_the_new_spellings_result():
  stack = _stack()
  params = stack.init(jax.random.key(0))
  ids, weights = _batch(5)
  ids = {f: ids[f] for f in ("user_id", "history", "clicks")}  # one width

  def check(old, new, match):
    got = _warns_here(
      lambda: stack.lookup(params, ids, weights=weights, **old), match
    )
    want = stack.lookup(params, ids, weights=weights, **new)
    jax.tree.map(np.testing.assert_array_equal, got, want)

  check({"concat": True}, {"output": "concat"}, "output='concat'")
  check({"keyed": True}, {"output": "keyed"}, "output='keyed'")
  check({"concat": False}, {}, "output='dict'")
  with pytest.raises(ValueError, match="output='concat'"):
    stack.lookup(params, ids, weights=weights, concat=True, keyed=True)

  # TableSpec(hashed=True / False)
  spec = _warns_here(lambda: gtx.TableSpec(8, 2, hashed=True), "gtx.Hashed()")
  assert spec == gtx.TableSpec(8, 2, hashed=gtx.Hashed())
  spec = _warns_here(lambda: gtx.TableSpec(8, 2, hashed=False), "hashed=None")
  assert spec == gtx.TableSpec(8, 2)

  # admit(max_new=<a float>): a fraction, now max_new_fraction
  hashed = gtx.TableStack(
    {
      "h": gtx.TableSpec(64, 2, hashed=gtx.Hashed()),
      "g": gtx.TableSpec(64, 2, hashed=gtx.Hashed()),
    }
  )
  vocab = hashed.init_vocab(jax.random.key(1))
  raw = {
    "h": np.arange(200, dtype=np.int32) * 7,
    "g": np.arange(100, dtype=np.int32) * 11,
  }
  for old, new, match in (
    ({"max_new": 0.5}, {"max_new_fraction": 0.5}, "max_new_fraction=0.5"),
    (
      {"max_new": {"h": 3, "g": 0.5}},
      {"max_new": {"h": 3}, "max_new_fraction": {"g": 0.5}},
      "max_new_fraction={'g': 0.5}",
    ),
  ):
    got = _warns_here(lambda old=old: hashed.admit(vocab, raw, **old), match)
    want = hashed.admit(vocab, raw, **new)
    jax.tree.map(np.testing.assert_array_equal, got, want)
