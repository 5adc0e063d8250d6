"""Pooled reads: the one gather that reads a table stack's features and the
one segment sum that pools them.

:func:`read_features` is ``TableStack.lookup``'s one call: the input
parsed (``_inputs.parse``), the hashed features' raw ids through their
maps where the maps are given (:func:`raw_slots` joins them for the id
map, ``_vocab``, and gives each feature its rows back), then per array
read the slots (:func:`dict_reader`, :func:`keyed_reader`), one gather
and one segment sum into ``[B, F, dim]`` (:func:`pool_rows`), and the
output's form (:func:`split_features` for the dict).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from gradtx import _platform
from gradtx._ids import raw_words
from gradtx._inputs import (
  Feature,
  Keyed,
  KeyedJagged,
  host_ready,
  parse,
  run_program,
)
from gradtx._lookup import host_check, lookup
from gradtx._plan import StackPlan, arrays_read, check_params, hashed_features
from gradtx._sharded import is_split, split_like, unsplit
from gradtx._vocab import Layout, check_vocab, find


class _Bag(NamedTuple):
  """A feature's ids as flat slots: ``ids[k]`` belongs to example
  ``segment[k]`` (``batch``: none) with weight ``weight[k]``."""

  ids: jax.Array
  segment: jax.Array | None  # None: slot k -> example k // per_example
  weight: jax.Array | None  # None: every slot weighs 1
  batch: int
  per_example: int  # ids per example for the dense forms, 0 if jagged


def _bag(name: str, form: Feature) -> _Bag:
  ids = form.ids  # row ids (_inputs.parse, or the id map's rows)
  weight = None if form.weights is None else jnp.asarray(form.weights)
  if form.lengths is not None:
    # slots past the last bag belong to no example
    segment = _bag_of_slots(form.lengths, ids.shape[0])
    return _Bag(ids, segment, weight, form.lengths.shape[0], 0)
  weight = None if weight is None else weight.reshape(-1)
  per = 1 if ids.ndim == 1 else ids.shape[1]
  return _Bag(ids.reshape(-1), None, weight, ids.shape[0], per)


def _bag_of_slots(lengths: jax.Array, n: int) -> jax.Array:
  """For each of ``n`` slots of flat jagged ids, the bag it belongs to (the
  bags' ``lengths`` one after the other; ``len(lengths)``: past the last
  bag): the number of bags ending at or before the slot, counted by one
  scatter of the bags' ends and one cumulative sum (the values of
  ``searchsorted(cumsum(lengths), slot, side="right")``, without its loop
  of dependent gathers)."""
  ends = _platform.prefix_sum(lengths)
  marks = jnp.zeros([n], jnp.int32).at[jnp.maximum(ends, 0)].add(1, mode="drop")
  return _platform.prefix_sum(marks)


def joined(parts: list[jax.Array]) -> jax.Array:
  """The 1-D ``parts`` one after the other, kept out of their consumers'
  fusions: fused into an elementwise loop, a concatenation of hundreds of
  operands becomes a chain of selects per element, whose compile time
  grows steeply with the features; alone it is a copy per part."""
  if len(parts) == 1:
    return parts[0]
  return lax.optimization_barrier(jnp.concatenate(parts))


# features a column block of _columns holds
_COLUMN_BLOCK = 32


def _columns(parts: list[jax.Array]) -> jax.Array:
  """The ``[B]`` ``parts`` as the columns of one ``[B, F]`` array, joined
  by blocks of 32 columns, each kept out of its consumers' fusions as in
  :func:`joined`. Columns sliced in order from one ``[B, F]`` matrix
  (``{f: m[:, i] ...}``) then join back into one slice of it per block
  (XLA merges a concatenation of adjacent slices), so a sliced dict does
  not compile a copy per feature; the blocks keep each concatenation
  along the minor axis small, whose compile time grows steeply with its
  operands."""
  if len(parts) == 1:
    return parts[0][:, None]
  blocks = [
    lax.optimization_barrier(jnp.stack(parts[i : i + _COLUMN_BLOCK], axis=1))
    for i in range(0, len(parts), _COLUMN_BLOCK)
  ]
  if len(blocks) == 1:
    return blocks[0]
  return lax.optimization_barrier(jnp.concatenate(blocks, axis=1))


class _Slots(NamedTuple):
  """A group's ids laid out for its one gather: ``segment`` None, ``ids``
  ``[B, F]`` one-hot and example-major (the rows gathered are the pooled
  rows); else slots of any shape pooled into ``segment``, ``feature * B +
  example`` (at or past ``B * F``: no example)."""

  ids: jax.Array  # int32
  weight: jax.Array | None  # float32, ids' shape; None: every slot 1
  feature: Any  # the slot's feature in the group (numpy or jax ints,
  # broadcastable to ids); F: none of the group's
  segment: jax.Array | None
  sorted: bool  # segment nondecreasing over the slots
  ok: Any = True  # False: the slot belongs to no example (padding)


def _dict_slots(bags: list[_Bag], batch: int) -> _Slots:
  """The slots of a dict's features: their ids joined, one-hot ones
  example-major."""
  nf = len(bags)
  weighted = any(b.weight is not None for b in bags)
  weights = [
    jnp.ones(b.ids.shape, jnp.float32) if b.weight is None else b.weight
    for b in bags
  ]
  weights = [w.astype(jnp.float32) for w in weights]
  ids = [b.ids for b in bags]
  if all(b.per_example == 1 for b in bags):
    weight = _columns(weights) if weighted else None
    feature = np.arange(nf, dtype=np.int32)[None]
    return _Slots(_columns(ids), weight, feature, None, True)
  weight = joined(weights) if weighted else None
  ids = joined(ids)
  sizes = [b.ids.shape[0] for b in bags]
  seg = []
  for b in bags:
    if b.segment is None:
      example = np.arange(b.ids.shape[0], dtype=np.int32) // b.per_example
      seg.append(jnp.asarray(example))
    else:  # jagged: slots past the last bag belong to no example
      seg.append(b.segment)
  example = joined(seg)
  feature = np.repeat(np.arange(nf, dtype=np.int32), sizes)
  # feature-major segments follow the slots' order: a sorted segment sum
  segment = feature * batch + jnp.minimum(example, batch - 1)
  return _Slots(ids, weight, feature, segment, True, example < batch)


def keyed_reader(x: Keyed | KeyedJagged) -> Callable[[list[str]], _Slots]:
  """``read(feats)``: the slots of features ``feats`` (a group, in its
  order) of a keyed input, with no op per feature."""
  if isinstance(x, KeyedJagged):
    return _jagged_reader(x)
  values = x.values  # row ids (_inputs.parse)
  weights = None if x.weights is None else jnp.asarray(x.weights, jnp.float32)
  batch, width = values.shape[:2]

  def read(feats: list[str]) -> _Slots:
    cols = [x.names.index(f) for f in feats]
    v, w = values, weights
    if cols != list(range(width)):  # one gather of the group's columns
      v = v[:, np.asarray(cols)]
      w = None if w is None else w[:, np.asarray(cols)]
    nf = len(cols)
    if v.ndim == 2:
      feature = np.arange(nf, dtype=np.int32)[None]
      return _Slots(v, w, feature, None, True)
    # bags: feature-major [F, B, L], so the segments are sorted
    v = jnp.swapaxes(v, 0, 1)
    w = None if w is None else jnp.swapaxes(w, 0, 1)
    shape = v.shape
    segment = lax.broadcasted_iota(jnp.int32, shape, 0) * batch
    segment = segment + lax.broadcasted_iota(jnp.int32, shape, 1)
    feature = np.arange(nf, dtype=np.int32)[:, None, None]
    return _Slots(v, w, feature, segment, True)

  return read


def _jagged_reader(x: KeyedJagged) -> Callable[[list[str]], _Slots]:
  ids = x.ids  # row ids (_inputs.parse)
  lengths = jnp.asarray(x.lengths).astype(jnp.int32)
  weight = None if x.weights is None else jnp.asarray(x.weights, jnp.float32)
  keys, batch = len(x.names), lengths.shape[1]
  # each slot's bag (key-major: key * B + example)
  bag = _bag_of_slots(lengths.reshape(-1), ids.shape[0])
  key, example = bag // batch, bag % batch  # key == keys: past the bags

  def read(feats: list[str]) -> _Slots:
    # each key's position in the group (len(feats): not in it, or none)
    where = np.full(keys + 1, len(feats), np.int32)
    for k, f in enumerate(feats):
      where[x.names.index(f)] = k
    identity = np.array_equal(where[:-1], np.arange(keys))
    feature = key if identity else jnp.asarray(where)[key]
    segment = feature * batch + example
    return _Slots(
      ids, weight, feature, segment, bool(np.all(np.diff(where) >= 0))
    )

  return read


def pool_rows(table, slots, batch, offsets, rows, stack, combiners, check=None):
  """One gather of a group's rows from ``table`` (features offset into
  its logical rows, placed by ``stack``; padding = the table's row count:
  out of range, a zero row and no gradient) and one segment sum into
  ``[B, F, dim]``, each feature pooled by its entry of ``combiners``.
  ``check``: the group's feature names, to raise for an id read outside
  its table's rows other than -1 (:func:`bounds_check`).

  The pooled rows are laid out example-major (``[B, F, dim]``), the layout
  a head that concatenates or stacks the features reads: one-hot features
  are gathered in that order directly, with no segment sum; bags are
  summed feature by feature (the slots' own order, a sorted segment sum)
  and the ``[F, B, dim]`` sums transposed. The ids are offset, checked
  and placed by one elementwise pass against each slot's feature's
  constants, and the norms of ``"mean"`` and ``"sqrtn"`` features are
  extra columns of the same segment sum, each feature's picked by a
  constant per feature, so the program does not grow with the number of
  features."""
  nf = len(offsets)
  # per feature, and a last entry for "none of the group's": no row valid
  off = np.asarray([*offsets, 0], np.int32)
  lim = np.asarray([*rows, 0], np.int32)
  if isinstance(slots.feature, np.ndarray):
    off, lim = off[slots.feature], lim[slots.feature]
  else:
    off, lim = jnp.asarray(off)[slots.feature], jnp.asarray(lim)[slots.feature]
  ids, weight = slots.ids, slots.weight
  read = jnp.asarray(slots.ok)
  if weight is not None:
    read = read & (weight != 0)
  if check is not None:  # of the group's features: -1 is their padding
    read_here = read & (jnp.asarray(slots.feature) < nf) & (ids != -1)
    ids = bounds_check(ids, read_here, slots.feature, lim, check)
  valid = (ids >= 0) & (ids < lim) & read
  row = ids + off
  row = row if stack is None else stack.physical(row)
  got = lookup(table, jnp.where(valid, row, table.shape[0]).reshape(-1))
  one_hot = slots.segment is None
  combiners = np.asarray(combiners)
  normed = [c for c in ("mean", "sqrtn") if c in combiners]
  if one_hot and weight is None and not normed:
    pooled = got  # padding read zeros
  else:
    if weight is None:
      weight = jnp.ones(ids.shape, jnp.float32)
    weight = jnp.where(valid, weight, 0.0).reshape(-1)
    pooled = got.astype(jnp.float32) * weight[:, None]
    # a mean's norm sums the weights, a sqrtn's their squares
    norms = [weight if c == "mean" else weight * weight for c in normed]
    if not one_hot:  # the rows and the norms in one segment sum
      dim = pooled.shape[-1]
      pooled = jax.ops.segment_sum(
        jnp.concatenate([pooled, *(n[:, None] for n in norms)], axis=1),
        slots.segment.reshape(-1),
        num_segments=batch * nf,
        indices_are_sorted=slots.sorted,
      )
      norms = [pooled[:, dim + k] for k in range(len(normed))]
      pooled = pooled[:, :dim]
    if normed:
      pooled = pooled / _norm(norms, normed, combiners, batch, one_hot)
    pooled = pooled.astype(table.dtype)
  if one_hot:
    return pooled.reshape(batch, nf, -1)
  return jnp.swapaxes(pooled.reshape(nf, batch, -1), 0, 1)


def _norm(
  norms: list[jax.Array],
  normed: list[str],
  combiners: np.ndarray,
  batch: int,
  one_hot: bool,
) -> jax.Array:
  """The ``[rows, 1]`` divisor of each pooled row: its feature's norm
  (``norms[k]`` pooled for ``normed[k]``; a sqrtn's the root of its sum)
  where its feature's combiner is ``normed[k]``, 1 for a sum and for an
  empty bag. The pooled rows are example-major ``[B * F]`` for one-hot
  features, feature-major ``[F * B]`` for bags: one constant per feature,
  broadcast over the batch, picks each row's norm."""
  nf = len(combiners)
  shape = (batch, nf) if one_hot else (nf, batch)
  per_feature = (1, nf) if one_hot else (nf, 1)
  out = None
  for n, c in zip(norms, normed, strict=True):
    n = (jnp.sqrt(n) if c == "sqrtn" else n).reshape(shape)
    n = jnp.where(n > 0, n, 1.0)
    if out is None and np.all(combiners == c):
      out = n  # every feature's
    else:
      pick = (combiners == c).reshape(per_feature)
      out = jnp.where(pick, n, 1.0 if out is None else out)
  return out.reshape(-1, 1)


def bounds_check(ids, read, feature, lim, names) -> jax.Array:
  """``ids`` after a check (``gtx.lookup``'s, :func:`host_check`) that
  raises for a slot read (``read``) whose id is outside ``[0, lim)``,
  naming the slot's feature (``names[feature]``) and the id."""
  bad = read & ((ids < 0) | (ids >= lim))
  feature = jnp.broadcast_to(jnp.asarray(feature, jnp.int32), ids.shape)
  lim = jnp.broadcast_to(jnp.asarray(lim, jnp.int32), ids.shape)
  report = functools.partial(_raise_out_of_range, names=tuple(names))
  return host_check(report, ids, bad, ids, feature, lim)


def _raise_out_of_range(bad, ids, feature, lim, names) -> None:
  if not bad.any():
    return
  k = np.flatnonzero(bad.reshape(-1))[0]
  name = names[int(feature.reshape(-1)[k])]
  raise ValueError(
    f"gradtx.TableStack.lookup: feature {name!r} has id "
    f"{int(ids.reshape(-1)[k])}, outside its table's rows [0, "
    f"{int(lim.reshape(-1)[k])}) ({int(bad.sum())} such id(s) in the batch; "
    "bounds_check=True). Fix the ids; mark padding with -1, a weight 0 or "
    "a jagged length."
  )


def split_features(pooled: jax.Array, names: list[str]) -> dict:
  """``[B, F, dim]`` -> feature name -> ``[B, dim]``: one split, whose
  transpose is one concatenation (per-feature slices would each transpose
  to a pad of the whole pooled array, summed).

  Examples:
    >>> import jax.numpy as jnp
    >>> from gradtx._pooled import split_features
    >>> out = split_features(jnp.zeros((2, 3, 4)), ["a", "b", "c"])
    >>> {f: x.shape for f, x in out.items()}
    {'a': (2, 4), 'b': (2, 4), 'c': (2, 4)}
  """
  if len(names) == 1:
    return {names[0]: pooled[:, 0]}
  parts = lax.split(pooled, [1] * len(names), axis=1)
  return {f: x[:, 0] for f, x in zip(names, parts, strict=True)}


def dict_reader(
  forms: Mapping[str, Feature], declared: list[str] | None = None
) -> tuple[int, Callable]:
  """``(batch, read)`` of a dict of features (their forms parsed,
  ``_inputs.parse``): ``read(feats)`` gives the :class:`_Slots` of those
  features.

  ``declared``: the features in the stack's declared order. When several
  groups (stacks) read one-hot features, their ids are joined once, all of
  them in that order (the columns of a sliced ``[B, F]`` matrix join back
  into it), and each group takes its columns by one static gather: a
  group's columns need not be adjacent in the matrix, and a sliced dict
  then adds no op per feature."""
  bags = {f: _bag(f, form) for f, form in forms.items()}
  sizes = {b.batch for b in bags.values()}
  if len(sizes) > 1:
    raise ValueError(
      "gradtx.TableStack.lookup: the features' batch sizes differ: "
      f"{ {f: b.batch for f, b in bags.items()} }. Give every feature the "
      "same leading axis."
    )
  batch = sizes.pop()
  one_hot = [f for f in (declared or list(forms)) if bags[f].per_example == 1]
  column_of = {f: k for k, f in enumerate(one_hot)}
  joined_columns: dict[str, jax.Array] = {}

  def columns(what: str, feats: list[str]) -> jax.Array:
    if what not in joined_columns:
      if what == "ids":
        parts = [bags[f].ids for f in one_hot]
      else:
        parts = [
          jnp.ones([batch], jnp.float32)
          if bags[f].weight is None
          else bags[f].weight.astype(jnp.float32)
          for f in one_hot
        ]
      joined_columns[what] = _columns(parts)
    whole = joined_columns[what]
    at = [column_of[f] for f in feats]
    if at == list(range(at[0], at[0] + len(at))):
      return whole[:, at[0] : at[0] + len(at)]
    return whole[:, np.asarray(at, np.int32)]

  def read(feats: list[str]) -> _Slots:
    group = [bags[f] for f in feats]
    if len(feats) == len(one_hot) or not all(f in column_of for f in feats):
      return _dict_slots(group, batch)
    weighted = any(b.weight is not None for b in group)
    feature = np.arange(len(feats), dtype=np.int32)[None]
    weight = columns("weights", feats) if weighted else None
    return _Slots(columns("ids", feats), weight, feature, None, True)

  return batch, read


# -- the raw ids of hashed features -------------------------------------------
class RawSlots(NamedTuple):
  """The raw ids of a stack's hashed features: flat words, which slots are
  ids, each slot's hashed table (static), and ``rebuild(rows)`` -> feature
  name -> its rows, in the shape of its ids."""

  hi: jax.Array
  lo: jax.Array
  valid: jax.Array
  tab: np.ndarray
  rebuild: Callable[[jax.Array], dict[str, Any]]


def raw_slots(
  layout: Layout, features: Mapping[str, str], forms: Mapping[str, Feature]
) -> RawSlots | None:
  """The raw ids in ``forms`` (parsed features, ``_inputs.parse``) of the
  features (``features``: feature -> table) of the hashed tables of one
  id map (``layout``), flat and joined, with a way back to each feature's
  shape; None when ``forms`` holds none."""
  # in the plan's order, which jit's sorting of dict keys does not change
  feats = [f for f, t in features.items() if f in forms and t in layout.tables]
  if not feats:
    return None
  his, los, oks, tabs, backs = [], [], [], [], []
  for f in feats:
    form = forms[f]
    split, lo, pad = raw_words(form.ids, f"feature {f!r}")
    # the map's work is over the whole step's ids: split over a data-
    # parallel batch, they are gathered first, and the rows split back
    hi, lo, pad = (unsplit(v) for v in (split, lo, pad))
    ok = ~pad
    if form.lengths is not None:
      total = jnp.sum(unsplit(form.lengths).astype(jnp.int32))
      ok = ok & (jnp.arange(hi.shape[0]) < total)
    if form.weights is not None:
      ok = ok & (unsplit(jnp.asarray(form.weights)) != 0)
    his.append(hi.reshape(-1))
    los.append(lo.reshape(-1))
    oks.append(ok.reshape(-1))
    tabs.append(np.full(hi.size, layout.tables.index(features[f])))
    backs.append((f, split))
  sizes = [h.shape[0] for h in his]

  def rebuild(rows: jax.Array) -> dict[str, Any]:
    parts = jnp.split(rows, np.cumsum(sizes)[:-1]) if len(sizes) > 1 else [rows]
    out = {}
    for (f, split), r in zip(backs, parts, strict=True):
      out[f] = split_like(r.reshape(split.shape), split)
    return out

  return RawSlots(
    joined(his),
    joined(los),
    joined(oks),
    np.concatenate(tabs).astype(np.int32),
    rebuild,
  )


# -- the one read of a stack's features ---------------------------------------
def read_features(
  plan: StackPlan,
  programs: dict,
  params: Mapping[str, jax.Array],
  ids: Any,
  weights: Mapping[str, ArrayLike] | None,
  combiners: tuple[tuple[str, str], ...],
  output: str,
  vocab: Mapping[str, Any] | None = None,
  bounds_check: bool = False,
) -> Any:
  """``TableStack.lookup``: every feature's pooled rows in ``output``'s
  form (``"dict"``, ``"concat"``, ``"keyed"``), one gather and one
  segment sum per array read.

  The inputs are made fit on the host (:func:`host_ready`); outside any
  trace the read runs as one program, compiled once per options and kept
  in ``programs`` (the stack's), checked op by op with ``bounds_check``
  so that a bad id raises at once. With ``vocab`` the hashed features'
  raw ids find their rows first (read-only)."""
  raw = [] if vocab is None else hashed_features(plan)
  ids, weights = host_ready(ids, weights, raw, "lookup")

  def read(p, i, w, v, check=False):
    return _read(plan, p, i, w, combiners, output, v, check)

  if bounds_check:
    return read(params, ids, weights, vocab, True)
  key = ("lookup", combiners, output)
  return run_program(programs, key, read, params, ids, weights, vocab)


def _read(plan, params, ids, weights, combiners, output, vocab, check):
  check_params(plan, params, "lookup")
  combiners = dict(combiners)
  weights = dict(weights or {})
  whole = isinstance(ids, (Keyed, KeyedJagged))
  if whole and weights:
    raise ValueError(
      "gradtx.TableStack.lookup: `ids` is keyed; put its weights in "
      f"`gtx.{type(ids).__name__}(..., weights=...)`, not in `weights`."
    )
  names = list(ids.names) if whole else list(ids)
  unknown = [f for f in names + list(weights) if f not in plan.features]
  if unknown:
    raise ValueError(
      f"gradtx.TableStack.lookup: unknown features {unknown}; the "
      f"features are {list(plan.features)}."
    )
  forms, batch = parse(
    ids, weights, hashed_features(plan), "lookup", raw=vocab is not None
  )
  if vocab is not None:
    forms = _found_rows(plan, vocab, forms)
  # A batch split over Explicit mesh axes: pooled whole, split back.
  split = next((x for x in jax.tree.leaves(forms) if is_split(x)), None)
  if split is not None:
    forms = jax.tree.map(lambda x: unsplit(x) if is_split(x) else x, forms)
  if batch is not None:  # keyed, read whole
    slots_of = keyed_reader(forms)
  else:
    batch, slots_of = dict_reader(
      forms, [f for f in plan.features if f in set(names)]
    )
  out, parts = {}, []
  for where, feats in arrays_read(plan, names):
    s = plan.stacks.get(where)
    tables = [plan.features[f] for f in feats]
    pooled = pool_rows(
      params[where],
      slots_of(feats),
      batch,
      [0] if s is None else [s.offsets[s.tables.index(t)] for t in tables],
      [plan.tables[t].rows for t in tables],
      s,
      [combiners[f] for f in feats],
      feats if check else None,
    )
    if split is not None:
      pooled = split_like(pooled, split)
    if output == "dict":
      out.update(split_features(pooled, feats))
    else:
      flat = output == "concat"
      parts.append(pooled.reshape(pooled.shape[0], -1) if flat else pooled)
  if output == "dict":
    return {f: out[f] for f in names}
  if output == "keyed":
    dims = {p.shape[-1] for p in parts}
    if len(dims) > 1:
      raise ValueError(
        "gradtx.TableStack.lookup `output='keyed'` needs features of one "
        f"width; these have widths {sorted(dims)}. Pass "
        "`output='concat'` (one [B, sum of dims] array) or read the dict."
      )
    values = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
    order = [f for _, feats in arrays_read(plan, names) for f in feats]
    return Keyed(order, values)
  return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


def _found_rows(plan, vocab, forms):
  """``forms`` with the hashed features' raw ids replaced by the rows
  their maps hold (read-only: an unknown id is padding)."""
  check_vocab(vocab, plan.maps, "lookup")
  forms = dict(forms)
  for name, layout in plan.maps.items():
    slots = raw_slots(layout, plan.features, forms)
    if slots is not None:
      rows = find(
        vocab[name], layout, slots.hi, slots.lo, slots.tab, slots.valid
      )
      for f, r in slots.rebuild(rows).items():
        forms[f] = forms[f]._replace(ids=r)
  return forms
