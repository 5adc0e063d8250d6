"""The whole-step figures on one GPU: gtx beside torch (and FBGEMM where it
imports), the cost model's prediction beside each gtx figure.

Each step of :mod:`benchmarks.gpu_steps` in :data:`MEASURED` compiled ahead
of time and timed round-robin beside its twins (:data:`TWINS`), fresh
uniform ids every step, the state donated; those of :data:`COMPILES` only
compiled. ``--dry-run`` runs every part at toy sizes on the CPU (FBGEMM
never), so the script cannot rot; ``benchmarks/gpu.sh`` is the command for
a lent GPU. Writes ``<out>/gpu.md`` and ``gpu.json``.

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
from benchmarks._common import available, hlo_op_counts
from benchmarks._common import version as _version
from benchmarks._results import RESULTS, commit, machine, markdown_table
from benchmarks._timing import Clock, Counter, Schedule

SEED = 0
LR = 1e-3
TWINS = {"single table": ["torch"], "criteo": ["torch", "fbgemm"]}
TWINS["bags"] = TWINS["criteo"]
MEASURED = ["single table", "criteo", "bags", "hashed"]  # timed
COMPILES = ["keyed 26", "keyed 500"]  # compiled only
HEADERS = (
  "step | gtx ms | model ms (a model) | measured / model | torch ms | "
  "fbgemm ms | gtx compile s | kernels | device whiles"
).split(" | ")
CHEADERS = "step | compile s | kernels | device whiles | model ms (a model)"
CHEADERS = CHEADERS.split(" | ")


def twin_runner(torch, system: str, program, batches):
  """torch's (or FBGEMM's) twin of ``program`` on the same ids: the one
  table by ``twins.torch_table``, the stacks by ``twins.torch_runner`` or
  ``twins.fbgemm_runner`` (the head on ``Adam``)."""
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
    for r in models.table_rows(features, info["cap"])
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
  try:
    return fn(*a)
  except Exception as e:
    if args.dry_run:
      raise
    notes.append(f"{what} did not run ({type(e).__name__}: {e})")
    print(notes[-1], flush=True)
    return None


def one_step(args, name, make, torch, rng, notes) -> list[dict]:
  """The rows of step ``name``: compiled ahead of time (its compile
  seconds, op counts and the model's ms), then, unless only compiled,
  timed beside its twins on ``args.batches`` batches."""
  program = make()
  if name in MEASURED:
    batches = [jax.device_put(program.batch(rng)) for _ in range(args.batches)]
  clock = Clock()
  exe = program.step.trace(*program.args).lower().compile()
  gtx, counts = {"compile_s": clock.wall()}, hlo_op_counts(exe.as_text())
  gtx.update(kernels=counts["kernels"], whiles=counts["while"])
  gtx["model_ms"] = _model_ms(program)
  if name not in MEASURED:
    print(gtx, flush=True)
    return [{"step": name, **gtx}]
  box = list(program.init(jax.random.key(SEED)))
  cycle = itertools.cycle(batches)

  def run():
    out = exe(*box, *next(cycle))
    box[:] = out[: program.donated]
    out[-1].block_until_ready()

  run()
  fns = {"gtx": run}
  np_batches = [jax.tree.map(np.asarray, b) for b in batches]
  cuda = torch is not None and torch.cuda.is_available()
  for system in TWINS.get(name, []) if torch is not None else []:
    if system == "fbgemm" and not (cuda and available("fbgemm_gpu")):
      continue
    twin = _guarded(
      args, notes, f"{name}: {system}", twin_runner, torch, system, program,
      np_batches,
    )  # fmt: skip
    if twin is not None:
      fns[system] = twin
  rows = []
  for system, s in Schedule.from_args(args).time(fns, label=name).items():
    rows.append({"step": name, "system": system, "ms": s * 1e3})
    rows[-1].update(gtx if system == "gtx" else {})
    print(rows[-1], flush=True)
  return rows


def write(args, rows, compiles, notes) -> str:
  m, by_step = machine(), {}
  for r in rows:
    by_step.setdefault(r["step"], {})[r["system"]] = r
  table = [
    [step, f"{g['ms']:.3f}", f"{g['model_ms']:.3f}"]
    + [f"{g['ms'] / g['model_ms']:.2f}x"]
    + [f"{s[k]['ms']:.3f}" if k in s else "n/a" for k in ("torch", "fbgemm")]
    + [f"{g['compile_s']:.1f}", g["kernels"], g["whiles"]]
    for step, s in by_step.items()
    for g in [s["gtx"]]
  ]
  ctable = [
    [c["step"], f"{c['compile_s']:.1f}", c["kernels"], c["whiles"]]
    + [f"{c['model_ms']:.3f}"]
    for c in compiles
  ]
  kind = "DRY RUN at toy sizes (not figures)" if args.dry_run else "measured"
  v = {
    mod: _version(mod) if available(mod) else "not installed"
    for mod in ("torch", "fbgemm_gpu")
  }
  md = [
    f"## The guides' whole steps on one GPU: {kind}",
    "",
    f"Device: {m['device']} (backend {m['backend']}), JAX {m['jax']}, "
    f"torch {v['torch']}, fbgemm_gpu {v['fbgemm_gpu']}; gradtx at "
    f"{commit()}. Median ms of a whole step "
    f"({Schedule.from_args(args).describe()}), "
    "fresh uniform ids, state donated. `model ms`: the cost model's "
    "prediction for the same program (`benchmarks/gpu_model.py`: a model, "
    "not a measurement; H100 HBM at 3.35 TB/s plus launch and sync costs). "
    "`device whiles`: while loops left in the program XLA compiled for "
    "this device.",
    "",
    markdown_table(HEADERS, table),
    "",
    "Compile (trace + lower + compile) of the `gtx.Keyed` step:",
    "",
    markdown_table(CHEADERS, ctable),
  ]
  md = "\n".join(md + ([""] + [f"- {n}" for n in notes] if notes else []))
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
  for flag, default in (("rounds", 5), ("burst", 10), ("settle", 3)):
    ap.add_argument(f"--{flag}", type=int, default=default)
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
  out = {"rows": [], "compiles": [], "notes": []}
  rng = np.random.default_rng(SEED)
  notes = out["notes"]
  for name in MEASURED + COMPILES:
    to = "rows" if name in MEASURED else "compiles"
    what = name if name in MEASURED else f"compile {name}"
    part = (one_step, args, name, steps[name], torch, rng, notes)
    out[to] += _guarded(args, notes, what, *part) or []
  return write(args, **out)


if __name__ == "__main__":
  main()
