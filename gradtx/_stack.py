"""Table stacks: the tables of one width and dtype stored as one array.

:class:`TableStack` plans, once and in the open, which tables share a stack
(FBGEMM's table-batched embeddings, SparseCore's table stacking): every
table of one row width and dtype is a slice of rows of one array, and
:meth:`TableStack.lookup` reads all the features of a stack with one
gather and pools them with one segment sum. The stack is an ordinary
array leaf of the params, read only as whole rows, so
:func:`gradtx.sparse_value_and_grad` gives it one SparseRows gradient, and
every gradtx optimizer updates it with one deduplication, one rule call and
one scatter per state kind, whatever the number of features. Features
arrive as a dict, or keyed in one array (:class:`gradtx.Keyed`,
:class:`gradtx.KeyedJagged`) that the lookup reads with no op per feature;
their forms and the pooled read are ``_pooled``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from gradtx import _vocab
from gradtx._fresh_rows import FreshRows
from gradtx._pooled import (
  COMBINERS,
  Jagged,
  Keyed,
  KeyedJagged,
  dict_reader,
  joined,
  keyed_batch,
  keyed_reader,
  pool_rows,
  split_features,
)
from gradtx._sharded import is_split, split_like, unsplit
from gradtx._vocab import DEFAULT_MAX_NEW, Hashed, VocabState

__all__ = ["TableSpec", "TableStack"]

# A table a step reads at least this many times per row stays outside the
# stacks (the reason is sparse_value_and_grad's: one summed gradient row
# per table row is then smaller than a row per read).
_READS_PER_ROW_OUTSIDE = 4


def _default_init(key: Any, shape: tuple[int, ...], dtype: Any) -> jax.Array:
  """The default initializer as an initializer function (a hashed table's
  rows given to new ids): normal with standard deviation ``1 / sqrt(dim)``,
  Flax's ``nn.Embed`` default."""
  std = 1.0 / math.sqrt(shape[-1])
  return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def _default_rows(
  key: Any, tables: jax.Array, rows: jax.Array, dim: int, dtype: Any
) -> jax.Array:
  """``[n, dim]`` rows of the default initializer for
  :meth:`TableStack.init`, the k-th drawn from its own key
  ``fold_in(fold_in(key, tables[k]), rows[k])``: a row's
  value depends on its table and row alone, so the rows of any number of
  tables are drawn by one vectorized draw (one compiled program, whatever
  the number of tables)."""

  def one(t, r):
    k = jax.random.fold_in(jax.random.fold_in(key, t), r)
    return jax.random.normal(k, (dim,), jnp.float32)

  std = 1.0 / math.sqrt(dim)
  return (std * jax.vmap(one)(tables, rows)).astype(dtype)


def _default_tables(
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
      from a key of its own (see :meth:`TableStack.init`). A hashed table
      draws a row given to a new id from it too.
    hashed: a :class:`gradtx.Hashed` (or True for its defaults): the table
      takes raw ids of any range, mapped to its ``rows`` rows by an id map
      (see :meth:`TableStack.admit`); None: ids are rows.
  """

  rows: int
  dim: int
  dtype: DTypeLike = jnp.float32
  initializer: Callable[..., jax.Array] | None = None
  hashed: Hashed | bool | None = None

  def __post_init__(self):
    if self.hashed is True:
      object.__setattr__(self, "hashed", Hashed())
    elif self.hashed is False:
      object.__setattr__(self, "hashed", None)
    elif self.hashed is not None and not isinstance(self.hashed, Hashed):
      raise TypeError(
        "gradtx.TableSpec `hashed` must be a gradtx.Hashed, True or None; "
        f"got {type(self.hashed).__name__}."
      )
    for name in ("rows", "dim"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
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


class _Stack(NamedTuple):
  """One stacked array: its name, tables and their first rows."""

  name: str
  dim: int
  dtype: str
  tables: tuple[str, ...]
  offsets: tuple[int, ...]  # each table's first logical row in the stack
  rows: int  # logical rows: the tables' rows
  shards: int  # logical row p sits at row (p % shards) * (size / shards)
  # + p // shards, so every table's rows spread evenly over the shards

  @property
  def size(self) -> int:
    """Rows of the array: ``rows`` padded to a multiple of ``shards``."""
    return -(-self.rows // self.shards) * self.shards

  def physical(self, p: Any) -> Any:
    """The array row of logical row ``p`` (numpy or jax ints)."""
    if self.shards == 1:
      return p
    return (p % self.shards) * (self.size // self.shards) + p // self.shards

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


def _stack_name(dim: int, dtype: str, lane: int = 0) -> str:
  return f"{dtype}x{dim}" + (f"_lane{lane}" if lane else "")


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


class TableStack:
  """Embedding tables stored by width and dtype, looked up in one pass.

  Tables of one ``dim`` and ``dtype`` are stacked into one array (a table's
  rows follow the previous table's); ``features`` name which table each
  input feature reads, so several features may share a table (a user's
  history of items reads the item table). With ``batch_size`` a table that
  a step would read at least 4 times per row (a 3-row table at batch 2048)
  stays an array of its own: its gradient is then one summed row per table
  row (see :func:`gradtx.sparse_value_and_grad`), smaller than a row per
  read inside the stack. ``print(stack)`` shows the plan.

  The params are a dict of plain arrays: one ``[rows, dim]`` array per stack
  (named ``"<dtype>x<dim>"``) and one per table kept outside, so any model
  library holds them, and :meth:`unstack` / :meth:`stack` convert to and
  from one array per table (export, serving, per-table checkpoints).

  Args:
    tables: table name -> :class:`TableSpec`.
    features: feature name -> table name; default, one feature per table
      under the table's name.
    batch_size: the examples per step, if known: tables read at least 4
      times per row at this batch (one id per example and feature) stay
      outside the stacks.
    shards: the devices each stack's rows are split over (a row-sharded
      stack): every table's rows are spread evenly over them.
    lanes: the most stacks the tables of one width and dtype are spread
      over (``"<dtype>x<dim>"``, then ``"<dtype>x<dim>_lane1"``, ...),
      balanced by the features that read them. Each stack is one chain
      of gather, update and scatter; independent chains can run on
      different cores of a CPU, one chain cannot.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import gradtx as gtx
    >>> stack = gtx.TableStack(
    ...     {"user": gtx.TableSpec(1000, 8), "item": gtx.TableSpec(500, 8)},
    ...     features={"user_id": "user", "item_id": "item",
    ...               "history": "item"})
    >>> params = stack.init(jax.random.key(0))
    >>> {k: v.shape for k, v in params.items()}
    {'float32x8': (1500, 8)}
    >>> emb = stack.lookup(params, {"user_id": jnp.array([3, 7]),
    ...                             "item_id": jnp.array([1, 2]),
    ...                             "history": jnp.array([[1, 4], [2, -1]])})
    >>> emb["history"].shape
    (2, 8)
  """

  def __init__(
    self,
    tables: Mapping[str, TableSpec],
    features: Mapping[str, str] | None = None,
    *,
    batch_size: int | None = None,
    shards: int = 1,
    lanes: int = 1,
  ):
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
    self.tables: dict[str, TableSpec] = dict(tables)
    if features is None:
      features = {name: name for name in self.tables}
    unknown = {f: t for f, t in features.items() if t not in self.tables}
    if unknown:
      raise ValueError(
        f"gradtx.TableStack `features` name tables that are not in "
        f"`tables`: {unknown}. The tables are {list(self.tables)}."
      )
    self.features: dict[str, str] = dict(features)
    if batch_size is not None and (
      isinstance(batch_size, bool)
      or not isinstance(batch_size, (int, np.integer))
      or batch_size < 1
    ):
      raise ValueError(
        f"gradtx.TableStack `batch_size` must be a positive int or None; "
        f"got {batch_size!r}."
      )
    self.batch_size = batch_size
    if isinstance(shards, bool) or not isinstance(shards, (int, np.integer)):
      shards = 0
    if shards < 1:
      raise ValueError(
        f"gradtx.TableStack `shards` must be a positive int (the devices a "
        f"stack's rows are split over); got {shards!r}."
      )
    self.shards = int(shards)
    readers: dict[str, int] = {}
    for t in self.features.values():
      readers[t] = readers.get(t, 0) + 1
    self.outside: dict[str, str] = {}  # table -> why it is not stacked
    for name, spec in self.tables.items():
      if name not in readers:
        self.outside[name] = "no feature reads it"
        continue
      reads = (batch_size or 0) * readers[name]
      if (
        batch_size is not None
        and spec.hashed is None
        and reads >= _READS_PER_ROW_OUTSIDE * spec.rows
      ):
        self.outside[name] = (
          f"{reads:,} reads per step at batch_size {batch_size} for "
          f"{spec.rows:,} rows: one summed gradient row per table row is "
          "smaller than a row per read"
        )
    by_key: dict[tuple[int, str], list[str]] = {}
    for name, spec in self.tables.items():
      if name not in self.outside:
        by_key.setdefault(spec.key, []).append(name)
    if isinstance(lanes, bool) or not isinstance(lanes, (int, np.integer)):
      lanes = 0
    if lanes < 1:
      raise ValueError(
        f"gradtx.TableStack `lanes` must be a positive int (the stacks the "
        f"tables of one width and dtype are spread over); got {lanes!r}."
      )
    self.lanes = int(lanes)
    self.stacks: dict[str, _Stack] = {}
    lanes_of = {
      (dim, dtype, k): part
      for (dim, dtype), names in by_key.items()
      for k, part in enumerate(_lanes(names, readers, self.tables, lanes))
    }
    for (dim, dtype, lane), names in lanes_of.items():
      offsets, start = [], 0
      for n in names:
        offsets.append(start)
        start += int(self.tables[n].rows)
      if start >= 2**31:
        raise ValueError(
          f"gradtx.TableStack: the {dtype} tables of width {dim} hold "
          f"{start:,} rows, more than int32 ids address (2**31 - 1). Give "
          "some of them another dtype or split them over two TableStacks."
        )
      stack = _Stack(
        _stack_name(dim, dtype, lane),
        dim,
        dtype,
        tuple(names),
        tuple(offsets),
        start,
        self.shards,
      )
      self.stacks[stack.name] = stack
    clash = set(self.stacks) & set(self.outside)
    if clash:
      raise ValueError(
        f"gradtx.TableStack: tables named {sorted(clash)} clash with the "
        "names of the stacks; rename them."
      )
    self._where = {
      t: (s.name, off)
      for s in self.stacks.values()
      for t, off in zip(s.tables, s.offsets, strict=True)
    }
    # the id map of each stack with hashed tables
    self.maps: dict[str, _vocab.Layout] = {}
    for s in self.stacks.values():
      hashed = [
        (t, off)
        for t, off in zip(s.tables, s.offsets, strict=True)
        if self.tables[t].hashed is not None
      ]
      if hashed:
        self.maps[s.name] = _vocab.Layout(
          tuple(t for t, _ in hashed),
          tuple(off for _, off in hashed),
          tuple(int(self.tables[t].rows) for t, _ in hashed),
          tuple(self.tables[t].hashed for t, _ in hashed),
          s.size,
          s.shards,
        )

  # -- the plan -------------------------------------------------------------
  def location(self, table: str) -> tuple[str, int]:
    """``(params key, first row)`` of ``table``: a stack's name and the
    table's offset in it, or the table's own name and 0 outside."""
    if table not in self.tables:
      raise KeyError(
        f"gradtx.TableStack has no table {table!r}; the tables are "
        f"{list(self.tables)}."
      )
    return self._where.get(table, (table, 0))

  def __repr__(self) -> str:
    lines = [
      f"TableStack: {len(self.tables)} table(s), {len(self.features)} "
      f"feature(s), {len(self.stacks)} stack(s), "
      f"{len(self.outside)} outside"
    ]
    for s in self.stacks.values():
      item = jnp.dtype(s.dtype).itemsize
      spread = (
        f", every table's rows spread over {s.shards} shards"
        + (f" ({s.size - s.rows} padding rows)" if s.size > s.rows else "")
        if s.shards > 1
        else ""
      )
      lines.append(
        f"  stack {s.name!r}: {s.size:,} rows x {s.dim} {s.dtype}, "
        f"{_bytes(s.size * s.dim * item)}{spread}"
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
        lines.append(
          f"    {t}: rows {off:,}..{off + self.tables[t].rows - 1:,}"
          f"  features {feats}{how}"
        )
      if s.name in self.maps:
        m = self.maps[s.name]
        sketch = m.sketch_bytes
        lines.append(
          f"    id map of {len(m.tables)} hashed table(s): "
          f"{_bytes(m.map_bytes)} "
          f"({_vocab.MAP_BYTES_PER_ROW} B a row of the stack"
          + (f", sketch {_bytes(sketch)}" if sketch else "")
          + ")"
        )
    for t, why in self.outside.items():
      spec = self.tables[t]
      lines.append(
        f"  outside {t!r}: {spec.rows:,} rows x {spec.dim} "
        f"{jnp.dtype(spec.dtype).name}: {why}"
      )
    return "\n".join(lines)

  __str__ = __repr__

  # -- params ---------------------------------------------------------------
  def init(self, key: Any) -> dict[str, jax.Array]:
    """The params: one array per stack and per table outside, each table's
    rows from its initializer with its own key (``fold_in(key, i)`` for
    the ``i``-th table of ``tables``; with the default initializer, row
    ``r`` of it from ``fold_in(fold_in(key, i), r)``), so they do not
    depend on the plan.

    One compiled program makes every table (the initializers are traced,
    as under ``jax.jit(model.init)``), and the default initializer draws
    the rows of all the tables that use it at once: its cost does not grow
    with the number of tables. (A table with an initializer of its own
    adds that initializer's ops to the program.)"""
    return jax.jit(self._init)(key)

  def _init(self, key: Any) -> dict[str, jax.Array]:
    per_table, alike = {}, {}
    names = list(self.tables)
    for i, (t, spec) in enumerate(self.tables.items()):
      shape, dtype = (int(spec.rows), int(spec.dim)), jnp.dtype(spec.dtype)
      if spec.initializer is None:  # drawn below, with its width's tables
        alike.setdefault((shape[1], dtype), []).append(i)
      else:
        x = spec.initializer(jax.random.fold_in(key, i), shape, dtype)
        per_table[t] = jnp.asarray(x, dtype)
    for (dim, dtype), index in alike.items():
      sizes = [int(self.tables[names[i]].rows) for i in index]
      rows = _default_tables(key, index, sizes, dim, dtype)
      # The group (every default table of this width and dtype) does not
      # depend on the plan; kept out of the fusions of the stacks that
      # consume it, its draw is the same program, bit for bit, whatever
      # the plan.
      rows = lax.optimization_barrier(rows)
      parts = jnp.split(rows, np.cumsum(sizes)[:-1])
      per_table.update(zip([names[i] for i in index], parts, strict=True))
    return self.stack(per_table)

  def stack(self, per_table: Mapping[str, ArrayLike]) -> dict[str, jax.Array]:
    """Params from one array per table (a per-table model or checkpoint)."""
    missing = [t for t in self.tables if t not in per_table]
    if missing:
      raise ValueError(
        f"gradtx.TableStack.stack: `per_table` has no array for {missing}."
      )
    for t, spec in self.tables.items():
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
      for s in self.stacks.values()
    }
    for t in self.outside:
      out[t] = jnp.asarray(per_table[t], self.tables[t].dtype)
    return out

  def unstack(self, params: Mapping[str, Any]) -> dict[str, Any]:
    """One ``[rows, dim]`` array per table, from the params (or from a tree
    shaped like them: optimizer moments, a dense gradient)."""
    self._check_params(params, "unstack")
    logical = {k: s.to_logical(params[k]) for k, s in self.stacks.items()}
    out = {}
    for t in self.tables:
      where, off = self.location(t)
      if where == t:
        out[t] = params[t]
      else:
        out[t] = logical[where][off : off + self.tables[t].rows]
    return out

  def _check_params(self, params: Any, what: str) -> None:
    want = list(self.stacks) + list(self.outside)
    if not isinstance(params, Mapping) or any(k not in params for k in want):
      got = list(params) if isinstance(params, Mapping) else type(params)
      raise ValueError(
        f"gradtx.TableStack.{what}: `params` must be the dict `stack.init` "
        f"returns, with keys {want}; got {got}."
      )

  # -- open vocabularies ----------------------------------------------------
  def init_vocab(self, key: Any) -> dict[str, VocabState]:
    """The id maps of the hashed tables, all rows free: a dict stack name
    -> :class:`gradtx.VocabState` of plain arrays, to carry beside the
    params through the step and into checkpoints. ``key`` seeds the rows
    given to new ids (each stack its own ``fold_in(key, i)``)."""
    if not self.maps:
      raise ValueError(
        "gradtx.TableStack.init_vocab: no table is hashed; declare one with "
        "`gtx.TableSpec(..., hashed=gtx.Hashed())`."
      )
    return {
      name: _vocab.init_state(layout, jax.random.fold_in(key, i))
      for i, (name, layout) in enumerate(self.maps.items())
    }

  def admit(
    self,
    vocab: Mapping[str, VocabState],
    ids: Mapping[str, Any],
    *,
    weights: Mapping[str, ArrayLike] | None = None,
    max_new: int | float | Mapping[str, int | float] = DEFAULT_MAX_NEW,
  ) -> tuple[dict[str, Any], dict[str, VocabState], dict[str, FreshRows]]:
    """Maps the raw ids of hashed features to rows, giving new ids rows.

    Inside the jitted step, before the loss: known ids read their rows, new
    ids take free rows or evict rows by their table's policy (see
    :class:`gradtx.Hashed`), and the map of every hashed table of a stack
    is updated in one pass, the features in the order of ``features``
    (new ids placed in that order: the same ids give the same rows).
    Padding (a negative id, a weight 0, a jagged slot past the bags) maps
    to no row. Pass the returned ``fresh`` to
    :func:`gradtx.reset_rows` before the loss, so that a row given to a
    new id is fresh in the table and in every optimizer state::

      ids, vocab, fresh = stack.admit(vocab, raw_ids)
      params, opt_state = gtx.reset_rows(opt, opt_state, params, fresh)
      loss, grads = gtx.sparse_value_and_grad(loss_fn)(params, ids, ...)

    Args:
      vocab: the maps (:meth:`init_vocab`).
      ids: feature name -> ids, as :meth:`lookup` takes them; a hashed
        table's features take raw ids: int32, uint32, int64 or uint64
        (numpy ones split on the host when ``jax_enable_x64`` is off;
        inside a jitted step pass :meth:`gradtx.Words.of` of them) or
        :class:`gradtx.Words`. Every value of an unsigned type or of
        Words is an id; a negative one of a signed type is padding.
      weights: per-id weights of ``[B, L]`` features (0: padding).
      max_new: the most new ids each hashed table places in one step,
        every table its own bound: an int, or a float, that fraction of
        the table's own id slots in ``ids`` (at least 64, or all of them
        when there are fewer); or a dict table name -> int or float, the
        tables it does not name at the default 0.125. A table's first new
        ids in order compete for its rows; the others read zeros for
        this step (counted in ``rejected``) and are placed when read
        again. No table's new ids take another's share. Its work (the
        placement, the fresh rows' values and :func:`reset_rows`) follows
        the sum of the bounds, not the ids: raise a table's bound when
        its ``rejected`` stays high while it has room (``starved``).

    Returns:
      ``(ids, vocab, fresh)``: the features' ids as rows for :meth:`lookup`
      (other features unchanged), the new maps, and stack name ->
      :class:`gradtx.FreshRows` (the rows given out and their new values).
    """
    _vocab.check_vocab(vocab, self.maps, "admit")
    self._check_max_new(max_new)
    out = dict(ids)
    new_vocab, fresh = dict(vocab), {}
    for name, layout in self.maps.items():
      slots = self._raw_slots(name, ids, weights, "admit")
      if slots is None:
        continue
      state = vocab[name]
      bound = _vocab.budgets(layout, slots.tab, max_new)
      rows, new_vocab[name], placed, tab = _vocab.admit(
        state, layout, slots.hi, slots.lo, slots.tab, slots.valid, bound
      )
      out.update(slots.rebuild(rows))
      fresh[name] = FreshRows(placed, self._fresh_values(name, state, tab))
    return out, new_vocab, fresh

  def drop_reassigned(
    self,
    grads: Mapping[str, Any],
    vocab: Mapping[str, VocabState],
    since: ArrayLike | Mapping[str, ArrayLike],
  ) -> dict[str, Any]:
    """Drops the gradient rows of hashed tables whose rows were given to
    another id after the gradient's ids were mapped.

    A gradient computed from the ids that :meth:`admit` mapped at the
    map's step ``s`` (the ``step`` of the maps it was given) and applied
    later (asynchronous training, :func:`gradtx.drop_stale`) may hold
    rows that a later ``admit`` gave to new ids: applied, the old id's
    gradient would train the new owner. The map records when each row
    was given out (``VocabState.born``); this keeps the gradient's rows
    given out at ``s`` or before and drops the others (a SparseRows entry
    becomes padding, a dense row zeros). Rows of plain tables are kept.
    Apply it to the gradient before the optimizer's ``update``; with
    :func:`gradtx.accumulate`, entries already in its buffer were dropped
    by :func:`gradtx.reset_rows` when their rows were given out.

    Args:
      grads: the stack's gradient, a dict with the keys of :meth:`init`'s
        params (SparseRows or arrays; a subset allowed).
      vocab: the maps now (:meth:`init_vocab`).
      since: the maps' ``step`` when the gradient's ids were mapped (the
        ``vocab[name].step`` that ``admit`` was given): an int scalar for
        every stack, or a dict stack name -> scalar.

    Returns:
      ``grads`` with those rows dropped.
    """
    _vocab.check_vocab(vocab, self.maps, "drop_reassigned")
    out = dict(grads)
    for name in self.maps:
      if name in out:
        s = since[name] if isinstance(since, Mapping) else since
        out[name] = _vocab.drop_reassigned(out[name], vocab[name].born, s)
    return out

  def _check_max_new(self, max_new: Any) -> None:
    def ok(v):
      return not isinstance(v, bool) and (
        (isinstance(v, (int, np.integer)) and v >= 1)
        or (isinstance(v, float) and 0 < v <= 1)
      )

    hashed = [t for layout in self.maps.values() for t in layout.tables]
    if isinstance(max_new, Mapping):
      unknown = [t for t in max_new if t not in hashed]
      if unknown:
        raise ValueError(
          f"gradtx.TableStack.admit `max_new` names {unknown}, which are not "
          f"hashed tables; the hashed tables are {hashed}."
        )
      bad = {t: v for t, v in max_new.items() if not ok(v)}
    else:
      bad = None if ok(max_new) else max_new
    if bad is not None and bad != {}:
      raise ValueError(
        "gradtx.TableStack.admit `max_new` must be an int >= 1 or a float in "
        "(0, 1] (a fraction of each table's id slots), or a dict of them per "
        f"hashed table; got {bad!r}."
      )

  def vocab_stats(self, vocab: Mapping[str, VocabState]) -> dict[str, dict]:
    """What to watch, per hashed table (cheap and jittable): ``live`` rows
    and ``occupancy``, the last step's ``inserted`` new ids, ``evicted``
    live ids and ``rejected`` id reads (no row: padding for that step),
    ``starved`` (the consecutive steps, up to the last, in which the
    table turned reads away while it had free rows and placed no new id),
    ``mean_age`` (steps since the row was given out) and ``mean_count``
    (reads of its id), and the live rows' ``age_buckets``,
    ``idle_buckets`` (steps since last read) and ``count_buckets`` in
    log2 buckets ``0, 1, 2-3, 4-7, ...``."""
    _vocab.check_vocab(vocab, self.maps, "vocab_stats")
    out = {}
    for name, layout in self.maps.items():
      out.update(_vocab.stats(vocab[name], layout))
    return out

  def _raw_slots(self, name, ids, weights, what) -> _RawSlots | None:
    """The raw ids of stack ``name``'s hashed features in ``ids``, flat and
    joined, with a way back to each feature's form."""
    layout = self.maps[name]
    weights = dict(weights or {})
    # in the plan's order, which jit's sorting of dict keys does not change
    feats = [
      f for f, t in self.features.items() if f in ids and t in layout.tables
    ]
    if not feats:
      return None
    his, los, oks, tabs, backs = [], [], [], [], []
    for f in feats:
      x, w = ids[f], weights.get(f)
      jag = isinstance(x, Jagged)
      raw = x.ids if jag else x
      split, lo, pad = _vocab.raw_words(raw, f"feature {f!r}")
      # the map's work is over the whole step's ids: split over a data-
      # parallel batch, they are gathered first, and the rows split back
      hi, lo, pad = (unsplit(v) for v in (split, lo, pad))
      shape = hi.shape
      ok = ~pad
      if jag:
        if hi.ndim != 1:
          raise ValueError(
            f"gradtx.TableStack.{what}: feature {f!r}: Jagged `ids` must be "
            f"[capacity]; got {shape}."
          )
        total = jnp.sum(unsplit(jnp.asarray(x.lengths)).astype(jnp.int32))
        ok = ok & (jnp.arange(shape[0]) < total)
        w = x.weights
      elif hi.ndim not in (1, 2):
        raise ValueError(
          f"gradtx.TableStack.{what}: feature {f!r} has ids of shape {shape}; "
          "pass [B] ids, [B, L] bags or a gradtx.Jagged."
        )
      if w is not None:
        ok = ok & (unsplit(jnp.asarray(w)) != 0)
      his.append(hi.reshape(-1))
      los.append(lo.reshape(-1))
      oks.append(ok.reshape(-1))
      tabs.append(np.full(hi.size, layout.tables.index(self.features[f])))
      backs.append((f, split, x if jag else None))
    sizes = [h.shape[0] for h in his]

    def rebuild(rows: jax.Array) -> dict[str, Any]:
      parts = (
        jnp.split(rows, np.cumsum(sizes)[:-1]) if len(sizes) > 1 else [rows]
      )
      out = {}
      for (f, split, jag), r in zip(backs, parts, strict=True):
        r = split_like(r.reshape(split.shape), split)
        out[f] = jag._replace(ids=r) if jag is not None else r
      return out

    return _RawSlots(
      joined(his),
      joined(los),
      joined(oks),
      np.concatenate(tabs).astype(np.int32),
      rebuild,
    )

  def _fresh_values(self, name, state, tab) -> jax.Array:
    """``[m, dim]`` new rows, the k-th for the k-th row placed (of hashed
    table ``tab[k]``): each table's initializer, keyed by the map's key and
    step."""
    layout, s = self.maps[name], self.stacks[name]
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
    n = tab.shape[0]
    groups: dict[Any, list[int]] = {}
    for k, t in enumerate(layout.tables):
      groups.setdefault(self.tables[t].initializer, []).append(k)
    values = None
    for g, (init, members) in enumerate(groups.items()):
      v = (init or _default_init)(
        jax.random.fold_in(key, g), (n, s.dim), jnp.dtype(s.dtype)
      ).astype(s.dtype)
      if values is None:
        values = v
      else:
        values = jnp.where(
          jnp.isin(tab, np.asarray(members))[:, None], v, values
        )
    return values

  # -- the lookup -----------------------------------------------------------
  def lookup(
    self,
    params: Mapping[str, jax.Array],
    ids: Mapping[str, Any] | Keyed | KeyedJagged,
    *,
    weights: Mapping[str, ArrayLike] | None = None,
    combiner: str = "sum",
    concat: bool = False,
    keyed: bool = False,
    vocab: Mapping[str, VocabState] | None = None,
  ) -> dict[str, jax.Array] | jax.Array | Keyed:
    """Every feature's pooled rows: one gather and one segment sum a stack.

    Ids per feature, all with the same batch ``B``:

    * ``[B]``: one row per example;
    * ``[B, L]``: a bag of ``L`` ids per example, with optional ``[B, L]``
      ``weights`` (a weight 0 marks padding), pooled by ``combiner``;
    * :class:`Jagged`: flat ids padded to a static capacity, per-example
      lengths and optional weights.

    or every feature at once, keyed by name: a :class:`Keyed` ``[B, F]``
    matrix (or ``[B, F, L]`` bags) or a :class:`KeyedJagged`, read whole
    with no per-feature op, so the program's size does not grow with the
    number of features (a dict adds a few ops per feature).

    An id outside ``[0, rows)`` of its table (negative ones included) is
    padding: it reads nothing and gets no gradient; so is an id of weight
    0. ``combiner`` pools a bag: ``"sum"`` (weighted sum), ``"mean"``
    (divided by the sum of its weights, padding excluded) or ``"sqrtn"``
    (divided by the square root of the sum of its squared weights); an
    empty bag pools to zeros.

    Args:
      params: the params of :meth:`init` (or any dict with those keys).
      ids: feature name -> ids, every feature of ``features`` that a model
        reads, a subset allowed; or a :class:`Keyed` / :class:`KeyedJagged`
        of such features.
      weights: feature name -> per-id weights of a ``[B, L]`` feature (a
        keyed input carries its own).
      combiner: ``"sum"``, ``"mean"`` or ``"sqrtn"``.
      concat: return one ``[B, sum of dims]`` array, the features in
        :meth:`concat_order`, the stack's declared feature order grouped by
        stack, whatever the order of ``ids``' keys (FBGEMM's pooled
        output): a head that reads all the features at once then reads the
        stack's pooled rows as they are, with no split into features and no
        stacking back.
      keyed: return a :class:`Keyed` of the pooled rows, ``values``
        ``[B, F, dim]`` in :meth:`concat_order` (every feature read must
        have one ``dim``): a head that reads each feature with weights of
        its own reads them as one array (``jnp.einsum("bfd,fd->b",
        out.values, w)``), with no op per feature.
      vocab: the id maps (:meth:`init_vocab`): the features of hashed
        tables then take raw ids, read-only (evaluation): a known id reads
        its row, an unknown one zeros, and nothing is inserted or evicted.
        Without it, they take the rows :meth:`admit` returned. (A keyed
        input is then read as its dict, feature by feature.)

    Returns:
      feature name -> ``[B, dim]`` rows in the table's dtype; with
      ``concat`` one ``[B, sum of dims]`` array; with ``keyed`` a
      :class:`Keyed`.
    """
    self._check_params(params, "lookup")
    if combiner not in COMBINERS:
      raise ValueError(
        f"gradtx.TableStack.lookup `combiner` must be one of {COMBINERS}; "
        f"got {combiner!r}."
      )
    if concat and keyed:
      raise ValueError(
        "gradtx.TableStack.lookup: pass `concat=True` (one [B, sum of dims] "
        "array) or `keyed=True` (a gradtx.Keyed [B, F, dim]), not both."
      )
    weights = dict(weights or {})
    whole = isinstance(ids, (Keyed, KeyedJagged))
    if whole and weights:
      raise ValueError(
        "gradtx.TableStack.lookup: `ids` is keyed; put its weights in "
        f"`gtx.{type(ids).__name__}(..., weights=...)`, not in `weights`."
      )
    names = list(ids.names) if whole else list(ids)
    unknown = [f for f in names + list(weights) if f not in self.features]
    if unknown:
      raise ValueError(
        f"gradtx.TableStack.lookup: unknown features {unknown}; the "
        f"features are {list(self.features)}."
      )
    if vocab is not None:
      _vocab.check_vocab(vocab, self.maps, "lookup")
      if isinstance(ids, Keyed) and ids.weights is not None:
        weights = {f: ids.weights[:, k] for k, f in enumerate(ids.names)}
      ids, whole = dict(ids), False
      for name, layout in self.maps.items():
        slots = self._raw_slots(name, ids, weights, "lookup")
        if slots is not None:
          rows = _vocab.find(
            vocab[name], layout, slots.hi, slots.lo, slots.tab, slots.valid
          )
          ids.update(slots.rebuild(rows))
    # A batch split over Explicit mesh axes: pooled whole, split back.
    split = next(
      (x for x in jax.tree.leaves((ids, weights)) if is_split(x)), None
    )
    if split is not None:
      ids, weights = jax.tree.map(
        lambda x: unsplit(x) if is_split(x) else x, (ids, weights)
      )
    if whole:
      batch, read = keyed_batch(ids), keyed_reader(ids)
    else:
      batch, read = dict_reader(ids, weights)
    out, parts = {}, []
    for where, feats in self._groups(names):
      s = self.stacks.get(where)
      tables = [self.features[f] for f in feats]
      pooled = pool_rows(
        params[where],
        read(feats),
        batch,
        [0] if s is None else [s.offsets[s.tables.index(t)] for t in tables],
        [self.tables[t].rows for t in tables],
        s,
        combiner,
      )
      if split is not None:
        pooled = split_like(pooled, split)
      if concat:
        parts.append(pooled.reshape(pooled.shape[0], -1))
      elif keyed:
        parts.append(pooled)
      else:
        out.update(split_features(pooled, feats))
    if keyed:
      dims = {p.shape[-1] for p in parts}
      if len(dims) > 1:
        raise ValueError(
          "gradtx.TableStack.lookup `keyed=True` needs features of one "
          f"width; these have widths {sorted(dims)}. Pass `concat=True` "
          "(one [B, sum of dims] array) or read the dict."
        )
      values = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
      return Keyed(self.concat_order(names), values)
    if concat:
      return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    return {f: out[f] for f in names}

  def _groups(self, features: Any) -> list[tuple[str, list[str]]]:
    """``(params key, features)`` per array read: the stacks in order, then
    each table outside; features in the order of ``features`` declared to
    the stack (never the order given: ``jax.jit`` sorts a dict's keys)."""
    given = set(features)
    declared = [f for f in self.features if f in given]
    groups = []
    for name, s in self.stacks.items():
      feats = [f for f in declared if self.features[f] in s.tables]
      if feats:
        groups.append((name, feats))
    for t in self.outside:
      feats = [f for f in declared if self.features[f] == t]
      if feats:
        groups.append((t, feats))
    return groups

  def concat_order(self, ids: Any) -> list[str]:
    """The features of ``lookup(..., concat=True)``'s array, in order:
    grouped by stack (in the order of ``stacks``, then the tables outside),
    each group in the order of the stack's ``features``. The order depends
    only on which features ``ids`` holds, not on the order of its keys, so
    it is the same eagerly and under ``jax.jit`` (which sorts a dict's
    keys)."""
    return [f for _, feats in self._groups(ids) for f in feats]


class _RawSlots(NamedTuple):
  """The raw ids of a stack's hashed features: flat words, which slots are
  ids, each slot's hashed table (static), and ``rebuild(rows)`` -> feature
  name -> rows in the feature's own form."""

  hi: jax.Array
  lo: jax.Array
  valid: jax.Array
  tab: np.ndarray
  rebuild: Callable[[jax.Array], dict[str, Any]]


def _bytes(n: float) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
    n /= 1024
  return f"{n:,.1f} GiB"
