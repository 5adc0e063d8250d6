"""Where the suite's time goes: per test, CPU seconds (the test's process
and the subprocesses it waited for), wall seconds, compilations (jax's
backend-compile event, which persistent-cache hits fire too) and seconds
of tracing, lowering, compiling and Python's garbage collection.

Opt in with ``GRADTX_TEST_PROFILE=PREFIX`` (conftest.py then registers
these hooks); each pytest process writes ``PREFIX.<worker>.json``. Then::

  python tests/profile_tests.py PREFIX [N]

prints the per-file table and the N costliest tests. Compare runs by CPU
seconds and compiles: on a shared machine wall time is noise. For a cold
run give it an empty compilation cache
(``JAX_COMPILATION_CACHE_DIR=$(mktemp -d)``). Not a test module: pytest
collects ``test_*.py``.
"""

from __future__ import annotations

import collections
import gc
import glob
import json
import os
import resource
import sys
import time

import pytest

_EVENTS = {  # jax.monitoring's duration events, by the column they add to
  "/jax/core/compile/backend_compile_duration": "compile s",
  "/jax/core/compile/jaxpr_trace_duration": "trace s",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower s",
}
_RECORDS: dict[str, dict[str, float]] = {}
_EAGER_NAMES: set[str] = set()
_TOTALS: collections.Counter = collections.Counter()
_PROGRAMS: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])


def _cpu() -> float:
  own = resource.getrusage(resource.RUSAGE_SELF)
  kids = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


_GC_START = [0.0]


def _gc(phase: str, info: dict) -> None:
  del info
  if phase == "start":
    _GC_START[0] = time.perf_counter()
  else:
    _TOTALS["gc s"] += time.perf_counter() - _GC_START[0]


def _count(event: str, duration: float, fun_name: str = "?", **kwargs) -> None:
  del kwargs
  column = _EVENTS.get(event)
  if column is None:
    return
  _TOTALS[column] += duration
  if column == "compile s":
    _TOTALS["compiles"] += 1
    if fun_name.removeprefix("jit(").removesuffix(")") in _EAGER_NAMES:
      _TOTALS["eager"] += 1
    program = _PROGRAMS[fun_name]
    program[0] += 1
    program[1] += duration


def _eager_names() -> set[str]:
  # An op-by-op compilation is named after its primitive (``add``) or after
  # the jitted jax.numpy / jax.lax function called eagerly (``multiply``,
  # ``_where``): every such name JAX defines. A test's own jitted function
  # of one of these names would count too.
  import jax.numpy  # noqa: F401
  from jax.extend.core import Primitive

  prefixes = ("jax.numpy", "jax._src.numpy", "jax.lax", "jax._src.lax")
  names = set()
  for name, module in list(sys.modules.items()):
    if module is None or not name.startswith(prefixes):
      continue
    for attr, value in vars(module).items():
      if isinstance(value, Primitive):
        names.add(value.name)
      elif callable(value) and not isinstance(value, type):
        names.add(attr)
  return names


def pytest_configure(config):
  import jax

  _EAGER_NAMES.update(_eager_names())
  jax.monitoring.register_event_duration_secs_listener(_count)
  gc.callbacks.append(_gc)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  cpu, wall, before = _cpu(), time.perf_counter(), _TOTALS.copy()
  yield
  record = {"cpu": _cpu() - cpu, "wall": time.perf_counter() - wall}
  for column in ("compiles", "eager", *_EVENTS.values(), "gc s"):
    record[column] = _TOTALS[column] - before[column]
  _RECORDS[item.nodeid] = record


def pytest_sessionfinish(session):
  if _RECORDS:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    prefix = os.environ["GRADTX_TEST_PROFILE"]
    with open(f"{prefix}.{worker}.json", "w") as f:
      json.dump(_RECORDS, f)
    with open(f"{prefix}.{worker}.programs", "w") as f:
      json.dump(_PROGRAMS, f)


def report(prefix: str, top: int = 30) -> None:
  records = {}
  programs = collections.defaultdict(lambda: [0, 0.0])
  for path in glob.glob(f"{prefix}.*.json"):
    with open(path) as f:
      records.update(json.load(f))
  for path in glob.glob(f"{prefix}.*.programs"):
    with open(path) as f:
      for name, (count, seconds) in json.load(f).items():
        programs[name][0] += count
        programs[name][1] += seconds
  files = collections.defaultdict(collections.Counter)
  for nodeid, r in records.items():
    f = files[nodeid.split("::")[0]]
    f.update(r)
    f["tests"] += 1
  total = collections.Counter()
  for f in files.values():
    total.update(f)
  times = ("trace s", "lower s", "compile s", "gc s")
  print(
    f"{'file':40} {'tests':>5} {'cpu s':>7} {'share':>6} {'compiles':>8}"
    f" {'eager':>6}" + "".join(f"{t:>10}" for t in times)
  )

  def row(name: str, f: collections.Counter) -> str:
    return (
      f"{name:40} {f['tests']:5d} {f['cpu']:7.1f} "
      f"{f['cpu'] / total['cpu']:6.1%} {f['compiles']:8.0f}"
      f" {f['eager']:6.0f}" + "".join(f"{f[t]:10.1f}" for t in times)
    )

  for name, f in sorted(files.items(), key=lambda kv: -kv[1]["cpu"]):
    print(row(name, f))
  print(row("total", total))
  print(f"\nthe {top} costliest tests (cpu s, compiles, eager, compile s)")
  ranked = sorted(records.items(), key=lambda kv: -kv[1]["cpu"])
  for nodeid, r in ranked[:top]:
    print(
      f"{r['cpu']:7.1f} {r['compiles']:5.0f} {r.get('eager', 0):5.0f}"
      f" {r.get('compile s', 0):6.1f}"
      f"  {nodeid}"
    )
  print(f"\nthe {top} costliest programs by name (compiles, compile s)")
  ranked = sorted(programs.items(), key=lambda kv: -kv[1][1])
  for name, (count, seconds) in ranked[:top]:
    print(f"{count:6.0f} {seconds:7.1f}  {name}")


if __name__ == "__main__":
  report(sys.argv[1], *map(int, sys.argv[2:3]))
