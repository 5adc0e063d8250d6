"""The runner of the optimizer-step benchmarks (``sparse_grad``,
``lazy_adam``, ``accumulate``, ``train_step``, ``optimizers`` and
``staleness``), each of them a :class:`Scenario`.

A scenario is data: its results file, title and columns, its flags and
``--quick`` sizes, the grid of cases it runs (:attr:`Scenario.cases`:
sizes, ids distribution, loss or optimizer), the systems it compares in a
case (:class:`System`: one step without arguments and what it reports),
the table rows of a case, and the notes and headline figures of the
table. :func:`run` parses the flags, builds each case's systems, times
them side by side in one process (the ``Schedule`` or ``--rounds``
round-robin rounds of ``benchmarks._timing``), frees them and writes
``results/<name>``. The systems the scenarios share: :func:`jax_table`
(``models.one_table_step`` and its state per row), :func:`update_step`
(an optimizer's update alone, on pre-built gradients) and
:func:`torch_table`; :func:`floor_ms` is the lazy step's floor.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import gradtx as gtx
from benchmarks import models, twins
from benchmarks._common import (
  add_memory_arg,
  available,
  memory_budget,
  parse,
  parser,
)
from benchmarks._results import columns, write_results
from benchmarks._timing import (
  Counter,
  Schedule,
  time_interleaved,
  warm_copy_bandwidth,
)

# the flags of one [--rows, --dim] table with --ids fresh ids a step
TABLE = {"--rows": 1_000_000, "--dim": 64, "--ids": 8192}


class System(NamedTuple):
  """One compared system of a case."""

  run: Callable[[], Any]  # one step, blocking on its result
  keep: Any = None  # what the step holds (buffers, modules) while timed
  per_row: float | str = "-"  # optimizer state bytes per table row
  copies: int | str = "-"  # table-sized copies in the compiled step


class Ctx(NamedTuple):
  """What a scenario's functions read besides the case, and its timer."""

  args: argparse.Namespace
  sched: Schedule | None  # the scenario's options name a schedule
  mem: float | None  # bytes the systems may hold at once (--mem-gib)
  bandwidth: float | None  # warm copy bandwidth (bytes/s) where needed
  torch: bool  # torch imports (and no --no-torch)
  found: dict[str, Any]  # what the cases leave for the notes

  def time(
    self,
    systems: dict[Any, System],
    label: str | None = None,
    *,
    warmup: int = 2,
    rounds: int | None = None,
  ) -> dict[Any, float]:
    """ms per step of each system, timed round-robin: the schedule, else
    ``rounds`` (default ``--rounds``) rounds after ``warmup`` calls."""
    gc.collect()
    runs = {k: v.run for k, v in systems.items()}
    if self.sched is not None:
      seconds = self.sched.time(runs, label=label)
    else:
      rounds = rounds or self.args.rounds
      seconds = time_interleaved(
        runs, warmup=warmup, rounds=rounds, label=label
      )
    return {k: t * 1e3 for k, t in seconds.items()}


Rows = list[list[Any]]


class Scenario(NamedTuple):
  """One benchmark as data, run by :func:`run`: ``case(c, ctx)`` builds
  the systems of each ``c`` of ``cases(ctx)``, times them
  (:meth:`Ctx.time`) and gives the case's table rows; ``finish(rows,
  ctx)`` gives the notes and the json's extra (its headline figures)."""

  name: str  # results/<name>.md|json
  title: str
  columns: str  # the table's headers, "a | b | c"
  doc: str  # the module's docstring (--help)
  cases: Callable[[Ctx], Iterable[Any]]
  case: Callable[[Any, Ctx], Rows]
  finish: Callable[[Rows, Ctx], tuple[str, dict]]
  flags: dict[str, Any] | None = None  # flag -> default or add_argument kw
  quick: dict[str, Any] | None = None  # --quick's sizes
  options: dict[str, Any] | None = None  # benchmarks._common.parser's
  mem_gib: float | None = None  # --mem-gib's default on CPU
  floor: bool = False  # measures the warm copy bandwidth
  torch: bool = False  # compares torch's twins (where torch imports)


def _flag(p: argparse.ArgumentParser, flag: str, spec: Any) -> None:
  """``spec``: add_argument's keywords, or a default (False: a switch; a
  list: one or more of its items' type)."""
  if isinstance(spec, dict):
    p.add_argument(flag, **spec)
  elif spec is False:
    p.add_argument(flag, action="store_true")
  elif isinstance(spec, list):
    p.add_argument(flag, type=type(spec[0]), nargs="+", default=spec)
  else:
    p.add_argument(flag, type=type(spec), default=spec)


def parse_args(s: Scenario, argv: Sequence[str] | None) -> argparse.Namespace:
  """``s``'s flags parsed, the shared ones applied (``_common.parse``)."""
  p = parser(s.doc, **(s.options or {}))
  for flag, spec in (s.flags or {}).items():
    _flag(p, flag, spec)
  if s.mem_gib is not None:
    add_memory_arg(p, s.mem_gib)
  return parse(p, argv, quick=s.quick)


def run(
  s: Scenario,
  argv: Sequence[str] | None = None,
  args: argparse.Namespace | None = None,
) -> None:
  """Runs every case of ``s`` and writes ``results/<s.name>``."""
  args = args or parse_args(s, argv)
  ctx = Ctx(
    args,
    Schedule.from_args(args) if "schedule" in (s.options or {}) else None,
    memory_budget(args) if s.mem_gib is not None else None,
    warm_copy_bandwidth() if s.floor else None,
    s.torch and available("torch") and not getattr(args, "no_torch", False),
    {},
  )
  rows = []
  for case in s.cases(ctx):
    rows += s.case(case, ctx)
    print(rows[-1], flush=True)
    gc.collect()
  notes, extra = s.finish(rows, ctx)
  write_results(
    s.name, s.title, columns(s.columns), rows, notes=notes, extra=extra
  )


# ----------------------------------------------------------------------------
# the systems the scenarios share


def update_step(tx: Any, apply: Callable = gtx.apply_updates) -> Callable:
  """``tx``'s update and ``apply`` alone, on pre-built gradients:
  ``step(params, state, grads)``, jitted, params and state donated."""

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return apply(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def jax_table(tx: Any, data: Any, start: int = 1, **kw: Any) -> System:
  """``models.one_table_step`` of ``tx`` on ``data`` (``kw``: its options),
  counting steps from ``start``, and its optimizer state bytes per row."""
  run_, box, copies = models.one_table_step(tx, data, **kw)
  leaves = [x for x in jax.tree.leaves(box[1]) if jnp.ndim(x) >= 1]
  per_row = sum(x.size * x.dtype.itemsize for x in leaves)
  return System(
    Counter(run_, start), box, per_row / data.table.shape[0], copies
  )


def torch_table(name: str, data: Any, start: int = 1, **kw: Any) -> System:
  """``twins.torch_table``: ``nn.Embedding(sparse=True)`` and
  ``torch.optim.<name>`` on ``data``."""
  run_, objs, per_row = twins.torch_table(name, data, **kw)
  return System(Counter(run_, start), objs, per_row)


def floor_ms(unique: float, dim: int, ids: int, bandwidth: float) -> float:
  """The ms a lazy Adam step must take: read + write the touched rows of
  params, m and v, read the gradient rows, at ``bandwidth``."""
  return (unique * dim * 4 * 6 + ids * (dim + 1) * 4) / bandwidth * 1e3
