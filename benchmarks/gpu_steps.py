"""The guides' training steps as programs to export, run and model.

Each builder returns a :class:`Program`: the jitted whole step (forward
with the loss returned, sparse backward, optimizer update, updates
applied; params, optimizer state and id map donated), its arguments as
``jax.ShapeDtypeStruct`` trees (so ``jax.export`` reads a program of any
size with no memory), and how to make concrete arguments of those shapes
for a run on a device.

* :func:`single_table`: one ``1M x 64`` table, 8,192 ids a step,
  ``gtx.lazy_adam`` (docs/guides/lazy_adam.md).
* :func:`criteo`: Criteo Kaggle's 26 cardinalities capped at 100k rows, 64
  wide, one ``gtx.TableStack`` made with ``batch_size=2048`` (the
  tables read at least 4 times a row in its dense stack), a linear logit
  per feature (docs/guides/recommenders.md, ``benchmarks.stacks``).
* :func:`bags`: the same tables, every feature a ``gtx.Jagged`` bag of
  1-20 weighted ids, batch 1024 (capacity 10,752 ids a feature).
* :func:`hashed`: the same 26 tables declared ``hashed=gtx.Hashed()``,
  batch 2048; ``stack.admit`` + ``gtx.reset_rows`` + the step
  (docs/guides/open_vocabularies.md).
* :func:`keyed`: ``features`` features (Criteo's cardinalities repeated)
  as one ``gtx.Keyed`` ``[B, F]`` matrix, pooled rows read by one einsum
  (``output="keyed"``): the form that keeps the program flat from 26 to 500
  features.

Every size is an argument, so tests and dry runs can shrink what they
need; the defaults are the guides' sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks.models import bce, table_rows

CAP = 100_000  # rows of a Criteo table at most, as benchmarks.stacks
MAX_BAG = 20  # a bag holds 1..MAX_BAG ids


class Program(NamedTuple):
  """One whole training step, ready to export or run."""

  name: str
  step: Any  # jax.jit(step, donate_argnums=...) of the whole step
  args: tuple  # the step's arguments as jax.ShapeDtypeStruct trees
  donated: int  # the first ``donated`` arguments are donated (the state)
  init: Callable[[Any], tuple]  # key -> the donated arguments, concrete
  batch: Callable[[np.random.Generator], tuple]  # rng -> the other ones
  info: dict  # sizes, for tables and the cost model's notes


def _abstract(tree: Any) -> Any:
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _update(tx: Any, loss: Callable[..., jax.Array]) -> Callable[..., Any]:
  """The sparse backward, ``tx`` and the updates applied."""

  def run(params, state, *batch):
    value, g = gtx.sparse_value_and_grad(loss)(params, *batch)
    u, state = tx.update(g, state, params)
    return gtx.apply_updates(params, u), state, value

  return run


def _program(name, tx, loss, params_fn, batch_fn, info) -> Program:
  """A step over ``(params, opt state, *batch)``, params and state donated;
  ``params_fn(key)`` makes the params, ``batch_fn(rng)`` a batch."""
  step = jax.jit(_update(tx, loss), donate_argnums=(0, 1))

  def init(key):
    params = params_fn(key)
    return params, tx.init(params)

  params = jax.eval_shape(params_fn, jax.random.key(0))
  state = jax.eval_shape(tx.init, params)
  batch = _abstract(batch_fn(np.random.default_rng(0)))
  return Program(name, step, (params, state, *batch), 2, init, batch_fn, info)


def criteo_rows(features: int = 26, cap: int = CAP) -> list[int]:
  """Criteo Kaggle's cardinalities (repeated past 26), capped at ``cap``."""
  return table_rows(features, cap)


def _labels(rng, batch):
  return (rng.random(batch) < 0.25).astype(np.float32)


def _head(features, dim):
  def make(key):
    return {
      "w": 0.1 * jax.random.normal(key, (features, dim), jnp.float32),
      "b": jnp.zeros((), jnp.float32),
    }

  return make


# ----------------------------------------------------------------------------
# the steps


def single_table(
  rows: int = 1_000_000, dim: int = 64, ids: int = 8192
) -> Program:
  """One ``[rows, dim]`` table, ``ids`` uniform ids a step, lazy Adam."""
  tx = gtx.lazy_adam(1e-3)

  def loss(p, i):
    return jnp.sum(jnp.tanh(p["emb"][i]) * 0.01)

  def params_fn(key):
    return {"emb": 0.05 * jax.random.normal(key, (rows, dim), jnp.float32)}

  def batch_fn(rng):
    return (rng.integers(0, rows, ids).astype(np.int32),)

  info = {"rows": rows, "dim": dim, "ids": ids, "id slots": ids}
  return _program("single table", tx, loss, params_fn, batch_fn, info)


def _concat_loss(stack, features: int, dim: int, batch: int, lookup_ids):
  """The stack's rows as one concat array, a linear head, bce."""

  def loss(p, ids, y):
    x = stack.lookup(p["emb"], lookup_ids(ids), output="concat")
    x = x.reshape(batch, features, dim)
    return bce(
      jnp.sum(x * p["head"]["w"][None], axis=(1, 2)) + p["head"]["b"], y
    )

  return loss


def _stack_program(name, stack, features, dim, batch, lookup_ids, batch_fn):
  tx = gtx.lazy_adam(1e-3)
  head = _head(len(features), dim)
  loss = _concat_loss(stack, len(features), dim, batch, lookup_ids)

  def params_fn(key):
    k1, k2 = jax.random.split(key)
    return {"emb": stack.init(k1), "head": head(k2)}

  return _program(name, tx, loss, params_fn, batch_fn, {})


def _criteo_stack(batch, dim, cap, features):
  """Criteo's tables (capped at ``cap`` rows) in one stack made for
  ``batch``: ``(rows, feature names, stack)``."""
  rows = criteo_rows(features, cap)
  names = [f"f{t}" for t in range(features)]
  specs = {n: gtx.TableSpec(r, dim) for n, r in zip(names, rows, strict=True)}
  return rows, names, gtx.TableStack(specs, batch_size=batch)


def criteo(
  batch: int = 2048, dim: int = 64, cap: int = CAP, features: int = 26
) -> Program:
  """The 26-feature Criteo stack step, one id per example and feature."""
  rows, names, stack = _criteo_stack(batch, dim, cap, features)

  def batch_fn(rng):
    ids = {
      n: rng.integers(0, r, batch).astype(np.int32)
      for n, r in zip(names, rows, strict=True)
    }
    return ids, _labels(rng, batch)

  p = _stack_program("criteo", stack, names, dim, batch, lambda x: x, batch_fn)
  info = {"features": features, "batch": batch, "dim": dim, "cap": cap}
  info["id slots"] = features * batch
  return p._replace(info=info)


def bag_capacity(batch: int) -> int:
  """A feature's static id capacity: the expected ids of ``batch`` bags of
  1..MAX_BAG, rounded up to 64 (as ``benchmarks.stacks``)."""
  return int(np.ceil(batch * (MAX_BAG + 1) / 2 / 64) * 64)


def jagged_batch(rng, rows: list[int], batch: int) -> list[tuple]:
  """Per feature: ``(ids, lengths, weights, n)``, the ids padded to
  :func:`bag_capacity` (zeros past ``n`` with weight 0)."""
  cap = bag_capacity(batch)
  out = []
  for r in rows:
    lengths = rng.integers(1, MAX_BAG + 1, batch).astype(np.int32)
    while lengths.sum() > cap:  # keep the capacity static
      over = lengths.sum() - cap
      k = rng.integers(0, batch, over)
      np.subtract.at(lengths, k, 1)
      lengths = np.maximum(lengths, 1)
    n = int(lengths.sum())
    ids = np.zeros(cap, np.int32)
    ids[:n] = rng.integers(0, r, n)
    w = np.zeros(cap, np.float32)
    w[:n] = rng.random(n)
    out.append((ids, lengths, w, n))
  return out


def bags(
  batch: int = 1024, dim: int = 64, cap: int = CAP, features: int = 26
) -> Program:
  """Criteo's tables read as ``gtx.Jagged`` bags of 1-20 weighted ids."""
  rows, names, stack = _criteo_stack(batch, dim, cap, features)

  def batch_fn(rng):
    parts = jagged_batch(rng, rows, batch)
    bag = {n: (i, ln, w) for n, (i, ln, w, _) in zip(names, parts, strict=True)}
    return bag, _labels(rng, batch)

  def lookup_ids(bag):
    return {n: gtx.Jagged(*v) for n, v in bag.items()}

  p = _stack_program("bags", stack, names, dim, batch, lookup_ids, batch_fn)
  info = {"features": features, "batch": batch, "dim": dim, "cap": cap}
  info["id slots"] = features * bag_capacity(batch)
  return p._replace(info=info)


def hashed(
  batch: int = 2048, dim: int = 64, cap: int = CAP, features: int = 26
) -> Program:
  """Criteo's tables as hashed tables (raw int32 ids of any range):
  ``stack.admit`` + ``gtx.reset_rows`` + the step, map donated too."""
  rows = criteo_rows(features, cap)
  names = [f"f{t}" for t in range(features)]
  specs = {
    n: gtx.TableSpec(r, dim, hashed=gtx.Hashed())
    for n, r in zip(names, rows, strict=True)
  }
  stack = gtx.TableStack(specs)
  tx = gtx.lazy_adam(1e-3)
  head = _head(features, dim)
  update = _update(tx, _concat_loss(stack, features, dim, batch, lambda x: x))

  def run(params, state, vocab, raw, y):
    ids, vocab, fresh = stack.admit(vocab, raw)
    params, state = gtx.reset_rows(tx, state, params, {"emb": fresh})
    params, state, value = update(params, state, ids, y)
    return params, state, vocab, value

  def params_fn(key):
    k1, k2 = jax.random.split(key)
    return {"emb": stack.init(k1), "head": head(k2)}

  def init(key):
    k1, k2 = jax.random.split(key)
    params = params_fn(k1)
    return params, tx.init(params), stack.init_vocab(k2)

  def batch_fn(rng):
    # raw ids over 2^31 values, ~4x the rows a table has in distinct ids
    raw = {
      n: (rng.integers(0, 4 * r, batch) * 2654435761 % (2**31 - 1))
      for n, r in zip(names, rows, strict=True)
    }
    return jax.tree.map(lambda x: x.astype(np.int32), raw), _labels(rng, batch)

  step = jax.jit(run, donate_argnums=(0, 1, 2))
  params = jax.eval_shape(params_fn, jax.random.key(0))
  state = jax.eval_shape(tx.init, params)
  vocab = jax.eval_shape(stack.init_vocab, jax.random.key(1))
  args = (params, state, vocab, *_abstract(batch_fn(np.random.default_rng(0))))
  info = {"features": features, "batch": batch, "dim": dim, "cap": cap}
  info["id slots"] = features * batch
  return Program("hashed", step, args, 3, init, batch_fn, info)


def keyed(
  features: int = 500, batch: int = 2048, dim: int = 64, cap: int = CAP
) -> Program:
  """``features`` one-hot features as one ``gtx.Keyed`` ``[B, F]`` matrix,
  the pooled rows back as a ``gtx.Keyed`` read by one einsum."""
  rows, names, stack = _criteo_stack(batch, dim, cap, features)
  tx = gtx.lazy_adam(1e-3)
  head = _head(features, dim)

  def loss(p, ids, y):
    out = stack.lookup(p["emb"], gtx.Keyed(names, ids), output="keyed")
    logit = jnp.einsum("bfd,fd->b", out.values, p["head"]["w"])
    return bce(logit + p["head"]["b"], y)

  def params_fn(key):
    k1, k2 = jax.random.split(key)
    return {"emb": stack.init(k1), "head": head(k2)}

  def batch_fn(rng):
    ids = np.stack([rng.integers(0, r, batch) for r in rows], 1)
    return ids.astype(np.int32), _labels(rng, batch)

  info = {"features": features, "batch": batch, "dim": dim, "cap": cap}
  info["id slots"] = features * batch
  return _program(f"keyed {features}", tx, loss, params_fn, batch_fn, info)


# The guides' steps at their sizes, by name.
STEPS: dict[str, Callable[[], Program]] = {
  "single table": single_table,
  "criteo": criteo,
  "bags": bags,
  "hashed": hashed,
  "keyed 26": lambda: keyed(26),
  "keyed 500": keyed,
}

# Toy sizes of the same steps (dry runs): every table under the row
# engine's loop threshold, so they say nothing of the accelerator program.
TOY: dict[str, Callable[[], Program]] = {
  "single table": lambda: single_table(rows=2000, dim=8, ids=256),
  "criteo": lambda: criteo(batch=128, dim=8, cap=500),
  "bags": lambda: bags(batch=64, dim=8, cap=500),
  "hashed": lambda: hashed(batch=128, dim=8, cap=500),
  "keyed 26": lambda: keyed(26, batch=128, dim=8, cap=500),
  "keyed 500": lambda: keyed(500, batch=32, dim=8, cap=200),
}
