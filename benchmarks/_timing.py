"""The benchmarks' timer: systems alternated round-robin in one process.

:func:`time_interleaved` (on a :class:`Schedule`) returns medians and keeps
each system's :func:`spread` in ``RUN.timings``; :func:`step_runner` and
:class:`Counter` make a donated jitted step a call on fresh ids. Why a
burst and a settle: ``results/harness_notes.md``.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple


def load_note() -> str:
  """The 1/5/15-minute load averages."""
  try:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())
  except OSError:
    return "unknown"


class _Run:
  """What the harness records of this process's run (one benchmark)."""

  def __init__(self) -> None:
    self.quick = False
    self.huge_pages: bool | None = None  # None: the benchmark has no flag
    self.memory_reused: bool | None = None  # None: no --fresh-memory flag
    self.load_start = load_note()
    self.timings: list[dict[str, Any]] = []


RUN = _Run()

# The whole-step benchmarks' defaults: SETTLE untimed steps of a system,
# then BURST timed ones, each round.
BURST = 10
SETTLE = 3


class Clock:
  """Wall and CPU seconds since it was made: ``c.wall(), c.cpu()``."""

  def __init__(self) -> None:
    self.start = time.perf_counter(), time.process_time()

  def wall(self) -> float:
    return time.perf_counter() - self.start[0]

  def cpu(self) -> float:
    return time.process_time() - self.start[1]


def once(fn: Callable[[], Any]) -> float:
  """Wall seconds of one call of ``fn`` (which must block on its result)."""
  clock = Clock()
  fn()
  return clock.wall()


class Schedule(NamedTuple):
  """How :func:`time_interleaved` alternates systems."""

  rounds: int = 10
  burst: int = BURST
  settle: int = SETTLE

  @classmethod
  def from_args(cls, args: Any) -> Schedule:
    return cls(args.rounds, args.burst, args.settle)

  @property
  def steps(self) -> int:
    """Steps each system runs (warmup 2, one HLO check, the rounds)."""
    return self.rounds * (self.burst + self.settle) + 3

  def time(
    self, fns: dict[str, Callable[[], Any]], *, warmup: int = 2, **kw: Any
  ) -> dict[str, float]:
    return time_interleaved(fns, warmup=warmup, **self._asdict(), **kw)

  def describe(self) -> str:
    settle = (
      f" after {self.settle} untimed ones (the steps that pay for the "
      "previous system's leftovers)"
      if self.settle
      else ""
    )
    return (
      f"median of {self.rounds} round-robin rounds x {self.burst} timed "
      f"consecutive steps of each system{settle}"
    )


def spread(seconds: Sequence[float], burst: int = 1) -> dict[str, float]:
  """Milliseconds of one system's timed calls (``burst`` a round): median,
  10th percentile, quartiles, lowest and highest round median."""
  ms = [1e3 * s for s in seconds]
  rounds = [
    statistics.median(ms[i : i + burst]) for i in range(0, len(ms), burst)
  ]
  if len(ms) > 1:
    deciles = statistics.quantiles(ms, n=10, method="inclusive")
    q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive")
  else:
    deciles, q1, q3 = ms * 9, ms[0], ms[0]
  return {
    "median": statistics.median(ms),
    "p10": deciles[0],
    "q1": q1,
    "q3": q3,
    "round_min": min(rounds),
    "round_max": max(rounds),
  }


def time_interleaved(
  fns: dict[str, Callable[[], Any]],
  *,
  warmup: int = 2,
  rounds: int = 15,
  burst: int = 1,
  settle: int = 0,
  samples: dict[str, list[float]] | None = None,
  label: str | None = None,
) -> dict[str, float]:
  """Median seconds per call of each function, round-robin: each round runs
  each ``settle`` times untimed, then ``burst`` times timed. ``samples``
  gets every timed call's seconds; the spreads are recorded under
  ``label`` (default: the functions' names)."""
  for fn in fns.values():
    for _ in range(warmup):
      fn()
  times: dict[str, list[float]] = {k: [] for k in fns}
  if samples is not None:
    samples.update(times)
  for _ in range(rounds):
    for k, fn in fns.items():
      for _ in range(settle):
        fn()
      for _ in range(burst):
        t0 = time.perf_counter()
        fn()
        times[k].append(time.perf_counter() - t0)
  label = label or ", ".join(map(_name, fns))
  record(label, times, burst, rounds=rounds, settle=settle)
  return {k: statistics.median(v) for k, v in times.items()}


def _name(system: Any) -> str:
  if isinstance(system, tuple):
    return " / ".join(map(str, system))
  return str(system)


def record(
  label: str, times: dict[str, Sequence[float]], burst: int = 1, **how: Any
) -> None:
  """Keeps each system's :func:`spread` of ``times`` for the json."""
  RUN.timings.append(
    {
      "label": label,
      "burst": burst,
      **how,
      "ms": {_name(k): spread(v, burst) for k, v in times.items() if v},
    }
  )


def step_runner(step, box: list, args_of) -> Callable[[int], Any]:
  """``run(i)``: ``step(params, state, *args_of(i))`` on ``box``'s (donated)
  params and state, the new ones kept in ``box``; returns the loss (the
  step's third output) where there is one."""
  import jax

  def run(i: int) -> Any:
    out = step(box[0], box[1], *args_of(i))
    box[0], box[1] = out[0], out[1]
    jax.block_until_ready(out)
    return out[2] if len(out) > 2 else None

  return run


class Counter:
  """``fn(i)`` as a call without arguments, ``i`` counting from ``start``."""

  def __init__(self, fn: Callable[[int], Any], start: int = 1):
    self.fn, self.i = fn, start  # 1: step 0 may have run (torch state init)

  def __call__(self) -> Any:
    out = self.fn(self.i)
    self.i += 1
    return out


def warm_copy_bandwidth() -> float:
  """Bytes/s (read + write) of the best of 10 copies of 256 MiB into an
  already-faulted buffer: ``np.copyto`` on CPU, a donated jitted ``a + 1``
  on accelerators."""
  import jax
  import numpy as np

  num_bytes = 256 * 2**20
  if jax.default_backend() == "cpu":
    src = np.ones(num_bytes // 4, np.float32)
    dst = np.zeros_like(src)
    np.copyto(dst, src)  # fault the pages in
    call = functools.partial(np.copyto, dst, src)
  else:
    f = jax.jit(lambda a: a + 1.0, donate_argnums=0)
    box = [jax.numpy.ones(num_bytes // 4, jax.numpy.float32)]

    def call():
      box[0] = f(box[0])
      box[0].block_until_ready()

  call()
  best = float("inf")
  for _ in range(10):
    t0 = time.perf_counter()
    call()
    best = min(best, time.perf_counter() - t0)
  return 2 * num_bytes / best
