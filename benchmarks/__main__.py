"""Runs every benchmark, makes the plots, prints one table of ratios.

  python -m benchmarks [--quick] [--only NAME ...]

Each benchmark runs in its own process (clean memory, its own device
flags) and writes ``benchmarks/results/<name>.md|json``; the plots are made
from those files by ``benchmarks.plots``.
"""

from __future__ import annotations

import json
import subprocess
import sys

from benchmarks._common import parse, parser
from benchmarks._results import RESULTS, machine, markdown_table
from benchmarks._timing import Clock
from benchmarks.probes import PROBES

BENCHMARKS = """sparse_grad lazy_adam accumulate staleness mirrored train_step
optimizers dense_threshold lr_pass row_reader row_gather cpu_overlap
convergence low_precision recsys compile_tables stacks vocab
eager_calls bounds_check publish""".split()
RESULT_NAME = {"staleness": "async_staleness"}  # module -> results/<name>


def headlines() -> list[list]:
  rows = []
  for name in BENCHMARKS:
    path = RESULTS / f"{RESULT_NAME.get(name, name)}.json"
    if not path.exists():
      continue
    for h in json.loads(path.read_text()).get("headline", []):
      rows.append([name, h["metric"], h["value"], h.get("target", "")])
  return rows


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__)
  p.add_argument("--only", nargs="+", choices=BENCHMARKS)
  args = parse(p, argv)  # --quick: each benchmark's results as <name>_quick
  failed = []
  for name in args.only or BENCHMARKS:
    cmd = [sys.executable, "-m", f"benchmarks.{name}"]
    if name in PROBES:  # python -m benchmarks.probes NAME
      cmd = [sys.executable, "-m", "benchmarks.probes", name]
    cmd += ["--quick"] if args.quick else []
    print(f"\n=== {' '.join(cmd[1:])}", flush=True)
    clock = Clock()
    if subprocess.run(cmd).returncode:
      failed.append(name)
    print(f"=== {name}: {clock.wall():.0f}s", flush=True)
  if args.quick:
    print("quick run: results written with suffix _quick; plots unchanged")
    return
  subprocess.run([sys.executable, "-m", "benchmarks.plots"], check=False)
  m = machine()
  table = markdown_table(
    ["benchmark", "metric", "value", "target"], headlines()
  )
  print(
    f"\n## Headline ratios ({m['cpu']}, {m['cores']} cores, "
    f"JAX {m['jax']})\n\n{table}"
  )
  (RESULTS / "summary.md").write_text(
    f"## Headline ratios\n\nMachine: {m['cpu']}, {m['cores']} cores, "
    f"backend {m['backend']}, JAX {m['jax']}.\n\n{table}\n"
  )
  if failed:
    raise SystemExit(f"failed: {failed}")


if __name__ == "__main__":
  main()
