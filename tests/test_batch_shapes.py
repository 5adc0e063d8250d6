"""A model's gradient structure, and so which optimizer updates each table,
do not change with the batch size (an epoch's short last batch)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conformance import cast

import gradtx as gtx

# The model of docs/guides/recommenders.md: t2 (3 rows) and t4 (24 rows) are
# read more than 4 times per row at batch 256, not at batch 2.
CARDS = (1460, 583, 3, 305, 24, 12517)


def _params():
  rng = np.random.RandomState(0)
  p = {
    f"t{i}": cast(0.01 * rng.normal(size=(c, 8)), jnp.float32)
    for i, c in enumerate(CARDS)
  }
  p["w"] = cast(rng.normal(size=(len(CARDS), 8)), jnp.float32)
  return p


def _loss(p, ids, labels):
  logit = sum(p[f"t{i}"][ids[:, i]] @ p["w"][i] for i in range(len(CARDS)))
  return jnp.mean(optax.sigmoid_binary_cross_entropy(logit, labels))


def _batch(n, seed):
  rng = np.random.RandomState(seed)
  ids = rng.randint(0, 3, (n, len(CARDS))).astype(np.int32)
  return jnp.asarray(ids), cast(rng.rand(n) > 0.5, jnp.float32)


def _is_sparse(x):
  return isinstance(x, gtx.SparseRows)


def test_a_short_last_batch_keeps_the_labels_and_the_gradient_structure():
  p = _params()
  labels = [gtx.sparse_labels(_loss)(p, *_batch(n, n)) for n in (256, 2)]
  assert labels[0] == labels[1]
  assert labels[0] == {**{f"t{i}": "sparse" for i in range(6)}, "w": "dense"}

  def grad(*a):  # and the sparse gradients made dense, in the same program
    g = gtx.sparse_grad(_loss)(*a)
    dense = {k: v.to_dense() if _is_sparse(v) else v for k, v in g.items()}
    return g, jax.grad(_loss)(*a), dense

  grad = jax.jit(grad)
  structures = []
  for n in (256, 2):
    ids, y = _batch(n, n)
    g, want, dense = grad(p, ids, y)
    structures.append(jax.tree.structure(g, is_leaf=_is_sparse))
    for k, w in want.items():
      np.testing.assert_allclose(dense[k], w, rtol=1e-5, atol=1e-7, err_msg=k)
  assert structures[0] == structures[1]
  # at batch 256 the tiny tables get every row once, at batch 2 a row a read
  assert grad(p, *_batch(256, 1))[0]["t2"].nnz == 3
  assert grad(p, *_batch(2, 1))[0]["t2"].nnz == 2


def test_a_short_last_batch_trains_with_multi_transform_and_one_optimizer():
  p0 = _params()
  labels = gtx.sparse_labels(_loss)(p0, *_batch(256, 0))
  txs = [
    optax.multi_transform(
      {"sparse": gtx.rowwise_adagrad(0.05), "dense": optax.adam(1e-3)},
      labels,
    ),
    gtx.lazy_adam(1e-2),
  ]

  def step(carries, ids, y):  # both optimizers in one program
    out = []
    for tx, (p, s) in zip(txs, carries, strict=True):
      value, g = gtx.sparse_value_and_grad(_loss)(p, ids, y)
      u, s = tx.update(g, s, p)
      out.append((gtx.apply_updates(p, u), s, value))
    return out

  step = jax.jit(step, donate_argnums=0)
  # the inits in one program; the donated params a fresh copy of p0's
  states = jax.jit(lambda p: [tx.init(p) for tx in txs])(p0)
  carries = [(_params(), s) for s in states]
  losses = []
  for n in (256, 2, 256):
    out = step(carries, *_batch(n, n))
    carries = [(p, s) for p, s, _ in out]
    losses.append([float(v) for _, _, v in out])
  assert np.all(np.isfinite(losses))
  # every table moved, and only the rows some batch read
  read = np.zeros(CARDS[0], bool)
  for n in (256, 2, 256):
    read[np.asarray(_batch(n, n)[0])[:, 0]] = True
  for p, _ in carries:
    moved = np.any(np.asarray(p["t0"]) != np.asarray(p0["t0"]), axis=1)
    np.testing.assert_array_equal(moved, read)
