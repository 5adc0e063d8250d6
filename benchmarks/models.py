"""The models the benchmarks share, written as users write them: one
table's step (:func:`one_table`, :func:`one_table_step`), the DLRM-shaped
model of ``benchmarks.recsys``, the table-stack models of
``benchmarks.stacks`` and the hashed Criteo step of ``benchmarks.vocab``.
torch's and FBGEMM's twins: ``benchmarks.twins``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks._common import hlo_table_copies, huge_pages, make_ids
from benchmarks._timing import Counter, step_runner

SEED = 0
HIDDEN = 256  # the mlp head's width


# name -> (gtx optimizer, torch's, learning rate, FBGEMM's EmbOptimType)
STACK_OPTIMIZERS = {
  "lazy_adam": (lambda: gtx.lazy_adam(1e-3), "SparseAdam", 1e-3, None),
  "rowwise_adagrad": (
    lambda: gtx.rowwise_adagrad(1e-2),
    "Adagrad",
    1e-2,
    "EXACT_ROWWISE_ADAGRAD",
  ),
  "adagrad": (
    lambda: gtx.adagrad(
      1e-2, initial_accumulator_value=0.0, eps=1e-10, eps_outside_sqrt=True
    ),
    "Adagrad",
    1e-2,
    "EXACT_ADAGRAD",
  ),
  "sgd": (lambda: gtx.lazy_sgd(1e-2), "SGD", 1e-2, "EXACT_SGD"),
}


# Criteo Kaggle's 26 categorical cardinalities (DLRM, dlrm_s_criteo_kaggle).
CRITEO_KAGGLE = [
  1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683,
  8351593, 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15,
  286181, 105, 142572,
]  # fmt: skip


def table_rows(tables: int, cap: int) -> list[int]:
  """Criteo's cardinalities for ``tables`` tables, capped at ``cap``."""
  return [min(CRITEO_KAGGLE[i % 26], cap) for i in range(tables)]


def row_offsets(rows: list[int]) -> np.ndarray:
  return np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int32)


def head_params(tables: int, dim: int, head: str, hidden: int, rng) -> dict:
  """The head's leaves (numpy): ``linear`` (a logit weight vector per table,
  a bias) or ``mlp`` (a tanh layer of ``hidden``, then a logit)."""
  f32, zero = np.float32, np.zeros((), np.float32)
  if head == "linear":
    w = 0.1 * rng.standard_normal((tables, dim))
    return {"w": w.astype(f32), "b": zero}
  fan_in = tables * dim
  w1 = rng.standard_normal((fan_in, hidden)) / fan_in**0.5
  w2 = rng.standard_normal(hidden) / hidden**0.5
  b1 = np.zeros(hidden, f32)
  return {"w1": w1.astype(f32), "b1": b1, "w2": w2.astype(f32), "b2": zero}


def logit(p: Any, x: jax.Array) -> jax.Array:
  """The head on the embeddings ``x`` ``[batch, tables, dim]``."""
  if "w" in p:
    return jnp.sum(x * p["w"], axis=(1, 2)) + p["b"]
  h = jnp.tanh(x.reshape(x.shape[0], -1) @ p["w1"] + p["b1"])
  return h @ p["w2"] + p["b2"]


def bce(logit: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean(jax.nn.softplus(logit) - y * logit)


def concat_rows(stack: Any, table: Any, ids: Any) -> jax.Array:
  """``stack.lookup(..., output="concat")``, or ``concat=True`` before."""
  if "output" in inspect.signature(stack.lookup).parameters:
    return stack.lookup(table, ids, output="concat")
  return stack.lookup(table, ids, concat=True)


class OneTable(NamedTuple):
  """A table, the ``ct`` of its loss ``sum(f(E[ids]) * ct)``, fresh ids a
  step (numpy and on the device)."""

  table: np.ndarray
  ct_np: np.ndarray
  ids_np: list[np.ndarray]
  ids: list[jax.Array]
  ct: jax.Array

  def unique(self) -> float:
    """Distinct rows a step, on average."""
    return float(np.mean([len(np.unique(i)) for i in self.ids_np]))


def one_table(rows: int, dim: int, n: int, dist: str, steps: int) -> OneTable:
  """:class:`OneTable` with ``steps`` fresh batches of ``n`` ids."""
  ids_np = make_ids(rows, n, steps, dist)
  rng = np.random.default_rng(SEED + 1)
  table = (0.1 * rng.standard_normal((rows, dim))).astype(np.float32)
  ct_np = rng.standard_normal((n, dim)).astype(np.float32)
  ids = [jnp.asarray(i) for i in ids_np]
  return OneTable(table, ct_np, ids_np, ids, jnp.asarray(ct_np))


def one_table_step(
  tx: Any,
  data: OneTable,
  *,
  linear: bool = False,
  lookup: bool = False,
  dense: bool = False,
  dtype: Any = jnp.float32,
  stochastic: bool = False,
) -> tuple[Callable[[int], Any], list, int]:
  """:class:`OneTable`'s whole step, jitted, params and state donated:
  ``(run(i), [params, state], table copies)``. ``f`` is tanh unless
  ``linear``; ``lookup``: read by ``gtx.lookup``; ``dense``: jax's gradient
  and optax's apply; ``stochastic``: a new ``key=`` to apply a step."""
  import optax

  def loss(p, ids, ct):
    rows = gtx.lookup(p["emb"], ids) if lookup else p["emb"][ids]
    rows = rows.astype(jnp.float32)
    return jnp.sum((rows if linear else jnp.tanh(rows)) * ct)

  grad = jax.value_and_grad if dense else gtx.sparse_value_and_grad
  apply = optax.apply_updates if dense else gtx.apply_updates

  def step(p, s, ids, ct, *key):
    value, g = grad(loss)(p, ids, ct)
    u, s = tx.update(g, s, p)
    kw = {"key": key[0]} if key else {}
    return apply(p, u, **kw), s, value

  params = {"emb": jnp.asarray(data.table, dtype)}
  box = [params, tx.init(params)]
  huge_pages(box)
  jstep = jax.jit(step, donate_argnums=(0, 1))
  ids, ct, key = data.ids, data.ct, jax.random.key(0)

  def args_of(i: int) -> tuple:
    keys = (jax.random.fold_in(key, i),) if stochastic else ()
    return (ids[i % len(ids)], ct, *keys)

  copies = hlo_table_copies(jstep, data.table.shape, *box, *args_of(0))
  return step_runner(jstep, box, args_of), box, copies


def whole_step(loss, tx):
  def step(p, s, ids, y):
    value, g = gtx.sparse_value_and_grad(loss)(p, ids, y)
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s, value

  return jax.jit(step, donate_argnums=(0, 1))


def _columns(rows, batch, steps, dist):
  """Each table's ids a step, and a label vector a step."""
  cols = [make_ids(v, batch, steps, dist, SEED + t) for t, v in enumerate(rows)]
  rng = np.random.default_rng(SEED + 1)
  labels = [(rng.random(batch) < 0.25).astype(np.float32) for _ in range(steps)]
  return cols, labels


def criteo_data(rows, batch, steps, dist):
  cols, labels = _columns(rows, batch, steps, dist)
  ids = [{f"f{t}": c[s] for t, c in enumerate(cols)} for s in range(steps)]
  return ids, labels


def bag_data(tables, rows, batch, steps, dist, max_len=20):
  """Per step and table: padded ids, lengths, weights; the capacity."""
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


def criteo_models(rows, dim, batch=None, lanes=None):
  names = [f"f{t}" for t in range(len(rows))]
  specs = {n: gtx.TableSpec(r, dim) for n, r in zip(names, rows, strict=True)}
  lanes = {} if lanes is None else {"lanes": lanes}
  stack = gtx.TableStack(specs, batch_size=batch, **lanes)

  # both in the stack's concat order: the head means the same in both
  def per_table_loss(p, ids, y):
    order = stack.concat_order(ids)
    x = jnp.stack([p[n][ids[n]] for n in order], axis=1)
    return bce(logit(p["head"], x), y)

  def stack_loss(p, ids, y):
    x = concat_rows(stack, p["emb"], ids)
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
    x = concat_rows(stack, p["emb"], bags).reshape(batch, -1, dim)
    return bce(logit(p["head"], x), y)

  return stack, names, per_table_loss, stack_loss


def loop_runner(step, params, tx, batches, labels):
  """``step`` on the next batch a call, donated, its first step run."""
  box = [params, tx.init(params)]
  huge_pages(box)
  feed = list(zip(batches, labels, strict=True))
  run = Counter(step_runner(step, box, lambda i: feed[i % len(feed)]), 0)
  run()
  return run


class Data(NamedTuple):
  ids: list[np.ndarray]  # per step, [batch, tables] int32, table-local ids
  labels: list[np.ndarray]  # per step, [batch] float32


def make_data(rows: list[int], batch: int, steps: int, dist: str) -> Data:
  cols, labels = _columns(rows, batch, steps, dist)
  return Data([np.stack([c[s] for c in cols], 1) for s in range(steps)], labels)


def init_params(rows: list[int], dim: int, head: str, hidden: int) -> dict:
  """Tables ``t0 ...`` and the head's leaves (numpy)."""
  rng = np.random.default_rng(SEED + 2)
  p = {
    f"t{i}": (0.05 * rng.standard_normal((v, dim))).astype(np.float32)
    for i, v in enumerate(rows)
  }
  p.update(head_params(len(rows), dim, head, hidden, rng))
  return p


def stacked(params: dict[str, np.ndarray], tables: int) -> dict:
  """The same params, the tables stacked into one leaf ``emb``."""
  out = {"emb": np.concatenate([params[f"t{i}"] for i in range(tables)])}
  out.update({k: v for k, v in params.items() if not k.startswith("t")})
  return out


def per_table_loss(tables: int) -> Callable[..., jax.Array]:
  def loss(p, ids, y):
    x = jnp.stack([p[f"t{i}"][ids[:, i]] for i in range(tables)], axis=1)
    return bce(logit(p, x), y)

  return loss


def stacked_loss(rows: list[int]) -> Callable[..., jax.Array]:
  offsets = row_offsets(rows)

  def loss(p, ids, y):
    return bce(logit(p, p["emb"][ids + offsets]), y)

  return loss


def abstract_params(rows: list[int], dim: int, stacked: bool) -> dict:
  """The linear-head model's params as shapes, ``t0`` ... or ``emb``."""
  shapes = {"w": (len(rows), dim), "b": ()}
  if stacked:
    shapes["emb"] = (sum(rows), dim)
  else:
    shapes.update({f"t{i}": (v, dim) for i, v in enumerate(rows)})
  return {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, s in shapes.items()}


# ----------------------------------------------------------------------------
# hashed tables: benchmarks.vocab's Criteo step (and ab_versions' --hashed)


def zipf_raw(rng, n, a, salt):
  """``n`` raw ids: Zipf ranks below 10^9, scrambled (one-to-one)."""
  rank = np.minimum(rng.zipf(a, n), 10**9).astype(np.int64)
  return ((rank * 2654435761 + salt * 97) % (2**31 - 1)).astype(np.int32)


def criteo_raw(batch: int, batches: int, zipf: float, seed: int):
  """26 features' names, batches of raw ids, labels, distinct ids."""
  names = [f"f{t}" for t in range(26)]
  rng = np.random.default_rng(seed)
  raw = [
    {n: zipf_raw(rng, batch, zipf, t) for t, n in enumerate(names)}
    for _ in range(batches)
  ]
  labels = [(rng.random(batch) < 0.25).astype(np.float32) for _ in raw]
  distinct = {
    n: len(np.unique(np.concatenate([b[n] for b in raw]))) for n in names
  }
  return names, raw, labels, distinct


def hashed_criteo(names, rows, dim, tx, hashed: bool):
  """``(stack, params, jitted step)``: a table a feature, hashed or not, a
  logit per feature; :func:`hashed_step` donated."""
  specs = {
    n: gtx.TableSpec(rows[n], dim, hashed=gtx.Hashed() if hashed else None)
    for n in names
  }
  stack = gtx.TableStack(specs)

  def loss(p, ids, y):
    x = stack.lookup(p["emb"], ids, output="concat")
    x = x.reshape(x.shape[0], len(names), dim)
    w = p["w"][np.array([names.index(f) for f in stack.concat_order(ids)])]
    return bce(jnp.sum(x * w, axis=(1, 2)), y)

  params = {
    "emb": stack.init(jax.random.key(0)),
    "w": jnp.full((len(names), dim), 0.01, jnp.float32),
  }
  step = hashed_step(stack, tx, loss, hashed)
  return stack, params, jax.jit(step, donate_argnums=tuple(range(2 + hashed)))


def hashed_step(stack, tx, loss, hashed: bool):
  """The whole step (not jitted), the loss last; ``hashed``: ``stack.admit``
  and ``gtx.reset_rows`` first, ``vocab`` carried after the state."""

  def plain(params, state, ids, y):
    v, g = gtx.sparse_value_and_grad(loss)(params, ids, y)
    u, state = tx.update(g, state, params)
    return gtx.apply_updates(params, u), state, v

  def mapped(params, state, vocab, ids, y):
    ids, vocab, fresh = stack.admit(vocab, ids)
    params, state = gtx.reset_rows(tx, state, params, {"emb": fresh})
    params, state, v = plain(params, state, ids, y)
    return params, state, vocab, v

  return mapped if hashed else plain
