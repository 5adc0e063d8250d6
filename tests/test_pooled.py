"""Pooled reads of a sliced ``[B, F]`` matrix across several stacks."""

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx


def _plan(features):
  # every third table tiny: read 4+ times a row at batch 64, so it is in
  # the dense stack, and the two stacks' columns interleave
  specs = {
    f"f{i}": gtx.TableSpec(8 if i % 3 == 0 else 500 + i, 4)
    for i in range(features)
  }
  return gtx.TableStack(specs, batch_size=64)


def _sliced(m, features):
  return {f"f{i}": m[:, i] for i in range(features)}


def test_interleaved_stacks_read_a_sliced_matrix_like_per_feature():
  features = 10
  stack = _plan(features)
  assert sorted(stack.stacks) == ["float32x4", "float32x4_dense"]
  params = stack.init(jax.random.key(0))
  rng = np.random.default_rng(0)
  m = np.stack(
    [rng.integers(-1, stack.tables[f"f{i}"].rows, 64) for i in range(features)],
    1,
  ).astype(np.int32)
  w = rng.random((64, features)).astype(np.float32)

  @jax.jit
  def read(params, m, w):
    ids = _sliced(m, features)
    weights = {f"f{i}": w[:, i] for i in range(features)}
    return stack.lookup(params, ids, weights=weights)

  got = read(params, m, w)
  tables = stack.unstack(params)
  for i in range(features):
    t = np.asarray(tables[f"f{i}"])
    ids = m[:, i]
    want = (
      np.where((ids >= 0)[:, None], t[np.maximum(ids, 0)], 0) * w[:, i : i + 1]
    )
    np.testing.assert_allclose(got[f"f{i}"], want, rtol=1e-6)


def test_a_sliced_matrix_adds_no_op_per_feature():
  # the ops of the lookup's program at 12 and 30 features (two stacks whose
  # columns interleave; both within one 32-column block of the join): the
  # same count
  def ops(features):
    stack = _plan(features)
    params = jax.eval_shape(stack.init, jax.random.key(0))

    def read(params, m):
      out = stack.lookup(params, _sliced(m, features), output="concat")
      return out.sum()

    m = jax.ShapeDtypeStruct((64, features), jnp.int32)
    jaxpr = jax.make_jaxpr(read)(params, m)
    # the user's slices are two ops per feature; the lookup adds none
    user = [e for e in jaxpr.eqns if e.primitive.name in ("slice", "squeeze")]
    assert len(user) == 2 * features
    return len(jaxpr.eqns) - len(user)

  assert ops(12) == ops(30)


def test_each_jagged_slot_finds_its_bag_as_a_search_of_the_ends():
  """A slot's bag is the number of bags ending at or before it (numpy's
  searchsorted of the ends): empty bags, bags filling every slot, bags
  whose lengths run past the slots, and slots past the last bag."""
  from gradtx._pooled import _bag_of_slots

  n = 12
  rng = np.random.default_rng(0)
  cases = [
    [0, 0, 0, 0, 0],
    [3, 0, 4, 0, 5],  # exactly n slots
    [5, 9, 2, 0, 1],  # past the slots
    [0, 2, 0, 0, 1],  # slots past the last bag
    *(rng.integers(0, 5, 5) for _ in range(4)),
  ]
  lengths = np.asarray(cases, np.int32)
  got = np.asarray(jax.jit(jax.vmap(lambda x: _bag_of_slots(x, n)))(lengths))
  for row, want_of in zip(got, lengths, strict=True):
    want = np.searchsorted(np.cumsum(want_of), np.arange(n), side="right")
    np.testing.assert_array_equal(row, want)
