"""The whole-step figures on one GPU, gtx beside torch (and FBGEMM where it
imports), with the cost model's prediction beside each gtx figure.

The steps of :mod:`benchmarks.gpu_steps`, each the guides' whole step
(forward with the loss returned, sparse backward, optimizer, updates
applied, state donated; fresh ids every step, uniform), compiled once
ahead of time and timed round-robin in one process
(:func:`benchmarks._timing.time_interleaved`), beside the twins of
:data:`TWINS`:

* ``single table``: 1M x 64, 8,192 ids, ``gtx.lazy_adam``; torch
  ``nn.Embedding(sparse=True)`` + ``SparseAdam``.
* ``criteo``: the 26-feature Criteo stack, batch 2048, a linear logit per
  feature; torch 26 ``nn.Embedding(sparse=True)`` + ``SparseAdam`` (the
  head on ``Adam``); FBGEMM's table-batched module on the GPU with its
  fused Adam (``EmbOptimType.ADAM``, bags of one id) where ``fbgemm_gpu``
  imports.
* ``bags``: the same tables read by bags of 1-20 weighted ids
  (``gtx.Jagged``), batch 1024; torch ``nn.EmbeddingBag(mode="sum",
  sparse=True, per_sample_weights)``; FBGEMM as above.
* ``hashed``: the 26 tables hashed, ``admit`` + ``reset_rows`` + the step
  (torch has no id map: gtx only).
* compile: trace + lower + compile of the ``gtx.Keyed`` step at 26 and 500
  features.

For every gtx step: the milliseconds, the model's prediction
(:mod:`benchmarks.gpu_model`, a model, not a measurement), the compile
seconds and the while loops left in the compiled program (what the GPU
runs, after XLA's passes). ``--dry-run`` runs every part at toy sizes on
the CPU (torch parts where torch imports, FBGEMM never) in well under a
minute, so the script cannot rot; ``benchmarks/gpu.sh`` is the command
for a lent GPU. Writes ``<out>/gpu.md`` and ``gpu.json`` (default
``benchmarks/results``).

  python -m benchmarks.gpu [--dry-run] [--rounds 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import jax
import numpy as np

from benchmarks import gpu_model, gpu_steps, models, twins
from benchmarks._common import available, compile_phases, hlo_op_counts
from benchmarks._common import version as _version
from benchmarks._results import RESULTS, commit, machine, markdown_table
from benchmarks._timing import Clock, Counter, Schedule

SEED = 0
LR = 1e-3
TWINS = {"single table": ["torch"], "criteo": ["torch", "fbgemm"]}
TWINS["bags"] = TWINS["criteo"]
MEASURED = ["single table", "criteo", "bags", "hashed"]  # timed
COMPILES = ["keyed 26", "keyed 500"]  # compiled only


def gtx_runner(program: gpu_steps.Program, batches: list):
  """The step compiled ahead of time on the next of ``batches`` a call,
  and its compile seconds and op counts (``while``: loops left after
  XLA's passes)."""
  clock = Clock()
  compiled = program.step.trace(*program.args).lower().compile()
  counts = {"compile_s": clock.wall(), **hlo_op_counts(compiled.as_text())}
  box = list(program.init(jax.random.key(SEED)))
  cycle = itertools.cycle(batches)

  def run():
    out = compiled(*box, *next(cycle))
    box[:] = out[: program.donated]
    out[-1].block_until_ready()

  run()
  return run, counts


def twin_runner(torch, system: str, program, batches):
  """torch's (or FBGEMM's, on the device) twin of ``program`` on the same
  ids: ``nn.Embedding(sparse=True)`` + ``SparseAdam`` for the one table
  (``twins.torch_table``); for the stacks one ``nn.Embedding`` /
  ``nn.EmbeddingBag`` a table with the head on ``Adam``
  (``twins.torch_runner``) or FBGEMM's table-batched module, its fused
  Adam in the backward (``twins.fbgemm_runner``)."""
  info, rng = program.info, np.random.default_rng(SEED)
  dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
  if "rows" in info:  # the one table
    ids = [b[0] for b in batches]
    shape = (info["rows"], info["dim"])
    table = (0.05 * rng.standard_normal(shape)).astype(np.float32)
    ct = np.full((len(ids[0]), info["dim"]), 0.01, np.float32)
    data = models.OneTable(table, ct, ids, [], None)
    return Counter(twins.torch_table("SparseAdam", data, lr=LR, device=dev)[0])
  dim, features = info["dim"], info["features"]
  tables = [
    (0.05 * rng.standard_normal((r, dim))).astype(np.float32)
    for r in gpu_steps.criteo_rows(features, info["cap"])
  ]
  head = models.head_params(features, dim, "linear", 0, rng)
  bags = isinstance(next(iter(batches[0][0].values())), tuple)
  feats = [
    {f: (*v, int(v[1].sum())) if bags else v for f, v in b[0].items()}
    for b in batches
  ]
  labels = [b[1] for b in batches]
  runner, optim = twins.torch_runner, "SparseAdam"
  if system == "fbgemm":
    runner, optim = twins.fbgemm_runner, "ADAM"
  return runner(torch, tables, head, optim, LR, feats, labels, bags, dev)[0]


def _model_ms(program: gpu_steps.Program) -> float:
  try:
    return gpu_model.predict(program).seconds * 1e3
  except Exception:  # noqa: BLE001 - a figure without its model is kept
    return float("nan")


def _guarded(args, notes: list[str], what: str, fn, *a):
  """``fn(*a)``; on a device a part that fails is noted and the run goes
  on (the other figures are worth the lent minutes); a dry run raises."""
  if args.dry_run:
    return fn(*a)
  try:
    return fn(*a)
  except Exception as e:  # noqa: BLE001
    notes.append(f"{what} did not run ({type(e).__name__}: {e})")
    print(notes[-1], flush=True)
    return None


def one_step(args, name, program, torch, rng, notes) -> list[dict]:
  batches = [jax.device_put(program.batch(rng)) for _ in range(args.batches)]
  run, counts = gtx_runner(program, batches)
  fns = {"gtx": run}
  np_batches = [jax.tree.map(np.asarray, b) for b in batches]
  fbgemm = torch is not None and available("fbgemm_gpu")
  for system in TWINS.get(name, []) if torch is not None else []:
    if system == "fbgemm" and not (fbgemm and torch.cuda.is_available()):
      continue
    what = f"{name}: {system}"
    twin = _guarded(
      args, notes, what, twin_runner, torch, system, program, np_batches
    )
    if twin is not None:
      fns[system] = twin
  times = Schedule.from_args(args).time(fns, label=name)
  rows = []
  for system, s in times.items():
    row = {"step": name, "system": system, "ms": s * 1e3}
    if system == "gtx":
      row.update(model_ms=_model_ms(program), compile_s=counts["compile_s"])
      row.update(kernels=counts["kernels"], whiles=counts["while"])
    rows.append(row)
    print(row, flush=True)
  return rows


def compile_point(name: str, program: gpu_steps.Program) -> dict:
  phases = compile_phases(program.step, *program.args)
  row = {"step": name, "compile_s": phases["total_s"]}
  row.update(kernels=phases["kernels"], whiles=phases["while"])
  row["model_ms"] = _model_ms(program)
  print(row, flush=True)
  return row


def write(args, rows, compiles, notes) -> str:
  m = machine()
  by_step: dict[str, dict] = {}
  for r in rows:
    by_step.setdefault(r["step"], {})[r["system"]] = r
  table = []
  for step, systems in by_step.items():
    g = systems["gtx"]
    table.append(
      [step, f"{g['ms']:.3f}", f"{g['model_ms']:.3f}"]
      + [f"{g['ms'] / g['model_ms']:.2f}x"]
      + [f"{systems[s]['ms']:.3f}" if s in systems else "n/a"
         for s in ("torch", "fbgemm")]
      + [f"{g['compile_s']:.1f}", g["kernels"], g["whiles"]]
    )  # fmt: skip
  ctable = [
    [c["step"], f"{c['compile_s']:.1f}", c["kernels"], c["whiles"],
     f"{c['model_ms']:.3f}"]
    for c in compiles
  ]  # fmt: skip
  kind = "DRY RUN at toy sizes (not figures)" if args.dry_run else "measured"
  versions = {
    mod: _version(mod) if available(mod) else "not installed"
    for mod in ("torch", "fbgemm_gpu")
  }
  md = "\n".join([
    f"## The guides' whole steps on one GPU: {kind}",
    "",
    f"Device: {m['device']} (backend {m['backend']}), JAX {m['jax']}, "
    f"torch {versions['torch']}, fbgemm_gpu {versions['fbgemm_gpu']}; "
    f"gradtx at {commit()}. Median ms of a whole step "
    f"({Schedule.from_args(args).describe()}), "
    "fresh uniform ids, state donated. `model ms`: the cost model's "
    "prediction for the same program (`benchmarks/gpu_model.py`: a model, "
    "not a measurement; H100 HBM at 3.35 TB/s plus launch and sync costs). "
    "`device whiles`: while loops left in the program XLA compiled for "
    "this device.",
    "",
    markdown_table(
      ["step", "gtx ms", "model ms (a model)", "measured / model",
       "torch ms", "fbgemm ms", "gtx compile s", "kernels",
       "device whiles"],
      table,
    ),
    "",
    "Compile (trace + lower + compile) of the `gtx.Keyed` step:",
    "",
    markdown_table(
      ["step", "compile s", "kernels", "device whiles",
       "model ms (a model)"],
      ctable,
    ),
  ] + ([""] + [f"- {n}" for n in notes] if notes else []))  # fmt: skip
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "gpu.md").write_text(md + "\n")
  payload = {"machine": m, "steps": rows, "compile": compiles, "notes": notes}
  payload["dry_run"] = args.dry_run
  (args.out / "gpu.json").write_text(json.dumps(payload, indent=2))
  print(md)
  return md


def main(argv: list[str] | None = None) -> str:
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--dry-run", action="store_true")
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--burst", type=int, default=10)
  ap.add_argument("--settle", type=int, default=3)
  ap.add_argument("--batches", type=int, default=8, help="distinct batches")
  ap.add_argument("--out", type=Path, default=RESULTS)
  ap.add_argument("--no-torch", action="store_true")
  args = ap.parse_args(argv)
  if args.dry_run:
    args.rounds, args.burst, args.settle, args.batches = 1, 1, 0, 2
  steps = gpu_steps.TOY if args.dry_run else gpu_steps.STEPS
  torch = None
  if not args.no_torch and available("torch"):
    import torch
  rows, compiles, notes = [], [], []
  rng = np.random.default_rng(SEED)
  for name in MEASURED:

    def run(name=name):
      return one_step(args, name, steps[name](), torch, rng, notes)

    rows += _guarded(args, notes, name, run) or []
  for name in COMPILES:
    row = _guarded(
      args,
      notes,
      f"compile {name}",
      lambda n=name: compile_point(n, steps[n]()),
    )
    compiles += [row] if row is not None else []
  return write(args, rows, compiles, notes)


if __name__ == "__main__":
  main()
