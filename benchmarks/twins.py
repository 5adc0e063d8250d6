"""torch's and FBGEMM's twins of the shared models (``benchmarks.models``),
and the random-rows floors beside them. torch is imported inside
functions: this module imports where torch does not.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks._common import import_torch, tbe, torch_huge_pages, torch_state
from benchmarks._timing import Counter

# torch's optimizers' learning rates, as the gtx twins' in benchmarks.recsys
LR = {"SparseAdam": 1e-3, "Adagrad": 1e-2, "SGD": 1e-2}


def torch_head(params_np: dict[str, np.ndarray], device="cpu") -> dict:
  import torch

  return {
    k: torch.nn.Parameter(torch.from_numpy(v.copy()).to(device))
    for k, v in params_np.items()
    if not k.startswith("t")
  }


def torch_logit(d: dict[str, Any], x: Any) -> Any:
  import torch

  if "w" in d:
    return (x * d["w"]).sum(dim=(1, 2)) + d["b"]
  h = torch.tanh(x.reshape(x.shape[0], -1) @ d["w1"] + d["b1"])
  return h @ d["w2"] + d["b2"]


def torch_table(name, data, *, linear=False, lr=1e-3, device="cpu"):
  """``models.one_table_step``'s twin: ``(run(i), objects, state bytes per
  row)``, its first step run."""
  torch = import_torch()
  emb = torch.nn.Embedding(*data.table.shape, sparse=True, device=device)
  with torch.no_grad():
    emb.weight.copy_(torch.from_numpy(data.table))
  opt = getattr(torch.optim, name)(emb.parameters(), lr=lr)
  ids = [torch.from_numpy(i.astype(np.int64)).to(device) for i in data.ids_np]
  ct = torch.from_numpy(data.ct_np).to(device)

  def run(i):
    opt.zero_grad(set_to_none=True)
    rows = emb(ids[i % len(ids)])
    loss = ((rows if linear else torch.tanh(rows)) * ct).sum()
    loss.backward()
    opt.step()
    loss.item()

  run(0)
  states = torch_state([opt])
  torch_huge_pages([emb.weight, *states])
  nbytes = sum(t.numel() * t.element_size() for t in states if t.dim() >= 1)
  return run, (emb, opt), nbytes / data.table.shape[0]


def _torch_optimizers(name: str, tables: list, dense: list, lr=None) -> list:
  import torch

  lr = LR[name] if lr is None else lr
  if name == "SparseAdam":  # SparseAdam refuses dense gradients
    return [torch.optim.SparseAdam(tables, lr=lr), torch.optim.Adam(dense, lr)]
  make = {"Adagrad": torch.optim.Adagrad, "SGD": torch.optim.SGD}[name]
  return [make(tables + dense, lr=lr)]


def _dlrm_twin(runner, params_np, rows, optimizer, lr, data):
  """``runner`` on ``benchmarks.recsys``' model: ``(run(i), loss, run)``."""
  import torch

  tables = [params_np[f"t{i}"] for i in range(len(rows))]
  feats = [{f"f{i}": s[:, i] for i in range(len(rows))} for s in data.ids]
  run, first = runner(
    torch, tables, params_np, optimizer, lr, feats, data.labels, False
  )
  return (lambda i: run()), first, run


def dlrm_torch(params_np, rows, opt_name, data):
  return _dlrm_twin(torch_runner, params_np, rows, opt_name, LR[opt_name], data)


def dlrm_fbgemm(params_np, rows, optim, data):
  lr = LR["SGD" if optim == "EXACT_SGD" else "Adagrad"]
  return _dlrm_twin(fbgemm_runner, params_np, rows, optim, lr, data)


def state_layout(tx: Any, dim: int) -> tuple[int, int]:
  """``(row buffers, per-row scalars)`` of ``tx``, the table included."""
  v = 1009  # any row count that is no other dimension
  state = jax.eval_shape(tx.init, {"t": jax.ShapeDtypeStruct((v, dim), "f4")})
  shapes = [x.shape for x in jax.tree.leaves(state)]
  return 1 + shapes.count((v, dim)), shapes.count((v,))


def random_rows_floor(layout, total: int, dim: int, data, offsets):
  """Each step's unique rows gathered and scattered: ``(run(i), how)``."""
  uniq = [np.unique(s + offsets) for s in data.ids]
  if jax.default_backend() != "cpu":
    run = _device_rows_floor(layout, total, dim, uniq)
    return run, "jitted jnp gather + scatter"
  return _host_rows_floor(layout, total, dim, uniq, import_torch())


def _host_rows_floor(layout, total: int, dim: int, uniq: list, torch):
  """The rows read and written back in place, by torch (or numpy)."""
  wide, narrow = layout
  shapes = [(total, dim)] * wide + [(total,)] * narrow
  if torch is not None:
    bufs = [torch.ones(sh) for sh in shapes]
    torch_huge_pages(bufs)
    idx = [torch.from_numpy(u.astype(np.int64)) for u in uniq]

    def run(i):
      u = idx[i % len(idx)]
      for b in bufs:
        b.index_copy_(0, u, b.index_select(0, u))

    return run, "torch index_select + index_copy_"
  bufs = [np.ones(sh, np.float32) for sh in shapes]

  def run_np(i):
    u = uniq[i % len(uniq)]
    for b in bufs:
      b[u] = np.take(b, u, axis=0)

  return run_np, "numpy take + fancy-index store"


def _device_rows_floor(layout, total: int, dim: int, uniq: list) -> Callable:
  """The same, jitted and donated (padded with an id the scatter drops)."""
  wide, narrow = layout
  n = max(len(u) for u in uniq)
  idx = [
    jnp.asarray(np.pad(u, (0, n - len(u)), constant_values=total)) for u in uniq
  ]
  box = [[jnp.ones((total, dim)) for _ in range(wide)]]
  box[0] += [jnp.ones(total) for _ in range(narrow)]

  @functools.partial(jax.jit, donate_argnums=0)
  def move(bufs, u):
    return [
      b.at[u].set(b.at[u].get(mode="fill", fill_value=0) + 1, mode="drop")
      for b in bufs
    ]

  def run(i):
    box[0] = move(box[0], idx[i % len(idx)])
    jax.block_until_ready(box[0])

  return run


def _on(torch, device):
  """numpy -> a tensor on ``device``."""
  return lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)


def _runner(torch, hp, opts, feed, forward, buffers):
  """``run()``: ``forward`` on the next of ``feed`` (its inputs, then the
  labels), the head, the loss's backward and ``opts``' steps: ``(run,
  first loss)``, then ``buffers()`` (after the first step) on huge pages."""
  loop = itertools.cycle(feed)

  def run():
    *x, y = next(loop)
    for o in opts:
      o.zero_grad(set_to_none=True)
    logit = torch_logit(hp, forward(*x))
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, y)
    loss.backward()  # FBGEMM's tables' optimizer runs fused in here
    for o in opts:
      o.step()
    return loss.item()

  first = run()
  torch_huge_pages(buffers())
  return run, first


def torch_runner(
  torch, tables_np, hp_np, opt_name, lr, batches, labels, bags, device="cpu"
):
  """One ``nn.Embedding`` (``nn.EmbeddingBag`` for ``bags`` of
  ``(ids, lengths, weights, n)``) a table, ``sparse=True``, and the head:
  ``(run(), first loss)``."""
  on = _on(torch, device)
  tables = []
  for t in tables_np:
    cls = torch.nn.EmbeddingBag if bags else torch.nn.Embedding
    kw = {"mode": "sum"} if bags else {}
    e = cls(t.shape[0], t.shape[1], sparse=True, device=device, **kw)
    with torch.no_grad():
      e.weight.copy_(torch.from_numpy(t))
    tables.append(e)
  hp = torch_head(hp_np, device)
  weights = [e.weight for e in tables]
  opts = _torch_optimizers(opt_name, weights, list(hp.values()), lr)
  feed = []
  for b, y in zip(batches, labels, strict=True):
    step = []
    for k in range(len(tables)):
      if bags:
        ids, lengths, wt, n = b[f"f{k}"]
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        step.append(
          (on(ids[:n].astype(np.int64)), on(offsets.astype(np.int64)))
          + (on(wt[:n]),)
        )
      else:
        step.append(on(b[f"f{k}"].astype(np.int64)))
    feed.append((step, on(y)))

  def forward(step):
    if bags:
      xs = [
        e(*x[:2], per_sample_weights=x[2])
        for e, x in zip(tables, step, strict=True)
      ]
    else:
      xs = [e(ids) for e, ids in zip(tables, step, strict=True)]
    return torch.stack(xs, dim=1)

  return _runner(
    torch, hp, opts, feed, forward, lambda: weights + torch_state(opts)
  )


def fbgemm_runner(
  torch, tables_np, hp_np, optim, lr, batches, labels, bags, device="cpu"
):
  """FBGEMM's table-batched module (the kernels TorchRec's
  ``EmbeddingBagCollection`` runs): all tables in one module, one call on
  its jagged input pooled by a sum, the optimizer fused into the backward;
  the head by torch's dense optimizer of the same kind."""
  on = _on(torch, device)
  rows, dim = [t.shape[0] for t in tables_np], tables_np[0].shape[1]
  module = tbe(rows, dim, optim, "SUM", lr, device)
  with torch.no_grad():
    for dst, t in zip(module.split_embedding_weights(), tables_np, strict=True):
      dst.copy_(torch.from_numpy(t))
  hp = torch_head(hp_np, device)
  head = {"EXACT_SGD": torch.optim.SGD, "ADAM": torch.optim.Adam}
  head = head.get(optim, torch.optim.Adagrad)(list(hp.values()), lr=lr)
  num = len(tables_np)
  feed = []
  for b, y in zip(batches, labels, strict=True):
    if bags:
      parts = [b[f"f{k}"] for k in range(num)]
      ids = np.concatenate([p[0][: p[3]] for p in parts])
      lengths = np.concatenate([p[1] for p in parts])
      wt = on(np.concatenate([p[2][: p[3]] for p in parts]))
    else:
      ids = np.concatenate([b[f"f{k}"] for k in range(num)])
      lengths = np.ones(ids.shape[0], np.int64)
      wt = None
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    feed.append((on(ids.astype(np.int64)), on(offsets.astype(np.int64)), wt))
    feed[-1] += (on(y),)

  def forward(ids, offsets, wt):
    return module(ids, offsets, per_sample_weights=wt).view(-1, num, dim)

  return _runner(
    torch, hp, [head], feed, forward, lambda: list(module.buffers())
  )


def floor_runner(torch, rows, dim, optimizer, unique_ids):
  """The optimizer part's floor: the unique rows of param and state."""
  layout = {"lazy_adam": 3, "adagrad": 2}.get(optimizer, 1), 0
  if optimizer == "rowwise_adagrad":
    layout = 1, 1
  run, _ = _host_rows_floor(layout, rows, dim, unique_ids, torch)
  run = Counter(run, 0)
  run()
  return run
