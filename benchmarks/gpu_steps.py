"""The guides' training steps as programs to export, run and model.

:func:`build` makes each step of :data:`SCENARIOS` a :class:`Program`: the
jitted whole step (forward with the loss, sparse backward,
``gtx.lazy_adam``, updates applied, the state donated), its arguments as
``jax.ShapeDtypeStruct`` trees (``jax.export`` reads any size with no
memory) and makers of concrete arguments for a run. :data:`STEPS` holds
them at the guides' sizes, :data:`TOY` at toy sizes (dry runs and tests).
"""

from __future__ import annotations

import functools
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

  step: Any  # jax.jit(step, donate_argnums=...) of the whole step
  args: tuple  # the step's arguments as jax.ShapeDtypeStruct trees
  donated: int  # the first ``donated`` arguments are donated (the state)
  init: Callable[[Any], tuple]  # key -> the donated arguments, concrete
  batch: Callable[[np.random.Generator], tuple]  # rng -> the other ones
  info: dict  # sizes, for the twins' tables


def jagged_batch(rng, rows: list[int], batch: int) -> list[tuple]:
  """Per feature: ``(ids, lengths, weights)`` of ``batch`` bags of
  1..MAX_BAG ids, padded with zeros of weight 0 to a static capacity (the
  expected ids rounded up to 64, as ``benchmarks.stacks``)."""
  cap = int(np.ceil(batch * (MAX_BAG + 1) / 2 / 64) * 64)
  out = []
  for r in rows:
    lengths = rng.integers(1, MAX_BAG + 1, batch).astype(np.int32)
    while lengths.sum() > cap:  # keep the capacity static
      k = rng.integers(0, batch, lengths.sum() - cap)
      np.subtract.at(lengths, k, 1)
      lengths = np.maximum(lengths, 1)
    n = int(lengths.sum())
    ids, w = np.zeros(cap, np.int32), np.zeros(cap, np.float32)
    ids[:n] = rng.integers(0, r, n)
    w[:n] = rng.random(n)
    out.append((ids, lengths, w))
  return out


def build(
  form: str,
  *,
  rows: int = 1_000_000,
  ids: int = 8192,
  batch: int = 2048,
  dim: int = 64,
  cap: int = CAP,
  features: int = 26,
) -> Program:
  """The step of ``form``: ``table``, one ``[rows, dim]`` table read by
  ``ids`` uniform ids; else Criteo's ``features`` cardinalities capped at
  ``cap`` in one ``gtx.TableStack``, a linear logit per feature, read by
  one id an example (``ids``), weighted ``gtx.Jagged`` bags (``bags``),
  hashed tables behind ``stack.admit`` + ``gtx.reset_rows`` (``hashed``)
  or one ``gtx.Keyed`` ``[B, F]`` matrix (``keyed``)."""
  tx = gtx.lazy_adam(1e-3)
  if form == "table":

    def loss(p, i):
      return jnp.sum(jnp.tanh(p["emb"][i]) * 0.01)

    def params_fn(key):
      return {"emb": 0.05 * jax.random.normal(key, (rows, dim), jnp.float32)}

    def batch_fn(rng):
      return (rng.integers(0, rows, ids).astype(np.int32),)

    return _assemble(tx, loss, params_fn, batch_fn, {"rows": rows, "dim": dim})

  sizes = table_rows(features, cap)
  names = [f"f{t}" for t in range(features)]
  hashed = gtx.Hashed() if form == "hashed" else None
  stack = gtx.TableStack(
    {
      n: gtx.TableSpec(r, dim, hashed=hashed)
      for n, r in zip(names, sizes, strict=True)
    },
    batch_size=None if hashed else batch,
  )

  def params_fn(key):
    k1, k2 = jax.random.split(key)
    w = 0.1 * jax.random.normal(k2, (features, dim), jnp.float32)
    return {
      "emb": stack.init(k1),
      "head": {"w": w, "b": jnp.zeros((), jnp.float32)},
    }

  def loss(p, ids, y):
    if form == "keyed":
      out = stack.lookup(p["emb"], gtx.Keyed(names, ids), output="keyed")
      logit = jnp.einsum("bfd,fd->b", out.values, p["head"]["w"])
      return bce(logit + p["head"]["b"], y)
    if form == "bags":
      ids = {n: gtx.Jagged(*v) for n, v in ids.items()}
    x = stack.lookup(p["emb"], ids, output="concat")
    x = x.reshape(batch, features, dim)
    logit = jnp.sum(x * p["head"]["w"][None], axis=(1, 2))
    return bce(logit + p["head"]["b"], y)

  def batch_fn(rng):
    if form == "bags":
      x = dict(zip(names, jagged_batch(rng, sizes, batch), strict=True))
    elif form == "keyed":
      x = np.stack([rng.integers(0, r, batch) for r in sizes], 1)
      x = x.astype(np.int32)
    else:  # hashed: raw ids over 2^31 values, ~4x a table's rows distinct
      x = {
        n: rng.integers(0, 4 * r if hashed else r, batch)
        for n, r in zip(names, sizes, strict=True)
      }
      if hashed:
        x = {n: v * 2654435761 % (2**31 - 1) for n, v in x.items()}
      x = {n: v.astype(np.int32) for n, v in x.items()}
    return x, (rng.random(batch) < 0.25).astype(np.float32)

  info = {"features": features, "dim": dim, "cap": cap}
  return _assemble(
    tx, loss, params_fn, batch_fn, info, stack if hashed else None
  )


def _assemble(tx, loss, params_fn, batch_fn, info, stack=None) -> Program:
  """The whole step over ``(params, opt state[, id map], *batch)`` jitted,
  the state donated: with a hashed ``stack``, ``stack.admit`` maps the raw
  ids and ``gtx.reset_rows`` makes the rows it gave out fresh first.
  ``params_fn(key)`` makes the params, ``batch_fn(rng)`` a batch."""

  def update(params, state, *batch):
    value, g = gtx.sparse_value_and_grad(loss)(params, *batch)
    u, state = tx.update(g, state, params)
    return gtx.apply_updates(params, u), state, value

  def run(params, state, *batch):
    if stack is None:
      return update(params, state, *batch)
    vocab, raw, y = batch
    ids, vocab, fresh = stack.admit(vocab, raw)
    params, state = gtx.reset_rows(tx, state, params, {"emb": fresh})
    params, state, value = update(params, state, ids, y)
    return params, state, vocab, value

  extra = () if stack is None else (stack.init_vocab,)

  def init(key):
    k1, k2 = jax.random.split(key) if extra else (key, None)
    params = params_fn(k1)
    return (params, tx.init(params), *(f(k2) for f in extra))

  params = jax.eval_shape(params_fn, jax.random.key(0))
  state = [params, jax.eval_shape(tx.init, params)]
  state += [jax.eval_shape(f, jax.random.key(1)) for f in extra]
  batch = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
    batch_fn(np.random.default_rng(0)),
  )
  step = jax.jit(run, donate_argnums=tuple(range(len(state))))
  return Program(step, (*state, *batch), len(state), init, batch_fn, info)


# name: (form, the guides' sizes, toy sizes: every table under the row
# engine's loop threshold, so they say nothing of the accelerator program)
SCENARIOS = {
  "single table": ("table", {}, dict(rows=2000, dim=8, ids=256)),
  "criteo": ("ids", {}, dict(batch=128, dim=8, cap=500)),
  "bags": ("bags", dict(batch=1024), dict(batch=64, dim=8, cap=500)),
  "hashed": ("hashed", {}, dict(batch=128, dim=8, cap=500)),
  "keyed 26": ("keyed", dict(features=26), dict(features=26, batch=128,
                                                  dim=8, cap=500)),
  "keyed 500": ("keyed", dict(features=500), dict(features=500, batch=32,
                                                   dim=8, cap=200)),
}  # fmt: skip

STEPS: dict[str, Callable[[], Program]] = {
  name: functools.partial(build, form, **big)
  for name, (form, big, _) in SCENARIOS.items()
}
TOY: dict[str, Callable[[], Program]] = {
  name: functools.partial(build, form, **toy)
  for name, (form, _, toy) in SCENARIOS.items()
}
