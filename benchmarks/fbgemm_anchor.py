"""FBGEMM anchor: TorchRec's fused embedding kernels on CPU, beside torch.

Optional: runs only where ``fbgemm_gpu`` imports (package ``fbgemm-gpu-cpu``,
which needs its matching torch: 1.9.0 pairs with torch 2.14.x, a separate
environment from gradtx's), and skips cleanly otherwise. It needs neither
jax nor gradtx, so it runs in that other environment:

  python -m venv /tmp/fbvenv
  /tmp/fbvenv/bin/pip install fbgemm-gpu-cpu==1.9.0 torch==2.14.1 numpy
  /tmp/fbvenv/bin/python -m benchmarks.fbgemm_anchor [--rows 1000000]

The same training step as ``benchmarks/train_step.py`` (fresh uniform ids
each step, loss ``sum(tanh(E[ids]) * ct)``), timed round-robin with
torch ``nn.Embedding(sparse=True)`` + ``SparseAdam`` in the same process:
FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` (HOST location, CPU)
fuses backward and optimizer. Adam is refused on CPU ("adam is not
supported in CPU mode"), so it runs the optimizers it has: EXACT_ADAGRAD
and EXACT_SGD as SUM bags of one id, EXACT_ROWWISE_ADAGRAD with pooling
NONE. Writes ``benchmarks/results/fbgemm_anchor.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# Stdlib-only helpers: this runs in an environment without jax.
from benchmarks._common import RESULTS, cpu_name, markdown_table


def _tbe(rows, dim, optim, pooling, lr):
  """FBGEMM's table-batched module on CPU: one table of ``rows`` rows, or
  one table per entry of a list (every table ``dim`` wide)."""
  from fbgemm_gpu.split_embedding_configs import EmbOptimType
  from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    EmbeddingLocation,
    PoolingMode,
  )
  from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
  )

  tables = rows if isinstance(rows, list) else [rows]
  return SplitTableBatchedEmbeddingBagsCodegen(
    [(r, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for r in tables],
    optimizer=getattr(EmbOptimType, optim),
    pooling_mode=getattr(PoolingMode, pooling),
    learning_rate=lr,
  )


def tbe_step(rows, dim, optim, pooling, lr, ids, ct):
  """FBGEMM's fused training step on ``[rows, dim]``: ``run(i)`` reads
  ``ids[i % len(ids)]`` (int64 tensors) as bags of one id, returns the loss
  ``sum(tanh(E[ids]) * ct)`` as a float after the backward, which runs the
  optimizer fused. Also the optimizer state's bytes per row and the
  module."""
  import torch

  tbe = _tbe(rows, dim, optim, pooling, lr)
  n = ct.shape[0]
  offsets = torch.arange(n + 1, dtype=torch.int64)

  def run(i):
    out = tbe(ids[i % len(ids)], offsets)
    loss = (torch.tanh(out.view(n, dim)) * ct).sum()
    loss.backward()  # the optimizer runs fused in the backward
    return loss.item()

  states = [t for table in tbe.split_optimizer_states() for t in table]
  per_row = sum(t.numel() * t.element_size() for t in states) / rows
  return run, per_row, tbe


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--rows", type=int, default=1_000_000)
  parser.add_argument("--dim", type=int, default=64)
  parser.add_argument("--ids", type=int, default=8192)
  parser.add_argument("--rounds", type=int, default=15)
  args = parser.parse_args(argv)
  try:
    import fbgemm_gpu  # noqa: F401
    import numpy as np
    import torch
  except ImportError as e:
    print(
      f"fbgemm_anchor: skipped ({e}). Install fbgemm-gpu-cpu with its "
      "matching torch in a separate environment (see this module's "
      "docstring); docs/benchmarks.md quotes earlier measured figures, "
      "labelled as such."
    )
    return 0
  torch.set_num_threads(2)
  rows, dim, n = args.rows, args.dim, args.ids
  rng = np.random.default_rng(0)
  steps = args.rounds + 2
  ids = [
    torch.from_numpy(rng.integers(0, rows, n).astype(np.int64))
    for _ in range(steps)
  ]
  ct = torch.from_numpy(rng.standard_normal((n, dim)).astype(np.float32))
  variants = {}

  def add_tbe(name, optim, pooling):
    try:
      variants[name], *_ = tbe_step(rows, dim, optim, pooling, 1e-3, ids, ct)
    except Exception as e:  # an optimizer this build refuses on CPU
      print(f"{name}: not available ({type(e).__name__}: {e})")

  add_tbe("FBGEMM EXACT_ADAGRAD (SUM bags of 1)", "EXACT_ADAGRAD", "SUM")
  add_tbe("FBGEMM EXACT_SGD (SUM bags of 1)", "EXACT_SGD", "SUM")
  add_tbe(
    "FBGEMM EXACT_ROWWISE_ADAGRAD (pooling NONE)",
    "EXACT_ROWWISE_ADAGRAD",
    "NONE",
  )
  add_tbe("FBGEMM ADAM (pooling NONE)", "ADAM", "NONE")
  emb = torch.nn.Embedding(rows, dim, sparse=True)
  opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-3)

  def torch_step(i):
    opt.zero_grad(set_to_none=True)
    loss = (torch.tanh(emb(ids[i % steps])) * ct).sum()
    loss.backward()
    opt.step()
    loss.item()

  variants["torch nn.Embedding(sparse=True) + SparseAdam"] = torch_step
  times = {k: [] for k in variants}
  for i in range(steps):
    for k, f in variants.items():
      t0 = time.perf_counter()
      f(i)
      if i >= 2:
        times[k].append(time.perf_counter() - t0)
  ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
  ref = ms["torch nn.Embedding(sparse=True) + SparseAdam"]
  lines = [
    "## FBGEMM anchor: fused CPU embedding step vs torch SparseAdam",
    "",
    f"Machine: {cpu_name()}, {os.cpu_count()} cores; torch {torch.__version__},"
    f" fbgemm_gpu {fbgemm_gpu.__version__}, 2 threads.",
    "",
    markdown_table(
      ["system", "ms/step", "/ torch SparseAdam"],
      [[k, v, v / ref] for k, v in ms.items()],
    ),
  ]
  load = "/".join(f"{x:.1f}" for x in os.getloadavg())
  lines += [
    "",
    f"{rows:,} x {dim} table, {n:,} fresh uniform ids a step, loss "
    "`sum(tanh(E[ids]) * ct)` returned; median of "
    f"{args.rounds} round-robin steps. FBGEMM has no Adam on CPU. Load "
    f"average (1/5/15 min) at the end: {load}.",
  ]
  md = "\n".join(lines) + "\n"
  print(md)
  RESULTS.mkdir(exist_ok=True)
  (RESULTS / "fbgemm_anchor.md").write_text(md)
  (RESULTS / "fbgemm_anchor.json").write_text(
    json.dumps(
      {"ms": ms, "rows": rows, "dim": dim, "ids": n, "load": load}, indent=2
    )
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
