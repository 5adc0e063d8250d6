"""Pooled reads: the input forms of a table stack's features and the one
gather that reads and pools them.

Features arrive as a dict of ``[B]`` ids, ``[B, L]`` bags or
:class:`Jagged` features, or keyed in one array (:class:`Keyed`,
:class:`KeyedJagged`); :func:`pad_batch` pads a short batch to the step's
shape. :func:`dict_reader` and :func:`keyed_reader` lay a group of
features out as slots, :func:`pool_rows` reads a group's rows from its
array with one gather and pools them with one segment sum into
``[B, F, dim]``, and :func:`split_features` splits that into features.
:func:`raw_slots` joins the raw ids of a hashed table's features for the
id map (``_vocab``) and gives its rows back in each feature's form.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from gradtx import _vocab
from gradtx._autodiff import lookup
from gradtx._sharded import split_like, unsplit
from gradtx._sparse_rows import MAX_ROWS, narrow_ids, narrow_wide
from gradtx._static import is_int
from gradtx._vocab import HostWords, Layout, Words

__all__ = ["Jagged", "Keyed", "KeyedJagged", "pad_batch"]

COMBINERS = ("sum", "mean", "sqrtn")


class Jagged(NamedTuple):
  """A jagged feature, as a data pipeline gives it (TorchRec's
  ``KeyedJaggedTensor`` for one key): the ids of every example one after
  the other, padded to a static capacity.

  Example ``b``'s ids are ``ids[offsets[b]:offsets[b] + lengths[b]]`` with
  ``offsets`` the exclusive cumulative sum of ``lengths``; the slots past
  ``sum(lengths)`` are padding.

  Attributes:
    ids: ``[capacity]`` integer ids.
    lengths: ``[B]`` integer bag lengths.
    weights: optional ``[capacity]`` per-id weights.
  """

  ids: ArrayLike
  lengths: ArrayLike
  weights: ArrayLike | None = None


def _key_names(keys: Any, what: str) -> tuple[str, ...]:
  keys = tuple(keys) if not isinstance(keys, str) else (keys,)
  if not keys or any(not isinstance(k, str) for k in keys):
    raise TypeError(
      f"gradtx.{what} `keys` must be a non-empty sequence of feature names; "
      f"got {keys!r}."
    )
  if len(set(keys)) != len(keys):
    raise ValueError(f"gradtx.{what} `keys` repeat a name: {list(keys)}.")
  return keys


class _KeyedMapping(Mapping):
  """A keyed input as a read-only mapping of its features: ``names`` in
  order, ``self[name]`` one feature's slice."""

  names: tuple[str, ...]

  def keys(self):
    return list(self.names)

  def __iter__(self):
    return iter(self.names)

  def __len__(self) -> int:
    return len(self.names)

  def _index(self, key: str) -> int:
    if key not in self.names:
      raise KeyError(key)
    return self.names.index(key)


@jax.tree_util.register_pytree_node_class
class Keyed(_KeyedMapping):
  """Features as one array, keyed by name (TorchRec's ``KeyedTensor``):
  axis 1 of ``values`` holds the features ``keys``, in that order.

  As :meth:`gradtx.TableStack.lookup`'s input, ``values`` are ids: ``[B, F]``
  (one id per example and feature, how Criteo-like data arrives) or
  ``[B, F, L]`` bags with optional ``[B, F, L]`` ``weights`` (a weight 0
  marks padding). The lookup reads the whole array at once: the feature
  offsets are one broadcast add, then one gather and one pooling, so the
  traced program does not grow with ``F`` (a dict of ``F`` slices of the
  same matrix adds ops per feature). As its output (``keyed=True``),
  ``values`` are the pooled rows ``[B, F, dim]``, which a per-feature
  head reads whole (``jnp.einsum("bfd,fd->b", out.values, w)``).

  The names are static (pytree metadata), so a ``Keyed`` passes through
  ``jax.jit`` as its arrays. It is a read-only mapping too: ``x[name]``
  is that feature's slice of ``values`` (``[B]``, ``[B, L]`` or
  ``[B, dim]``; its weights ``x.weights[:, i]``), and ``dict(x)`` the
  dict form, one slice per feature.

  Attributes:
    names: the feature names (``keys``), one per index of axis 1.
    values: ``[B, F, ...]`` ids or pooled rows.
    weights: optional per-id weights, the shape of ``values``.
  """

  def __init__(
    self, keys: Sequence[str], values: Any, weights: Any = None
  ) -> None:
    self.names = _key_names(keys, "Keyed")
    self.values = values
    self.weights = weights
    shape = getattr(values, "shape", None)
    if shape is not None and (len(shape) < 2 or shape[1] != len(self.names)):
      raise ValueError(
        f"gradtx.Keyed `values` must be [B, {len(self.names)}, ...] (axis 1 "
        f"holds the {len(self.names)} keys); got shape {tuple(shape)}."
      )
    wshape = getattr(weights, "shape", None)
    if wshape is not None and tuple(wshape) != tuple(shape):
      raise ValueError(
        f"gradtx.Keyed `weights` must have the shape of `values` "
        f"{tuple(shape)}; got {tuple(wshape)}."
      )

  def tree_flatten(self):
    return (self.values, self.weights), self.names

  @classmethod
  def tree_unflatten(cls, names, children):
    out = object.__new__(cls)
    out.names = names
    out.values, out.weights = children
    return out

  def __getitem__(self, key: str) -> Any:
    return self.values[:, self._index(key)]

  def __repr__(self) -> str:
    shape = getattr(self.values, "shape", "?")
    return f"Keyed(keys={list(self.names)}, values: {shape})"


@jax.tree_util.register_pytree_node_class
class KeyedJagged(_KeyedMapping):
  """Jagged features as one flat array, keyed by name (TorchRec's
  ``KeyedJaggedTensor``): the ids of feature ``keys[0]`` for every
  example, then those of ``keys[1]``, ..., padded to a static capacity.

  ``lengths[f, b]`` is the bag length of feature ``f`` for example ``b``
  (TorchRec's flat ``lengths`` reshaped to ``[F, B]``); the slots past
  ``sum(lengths)`` are padding. :meth:`gradtx.TableStack.lookup` reads it in one
  pass: each slot's bag is found by one search over the cumulative
  lengths, its feature's offset added by one take, then one gather and
  one segment sum, whatever the number of features.

  It is a read-only mapping too: ``x[name]`` is that feature as a
  :class:`Jagged` (its slots moved to the front), ``dict(x)`` the dict
  form.

  Attributes:
    names: the feature names (``keys``), in the order of their slots.
    ids: ``[capacity]`` integer ids.
    lengths: ``[F, B]`` integer bag lengths.
    weights: optional ``[capacity]`` per-id weights.
  """

  def __init__(
    self, keys: Sequence[str], ids: Any, lengths: Any, weights: Any = None
  ) -> None:
    self.names = _key_names(keys, "KeyedJagged")
    self.ids, self.lengths, self.weights = ids, lengths, weights
    shape = getattr(lengths, "shape", None)
    if shape is not None and (len(shape) != 2 or shape[0] != len(self.names)):
      raise ValueError(
        f"gradtx.KeyedJagged `lengths` must be [{len(self.names)}, B] (one "
        f"row per key); got shape {tuple(shape)}."
      )

  def tree_flatten(self):
    return (self.ids, self.lengths, self.weights), self.names

  @classmethod
  def tree_unflatten(cls, names, children):
    out = object.__new__(cls)
    out.names = names
    out.ids, out.lengths, out.weights = children
    return out

  def __getitem__(self, key: str) -> Jagged:
    k = self._index(key)
    lengths = jnp.asarray(self.lengths).astype(jnp.int32)
    start = jnp.sum(lengths[:k])
    roll = lambda x: None if x is None else jnp.roll(jnp.asarray(x), -start)  # noqa: E731
    return Jagged(roll(self.ids), lengths[k], roll(self.weights))

  def __repr__(self) -> str:
    shape = getattr(self.ids, "shape", "?")
    return f"KeyedJagged(keys={list(self.names)}, ids: {shape})"


def pad_batch(batch: Any, batch_size: int) -> tuple[Any, Any]:
  """A short batch padded to ``batch_size`` examples, and the mask of the
  real ones: the last batch of an epoch then runs the compiled step
  instead of compiling another.

  Every array of ``batch`` (any pytree: a dict of ids, weights, labels,
  dense features) is padded along its leading batch axis: signed integer
  ids with -1 (padding: no row read, no gradient), floats with 0 (a weight
  0 is padding too; labels and dense features 0), bools with False. A
  :class:`Jagged`'s ``lengths`` (and a :class:`KeyedJagged`'s, along
  ``B``) get empty bags; its flat ids keep their capacity. A
  :class:`Keyed` is padded like its arrays. Scalars pass unchanged.

  The padded examples read zero rows, so :meth:`gradtx.TableStack.lookup` and
  the sparse gradients are those of the short batch; the loss must not
  count them: weight each example's loss by the mask, and divide by the
  mask's sum for a mean (``jnp.sum(mask * l) / jnp.sum(mask)``). Then the
  loss, the gradients and every optimizer's updates are the short
  batch's.

  Args:
    batch: the short batch: arrays whose leading axis is its ``B``
      examples (numpy arrays stay numpy, host-side).
    batch_size: the compiled step's batch, at least ``B``.

  Returns:
    ``(padded, mask)``: the batch with ``batch_size`` examples, and a bool
    ``[batch_size]`` array, True for the ``B`` real examples.

  Examples:
    >>> import numpy as np
    >>> import gradtx as gtx
    >>> ids = {"user": np.array([3, 7]), "history": np.array([[1, 2]] * 2),
    ...        "clicks": gtx.Jagged(np.array([4, 5, 6]), np.array([2, 1]))}
    >>> padded, mask = gtx.pad_batch(ids, 4)
    >>> padded["user"], padded["clicks"].lengths
    (array([ 3,  7, -1, -1]), array([2, 1, 0, 0]))
    >>> mask
    array([ True,  True, False, False])
  """
  if not is_int(batch_size) or batch_size < 1:
    raise ValueError(
      f"gradtx.pad_batch `batch_size` must be a positive int; got "
      f"{batch_size!r}."
    )
  special = (Jagged, Keyed, KeyedJagged, Words)
  is_special = lambda x: isinstance(x, special)  # noqa: E731
  sizes: dict[str, int] = {}

  def axis0(path, x, axis=0):
    shape = np.shape(x)
    if len(shape) > axis:
      sizes[jax.tree_util.keystr(path)] = shape[axis]

  def collect(path, x):
    if isinstance(x, Words):
      raise TypeError(
        f"gradtx.pad_batch: `batch{jax.tree_util.keystr(path)}` holds "
        "gradtx.Words: every value of a 64-bit id is an id, so none pads. "
        "Give the feature weights (0 pads it) and pad its ids yourself."
      )
    if isinstance(x, Jagged):
      axis0(path, x.lengths)
    elif isinstance(x, KeyedJagged):
      axis0(path, x.lengths, 1)
    elif isinstance(x, Keyed):
      axis0(path, x.values)
    elif x is not None:
      axis0(path, x)

  jax.tree_util.tree_map_with_path(collect, batch, is_leaf=is_special)
  if len(set(sizes.values())) > 1:
    raise ValueError(
      "gradtx.pad_batch: the arrays of `batch` have different leading "
      f"(batch) axes: {sizes}."
    )
  b = next(iter(sizes.values()), batch_size)
  if b > batch_size:
    raise ValueError(
      f"gradtx.pad_batch: `batch` has {b} examples, more than `batch_size` "
      f"{batch_size}."
    )

  def pad(x, fill, axis=0):
    if x is None or np.ndim(x) <= axis:
      return x
    xp = np if isinstance(x, np.ndarray) else jnp
    dtype = xp.asarray(x).dtype
    if fill == -1 and not jnp.issubdtype(dtype, jnp.signedinteger):
      if jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
          f"gradtx.pad_batch: ids of dtype {dtype} have no padding value "
          "(every unsigned value is an id); give the feature weights (0 "
          "pads it) and pad its ids yourself, or pass signed ids."
        )
      fill = False if dtype == jnp.bool_ else 0
    widths = [(0, 0)] * np.ndim(x)
    widths[axis] = (0, batch_size - b)
    return xp.pad(x, widths, constant_values=fill)

  def one(x):
    if isinstance(x, Jagged):
      return x._replace(lengths=pad(x.lengths, 0))
    if isinstance(x, KeyedJagged):
      return KeyedJagged(x.names, x.ids, pad(x.lengths, 0, 1), x.weights)
    if isinstance(x, Keyed):
      return Keyed(x.names, pad(x.values, -1), pad(x.weights, 0))
    return pad(x, -1)

  padded = jax.tree.map(one, batch, is_leaf=is_special)
  return padded, np.arange(batch_size) < b


class _Bag(NamedTuple):
  """A feature's ids as flat slots: ``ids[k]`` belongs to example
  ``segment[k]`` (``batch``: none) with weight ``weight[k]``."""

  ids: jax.Array
  segment: jax.Array | None  # None: slot k -> example k // per_example
  weight: jax.Array | None  # None: every slot weighs 1
  batch: int
  per_example: int  # ids per example for the dense forms, 0 if jagged


class Feature(NamedTuple):
  """One feature of a dict input, its form checked (:func:`feature_form`)."""

  ids: Any  # as given: [B], [B, L], or a Jagged's [capacity]
  lengths: jax.Array | None  # a Jagged's [B] integer lengths; else None
  weights: Any  # per-id weights, the ids' shape; None: every id weighs 1


def _shape(x: Any) -> tuple[int, ...]:
  return tuple(np.shape(x.hi if isinstance(x, (Words, HostWords)) else x))


def host_ready(ids: Any, weights: Any, raw: Sequence[str]) -> tuple[Any, Any]:
  """``(ids, weights)`` with their numpy 64-bit integer arrays made fit on
  the host for a compiled program, which would narrow them to 32 bits
  while ``jax_enable_x64`` is off: an array whose values an int32 (or a
  uint32) holds is cast to it, exactly; the ids of a dict feature past
  that are split into words (:class:`HostWords`, padding kept) when the
  feature is in ``raw`` (the raw ids of a hashed table), else narrowed as
  any row ids are (:func:`narrow_ids`: an id no int32 holds is padding).
  Any other such array (a keyed input's, a length past int32) stays: the
  caller reads it op by op."""

  def cast(x: Any) -> Any:
    if not isinstance(x, np.ndarray) or not _vocab.split_on_host(x.dtype):
      return x
    low, high = (x.min(), x.max()) if x.size else (0, 0)
    for dtype in (np.int32, np.uint32):
      if np.iinfo(dtype).min <= low and high <= np.iinfo(dtype).max:
        return x.astype(dtype)
    return x

  def feature(name: str, x: Any) -> Any:
    if isinstance(x, Jagged):
      return Jagged(feature(name, x.ids), cast(x.lengths), cast(x.weights))
    x = cast(x)
    if not isinstance(x, np.ndarray) or not _vocab.split_on_host(x.dtype):
      return x
    if name in raw:
      return _vocab.host_words(x, f"feature {name!r} `ids`")
    return narrow_wide(x, MAX_ROWS)

  if isinstance(ids, (Keyed, KeyedJagged)):
    ids = jax.tree.map(cast, ids)
  elif isinstance(ids, Mapping):
    ids = {f: feature(f, x) for f, x in ids.items()}
  return ids, jax.tree.map(cast, weights)


def feature_form(name: str, x: Any, w: Any, what: str) -> Feature:
  """The one parser of a feature's input form, for the TableStack method
  ``what`` (``"lookup"``, ``"admit"``) that names it in its errors:
  ``[B]`` ids, ``[B, L]`` bags with ``w`` (``weights[name]``, or None) of
  their shape, or a :class:`Jagged`. Its ids stay as given (row ids, or
  raw ids of a hashed table); only their shapes are checked."""
  where = f"gradtx.TableStack.{what}: feature {name!r}"
  if isinstance(x, Jagged):
    if w is not None:
      raise ValueError(
        f"{where} is Jagged; put its weights in `Jagged(..., weights=...)`, "
        "not in `weights`."
      )
    shape, lengths = _shape(x.ids), jnp.asarray(x.lengths)
    if len(shape) != 1 or lengths.ndim != 1:
      raise ValueError(
        f"{where}: Jagged `ids` must be [capacity] and `lengths` [B]; got "
        f"{shape} and {lengths.shape}."
      )
    _check_lengths(name, lengths, what)
    if x.weights is not None and _shape(x.weights) != shape:
      raise ValueError(
        f"{where}: Jagged `weights` must have the ids' shape {shape}; got "
        f"{_shape(x.weights)}."
      )
    return Feature(x.ids, lengths, x.weights)
  shape = _shape(x)
  if len(shape) not in (1, 2):
    raise ValueError(
      f"{where} has ids of shape {shape}; pass [B] ids, [B, L] bags or a "
      "gradtx.Jagged."
    )
  if w is not None and _shape(w) != shape:
    raise ValueError(
      f"gradtx.TableStack.{what}: `weights[{name!r}]` must have the ids' "
      f"shape {shape}; got {_shape(w)}."
    )
  return Feature(x, None, w)


def _bag(name: str, x: Any, w: Any) -> _Bag:
  form = feature_form(name, x, w, "lookup")
  ids = _ids(name, form.ids)
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
  ends = jnp.cumsum(lengths.astype(jnp.int32))
  marks = jnp.zeros([n], jnp.int32).at[jnp.maximum(ends, 0)].add(1, mode="drop")
  return jnp.cumsum(marks, dtype=jnp.int32)


def _ids(name: str, x: Any) -> jax.Array:
  """Feature ``name``'s ids as int32 (:func:`narrow_ids`): an id no int32
  holds is padding."""
  return narrow_ids(
    x, MAX_ROWS, f"gradtx.TableStack.lookup: feature {name!r} `ids`"
  )


def _check_lengths(name: str, lengths: jax.Array, what: str) -> None:
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(
      f"gradtx.TableStack.{what}: feature {name!r} has `lengths` of dtype "
      f"{lengths.dtype}; pass integers (`.astype(jnp.int32)`)."
    )


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


def keyed_batch(x: Keyed | KeyedJagged) -> int:
  """The batch of a keyed input, its arrays' forms checked."""
  what = type(x).__name__
  arrays = (x.values,) if isinstance(x, Keyed) else (x.ids, x.lengths)
  if any(isinstance(a, Words) for a in arrays):
    raise TypeError(
      f"gradtx.TableStack.lookup: the gradtx.{what} holds raw gradtx.Words "
      "ids; pass `vocab=` to map them read-only, or the ids `stack.admit` "
      "returned."
    )
  if isinstance(x, Keyed):
    v = jnp.asarray(x.values)
    if v.ndim not in (2, 3):
      raise ValueError(
        "gradtx.TableStack.lookup: a gradtx.Keyed of ids must have `values` "
        f"[B, F] or [B, F, L]; got {v.shape}."
      )
    return v.shape[0]
  ids, lengths = jnp.asarray(x.ids), jnp.asarray(x.lengths)
  _check_lengths(what, lengths, "lookup")
  if ids.ndim != 1:
    raise ValueError(
      f"gradtx.TableStack.lookup: gradtx.KeyedJagged `ids` must be "
      f"[capacity]; got {ids.shape}."
    )
  if x.weights is not None and jnp.shape(x.weights) != ids.shape:
    raise ValueError(
      "gradtx.TableStack.lookup: gradtx.KeyedJagged `weights` must have the "
      f"ids' shape {ids.shape}; got {jnp.shape(x.weights)}."
    )
  return lengths.shape[1]


def keyed_reader(x: Keyed | KeyedJagged) -> Callable[[list[str]], _Slots]:
  """``read(feats)``: the slots of features ``feats`` (a group, in its
  order) of a keyed input, with no op per feature."""
  if isinstance(x, KeyedJagged):
    return _jagged_reader(x)
  values = narrow_ids(
    x.values, MAX_ROWS, "gradtx.TableStack.lookup: gradtx.Keyed `values`"
  )
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
  ids = narrow_ids(
    x.ids, MAX_ROWS, "gradtx.TableStack.lookup: gradtx.KeyedJagged `ids`"
  )
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


def pool_rows(table, slots, batch, offsets, rows, stack, combiner):
  """One gather of a group's rows from ``table`` (features offset into
  its logical rows, placed by ``stack``; padding = the table's row count:
  out of range, a zero row and no gradient) and one segment sum into
  ``[B, F, dim]``.

  The pooled rows are laid out example-major (``[B, F, dim]``), the layout
  a head that concatenates or stacks the features reads: one-hot features
  are gathered in that order directly, with no segment sum; bags are
  summed feature by feature (the slots' own order, a sorted segment sum)
  and the ``[F, B, dim]`` sums transposed. The ids are offset, checked
  and placed by one elementwise pass against each slot's feature's
  constants, so the program does not grow with the number of features."""
  nf = len(offsets)
  # per feature, and a last entry for "none of the group's": no row valid
  off = np.asarray([*offsets, 0], np.int32)
  lim = np.asarray([*rows, 0], np.int32)
  if isinstance(slots.feature, np.ndarray):
    off, lim = off[slots.feature], lim[slots.feature]
  else:
    off, lim = jnp.asarray(off)[slots.feature], jnp.asarray(lim)[slots.feature]
  ids, weight = slots.ids, slots.weight
  valid = (ids >= 0) & (ids < lim) & slots.ok
  if weight is not None:
    valid = valid & (weight != 0)
  row = ids + off
  row = row if stack is None else stack.physical(row)
  got = lookup(table, jnp.where(valid, row, table.shape[0]).reshape(-1))
  one_hot = slots.segment is None
  if one_hot and weight is None and combiner == "sum":
    pooled = got  # padding read zeros
  else:
    if weight is None:
      weight = jnp.ones(ids.shape, jnp.float32)
    weight = jnp.where(valid, weight, 0.0).reshape(-1)
    vals = got.astype(jnp.float32) * weight[:, None]
    segment = None if one_hot else slots.segment.reshape(-1)
    pool = functools.partial(
      jax.ops.segment_sum,
      segment_ids=segment,
      num_segments=batch * nf,
      indices_are_sorted=slots.sorted,
    )
    pooled = vals if one_hot else pool(vals)
    if combiner != "sum":
      norm = weight if combiner == "mean" else weight * weight
      if not one_hot:
        norm = pool(norm)
      if combiner == "sqrtn":
        norm = jnp.sqrt(norm)
      pooled = pooled / jnp.where(norm > 0, norm, 1.0)[:, None]
    pooled = pooled.astype(table.dtype)
  if one_hot:
    return pooled.reshape(batch, nf, -1)
  return jnp.swapaxes(pooled.reshape(nf, batch, -1), 0, 1)


def split_features(pooled: jax.Array, names: list[str]) -> dict:
  """``[B, F, dim]`` -> feature name -> ``[B, dim]``: one split, whose
  transpose is one concatenation (per-feature slices would each transpose
  to a pad of the whole pooled array, summed)."""
  if len(names) == 1:
    return {names[0]: pooled[:, 0]}
  parts = lax.split(pooled, [1] * len(names), axis=1)
  return {f: x[:, 0] for f, x in zip(names, parts, strict=True)}


def dict_reader(
  ids: Any, weights: Any, declared: list[str] | None = None
) -> tuple[int, Callable]:
  """``(batch, read)`` of a dict of features: ``read(feats)`` gives the
  :class:`_Slots` of those features.

  ``declared``: the features in the stack's declared order. When several
  groups (stacks) read one-hot features, their ids are joined once, all of
  them in that order (the columns of a sliced ``[B, F]`` matrix join back
  into it), and each group takes its columns by one static gather: a
  group's columns need not be adjacent in the matrix, and a sliced dict
  then adds no op per feature."""
  for f, x in ids.items():
    if isinstance(x.ids if isinstance(x, Jagged) else x, Words):
      raise TypeError(
        f"gradtx.TableStack.lookup: feature {f!r} has raw gradtx.Words "
        "ids; pass `vocab=` to map them read-only, or the ids "
        "`stack.admit` returned."
      )
  bags = {f: _bag(f, x, weights.get(f)) for f, x in ids.items()}
  sizes = {b.batch for b in bags.values()}
  if len(sizes) > 1:
    raise ValueError(
      "gradtx.TableStack.lookup: the features' batch sizes differ: "
      f"{ {f: b.batch for f, b in bags.items()} }. Give every feature the "
      "same leading axis."
    )
  batch = sizes.pop()
  one_hot = [f for f in (declared or list(ids)) if bags[f].per_example == 1]
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
  name -> rows in the feature's own form."""

  hi: jax.Array
  lo: jax.Array
  valid: jax.Array
  tab: np.ndarray
  rebuild: Callable[[jax.Array], dict[str, Any]]


def raw_slots(
  layout: Layout,
  features: Mapping[str, str],
  ids: Mapping[str, Any],
  weights: Mapping[str, ArrayLike] | None,
  what: str,
) -> RawSlots | None:
  """The raw ids in ``ids`` of the features (``features``: feature ->
  table) of the hashed tables of one id map (``layout``), flat and joined,
  with a way back to each feature's form; None when ``ids`` holds none.
  ``what``: the TableStack method reading them, named in errors."""
  weights = dict(weights or {})
  # in the plan's order, which jit's sorting of dict keys does not change
  feats = [f for f, t in features.items() if f in ids and t in layout.tables]
  if not feats:
    return None
  his, los, oks, tabs, backs = [], [], [], [], []
  for f in feats:
    x = ids[f]
    form = feature_form(f, x, weights.get(f), what)
    split, lo, pad = _vocab.raw_words(form.ids, f"feature {f!r}")
    # the map's work is over the whole step's ids: split over a data-
    # parallel batch, they are gathered first, and the rows split back
    hi, lo, pad = (unsplit(v) for v in (split, lo, pad))
    ok = ~pad
    jag = form.lengths is not None
    if jag:
      total = jnp.sum(unsplit(form.lengths).astype(jnp.int32))
      ok = ok & (jnp.arange(hi.shape[0]) < total)
    if form.weights is not None:
      ok = ok & (unsplit(jnp.asarray(form.weights)) != 0)
    his.append(hi.reshape(-1))
    los.append(lo.reshape(-1))
    oks.append(ok.reshape(-1))
    tabs.append(np.full(hi.size, layout.tables.index(features[f])))
    backs.append((f, split, x if jag else None))
  sizes = [h.shape[0] for h in his]

  def rebuild(rows: jax.Array) -> dict[str, Any]:
    parts = jnp.split(rows, np.cumsum(sizes)[:-1]) if len(sizes) > 1 else [rows]
    out = {}
    for (f, split, jag), r in zip(backs, parts, strict=True):
      r = split_like(r.reshape(split.shape), split)
      out[f] = jag._replace(ids=r) if jag is not None else r
    return out

  return RawSlots(
    joined(his),
    joined(los),
    joined(oks),
    np.concatenate(tabs).astype(np.int32),
    rebuild,
  )
