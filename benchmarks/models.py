"""The models the benchmarks share, written as users write them.

Criteo Kaggle's 26 cardinalities (:data:`CRITEO_KAGGLE`,
:func:`table_rows`), the DLRM-shaped head (:func:`head_params`,
:func:`logit`, and torch's twin :func:`torch_head`, :func:`torch_logit`)
with its binary cross-entropy (:func:`bce`), the whole training step
(:func:`whole_step`: sparse gradient, ``tx.update``, ``apply_updates``,
jitted, params and state donated), the one-table torch step
(:func:`torch_sparse_adam`), and the table-stack models of
``benchmarks.stacks`` (:func:`criteo_data`, :func:`criteo_models`,
:func:`bag_data`, :func:`bag_models`, :func:`loop_runner`).
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks._common import (
  huge_pages,
  import_torch,
  make_ids,
  torch_huge_pages,
  torch_state,
)

SEED = 0
HIDDEN = 256  # the mlp head's width


# Criteo Kaggle's 26 categorical cardinalities (DLRM, dlrm_s_criteo_kaggle).
CRITEO_KAGGLE = [
  1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683,
  8351593, 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15,
  286181, 105, 142572,
]  # fmt: skip


def table_rows(tables: int, cap: int) -> list[int]:
  """Rows of ``tables`` tables: Criteo's cardinalities, repeated past 26,
  capped at ``cap``."""
  return [min(CRITEO_KAGGLE[i % 26], cap) for i in range(tables)]


def row_offsets(rows: list[int]) -> np.ndarray:
  return np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int32)


def head_params(tables: int, dim: int, head: str, hidden: int, rng) -> dict:
  """The head's dense leaves (numpy): ``linear``, a logit weight vector per
  table and a bias; ``mlp``, a tanh layer of ``hidden`` over the
  concatenated embeddings, then a logit."""
  if head == "linear":
    return {
      "w": (0.1 * rng.standard_normal((tables, dim))).astype(np.float32),
      "b": np.zeros((), np.float32),
    }
  fan_in = tables * dim
  return {
    "w1": (rng.standard_normal((fan_in, hidden)) / fan_in**0.5).astype(
      np.float32
    ),
    "b1": np.zeros(hidden, np.float32),
    "w2": (rng.standard_normal(hidden) / hidden**0.5).astype(np.float32),
    "b2": np.zeros((), np.float32),
  }


def logit(p: Any, x: jax.Array) -> jax.Array:
  """The head on the embeddings ``x`` ``[batch, tables, dim]``."""
  if "w" in p:
    return jnp.sum(x * p["w"], axis=(1, 2)) + p["b"]
  h = jnp.tanh(x.reshape(x.shape[0], -1) @ p["w1"] + p["b1"])
  return h @ p["w2"] + p["b2"]


def bce(logit: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean(jax.nn.softplus(logit) - y * logit)


def whole_step(loss, tx):
  def step(p, s, ids, y):
    value, g = gtx.sparse_value_and_grad(loss)(p, ids, y)
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s, value

  return jax.jit(step, donate_argnums=(0, 1))


def torch_head(params_np: dict[str, np.ndarray]) -> dict[str, Any]:
  import torch

  return {
    k: torch.nn.Parameter(torch.from_numpy(v.copy()))
    for k, v in params_np.items()
    if not k.startswith("t")
  }


def torch_logit(d: dict[str, Any], x: Any) -> Any:
  import torch

  if "w" in d:
    return (x * d["w"]).sum(dim=(1, 2)) + d["b"]
  h = torch.tanh(x.reshape(x.shape[0], -1) @ d["w1"] + d["b1"])
  return h @ d["w2"] + d["b2"]


def torch_sparse_adam(table_np, ids_np, ct_np, linear):
  torch = import_torch()
  emb = torch.nn.Embedding(*table_np.shape, sparse=True)
  with torch.no_grad():
    emb.weight.copy_(torch.from_numpy(table_np))
  opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-3)
  ids = [torch.from_numpy(i.astype(np.int64)) for i in ids_np]
  ct = torch.from_numpy(ct_np)

  def run(i):
    opt.zero_grad(set_to_none=True)
    rows = emb(ids[i % len(ids)])
    loss = ((rows if linear else torch.tanh(rows)) * ct).sum()
    loss.backward()
    opt.step()
    loss.item()
    if i == 0:  # SparseAdam makes its state on step 1
      torch_huge_pages([emb.weight, *torch_state([opt])])

  return run, (emb, opt)


def criteo_data(rows, batch, steps, dist):
  cols = [make_ids(v, batch, steps, dist, SEED + t) for t, v in enumerate(rows)]
  ids = [{f"f{t}": c[s] for t, c in enumerate(cols)} for s in range(steps)]
  rng = np.random.default_rng(SEED + 1)
  labels = [(rng.random(batch) < 0.25).astype(np.float32) for _ in ids]
  return ids, labels


def bag_data(tables, rows, batch, steps, dist, max_len=20):
  """Per step and table: flat ids padded to the static capacity ``batch *
  10.5`` rounded up (the expected total), lengths and weights."""
  rng = np.random.default_rng(SEED + 5)
  cap = int(np.ceil(batch * (max_len + 1) / 2 / 64) * 64)
  out = []
  for s in range(steps):
    step = {}
    for t in range(tables):
      lengths = rng.integers(1, max_len + 1, batch).astype(np.int32)
      while lengths.sum() > cap:  # keep the capacity static
        lengths[rng.integers(0, batch)] -= 1
        lengths = np.maximum(lengths, 1)
      n = int(lengths.sum())
      ids = np.zeros(cap, np.int32)
      ids[:n] = make_ids(rows, n, 1, dist, SEED + 100 * s + t)[0]
      w = np.zeros(cap, np.float32)
      w[:n] = rng.random(n).astype(np.float32)
      step[f"f{t}"] = (ids, lengths, w, n)
    out.append(step)
  labels = [(rng.random(batch) < 0.25).astype(np.float32) for _ in out]
  return out, labels, cap


def criteo_models(rows, dim, batch=None):
  names = [f"f{t}" for t in range(len(rows))]
  specs = {n: gtx.TableSpec(r, dim) for n, r in zip(names, rows, strict=True)}
  # as the recommenders guide builds it: with the step's batch size, the
  # tables a step reads at least 4 times a row stay outside the stack
  stack = gtx.TableStack(specs, batch_size=batch)

  # both read the features in the stack's concat order (its declared
  # order), so the head's params mean the same in both
  def per_table_loss(p, ids, y):
    order = stack.concat_order(ids)
    x = jnp.stack([p[n][ids[n]] for n in order], axis=1)
    return bce(logit(p["head"], x), y)

  def stack_loss(p, ids, y):
    # the pooled features as one array (FBGEMM's output)
    x = stack.lookup(p["emb"], ids, concat=True)
    return bce(logit(p["head"], x.reshape(x.shape[0], len(names), dim)), y)

  return stack, names, per_table_loss, stack_loss


def bag_models(tables, rows, dim, batch):
  names = [f"f{t}" for t in range(tables)]
  stack = gtx.TableStack(
    {n: gtx.TableSpec(rows, dim) for n in names}, batch_size=batch
  )

  def per_table_loss(p, bags, y):
    emb = []
    for n in stack.concat_order(bags):
      ids, seg, w = bags[n]
      rows_ = p[n][ids] * w[:, None]
      emb.append(
        jax.ops.segment_sum(rows_, seg, batch, indices_are_sorted=True)
      )
    return bce(logit(p["head"], jnp.stack(emb, axis=1)), y)

  def stack_loss(p, bags, y):
    x = stack.lookup(p["emb"], bags, concat=True).reshape(batch, -1, dim)
    return bce(logit(p["head"], x), y)

  return stack, names, per_table_loss, stack_loss


def loop_runner(step, params, tx, batches, labels):
  box = [params, tx.init(params)]
  huge_pages(box)

  loop = itertools.cycle(list(zip(batches, labels, strict=True)))

  def run():
    ids, y = next(loop)
    box[0], box[1], v = step(box[0], box[1], ids, y)
    jax.block_until_ready((box[0], v))
    return float(v)

  run()
  return run
