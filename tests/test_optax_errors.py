"""optax's dense transformations refuse a SparseRows gradient, naming the
transformation and the fix; optax's structure functions carry one through to
the gradtx transformations inside."""

import importlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtx as gtx
from gradtx import _flatten_guard

NUM_ROWS = 6
IDS = np.array([4, 1, 4, NUM_ROWS], np.int32)  # a duplicate and padding


def _params():
  return {
    "emb": jnp.linspace(-1.0, 1.0, NUM_ROWS * 2).reshape(NUM_ROWS, 2),
    "w": jnp.array([0.5, -2.0]),
  }


def _loss(params, ids):
  return jnp.sum(jnp.tanh(params["emb"][ids] @ params["w"]))


def _grads():
  return gtx.sparse_grad(_loss)(_params(), jnp.asarray(IDS))


# (the optax transformation, names the message must hold: the optax
# transformation as called, then its fix)
CASES = {
  "adam": (lambda: optax.adam(1e-2), "`optax.adam`", "`gtx.lazy_adam("),
  "adamw": (lambda: optax.adamw(1e-2), "`optax.adamw`", "`gtx.lazy_adamw("),
  "adagrad": (lambda: optax.adagrad(1e-2), "`optax.adagrad`", "`gtx.adagrad("),
  "sgd_momentum": (
    lambda: optax.sgd(1e-2, momentum=0.9),
    "`optax.sgd(learning_rate, momentum=m)`",
    "`gtx.lazy_sgd(learning_rate, momentum=m)`",
  ),
  "sgd": (
    lambda: optax.sgd(1e-2),
    "`optax.sgd(learning_rate)`",
    "`gtx.lazy_sgd(learning_rate)`",
  ),
  "add_decayed_weights": (
    lambda: optax.add_decayed_weights(1e-4),
    "`optax.add_decayed_weights`",
    "`gtx.add_decayed_weights(",
  ),
  "clip_by_global_norm": (
    lambda: optax.clip_by_global_norm(1.0),
    "`optax.clip_by_global_norm`",
    "`gtx.clip_by_global_norm(",
  ),
  # an int step keeps int32 ids: it used to double them silently
  "scale": (lambda: optax.scale(2), "`optax.scale`", "`gtx.scale("),
  # a float schedule cast to int32 used to zero them silently
  "scale_by_schedule": (
    lambda: optax.scale_by_schedule(lambda count: 0.1),
    "`optax.scale_by_schedule`",
    "`gtx.scale_by_learning_rate(",
  ),
  # no gradtx twin
  **{
    name: (
      lambda name=name: getattr(optax, name)(1e-2),
      f"`optax.{name}`",
      "`gtx.row_transformation`",
    )
    for name in ("rmsprop", "adabelief", "lion")
  },
  "multi_steps": (
    lambda: optax.MultiSteps(gtx.lazy_adam(1e-2), 2),
    "`optax.MultiSteps`",
    "`gtx.accumulate(",
  ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_optax_transform_refuses_sparse_rows(case):
  make, transform, fix = CASES[case]
  tx = make()
  params = _params()
  with pytest.raises(TypeError) as info:
    jax.jit(tx.update)(_grads(), tx.init(params), params)
  msg = str(info.value)
  assert "gradtx.SparseRows" in msg and transform in msg and fix in msg, msg
  if case != "multi_steps":
    assert "`gtx.densify()`" in msg and "gtx.sparse_labels(loss)" in msg, msg


def test_every_refused_optax_function_exists():
  # The refusal keys on optax's module and function names: a renamed one
  # (a newer optax) would silently stop being refused.
  for module, qualname in _flatten_guard._SPLITS_UPDATES:
    if not module.startswith("optax."):
      continue
    outer = importlib.import_module(module)
    for part in qualname.split(".<locals>.")[0].split("."):
      outer = getattr(outer, part)
    codes, found = [outer.__code__], False
    while codes and not found:
      code = codes.pop()
      found = code.co_qualname == qualname
      codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    assert found, f"optax has no {module}.{qualname}"


def _adam_on_dense(params, grads, dense_tx):
  """The reference: optax on the densified gradient."""
  dense = jax.tree.map(
    lambda g: g.to_dense() if isinstance(g, gtx.SparseRows) else g,
    grads,
    is_leaf=lambda g: isinstance(g, gtx.SparseRows),
  )
  updates, _ = dense_tx.update(dense, dense_tx.init(params), params)
  return optax.apply_updates(params, updates)


STRUCTURES = {
  "chain": (
    lambda labels: optax.chain(
      gtx.clip_by_global_norm(0.5), gtx.lazy_adam(1e-2)
    ),
    optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2)),
  ),
  "multi_transform": (
    lambda labels: optax.multi_transform(
      {"sparse": gtx.lazy_adam(1e-2), "dense": optax.adam(1e-2)}, labels
    ),
    optax.adam(1e-2),
  ),
  "inject_hyperparams": (
    lambda labels: optax.inject_hyperparams(gtx.lazy_adam)(learning_rate=1e-2),
    optax.adam(1e-2),
  ),
  "masked": (
    lambda labels: optax.masked(gtx.lazy_adam(1e-2), {"emb": True, "w": False}),
    optax.masked(optax.adam(1e-2), {"emb": True, "w": False}),
  ),
}


@pytest.mark.parametrize("structure", sorted(STRUCTURES))
def test_optax_structure_functions_carry_sparse_rows(structure):
  # One step from fresh state: lazy Adam equals Adam on the dense gradient
  # (an untouched row has zero moments, so Adam leaves it too).
  make, dense_tx = STRUCTURES[structure]
  params = _params()
  labels = gtx.sparse_labels(_loss)(params, jnp.asarray(IDS))
  assert labels == {"emb": "sparse", "w": "dense"}
  tx = make(labels)

  @jax.jit
  def step(params, grads):
    updates, _ = tx.update(grads, tx.init(params), params)
    assert isinstance(updates["emb"], gtx.SparseRows)
    got = optax.apply_updates(params, updates)
    return got, _adam_on_dense(params, grads, dense_tx)

  got, want = step(params, _grads())
  for k in params:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7)
  assert np.abs(got["emb"] - params["emb"]).max() > 1e-3
