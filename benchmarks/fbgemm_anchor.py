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

import sys

from benchmarks._common import (
  fbgemm,
  import_torch,
  parse,
  parser,
  tbe_step,
  version,
)
from benchmarks._results import write_results

# The harness imports jax only where it is installed: this runs without it.
from benchmarks._timing import Counter, time_interleaved


def main(argv: list[str] | None = None) -> int:
  p = parser(__doc__.split("\n\n")[0], rounds=15)
  p.add_argument("--rows", type=int, default=1_000_000)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--ids", type=int, default=8192)
  args = parse(p, argv, quick=dict(rows=20_000, ids=512, rounds=3))
  if not fbgemm():
    print(
      "fbgemm_anchor: skipped (fbgemm_gpu or torch does not import). Install "
      "fbgemm-gpu-cpu with its matching torch in a separate environment "
      "(see this module's docstring); docs/benchmarks.md quotes earlier "
      "measured figures, labelled as such."
    )
    return 0
  import numpy as np

  torch = import_torch()
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
  times = time_interleaved(
    {k: Counter(f, 0) for k, f in variants.items()}, rounds=args.rounds
  )
  ms = {k: t * 1e3 for k, t in times.items()}
  ref = ms["torch nn.Embedding(sparse=True) + SparseAdam"]
  write_results(
    "fbgemm_anchor",
    "FBGEMM anchor: fused CPU embedding step vs torch SparseAdam",
    ["system", "ms/step", "/ torch SparseAdam"],
    [[k, v, v / ref] for k, v in ms.items()],
    notes=(
      f"{rows:,} x {dim} table, {n:,} fresh uniform ids a step, loss "
      "`sum(tanh(E[ids]) * ct)` returned; median of "
      f"{args.rounds} round-robin steps. FBGEMM has no Adam on CPU. torch "
      f"{version('torch')}, fbgemm_gpu {version('fbgemm_gpu')}, 2 threads."
    ),
    extra={"ms": ms, "table": {"rows": rows, "dim": dim, "ids": n}},
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
