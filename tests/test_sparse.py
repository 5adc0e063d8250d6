"""Row-sparse gradients: SparseRows, lookup, sparse_value_and_grad,
apply_updates and the sparse-aware transforms."""

import functools
import re

import equinox as eqx
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references as ref
from conformance import cast, to_dense
from hypothesis import given, settings
from hypothesis import strategies as st

import gradtx as gtx

# Inputs are built in numpy, and a SparseRows is densified by one jitted
# program per shape (eagerly, every op of to_dense compiles on its own).
_valid_indices = jax.jit(lambda g: g.valid_indices())

# ----------------------------------------------------------------------------
# SparseRows


def test_sparse_rows_properties():
  g = gtx.SparseRows(np.array([2, 0]), np.ones((2, 3, 4), np.float32), 5)
  assert g.shape == (5, 3, 4)
  assert g.dtype == jnp.float32
  assert g.num_rows == 5
  assert g.indices.dtype == jnp.int32
  assert g.values.shape == (2, 3, 4)
  leaves, treedef = jax.tree.flatten(g)
  assert len(leaves) == 2
  assert jax.tree.unflatten(treedef, leaves).num_rows == 5


def test_sparse_rows_to_dense_drops_padding():
  values = np.arange(5, dtype=np.float32)[:, None] + np.zeros(
    (5, 2), np.float32
  )
  g = gtx.SparseRows(np.array([1, -1, 4, 7, 1]), values, 5)
  np.testing.assert_array_equal(
    to_dense(g), ref.to_dense(g.indices, g.values, 5)
  )


# (num_rows, ids): ids in [-2, num_rows + 1], so duplicates and padding of
# both kinds are common. A few sizes only, each compiled once (_jitted).
ROWS_AND_IDS = st.sampled_from([1, 2, 5, 12]).flatmap(
  lambda num_rows: st.tuples(
    st.just(num_rows),
    hnp.arrays(
      np.int32,
      st.sampled_from([0, 1, 6, 20]),
      elements=st.integers(-2, num_rows + 1),
    ),
  )
)


def _coalesce(g):
  c = g.coalesce()
  return c.indices, c.values


def unique_rows(g):
  """The row engine's deduplication (``gradtx._dedup.unique_rows``)."""
  d = g.deduplicated()
  return d.indices, d.values


@functools.cache
def _jitted(dedup, num_rows):
  return jax.jit(lambda i, v: dedup(gtx.SparseRows(i, v, num_rows)))


@pytest.mark.parametrize(
  "dedup, reference",
  [(_coalesce, ref.coalesce), (unique_rows, ref.unique_rows)],
  ids=["coalesce", "unique_rows"],
)
@settings(max_examples=40, deadline=None)
@given(ROWS_AND_IDS, st.integers(0, 2**16))
def test_dedup_matches_reference(dedup, reference, rows_and_ids, seed):
  # coalesce: sorted unique ids, padding (zero rows) at the tail. unique_rows
  # (the row engine's): each id at its first position holding the sum, later
  # duplicates and padding as num_rows (their values unchecked).
  num_rows, ids = rows_and_ids
  vals = np.random.RandomState(seed).randint(-8, 8, size=(len(ids), 3))
  vals = vals.astype(np.float32)
  got_idx, got_val = _jitted(dedup, num_rows)(ids, vals)
  want_idx, want_val = reference(ids, vals, num_rows)
  np.testing.assert_array_equal(np.asarray(got_idx), want_idx)
  check = want_idx < num_rows if dedup is unique_rows else slice(None)
  np.testing.assert_array_equal(np.asarray(got_val)[check], want_val[check])
  assert got_val.shape == vals.shape


@pytest.mark.parametrize(
  "case", ["all_same", "all_distinct", "all_padding", "hash_heavy", "one"]
)
def test_unique_rows_sums_bit_for_bit_like_coalesce(case):
  # Adversarial id sets for the hashing rounds (one id n times, n distinct
  # ids, only padding, ids spaced 2**20 apart near the int32 limit, n = 1):
  # the sums have the same bits as coalesce's (same additions in the same
  # order), every id appears once, and two compilations agree.
  n, num_rows = 512, 2**31 - 1
  rng = np.random.RandomState(0)
  ids = {
    "all_same": np.full(n, 7),
    "all_distinct": rng.permutation(10 * n)[:n],
    "all_padding": np.full(n, -1),
    "hash_heavy": (num_rows - 1) - (rng.randint(0, 64, n) << 20),
    "one": np.array([3]),
  }[case].astype(np.int32)
  vals = rng.normal(size=(len(ids), 4)).astype(np.float32)
  g = gtx.SparseRows(ids, vals, num_rows)
  idx, val = jax.jit(unique_rows)(g)
  idx2, val2 = jax.jit(lambda g: unique_rows(g))(g)
  np.testing.assert_array_equal(idx, idx2)
  np.testing.assert_array_equal(val, val2)
  c = jax.jit(lambda g: g.coalesce())(g)
  idx, val = np.asarray(idx), np.asarray(val)
  valid = idx < num_rows
  assert len(set(idx[valid])) == valid.sum()
  got = dict(zip(idx[valid].tolist(), val[valid], strict=True))
  c_idx, c_val = np.asarray(c.indices), np.asarray(c.values)
  want = {
    i: v for i, v in zip(c_idx.tolist(), c_val, strict=True) if i < num_rows
  }
  assert got.keys() == want.keys()
  for i in want:
    np.testing.assert_array_equal(got[i], want[i])


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_add_duplicates_in_chunks_is_one_sequential_scatter(chunk):
  # Chunks of duplicates (several loop trips, a last partial one) add in
  # the order of one scatter-add over all positions: the same bits.
  from gradtx._dedup import _add_duplicates

  rng = np.random.RandomState(1)
  ids = rng.randint(0, 9, size=40).astype(np.int32)
  vals = rng.normal(size=(40, 3)).astype(np.float32)
  first, dup, want = _duplicates_and_one_scatter(ids, vals)
  got = jax.jit(_add_duplicates, static_argnums=3)(vals, first, dup, chunk)
  dup = np.asarray(dup)
  np.testing.assert_array_equal(np.asarray(got)[~dup], np.asarray(want)[~dup])


@jax.jit
def _duplicates_and_one_scatter(ids, vals):
  # the first positions, the duplicates and the one scatter-add over all
  # positions: one program, shared by every chunk size
  from gradtx._dedup import _first_positions

  first = _first_positions(ids, 9)
  dup = first != jnp.arange(40)
  want = vals.at[jnp.where(dup, first, 40)].add(vals, mode="drop")
  return first, dup, want


def test_coalesce_scan_path_matches_scatter_path():
  # The GPU path (segmented scan) must give the CPU path's result.
  from gradtx._dedup import _segment_sum_scan, _segment_sum_scatter

  rng = np.random.RandomState(0)
  idx = rng.randint(0, 9, size=50)
  sidx = np.sort(idx)
  seg = np.cumsum(np.concatenate([[True], sidx[1:] != sidx[:-1]])) - 1
  vals = rng.randint(-5, 5, size=(50, 3)).astype(np.float32)
  args = (
    vals,
    idx.astype(np.int32),
    sidx.astype(np.int32),
    seg.astype(np.int32),
  )
  a = jax.jit(_segment_sum_scan)(*args)  # eager, each scan op compiles
  b = jax.jit(_segment_sum_scatter)(*args)
  np.testing.assert_array_equal(a, b)
  want = np.zeros_like(vals)
  np.add.at(want, seg[np.searchsorted(sidx, idx)], vals)
  np.testing.assert_array_equal(b, want)


_ONES_1x2 = np.ones((1, 2), np.float32)


@pytest.mark.parametrize(
  "args, err, match",
  [
    ((np.array([0.0], np.float32), _ONES_1x2, 3), TypeError, "indices"),
    ((np.array([[0]], np.int32), _ONES_1x2, 3), ValueError, "1-D"),
    (
      (np.array([0, 1], np.int32), np.ones((3, 2), np.float32), 3),
      ValueError,
      "values",
    ),
    ((np.array([0], np.int32), _ONES_1x2, 3.0), TypeError, "num_rows"),
    ((np.array([0], np.int32), _ONES_1x2, -1), ValueError, "num_rows"),
    ((np.array([0], np.int32), _ONES_1x2, 2**31), ValueError, "int32"),
  ],
)
def test_sparse_rows_bad_input(args, err, match):
  with pytest.raises(err, match=match):
    gtx.SparseRows(*args)


def test_dense_optax_transform_on_sparse_rows_raises():
  g = {"emb": gtx.SparseRows(jnp.array([1]), jnp.ones((1, 2)), 4)}
  tx = optax.scale(0.5)
  with pytest.raises(TypeError, match=r"SparseRows.*densify"):
    tx.update(g, tx.init(None))
  with pytest.raises(TypeError, match="SparseRows"):
    jax.jit(lambda g: tx.update(g, optax.EmptyState()))(g)


def test_densify_then_optax():
  g = {"emb": gtx.SparseRows(np.array([1, 1]), np.ones((2, 2), np.float32), 4)}
  tx = optax.chain(gtx.densify(), optax.scale(0.5))
  zeros = {"emb": np.zeros((4, 2), np.float32)}
  u, _ = jax.jit(lambda g, p: tx.update(g, tx.init(p)))(g, zeros)
  np.testing.assert_array_equal(u["emb"], [[0, 0], [1, 1], [0, 0], [0, 0]])


# ----------------------------------------------------------------------------
# lookup and sparse_value_and_grad


def _dense(x):
  return x.to_dense() if isinstance(x, gtx.SparseRows) else x


def _assert_grads_match(sparse_grads, dense_grads):
  assert jax.tree.structure(
    sparse_grads, is_leaf=lambda x: isinstance(x, gtx.SparseRows)
  ) == jax.tree.structure(dense_grads)
  for s, d in zip(
    jax.tree.leaves(_densified_jit(sparse_grads)),
    jax.tree.leaves(dense_grads),
    strict=True,
  ):
    np.testing.assert_allclose(s, d, rtol=1e-5, atol=1e-5)


def _params():
  rng = np.random.RandomState(0)
  return {
    "emb": cast(rng.normal(size=(50, 8)), jnp.float32),
    "emb2": cast(rng.normal(size=(20, 8)), jnp.float32),
    "w": cast(rng.normal(size=(8, 3)), jnp.float32),
  }


def _ids(shape, hi=50, seed=1):
  return cast(np.random.RandomState(seed).randint(0, hi, size=shape), np.int32)


def loss_one_table(p, ids):
  return jnp.sum(jnp.tanh(gtx.lookup(p["emb"], ids) @ p["w"]) ** 2)


def loss_two_tables_twice(p, ids, ids2):
  a = gtx.lookup(p["emb"], ids).mean(axis=1)  # [batch, seq] ids
  b = gtx.lookup(p["emb2"], ids2)
  c = gtx.lookup(p["emb"], ids2)  # the same table again
  return jnp.sum(jnp.sin(a @ p["w"])) + jnp.sum((b * c) ** 2)


@pytest.mark.parametrize("jit", [False, True])
def test_sparse_grad_matches_jax_grad_one_table(jit):
  f = gtx.sparse_value_and_grad(loss_one_table)
  reference = jax.value_and_grad(loss_one_table)
  ids = np.array(_ids(16))
  ids[3] = np.asarray(_ids(1))[0]  # repeated ids
  if jit:  # both in one program
    (v, g), (v2, g2) = jax.jit(lambda p, i: (f(p, i), reference(p, i)))(
      _params(), ids
    )
  else:  # gtx eager, the reference jitted
    v, g = f(_params(), jnp.asarray(ids))
    v2, g2 = jax.jit(reference)(_params(), ids)
  np.testing.assert_allclose(v, v2, rtol=1e-6)
  assert isinstance(g["emb"], gtx.SparseRows)
  assert isinstance(g["w"], jax.Array)
  assert g["emb"].indices.shape == (16,)
  _assert_grads_match(g, g2)


def test_sparse_grad_two_tables_twice_batch_seq_ids():
  ids = _ids((4, 5))
  ids2 = _ids((6,), hi=20, seed=2)
  f = gtx.sparse_value_and_grad(loss_two_tables_twice)
  reference = jax.value_and_grad(loss_two_tables_twice)
  (v, g), (v2, g2) = jax.jit(lambda *a: (f(*a), reference(*a)))(
    _params(), ids, ids2
  )
  np.testing.assert_allclose(v, v2, rtol=1e-6)
  # one SparseRows per table, all lookups concatenated in call order
  assert g["emb"].indices.shape == (26,)
  np.testing.assert_array_equal(
    np.asarray(g["emb"].indices)[:20], np.asarray(ids).reshape(-1)
  )
  assert g["emb2"].indices.shape == (6,)
  _assert_grads_match(g, g2)


def test_table_used_outside_lookup_gets_dense_grad():
  def loss(p, ids):
    h = gtx.lookup(p["emb"], ids).sum(0)
    return jnp.sum(jnp.tanh(p["emb"] @ h))  # tied output projection

  g, want = jax.jit(
    lambda p, i: (gtx.sparse_grad(loss)(p, i), jax.grad(loss)(p, i))
  )(_params(), _ids(7))
  assert not isinstance(g["emb"], gtx.SparseRows)
  _assert_grads_match(g, want)


def test_has_aux_argnums_and_sparse_grad():
  def loss(x, p, ids):
    out = jnp.sum(gtx.lookup(p["emb"], ids) * x[None])
    return out, {"n": ids.size}

  x = cast(np.ones(8), jnp.float32)

  @jax.jit
  def run(*args):  # gtx's two calls and the reference, one program
    return (
      gtx.sparse_value_and_grad(loss, argnums=(0, 1), has_aux=True)(*args),
      jax.value_and_grad(loss, (0, 1), has_aux=True)(*args),
      gtx.sparse_grad(loss, argnums=1, has_aux=True)(*args)[0],
    )

  ((v, aux), (gx, gp)), ((v2, _), (gx2, gp2)), grads = run(
    x, _params(), _ids(5)
  )
  assert aux == {"n": 5}
  np.testing.assert_allclose(v, v2)
  _assert_grads_match((gx, gp), (gx2, gp2))
  _assert_grads_match(grads, gp2)


def test_out_of_range_and_negative_ids_are_padding():
  table = np.arange(12, dtype=np.float32).reshape(4, 3)
  ids = np.array([0, -1, 4, 9, 3], np.int32)
  f = lambda t, i: jnp.sum(gtx.lookup(t, i) ** 2)  # noqa: E731

  @jax.jit
  def run(table, ids):  # the lookup, its sparse gradient and jax's
    dense = gtx.sparse_grad(f)(table, ids).to_dense()
    return gtx.lookup(table, ids), dense, jax.grad(f)(table, ids)

  out, dense, want = map(np.asarray, run(table, ids))
  np.testing.assert_array_equal(out[1:4], 0.0)
  np.testing.assert_array_equal(out[4], table[3])
  np.testing.assert_array_equal(dense, want)
  assert float(np.abs(dense[1:3]).sum()) == 0.0


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
def test_wide_ids_out_of_range_are_padding_not_wrapped(dtype):
  # 2**32 + 1 would wrap onto row 1 when cast to int32.
  ids = np.array([2**32 + 1, 1, 2**33 + 3, 3], dtype)
  table = np.arange(12, dtype=np.float32).reshape(4, 3)
  out = gtx.lookup(table, ids)  # eager: 64-bit ids outside jit
  want = np.zeros((4, 3), np.float32)
  want[[1, 3]] = table[np.array([1, 3])]
  np.testing.assert_array_equal(out, want)
  rows = gtx.SparseRows(ids, np.ones((4, 3), np.float32), 4)
  assert rows.indices.dtype == jnp.int32
  np.testing.assert_array_equal(_valid_indices(rows), [4, 1, 4, 3])
  np.testing.assert_array_equal(
    np.asarray(to_dense(rows)).sum(axis=1), [0, 3, 0, 3]
  )
  with pytest.raises(ValueError, match="outside"):
    gtx.lookup(table, ids, bounds_check=True)
  # Python ints and lists are 64-bit too; key arrays are not ids
  np.testing.assert_array_equal(gtx.lookup(table, 2**32 + 1), 0.0)
  np.testing.assert_array_equal(
    _valid_indices(
      gtx.SparseRows([2**32 + 1, 1], np.ones((2, 3), np.float32), 4)
    ),
    [4, 1],
  )
  with pytest.raises(TypeError, match="must be integer row ids"):
    gtx.lookup(table, jax.random.key(0))


def test_bounds_check():
  table = jnp.ones((4, 2))
  with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
    gtx.lookup(table, jnp.array([1, 4]), bounds_check=True)
  f = jax.jit(lambda i: gtx.lookup(table, i, bounds_check=True))
  f(jnp.array([0, 3])).block_until_ready()
  with pytest.raises(Exception, match=r"outside \[0, 4\)"):
    f(jnp.array([-1, 2])).block_until_ready()


def test_lookup_bad_ids():
  with pytest.raises(TypeError, match="ids"):
    gtx.lookup(jnp.ones((3, 2)), jnp.array([0.0, 1.0]))
  with pytest.raises(ValueError, match="table"):
    gtx.lookup(jnp.float32(1.0), jnp.array([0]))


def test_no_dense_table_buffer_in_compiled_gradient():
  num_rows, dim = 200_000, 16
  # shapes only: lowered, never run
  params = {
    "emb": jax.ShapeDtypeStruct((num_rows, dim), jnp.float32),
    "w": jax.ShapeDtypeStruct((dim,), jnp.float32),
  }
  ids = jax.ShapeDtypeStruct((256,), jnp.int32)

  def loss(p, i):
    return jnp.sum(gtx.lookup(p["emb"], i) @ p["w"])

  table_bytes = num_rows * dim * 4
  sparse = jax.jit(gtx.sparse_value_and_grad(loss)).lower(params, ids)
  dense = jax.jit(jax.value_and_grad(loss)).lower(params, ids)
  sparse = sparse.compile()  # compiled once, read twice
  sparse_mem = sparse.memory_analysis()
  dense_mem = dense.compile().memory_analysis()
  assert sparse_mem.temp_size_in_bytes + sparse_mem.output_size_in_bytes < (
    table_bytes / 10
  )
  assert dense_mem.output_size_in_bytes >= table_bytes  # the check can fail
  # no op in the optimized HLO produces a [num_rows, dim] value
  hlo = sparse.as_text()
  produced = [
    line
    for line in hlo.splitlines()
    if re.search(rf"= f32\[{num_rows},{dim}\]", line)
    and "parameter(" not in line
  ]
  assert not produced, produced


def test_equinox_module():
  class Model(eqx.Module):
    emb: jax.Array
    proj: eqx.nn.Linear

    def __call__(self, ids):
      return self.proj(gtx.lookup(self.emb, ids).sum(0))

  model = Model(
    cast(np.random.RandomState(0).normal(size=(30, 4)), jnp.float32),
    eqx.nn.Linear(4, 2, key=jax.random.key(0)),
  )
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def loss(params, ids):
    return jnp.sum(eqx.combine(params, static)(ids) ** 2)

  ids = _ids(9, hi=30)
  g, want = jax.jit(
    lambda p, i: (gtx.sparse_grad(loss)(p, i), jax.grad(loss)(p, i))
  )(params, ids)
  assert isinstance(g.emb, gtx.SparseRows)
  _assert_grads_match(g, want)


def test_flax_linen_module():
  import flax.linen as nn

  class Model(nn.Module):
    @nn.compact
    def __call__(self, ids):
      table = self.param("emb", nn.initializers.normal(1.0), (30, 4))
      return nn.Dense(2)(gtx.lookup(table, ids).sum(0))

  model = Model()
  ids = _ids(9, hi=30)
  variables = jax.jit(model.init)(jax.random.key(0), ids)

  def loss(v, ids):
    return jnp.sum(model.apply(v, ids) ** 2)

  g, want = jax.jit(
    lambda v, i: (gtx.sparse_grad(loss)(v, i), jax.grad(loss)(v, i))
  )(variables, ids)
  assert isinstance(g["params"]["emb"], gtx.SparseRows)
  _assert_grads_match(g, want)


# ----------------------------------------------------------------------------
# apply_updates


def test_apply_updates_sparse_and_dense():
  params = {
    "emb": np.zeros((5, 2), np.float32),
    "b": np.ones(2, jnp.bfloat16),
  }
  updates = {
    "emb": gtx.SparseRows(
      np.array([1, 1, -1, 5, 3]), np.ones((5, 2), np.float32), 5
    ),
    "b": np.full(2, 0.5, np.float32),
  }
  out = jax.jit(gtx.apply_updates)(params, updates)
  np.testing.assert_array_equal(
    out["emb"], ref.to_dense(updates["emb"].indices, updates["emb"].values, 5)
  )
  assert out["b"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(out["b"], [1.5, 1.5])


def test_apply_updates_bf16_table_and_none():
  params = {"emb": np.zeros((3, 2), jnp.bfloat16), "x": np.ones(1, np.float32)}
  u = {
    "emb": gtx.SparseRows(np.array([2]), np.ones((1, 2), np.float32), 3),
    "x": None,
  }
  out = jax.jit(gtx.apply_updates)(params, u)
  assert out["emb"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(out["x"], [1.0])


def test_apply_updates_in_place_with_donation():
  params = {"emb": cast(np.zeros((1000, 8)), jnp.float32)}
  u = {"emb": gtx.SparseRows(np.array([3]), np.ones((1, 8), np.float32), 1000)}
  f = jax.jit(gtx.apply_updates, donate_argnums=0)
  hlo = f.lower(params, u).compile().as_text()
  assert "input_output_alias" in hlo
  out = f(params, u)
  assert float(np.asarray(out["emb"]).sum()) == 8.0


def _ones(shape):
  return jnp.asarray(np.ones(shape, np.float32))


def test_apply_updates_bad_input():
  with pytest.raises(ValueError, match="`updates`.*`params`"):
    gtx.apply_updates({"a": _ones(2)}, {"b": _ones(2)})
  with pytest.raises(ValueError, match="num_rows"):
    gtx.apply_updates(
      {"a": _ones((4, 2))},
      {"a": gtx.SparseRows(np.array([0]), _ones((1, 2)), 5)},
    )
  with pytest.raises(ValueError, match="row shape"):
    gtx.apply_updates(
      {"a": _ones((4, 2))},
      {"a": gtx.SparseRows(np.array([0]), _ones((1, 3)), 4)},
    )


# ----------------------------------------------------------------------------
# sparse-aware transforms against optax


def _tree():
  rng = np.random.RandomState(3)
  params = {
    "emb": cast(rng.normal(size=(6, 2)), jnp.float32),
    "w": cast(rng.normal(size=(3,)), jnp.float32),
  }
  # rounded to float32, then times 3 in float32 (numpy: the same bits)
  values = rng.normal(size=(4, 2)).astype(np.float32) * np.float32(3)
  grads = {
    "emb": gtx.SparseRows(np.array([4, 1, 4, 6]), values, 6),
    "w": cast(rng.normal(size=(3,)), jnp.float32),
  }
  return params, grads


def _densified(tree):
  return jax.tree.map(
    _dense, tree, is_leaf=lambda x: isinstance(x, gtx.SparseRows)
  )


_densified_jit = jax.jit(_densified)


@pytest.mark.parametrize(
  "ours, theirs",
  [
    (lambda: gtx.scale(-0.3), lambda: optax.scale(-0.3)),
    (
      lambda: gtx.scale_by_learning_rate(0.1),
      lambda: optax.scale_by_learning_rate(0.1),
    ),
    (
      lambda: gtx.scale_by_learning_rate(optax.linear_schedule(1.0, 0.1, 3)),
      lambda: optax.scale_by_learning_rate(optax.linear_schedule(1.0, 0.1, 3)),
    ),
    (
      lambda: gtx.clip_by_global_norm(1.0),
      lambda: optax.clip_by_global_norm(1.0),
    ),
    (
      lambda: gtx.clip_by_global_norm(100.0),
      lambda: optax.clip_by_global_norm(100.0),
    ),
    (
      lambda: gtx.add_decayed_weights(0.1),
      lambda: optax.add_decayed_weights(0.1),
    ),
  ],
)
def test_transforms_match_optax_on_dense_and_sparse(ours, theirs):
  params, grads = _tree()
  ours, theirs = ours(), theirs()

  @jax.jit
  def run(params, grads):
    # both sides' steps and the dense-leaves-alone updates, one program
    s1, s2 = ours.init(params), theirs.init(params)
    dense_grads = _densified(grads)
    steps = []
    for _ in range(3):
      u1, s1 = ours.update(grads, s1, params)
      u2, s2 = theirs.update(dense_grads, s2, params)
      steps.append((u1, u2))
    d1, _ = ours.update(
      {"w": grads["w"]}, ours.init(params), {"w": params["w"]}
    )
    d2, _ = theirs.update(
      {"w": grads["w"]}, theirs.init(params), {"w": params["w"]}
    )
    return steps, d1, d2

  steps, d1, d2 = run(params, grads)
  for u1, u2 in steps:
    if "decayed" not in repr(ours.update):
      _assert_grads_match(u1, u2)
  # dense leaves alone: bit-identical to optax
  np.testing.assert_array_equal(d1["w"], d2["w"])


def test_add_decayed_weights_touches_only_gradient_rows():
  params, grads = _tree()
  tx = gtx.add_decayed_weights(0.1)
  dense = jax.jit(
    lambda g, p: tx.update(g, optax.EmptyState(), p)[0]["emb"].to_dense()
  )(grads, params)
  touched = np.zeros(6, bool)
  touched[[1, 4]] = True
  want = ref.to_dense(grads["emb"].indices, grads["emb"].values, 6)
  want[touched] += 0.1 * np.asarray(params["emb"])[touched]
  np.testing.assert_allclose(dense, want, rtol=1e-6)
  masked, _ = gtx.add_decayed_weights(
    0.1, mask={"emb": False, "w": True}
  ).update(grads, optax.EmptyState(), params)
  assert masked["emb"] is grads["emb"]


def test_clip_counts_duplicates_once_per_row():
  g = gtx.SparseRows(np.array([0, 0]), np.full((2, 1), 3.0, np.float32), 2)
  assert float(jax.jit(gtx.global_norm)(g)) == 6.0  # |3 + 3|, not sqrt(9 + 9)


@pytest.mark.parametrize("check_vma", [True, False])
def test_sparse_grad_inside_shard_map(check_vma):
  # The same gradient as jax.grad in the same shard_map: per replica with
  # check_vma=False; summed over replicas (rows gathered) with True.
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()), ("r",))

  def per_replica(p, i):
    g = gtx.sparse_grad(loss_one_table)(p, i)
    d = jax.grad(loss_one_table)(p, i)
    return jax.tree.map(lambda x: x[None], (_densified(g), d))

  ours, want = jax.jit(
    jax.shard_map(
      per_replica,
      mesh=mesh,
      in_specs=(P(), P("r")),
      out_specs=P("r"),
      check_vma=check_vma,
    )
  )(_params(), _ids(16))
  _assert_grads_match(ours, want)
  if not check_vma:
    ids = np.asarray(_ids(16))[:2]
    local = jax.jit(jax.grad(loss_one_table))(_params(), ids)
    np.testing.assert_allclose(
      np.asarray(ours["emb"])[0], local["emb"], atol=1e-6
    )


def test_apply_updates_rounds_once_into_bf16_like_optax():
  rng = np.random.RandomState(0)
  table = cast(rng.normal(size=(6, 3)), jnp.bfloat16)
  u = gtx.SparseRows(
    np.array([4, 1, 4, 9]),
    (rng.normal(size=(4, 3)) * 1e-2).astype(np.float32),
    6,
  )
  got, want = jax.jit(
    lambda t, u: (gtx.apply_updates(t, u), optax.apply_updates(t, u.to_dense()))
  )(table, u)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
    np.asarray(got, np.float32), np.asarray(want, np.float32)
  )


def test_apply_updates_gpu_path_matches_cpu_path():
  from gradtx._rowio import add_unique_rows

  p = cast(np.random.RandomState(1).normal(size=(7, 2)), jnp.float32)
  u = gtx.SparseRows(
    np.array([3, -1, 3, 6, 0]), np.full((5, 2), 0.5, np.float32), 7
  )
  gpu, cpu = jax.jit(
    lambda p, u: (
      add_unique_rows(p, u.valid_indices(), u.values),
      gtx.apply_updates(p, u),
    )
  )(p, u)
  np.testing.assert_allclose(gpu, cpu, rtol=1e-7)


def test_apply_updates_rejects_broadcasting_dense_update():
  with pytest.raises(ValueError, match=r"shape \(3,\).*shape \(1,\)"):
    gtx.apply_updates(_ones(1), _ones(3))
