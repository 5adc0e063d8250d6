"""The runner of the optimizer-step benchmarks (``sparse_grad``,
``lazy_adam``, ``accumulate``, ``train_step``, ``optimizers`` and
``staleness``): each a :class:`Scenario` (flags, cases, the systems of a
case timed side by side, rows, notes) run by :func:`run`, with the
systems they share.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import gradtx as gtx
from benchmarks import _common, _timing, models, twins
from benchmarks._results import columns, headline, write_results

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
  sched: _timing.Schedule | None  # the scenario's options name a schedule
  mem: float | None  # bytes the systems may hold at once (--mem-gib)
  bandwidth: float | None  # warm copy bandwidth (bytes/s) where needed
  torch: bool  # torch imports (and no --no-torch)
  found: dict[str, Any]  # what the cases leave for the notes

  def time(self, systems: dict, label: str | None = None, **kw: Any) -> dict:
    """ms per step of each system, timed round-robin: the schedule, else
    ``time_interleaved`` (``warmup`` 2, ``rounds`` ``--rounds``)."""
    gc.collect()
    runs = {k: v.run for k, v in systems.items()}
    if self.sched is not None:
      seconds = self.sched.time(runs, label=label)
    else:
      kw = {"warmup": 2, **kw}
      kw["rounds"] = kw.get("rounds") or self.args.rounds
      seconds = _timing.time_interleaved(runs, label=label, **kw)
    return {k: t * 1e3 for k, t in seconds.items()}


Rows = list[list[Any]]


class Scenario(NamedTuple):
  """One benchmark as data: ``case(c, ctx)`` times each case of
  ``cases(ctx)`` and gives its rows; ``finish(rows, ctx)`` the notes and
  the json's extra."""

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

  def main(self, argv: Sequence[str] | None = None) -> None:
    run(self, argv)


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
  p = _common.parser(s.doc, **(s.options or {}))
  for flag, spec in (s.flags or {}).items():
    _flag(p, flag, spec)
  if s.mem_gib is not None:
    _common.add_memory_arg(p, s.mem_gib)
  return _common.parse(p, argv, quick=s.quick)


def run(
  s: Scenario,
  argv: Sequence[str] | None = None,
  args: argparse.Namespace | None = None,
) -> None:
  """Runs every case of ``s`` and writes ``results/<s.name>``."""
  args = args or parse_args(s, argv)
  opts, torch = s.options or {}, s.torch and _common.available("torch")
  ctx = Ctx(
    args,
    _timing.Schedule.from_args(args) if "schedule" in opts else None,
    _common.memory_budget(args) if s.mem_gib is not None else None,
    _timing.warm_copy_bandwidth() if s.floor else None,
    torch and not getattr(args, "no_torch", False),
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
  """``step(params, state, grads)``: ``tx``'s update and ``apply`` alone,
  jitted, params and state donated."""

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return apply(params, updates), state

  return jax.jit(step, donate_argnums=(0, 1))


def jax_table(tx: Any, data: Any, start: int = 1, **kw: Any) -> System:
  """``models.one_table_step`` of ``tx`` on ``data`` and its optimizer
  state bytes per row."""
  run_, box, copies = models.one_table_step(tx, data, **kw)
  leaves = [x for x in jax.tree.leaves(box[1]) if jnp.ndim(x) >= 1]
  per_row = sum(x.size * x.dtype.itemsize for x in leaves)
  return System(
    _timing.Counter(run_, start), box, per_row / data.table.shape[0], copies
  )


def torch_table(name: str, data: Any, start: int = 1, **kw: Any) -> System:
  """``twins.torch_table``: ``torch.optim.<name>`` on ``data``."""
  run_, objs, per_row = twins.torch_table(name, data, **kw)
  return System(_timing.Counter(run_, start), objs, per_row)


def floor_ms(unique: float, dim: int, ids: int, bandwidth: float) -> float:
  """The ms a lazy Adam step must take: read + write the touched rows of
  params, m and v, read the gradient rows, at ``bandwidth``."""
  return (unique * dim * 4 * 6 + ids * (dim + 1) * 4) / bandwidth * 1e3


def row_heads(rows: Rows, *heads: tuple) -> list[dict]:
  """Each row's headlines, ``(metric, column, target, digits)`` each (the
  metric formatted with the row), where that column holds a number."""
  return [
    headline(metric.format(*r), round(r[col], digits), target)
    for r in rows
    for metric, col, target, digits in heads
    if isinstance(r[col], float)
  ]
