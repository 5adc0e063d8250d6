"""The plan of a table stack: which tables share an array, and where.

:class:`TableSpec` declares a table; :func:`plan_stacks` decides, once and
with no JAX array, which tables of one width and dtype share a stacked
array (and over how many lanes), which stay outside and why, each table's
first row, how a stack's rows spread over its shards, and the id map of
each stack with hashed tables. It returns a :class:`StackPlan`, which
prints itself (``print(stack)``) and whose :class:`StackSpec` records
``TableStack.stacks`` hands out. The default initializer of the tables
(:func:`default_tables`) is here too; the rows an id map gives to new ids
draw its distribution themselves (``_vocab``). The plan answers for the
facade what follows from it alone: the params of one array per stack
(:func:`init_params`, :func:`stack_params`, :func:`unstack_params`), each
feature's combiner and the arrays a set of features reads
(:func:`arrays_read`); a :class:`StackSpec` maps its rows both ways
(``physical``, ``logical``, ``table_of``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import DTypeLike

from gradtx import _rows
from gradtx._lookup import DENSE_READS_PER_ROW
from gradtx._memory import format_bytes
from gradtx._sharded import gathered_row, spread_row
from gradtx._static import is_int
from gradtx._vocab import MAP_BYTES_PER_ROW, Hashed, Layout

__all__ = ["StackPlan", "StackSpec", "TableSpec"]

# how a bag's rows pool (TableSpec's `combiner`, TableStack.lookup's)
COMBINERS = ("sum", "mean", "sqrtn")


def _default_rows(
  key: Any, tables: jax.Array, rows: jax.Array, dim: int, dtype: Any
) -> jax.Array:
  """``[n, dim]`` rows of the default initializer for
  :meth:`gradtx.TableStack.init`, the k-th drawn from its own key
  ``fold_in(fold_in(key, tables[k]), rows[k])``: a row's
  value depends on its table and row alone, so the rows of any number of
  tables are drawn by one vectorized draw (one compiled program, whatever
  the number of tables)."""

  def one(t, r):
    k = jax.random.fold_in(jax.random.fold_in(key, t), r)
    return jax.random.normal(k, (dim,), jnp.float32)

  std = 1.0 / math.sqrt(dim)
  return (std * jax.vmap(one)(tables, rows)).astype(dtype)


def default_tables(
  key: Any, index: Sequence[int], sizes: Sequence[int], dim: int, dtype: Any
) -> jax.Array:
  """The default rows of tables ``index`` (their positions in ``tables``)
  of ``sizes`` rows, one after the other: ``[sum(sizes), dim]``."""
  ends = np.cumsum(sizes)
  i = lax.iota(jnp.int32, int(ends[-1]))
  k = jnp.searchsorted(jnp.asarray(ends, jnp.int32), i, side="right")
  starts = jnp.asarray(ends - np.asarray(sizes), jnp.int32)
  return _default_rows(
    key, jnp.asarray(index, jnp.int32)[k], i - starts[k], dim, dtype
  )


@dataclasses.dataclass(frozen=True)
class TableSpec:
  """One embedding table: its rows, width, dtype and initializer.

  Args:
    rows: the number of rows (ids ``0..rows-1``).
    dim: the row width.
    dtype: the table's dtype (float32, bfloat16, float16); tables of one
      ``dim`` and ``dtype`` share a stack.
    initializer: ``initializer(key, (rows, dim), dtype) -> array``, a
      ``jax.nn.initializers`` function; default: normal with standard
      deviation ``1 / sqrt(dim)`` (Flax ``nn.Embed``'s), each row drawn
      from a key of its own (see :meth:`gradtx.TableStack.init`). A hashed table
      draws a row given to a new id from it too.
    hashed: a :class:`gradtx.Hashed`: the table takes raw ids of any
      range, mapped to its ``rows`` rows by an id map (see
      :meth:`gradtx.TableStack.admit`); None (the default): ids are rows.
      (``True`` and ``False`` are deprecated spellings of ``gtx.Hashed()``
      and None.)
    combiner: how :meth:`gradtx.TableStack.lookup` pools a bag of this
      table's rows: ``"sum"``, ``"mean"`` or ``"sqrtn"`` (TorchRec's
      ``EmbeddingBagConfig.pooling``); None (the default): by the lookup's
      ``combiner``, ``"sum"`` unless it says otherwise. A lookup's
      ``combiner`` overrides it (for every feature, or for the features it
      names).
  """

  rows: int
  dim: int
  dtype: DTypeLike = jnp.float32
  initializer: Callable[..., jax.Array] | None = None
  hashed: Hashed | None = None
  combiner: str | None = None

  def __post_init__(self):
    if isinstance(self.hashed, bool):
      new = "gtx.Hashed()" if self.hashed else "None"
      warnings.warn(
        f"gradtx.TableSpec `hashed={self.hashed}` is deprecated: pass "
        f"`hashed={new}`.",
        DeprecationWarning,
        stacklevel=3,
      )
      object.__setattr__(self, "hashed", Hashed() if self.hashed else None)
    if self.hashed is not None and not isinstance(self.hashed, Hashed):
      raise TypeError(
        "gradtx.TableSpec `hashed` must be a gradtx.Hashed or None; got "
        f"{type(self.hashed).__name__}."
      )
    if self.combiner is not None and self.combiner not in COMBINERS:
      raise ValueError(
        f"gradtx.TableSpec `combiner` must be one of {COMBINERS} or None; "
        f"got {self.combiner!r}."
      )
    for name in ("rows", "dim"):
      v = getattr(self, name)
      if not is_int(v) or v < 1:
        raise ValueError(
          f"gradtx.TableSpec `{name}` must be a positive int; got {v!r}."
        )
    if not jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating):
      raise ValueError(
        f"gradtx.TableSpec `dtype` must be a float dtype; got {self.dtype}."
      )

  @property
  def key(self) -> tuple[int, str]:
    """What tables of one stack share: the row width and the dtype."""
    return int(self.dim), jnp.dtype(self.dtype).name


class StackSpec(NamedTuple):
  """One stacked array of a :class:`StackPlan`: its name, tables and their
  first rows (``stack.stacks[name]``).

  Attributes:
    name: the params key, ``"<dtype>x<dim>"`` (``"..._lane<k>"`` for the
      further lanes).
    dim: the row width.
    dtype: the dtype's name.
    tables: the tables stored in it, in order.
    offsets: each table's first logical row in the stack.
    rows: the logical rows: the tables' rows together.
    shards: the devices its rows are split over; logical row ``p`` sits at
      array row ``(p % shards) * (size // shards) + p // shards``, so
      every table's rows spread evenly over the shards.
    dense: a stack of the tables a step at ``batch_size`` reads at least 4
      times per row (``"<dtype>x<dim>_dense"``): its gradient is one
      dense array, a summed row per table row, smaller than a row per
      read (see :func:`gradtx.sparse_value_and_grad`); never split over
      lanes or shards.
  """

  name: str
  dim: int
  dtype: str
  tables: tuple[str, ...]
  offsets: tuple[int, ...]
  rows: int
  shards: int
  dense: bool = False

  @property
  def size(self) -> int:
    """Rows of the array: ``rows`` padded to a multiple of ``shards``."""
    return -(-self.rows // self.shards) * self.shards

  def physical(self, p: Any) -> Any:
    """The array row of logical row ``p`` (numpy or jax ints)."""
    return spread_row(p, self.size, self.shards)

  def logical(self, r: Any) -> Any:
    """The logical row of array row ``r`` (numpy or jax ints)."""
    return gathered_row(r, self.size, self.shards)

  def table_of(self, r: Any) -> np.ndarray:
    """The index in ``tables`` of the table holding each array row ``r``
    (numpy ints)."""
    at = np.searchsorted(np.asarray(self.offsets), self.logical(r), "right")
    return at - 1

  def to_array(self, logical: Any) -> Any:
    """``[rows, ...]`` rows in logical order -> the stack's array."""
    if self.shards == 1:
      return logical
    pad = [(0, self.size - self.rows)] + [(0, 0)] * (logical.ndim - 1)
    x = jnp.pad(logical, pad)
    x = x.reshape(self.size // self.shards, self.shards, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape(self.size, *x.shape[2:])

  def to_logical(self, x: Any) -> Any:
    """The stack's array (or a tree leaf shaped like it) -> logical rows."""
    if self.shards == 1:
      return x
    x = x.reshape(self.shards, self.size // self.shards, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape(self.size, *x.shape[2:])[: self.rows]


def _stack_name(dim: int, dtype: str, lane: int = 0, dense=False) -> str:
  return (
    f"{dtype}x{dim}"
    + (f"_lane{lane}" if lane else "")
    + ("_dense" if dense else "")
  )


# A stack made for a batch of at least this many examples is spread over
# AUTO_LANES lanes by default (``lanes=None``). The rule reads the plan's
# arguments alone, never the host (its backend or its cores), so a stack's
# params keys are the same on every host, and a program exported on a CPU
# host for a GPU is the one a GPU host builds. It reads the batch, not the
# features, so a model's program keeps its shape as features are added.
AUTO_LANES_MIN_BATCH = 2048
AUTO_LANES = 2


def _auto_lanes(names: list[str], batch_size: int | None, shards: int) -> int:
  """The default lanes of one width and dtype (``lanes=None``):
  :data:`AUTO_LANES` for a step of at least :data:`AUTO_LANES_MIN_BATCH`
  examples, one otherwise (no ``batch_size``, a smaller batch, one table,
  a row-sharded stack). Each lane is one chain of kernels: XLA:CPU runs
  independent chains on its threads side by side; a GPU or TPU runs each
  across the whole device, one after the other."""
  if batch_size is None or shards > 1 or len(names) < 2:
    return 1
  return AUTO_LANES if batch_size >= AUTO_LANES_MIN_BATCH else 1


def _lanes(
  names: list[str],
  readers: Mapping[str, int],
  tables: Mapping[str, TableSpec],
  lanes: int,
) -> list[list[str]]:
  """The tables of one width and dtype spread over at most ``lanes``
  stacks, balanced by the features that read them (a step's ids), then by
  rows; each lane keeps the declared order."""
  if lanes == 1 or len(names) == 1:
    return [names]
  lanes = min(lanes, len(names))
  load = [(0, 0)] * lanes
  lane_of = {}
  heavy_first = sorted(
    names, key=lambda t: (-readers.get(t, 0), -int(tables[t].rows))
  )
  for t in heavy_first:
    k = min(range(lanes), key=lambda i: load[i])
    lane_of[t] = k
    load[k] = (load[k][0] + readers.get(t, 0), load[k][1] + int(tables[t].rows))
  return [[t for t in names if lane_of[t] == k] for k in range(lanes)]


def _platform_lines(lanes: int) -> list[str]:
  """What each platform runs for a stack's step (chosen inside the
  program, gradtx/_platform.py): one plan and params keys on every host."""
  cpu, accelerator = (
    ("; lanes side by side", "; lanes one after the other")
    if lanes > 1
    else ("", "")
  )
  return [
    "  on CPU: ids deduplicated by hashing; a stack of "
    f"{_rows.LOOP_MIN_IDS:,} id slots or more a step updated in a loop, "
    f"{_rows.LOOP_CHUNK:,} unique rows a trip{cpu}",
    "  on GPU and TPU: ids deduplicated by sort, duplicates summed by a "
    "segmented scan, every unique row updated in one pass (no loop, the "
    f"same bits run after run){accelerator}",
  ]


@dataclasses.dataclass(frozen=True, eq=False)
class StackPlan:
  """Where a :class:`gradtx.TableStack` keeps its tables: built by the
  stack from its arguments, with no JAX array, and printed by
  ``print(stack)`` (``stack.plan``).

  Attributes:
    tables: table name -> :class:`TableSpec`.
    features: feature name -> the table it reads.
    batch_size: the examples per step the plan was made for, or None.
    shards: the devices each stack's rows are split over.
    lanes: the most stacks of one width and dtype (the number given, or
      the most the default chose).
    stacks: stack name (its params key) -> :class:`StackSpec`.
    outside: table name -> why it is an array of its own: no feature
      reads it.
    maps: stack name -> the layout of the id map of its hashed tables.

  Examples:
    >>> import gradtx as gtx
    >>> stack = gtx.TableStack(
    ...     {"user": gtx.TableSpec(1000, 8), "item": gtx.TableSpec(500, 8),
    ...      "country": gtx.TableSpec(3, 8)}, batch_size=256)
    >>> plan = stack.plan
    >>> plan.stacks["float32x8"].tables, plan.stacks["float32x8"].size
    (('user', 'item'), 1500)
    >>> plan.location("item"), plan.location("country")
    (('float32x8', 1000), ('float32x8_dense', 0))
  """

  tables: dict[str, TableSpec]
  features: dict[str, str]
  batch_size: int | None
  shards: int
  lanes: int
  stacks: dict[str, StackSpec]
  outside: dict[str, str]
  maps: dict[str, Layout]

  def location(self, table: str) -> tuple[str, int]:
    """``(params key, first row)`` of ``table``: a stack's name and the
    table's offset in it, or the table's own name and 0 outside."""
    if table not in self.tables:
      raise KeyError(
        f"gradtx.TableStack has no table {table!r}; the tables are "
        f"{list(self.tables)}."
      )
    for s in self.stacks.values():
      if table in s.tables:
        return s.name, s.offsets[s.tables.index(table)]
    return table, 0

  def __repr__(self) -> str:
    lines = [
      f"TableStack: {len(self.tables)} table(s), {len(self.features)} "
      f"feature(s), {len(self.stacks)} stack(s), "
      f"{len(self.outside)} outside"
    ]
    if self.lanes > 1:
      lines.append(
        f"  up to {self.lanes} lanes: the tables of one width and dtype "
        "spread over stacks that a CPU step updates side by side (a GPU "
        "or TPU, one after the other)"
      )
    for s in self.stacks.values():
      item = jnp.dtype(s.dtype).itemsize
      spread = (
        f", every table's rows spread over {s.shards} shards"
        + (f" ({s.size - s.rows} padding rows)" if s.size > s.rows else "")
        if s.shards > 1
        else ""
      )
      dense = (
        f": read at least {DENSE_READS_PER_ROW:g} times a row a step at "
        f"batch_size {self.batch_size}, one dense gradient"
        if s.dense
        else ""
      )
      lines.append(
        f"  stack {s.name!r}: {s.size:,} rows x {s.dim} {s.dtype}, "
        f"{format_bytes(s.size * s.dim * item)}{spread}{dense}"
      )
      for t, off in zip(s.tables, s.offsets, strict=True):
        feats = [f for f, tt in self.features.items() if tt == t]
        h = self.tables[t].hashed
        how = (
          f"  hashed ({h.policy}"
          + (f", ttl {h.ttl}" if h.ttl is not None else "")
          + (f", min_count {h.min_count}" if h.min_count > 1 else "")
          + (
            f", admit_probability {h.admit_probability}"
            if h.admit_probability < 1
            else ""
          )
          + f", {h.probes} probes)"
          if h is not None
          else ""
        )
        pooled = self.tables[t].combiner
        how += f"  pooled by {pooled}" if pooled is not None else ""
        lines.append(
          f"    {t}: rows {off:,}..{off + self.tables[t].rows - 1:,}"
          f"  features {feats}{how}"
        )
      if s.name in self.maps:
        m = self.maps[s.name]
        sketch = m.sketch_bytes
        lines.append(
          f"    id map of {len(m.tables)} hashed table(s): "
          f"{format_bytes(m.map_bytes)} "
          f"({MAP_BYTES_PER_ROW} B a row of the stack"
          + (f", sketch {format_bytes(sketch)}" if sketch else "")
          + ")"
        )
    for t, why in self.outside.items():
      spec = self.tables[t]
      lines.append(
        f"  outside {t!r}: {spec.rows:,} rows x {spec.dim} "
        f"{jnp.dtype(spec.dtype).name}: {why}"
      )
    lines.extend(_platform_lines(self.lanes))
    return "\n".join(lines)

  __str__ = __repr__


def plan_stacks(
  tables: Mapping[str, TableSpec],
  features: Mapping[str, str] | None = None,
  *,
  batch_size: int | None = None,
  shards: int = 1,
  lanes: int | None = None,
) -> StackPlan:
  """The plan of :class:`gradtx.TableStack` for its arguments (their
  errors name the stack's arguments)."""
  if not isinstance(tables, Mapping) or not tables:
    raise ValueError(
      "gradtx.TableStack `tables` must be a non-empty dict of table name "
      f"-> gradtx.TableSpec; got {tables!r}."
    )
  for name, spec in tables.items():
    if not isinstance(spec, TableSpec):
      raise TypeError(
        f"gradtx.TableStack `tables[{name!r}]` must be a gradtx.TableSpec; "
        f"got {type(spec).__name__}."
      )
  tables = dict(tables)
  if features is None:
    features = {name: name for name in tables}
  unknown = {f: t for f, t in features.items() if t not in tables}
  if unknown:
    raise ValueError(
      f"gradtx.TableStack `features` name tables that are not in "
      f"`tables`: {unknown}. The tables are {list(tables)}."
    )
  features = dict(features)
  if batch_size is not None:
    _check_count(batch_size, "batch_size", " or None")
  shards = _check_count(
    shards, "shards", " (the devices a stack's rows are split over)"
  )
  readers: dict[str, int] = {}
  for t in features.values():
    readers[t] = readers.get(t, 0) + 1
  outside: dict[str, str] = {}  # table -> why it is not stacked
  # the tables a step reads at least DENSE_READS_PER_ROW times a row (not
  # hashed ones: their map works on a sparse stack's rows), per width and
  # dtype: one dense stack each
  heavy: dict[tuple[int, str], list[str]] = {}
  by_key: dict[tuple[int, str], list[str]] = {}
  for name, spec in tables.items():
    if name not in readers:
      outside[name] = "no feature reads it"
    elif (
      batch_size is not None
      and spec.hashed is None
      and batch_size * readers[name] >= DENSE_READS_PER_ROW * spec.rows
    ):
      heavy.setdefault(spec.key, []).append(name)
    else:
      by_key.setdefault(spec.key, []).append(name)
  if lanes is not None:
    lanes = _check_count(
      lanes,
      "lanes",
      " (the stacks the tables of one width and dtype are spread over) or "
      "None (two on a CPU at a batch_size of 2048 or more, see TableStack)",
    )
  per_key = {
    key: lanes or _auto_lanes(names, batch_size, shards)
    for key, names in by_key.items()
  }
  stacks: dict[str, StackSpec] = {}
  lanes_of = {
    (dim, dtype, k, False): part
    for (dim, dtype), names in by_key.items()
    for k, part in enumerate(
      _lanes(names, readers, tables, per_key[dim, dtype])
    )
  }
  lanes_of.update(
    {(dim, dtype, 0, True): n for (dim, dtype), n in heavy.items()}
  )
  lanes = lanes or max(per_key.values(), default=1)
  for (dim, dtype, lane, dense), names in lanes_of.items():
    offsets, start = [], 0
    for n in names:
      offsets.append(start)
      start += int(tables[n].rows)
    if start >= 2**31:
      raise ValueError(
        f"gradtx.TableStack: the {dtype} tables of width {dim} hold "
        f"{start:,} rows, more than int32 ids address (2**31 - 1). Give "
        "some of them another dtype or split them over two TableStacks."
      )
    stack = StackSpec(
      _stack_name(dim, dtype, lane, dense),
      dim,
      dtype,
      tuple(names),
      tuple(offsets),
      start,
      1 if dense else shards,
      dense,
    )
    stacks[stack.name] = stack
  clash = set(stacks) & set(outside)
  if clash:
    raise ValueError(
      f"gradtx.TableStack: tables named {sorted(clash)} clash with the "
      "names of the stacks; rename them."
    )
  # the id map of each stack with hashed tables
  maps: dict[str, Layout] = {}
  for s in stacks.values():
    hashed = [
      (t, off)
      for t, off in zip(s.tables, s.offsets, strict=True)
      if tables[t].hashed is not None
    ]
    if hashed:
      maps[s.name] = Layout(
        tuple(t for t, _ in hashed),
        tuple(off for _, off in hashed),
        tuple(int(tables[t].rows) for t, _ in hashed),
        tuple(tables[t].hashed for t, _ in hashed),
        s.size,
        s.shards,
        tuple(tables[t].initializer for t, _ in hashed),
        s.dim,
        s.dtype,
      )
  return StackPlan(
    tables, features, batch_size, shards, lanes, stacks, outside, maps
  )


def _check_count(value: Any, name: str, what: str) -> int:
  """``value`` as an int, or the error that names TableStack's ``name``."""
  if not is_int(value) or value < 1:
    raise ValueError(
      f"gradtx.TableStack `{name}` must be a positive int{what}; got {value!r}."
    )
  return int(value)


# -- the params, read by the plan ---------------------------------------------
def init_params(plan: StackPlan, key: Any) -> dict[str, jax.Array]:
  """The params of ``plan`` (``TableStack.init``'s, traced): each table's
  rows from its initializer with its own key, the default initializer's
  tables of one width and dtype drawn at once."""
  per_table, alike = {}, {}
  names = list(plan.tables)
  for i, (t, spec) in enumerate(plan.tables.items()):
    shape, dtype = (int(spec.rows), int(spec.dim)), jnp.dtype(spec.dtype)
    if spec.initializer is None:  # drawn below, with its width's tables
      alike.setdefault((shape[1], dtype), []).append(i)
    else:
      x = spec.initializer(jax.random.fold_in(key, i), shape, dtype)
      per_table[t] = jnp.asarray(x, dtype)
  for (dim, dtype), index in alike.items():
    sizes = [int(plan.tables[names[i]].rows) for i in index]
    rows = default_tables(key, index, sizes, dim, dtype)
    # The group (every default table of this width and dtype) does not
    # depend on the plan; kept out of the fusions of the stacks that
    # consume it, its draw is the same program, bit for bit, whatever
    # the plan.
    rows = lax.optimization_barrier(rows)
    parts = jnp.split(rows, np.cumsum(sizes)[:-1])
    per_table.update(zip([names[i] for i in index], parts, strict=True))
  return stack_params(plan, per_table)


def stack_params(plan: StackPlan, per_table: Mapping[str, Any]) -> dict:
  """Params from one array per table (``TableStack.stack``)."""
  missing = [t for t in plan.tables if t not in per_table]
  if missing:
    raise ValueError(
      f"gradtx.TableStack.stack: `per_table` has no array for {missing}."
    )
  for t, spec in plan.tables.items():
    shape = tuple(jnp.shape(per_table[t]))
    if shape != (spec.rows, spec.dim):
      raise ValueError(
        f"gradtx.TableStack.stack: table {t!r} has shape {shape}, its "
        f"TableSpec says ({spec.rows}, {spec.dim})."
      )
  out = {
    s.name: s.to_array(
      jnp.concatenate([jnp.asarray(per_table[t], s.dtype) for t in s.tables])
    )
    for s in plan.stacks.values()
  }
  for t in plan.outside:
    out[t] = jnp.asarray(per_table[t], plan.tables[t].dtype)
  return out


def unstack_params(plan: StackPlan, params: Mapping[str, Any]) -> dict:
  """One ``[rows, dim]`` array per table (``TableStack.unstack``)."""
  check_params(plan, params, "unstack")
  logical = {k: s.to_logical(params[k]) for k, s in plan.stacks.items()}
  out = {}
  for t in plan.tables:
    where, off = plan.location(t)
    if where == t:
      out[t] = params[t]
    else:
      out[t] = logical[where][off : off + plan.tables[t].rows]
  return out


def check_params(plan: StackPlan, params: Any, what: str) -> None:
  """``params`` has the keys of the plan's arrays, for the TableStack
  method ``what``."""
  want = list(plan.stacks) + list(plan.outside)
  if not isinstance(params, Mapping) or any(k not in params for k in want):
    got = list(params) if isinstance(params, Mapping) else type(params)
    raise ValueError(
      f"gradtx.TableStack.{what}: `params` must be the dict `stack.init` "
      f"returns, with keys {want}; got {got}."
    )


# -- the features, read by the plan -------------------------------------------
def hashed_features(plan: StackPlan) -> list[str]:
  """The features of hashed tables, in the plan's order."""
  hashed = {t for layout in plan.maps.values() for t in layout.tables}
  return [f for f, t in plan.features.items() if t in hashed]


def feature_combiners(
  plan: StackPlan, combiner: Any
) -> tuple[tuple[str, str], ...]:
  """Each feature's combiner (``lookup``'s ``combiner`` over its table's),
  checked: ``((feature, combiner), ...)``, hashable (a program's key)."""
  given = combiner if isinstance(combiner, Mapping) else {}
  unknown = [f for f in given if f not in plan.features]
  if unknown:
    raise ValueError(
      f"gradtx.TableStack.lookup `combiner` names unknown features "
      f"{unknown}; the features are {list(plan.features)}."
    )
  every = None if isinstance(combiner, Mapping) else combiner
  out = []
  for f, t in plan.features.items():
    c = given.get(f, every) or plan.tables[t].combiner or "sum"
    if c not in COMBINERS:
      raise ValueError(
        f"gradtx.TableStack.lookup `combiner` must be one of {COMBINERS}, "
        f"or a dict feature name -> one of them; got {c!r}"
        + (f" for feature {f!r}." if f in given else ".")
      )
    out.append((f, c))
  return tuple(out)


def arrays_read(plan: StackPlan, features: Any) -> list[tuple[str, list[str]]]:
  """``(params key, features)`` per array that ``features`` read: the
  stacks in order, then each table outside; features in the order
  declared to the stack (never the order given: ``jax.jit`` sorts a
  dict's keys)."""
  given = set(features)
  declared = [f for f in plan.features if f in given]
  by_array = []
  for name, s in plan.stacks.items():
    feats = [f for f in declared if plan.features[f] in s.tables]
    if feats:
      by_array.append((name, feats))
  for t in plan.outside:
    feats = [f for f in declared if plan.features[f] == t]
    if feats:
      by_array.append((t, feats))
  return by_array
