"""No table-sized copy in a compiled, donated training step.

A lazy step touches ``n`` rows; a ``copy`` of a ``[V, ...]`` table or state
leaf in the compiled step makes it O(V) (issue 13: 17x slower at 1M rows).
Each test compiles a whole step (forward with the loss returned, sparse
backward, optimizer, apply; params and state donated) and reads the
optimized HLO and XLA's memory analysis. V is a distinctive prime so no
other value has its leading dimension.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtx as gtx

V = 100_003
V2 = 100_019
D = 8
N = 64


def _table_copies(hlo: str, rows: int) -> list[str]:
  """Instructions ``copy``-ing a value whose leading dimension is ``rows``."""
  shape = re.compile(rf"=\s*[a-z0-9]+\[{rows}[,\]]")
  return [
    line.strip()[:160]
    for line in hlo.splitlines()
    if shape.search(line) and re.search(r"\scopy(-start)?\(", line)
  ]


def _assert_in_place(jitted, *args, rows=(V,), dense_grad=False):
  compiled = jitted.lower(*args).compile()
  hlo = compiled.as_text()
  for r in rows:
    assert not _table_copies(hlo, r), _table_copies(hlo, r)
  mem = compiled.memory_analysis()
  smallest = min(rows) * 4  # a [V] int32/float32 state leaf
  # Every table-sized output is written into its donated input.
  not_aliased = mem.output_size_in_bytes - mem.alias_size_in_bytes
  assert not_aliased < smallest, (not_aliased, smallest)
  if not dense_grad:
    # Nor is any other table-sized value built (a fusion that rewrites a
    # whole table out of place would show here, not as a `copy`).
    assert mem.temp_size_in_bytes < smallest, (mem.temp_size_in_bytes, hlo)


def _data(seed=0, rows=V):
  rng = np.random.default_rng(seed)
  ids = jnp.asarray(rng.integers(0, rows, N), jnp.int32)
  ct = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
  return ids, ct


def _linear(params, ids, ct):
  return jnp.sum(gtx.lookup(params["emb"], ids) * ct)


def _tanh(params, ids, ct):
  return jnp.sum(jnp.tanh(gtx.lookup(params["emb"], ids)) * ct)


def _make_step(loss_fn, tx, **extra):
  def step(params, state, ids, ct):
    loss, g = gtx.sparse_value_and_grad(loss_fn)(params, ids, ct)
    u, state = tx.update(g, state, params, **extra)
    return gtx.apply_updates(params, u), state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def _params():
  return {"emb": jnp.zeros((V, D), jnp.float32)}


def test_detects_the_copy_of_plain_jax():
  # The check is not vacuous: plain JAX copies the donated table when the
  # update does not read the rows the loss read.
  def step(p, ids, ct):
    loss = jnp.sum(p[ids] * ct)
    return p.at[ids].add(-0.1 * ct), loss

  ids, ct = _data()
  hlo = (
    jax.jit(step, donate_argnums=0)
    .lower(jnp.zeros((V, D)), ids, ct)
    .compile()
    .as_text()
  )
  assert _table_copies(hlo, V)


@pytest.mark.parametrize("loss_fn", [_linear, _tanh], ids=["linear", "tanh"])
@pytest.mark.parametrize("catch_up", [False, True], ids=["lazy", "catch_up"])
def test_lazy_adam_step_in_place(loss_fn, catch_up):
  tx = gtx.lazy_adam(1e-3, catch_up=catch_up)
  params = _params()
  step = _make_step(loss_fn, tx)
  _assert_in_place(step, params, tx.init(params), *_data())


def test_tied_embedding_dense_grad_in_place():
  # The table is read by rows and as a whole (an output projection), so its
  # gradient is dense; the loss is linear in the table.
  w = jnp.linspace(-1.0, 1.0, D)

  def loss_fn(params, ids, ct):
    e = params["emb"]
    return jnp.sum(gtx.lookup(e, ids) * ct) + jnp.sum(e @ w)

  tx = gtx.lazy_adam(1e-3)
  params = _params()
  step = _make_step(loss_fn, tx)
  _assert_in_place(step, params, tx.init(params), *_data(), dense_grad=True)


def test_two_tables_in_place():
  def loss_fn(params, ids, ct):
    a = gtx.lookup(params["a"], ids)
    b = gtx.lookup(params["b"], ids + 7)
    return jnp.sum(a * ct) + jnp.sum(b * ct)

  tx = gtx.lazy_adam(1e-3)
  params = {"a": jnp.zeros((V, D)), "b": jnp.zeros((V2, D))}
  step = _make_step(loss_fn, tx)
  _assert_in_place(step, params, tx.init(params), *_data(), rows=(V, V2))


@pytest.mark.parametrize(
  "wrap", ["accumulate", "drop_stale", "apply_if_finite"]
)
def test_wrapped_lazy_adam_in_place(wrap):
  # Each wrapper runs the inner update inside a lax.cond, where XLA copies
  # a table that is read after its in-place write.
  inner = gtx.lazy_adam(1e-3)
  extra = {}
  if wrap == "accumulate":
    tx = gtx.accumulate(inner, 2, rows_per_step=N)
  elif wrap == "drop_stale":
    tx, extra = gtx.drop_stale(inner, 1), {"grad_step": jnp.int32(0)}
  else:
    tx = optax.apply_if_finite(inner, 3)
  params = _params()
  step = _make_step(_linear, tx, **extra)
  _assert_in_place(step, params, tx.init(params), *_data())


def test_mirrored_step_in_place():
  m = gtx.Mirrored(jax.devices()[:2])
  tx = optax.chain(gtx.all_reduce(m.axis_name), gtx.lazy_adam(1e-3))

  def step(params, state, batch):
    ids, ct = batch
    loss, g = gtx.sparse_value_and_grad(_linear)(params, ids, ct)
    u, state = tx.update(g, state, params)
    return gtx.apply_updates(params, u), state, m.reduce_in_step(loss, "mean")

  params = m.replicate(_params())
  state = m.replicate(tx.init(params))
  batch = m.shard_batch(_data())
  _assert_in_place(m.step(step, donate_argnums=(0, 1)), params, state, batch)


# ----------------------------------------------------------------------------
# one deduplication per step: SparseRows says when its ids are unique

_OPTIMIZERS = {
  "lazy_adam": lambda: gtx.lazy_adam(1e-2),
  "lazy_adamw": lambda: gtx.lazy_adamw(1e-2, weight_decay=1e-2),
  "adagrad": lambda: gtx.adagrad(0.1),
  "rowwise_adagrad": lambda: gtx.rowwise_adagrad(0.1),
  "ftrl": lambda: gtx.ftrl(0.1),
  "lazy_sgd_momentum": lambda: gtx.lazy_sgd(0.1, momentum=0.9),
  "chain_clip_decay": lambda: optax.chain(
    gtx.clip_by_global_norm(1.0),
    gtx.lazy_adam(1e-2),
    gtx.add_decayed_weights(1e-3),
    gtx.scale(0.5),
  ),
}


# float32 tables of every row optimizer alone: the conformance suite's
# check_in_place. bfloat16 tables take float32 updates (another
# apply_updates path).
@pytest.mark.parametrize(
  "name, dtype",
  [(n, "bfloat16") for n in sorted(_OPTIMIZERS)]
  + [("chain_clip_decay", "float32")],
)
def test_a_step_deduplicates_its_ids_once(name, dtype):
  from hlo import dedups

  tx = _OPTIMIZERS[name]()
  p = {
    "emb": jnp.zeros((53, D), dtype),
    "w": jnp.ones(D, dtype),
  }
  ids = jnp.array([1, 3, 3, 7, 52, 1])

  def loss(p, ids):
    return jnp.sum((p["emb"][ids] @ p["w"]).astype(jnp.float32))

  def step(p, s, ids):
    _, g = gtx.sparse_value_and_grad(loss)(p, ids)
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s

  compiled = jax.jit(step).lower(p, tx.init(p), ids).compile()
  assert dedups(compiled) == (1, 0)
