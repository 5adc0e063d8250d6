"""``TableStack.init`` against the number of tables, this checkout against
an earlier commit.

A model's first call of ``stack.init(key)``, wall seconds including every
compile, each in a fresh process (the persistent compilation cache off),
for 26, 104 and 500 tables ``--dim`` wide: Criteo's cardinalities capped at
``--cap`` rows and repeated past 26 (26 distinct table shapes), and tables
of distinct sizes (``1000 + 7 i`` rows: one shape each). The earlier
version (``--before``) is materialized from git as in ``ab_versions``.

  python -m benchmarks.stack_init --before REV [--tables 26 104 500]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchmarks._common import ROOT, parse, parser
from benchmarks._results import write_results
from benchmarks._timing import once
from benchmarks.models import table_rows


def _sizes(kind: str, n: int, cap: int) -> list[int]:
  return (
    table_rows(n, cap) if kind == "criteo" else [1000 + 7 * i for i in range(n)]
  )


def _one(rev: str, kind: str, n: int, cap: int, dim: int) -> None:
  """In a fresh process: the first ``init`` of one stack, printed as JSON."""
  import jax

  jax.config.update("jax_enable_compilation_cache", False)
  if rev == "HEAD+":
    import gradtx as gtx
  else:
    from benchmarks._common import load_version

    gtx = load_version(rev)
  sizes = _sizes(kind, n, cap)
  stack = gtx.TableStack(
    {f"t{i}": gtx.TableSpec(r, dim) for i, r in enumerate(sizes)}
  )
  key = jax.random.key(0)
  jax.block_until_ready(jax.random.fold_in(key, 1))  # the backend up
  seconds = once(lambda: jax.block_until_ready(stack.init(key)))
  print(json.dumps({"init": seconds, "rows": sum(sizes)}))


def main(argv=None):
  p = parser(__doc__.split("\n")[0])
  p.add_argument("--before", required=True)
  p.add_argument("--tables", type=int, nargs="+", default=[26, 104, 500])
  p.add_argument("--cap", type=int, default=20_000)
  p.add_argument("--dim", type=int, default=32)
  p.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
  args = parse(p, argv, quick=dict(tables=[4, 8], cap=2000))
  if args.one:
    rev, kind, n = args.one
    _one(rev, kind, int(n), args.cap, args.dim)
    return
  git = ["git", "rev-parse", "--short", "HEAD"]
  now = subprocess.run(git, cwd=ROOT, check=True, capture_output=True)
  now = now.stdout.decode().strip()
  versions = {
    f"this checkout ({now}+)": "HEAD+",
    f"before ({args.before})": args.before,
  }
  rows = []
  for kind in ("criteo", "distinct"):
    for n in args.tables:
      got = {}
      for name, rev in versions.items():
        cmd = [sys.executable, "-m", "benchmarks.stack_init"]
        cmd += ["--before", args.before, "--cap", str(args.cap)]
        cmd += ["--dim", str(args.dim), "--one", rev, kind, str(n)]
        out = subprocess.run(
          cmd, cwd=ROOT, check=True, capture_output=True, text=True
        )
        got[name] = json.loads(out.stdout.strip().splitlines()[-1])
      (a, b) = (got[k]["init"] for k in versions)
      rows.append([kind, n, f"{got[name]['rows']:,}", f"{a:.2f}", f"{b:.2f}"])
      rows[-1].append(f"{b / a:.1f}x")
      print(rows[-1], flush=True)
  (after, before) = versions
  write_results(
    "stack_init",
    f"TableStack.init, first call in a fresh process ({args.dim} wide), wall s "
    "including compiles",
    ["tables' sizes", "tables", "rows", after, before, "speed-up"],
    rows,
    notes=(
      "criteo: Criteo's 26 cardinalities capped at "
      f"{args.cap:,} rows, repeated past 26 (26 distinct shapes); distinct: "
      "1000 + 7i rows, every table its own shape."
    ),
  )


if __name__ == "__main__":
  main()
