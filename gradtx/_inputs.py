"""The input forms of a table stack's features and their one parser.

Features arrive as a dict of ``[B]`` ids, ``[B, L]`` bags or
:class:`Jagged` features, or keyed in one array (:class:`Keyed`,
:class:`KeyedJagged`); :func:`pad_batch` pads a short batch to the step's
shape. :func:`host_ready` makes every form fit a compiled program on the
host (jagged lengths checked, numpy 64-bit ids narrowed or split into
words) and :func:`outside_traces` says whether a call may run as one;
:func:`parse` is the one parse of an input (a dict feature's form by
:func:`feature_form`, a keyed input's by :func:`keyed_batch`, or read as
its dict by :func:`plain_features`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.typing import ArrayLike

from gradtx._ids import HostWords, Words, host_words, row_ids, split_on_host
from gradtx._static import is_int

__all__ = ["Jagged", "Keyed", "KeyedJagged", "pad_batch"]


class Jagged(NamedTuple):
  """A jagged feature, as a data pipeline gives it (TorchRec's
  ``KeyedJaggedTensor`` for one key): the ids of every example one after
  the other, padded to a static capacity.

  Example ``b``'s ids are ``ids[offsets[b]:offsets[b] + lengths[b]]`` with
  ``offsets`` the exclusive cumulative sum of ``lengths``; the slots past
  ``sum(lengths)`` are padding. Lengths summing past the capacity, or
  negative, raise outside ``jax.jit``; inside it they are a ``checkify``
  check (:meth:`gradtx.TableStack.lookup`).

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
  same matrix adds ops per feature). As its output (``output="keyed"``),
  ``values`` are the pooled rows ``[B, F, dim]``, which a per-feature
  head reads whole (``jnp.einsum("bfd,fd->b", out.values, w)``).

  64-bit ids fit as they do in a dict: numpy ``int64`` / ``uint64``
  ``values`` are split on the host when they do not fit an int32, and
  inside a jitted step ``values`` may be :class:`gradtx.Words` (a hashed
  feature's raw ids exact; a plain feature's row ids read from the words,
  padding by weight 0). The names are static (pytree metadata), so a
  ``Keyed`` passes through ``jax.jit`` as its arrays. It is a read-only
  mapping too: ``x[name]`` is that feature's slice of ``values``
  (``[B]``, ``[B, L]`` or ``[B, dim]``; its weights ``x.weights[:, i]``),
  and ``dict(x)`` the dict form, one slice per feature.

  Attributes:
    names: the feature names (``keys``), one per index of axis 1.
    values: ``[B, F, ...]`` ids (or :class:`gradtx.Words`) or pooled rows.
    weights: optional per-id weights, the shape of ``values``.
  """

  def __init__(
    self, keys: Sequence[str], values: Any, weights: Any = None
  ) -> None:
    self.names = _key_names(keys, "Keyed")
    self.values = values
    self.weights = weights
    shape = _shape(values)
    if len(shape) < 2 or shape[1] != len(self.names):
      raise ValueError(
        f"gradtx.Keyed `values` must be [B, {len(self.names)}, ...] (axis 1 "
        f"holds the {len(self.names)} keys); got shape {tuple(shape)}."
      )
    wshape = None if weights is None else _shape(weights)
    if wshape is not None and wshape != shape:
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
    k = self._index(key)
    return _each_word(self.values, lambda v: v[:, k])

  def __repr__(self) -> str:
    shape = _shape(self.values)
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

  ``sum(lengths)`` may not pass the capacity: outside ``jax.jit`` a
  lookup or ``admit`` raises, inside it the ids that did not fit are a
  ``checkify`` error (:meth:`gradtx.TableStack.lookup`). 64-bit ids fit as
  in a dict: numpy ``int64`` / ``uint64`` ``ids`` are split on the host
  when they do not fit an int32, and inside a jitted step ``ids`` may be
  :class:`gradtx.Words` (a hashed feature's raw ids exact, a plain
  feature's row ids read from the words), so one array mixes a hashed
  feature's raw 64-bit ids with the row ids of the others.

  It is a read-only mapping too: ``x[name]`` is that feature as a
  :class:`Jagged` (its slots moved to the front), ``dict(x)`` the dict
  form.

  Attributes:
    names: the feature names (``keys``), in the order of their slots.
    ids: ``[capacity]`` integer ids, or :class:`gradtx.Words`.
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
    roll = lambda x: jnp.roll(jnp.asarray(x), -start)  # noqa: E731
    weights = None if self.weights is None else roll(self.weights)
    return Jagged(_each_word(self.ids, roll), lengths[k], weights)

  def __repr__(self) -> str:
    shape = _shape(self.ids)
    return f"KeyedJagged(keys={list(self.names)}, ids: {shape})"


def _each_word(x: Any, fn: Callable[[Any], Any]) -> Any:
  """``fn`` of ids, or of each array of words (:class:`Words`,
  :class:`HostWords`)."""
  if isinstance(x, (Words, HostWords)):
    return type(x)(*(fn(v) for v in x))
  return fn(x)


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

  64-bit ids as :class:`gradtx.Words` have no padding value (every value
  is an id), so a length or a weight marks their padding: a
  :class:`Jagged` or :class:`KeyedJagged` of Words pads as any (empty
  bags), a :class:`Keyed` of Words with ``weights`` gets weights 0; bare
  Words (give them as ``Jagged(Words.of(ids), lengths)`` in every batch,
  lengths 1 for one id per example) and a Keyed of Words without weights
  are refused.

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
    where = f"`batch{jax.tree_util.keystr(path)}`"
    if isinstance(x, Words):
      raise TypeError(
        f"gradtx.pad_batch: {where} holds gradtx.Words, and every value of "
        "a 64-bit id is an id, so none pads. Give the feature as a "
        "gtx.Jagged(gtx.Words.of(ids), lengths) in every batch (lengths of "
        "1 for one id per example), whose padded examples get length 0."
      )
    if isinstance(x, Keyed) and isinstance(x.values, Words):
      if x.weights is None:
        raise TypeError(
          f"gradtx.pad_batch: {where} is a gradtx.Keyed of gradtx.Words "
          "without weights: every value of a 64-bit id is an id, so none "
          "pads. Give it weights (1.0 for every id) in every batch, whose "
          "padded examples get weight 0, or pass a gtx.KeyedJagged."
        )
      axis0(path, x.values.hi)
      return
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
    if isinstance(x, Keyed):  # of words: the weights 0 pad them
      fill = 0 if isinstance(x.values, Words) else -1
      values = _each_word(x.values, lambda v: pad(v, fill))
      return Keyed(x.names, values, pad(x.weights, 0))
    return pad(x, -1)

  padded = jax.tree.map(one, batch, is_leaf=is_special)
  return padded, np.arange(batch_size) < b


class Feature(NamedTuple):
  """One feature of a dict input, its form checked (:func:`feature_form`)."""

  ids: Any  # [B], [B, L], or a Jagged's [capacity]; row ids once parsed
  # (:func:`parse`), a hashed feature's raw ids where it keeps them
  lengths: jax.Array | None  # a Jagged's [B] integer lengths; else None
  weights: Any  # per-id weights, the ids' shape; None: every id weighs 1


def _shape(x: Any) -> tuple[int, ...]:
  return tuple(np.shape(x.hi if isinstance(x, (Words, HostWords)) else x))


def host_ready(
  ids: Any, weights: Any, raw: Sequence[str], what: str
) -> tuple[Any, Any]:
  """``(ids, weights)`` made fit on the host for a compiled program, the
  one conversion of every input form, for the TableStack method ``what``
  that names it in errors.

  A jagged feature's lengths are checked (:func:`check_lengths`). A numpy
  64-bit integer array, which a compiled program would narrow to 32 bits
  while ``jax_enable_x64`` is off, is cast to int32 when its values fit,
  exactly; past that, the raw ids of a hashed feature (one in ``raw``) are
  split into words (:class:`HostWords`, padding kept): a dict feature's
  alone, a keyed input's whole array, whose plain features' row ids then
  read from the words. A plain feature's row id past int32 raises: no
  table has that many rows."""
  check_lengths(ids, what)

  def cast(x: Any, unsigned: bool = False) -> Any:
    if not isinstance(x, np.ndarray) or not split_on_host(x.dtype):
      return x
    low, high = (x.min(), x.max()) if x.size else (0, 0)
    for dtype in (np.int32, np.uint32) if unsigned else (np.int32,):
      if np.iinfo(dtype).min <= low and high <= np.iinfo(dtype).max:
        return x.astype(dtype)
    return x

  def feature(name: str, x: Any) -> Any:
    if isinstance(x, Jagged):
      return Jagged(feature(name, x.ids), cast(x.lengths), cast(x.weights))
    x = cast(x, unsigned=name in raw)
    if not isinstance(x, np.ndarray) or not split_on_host(x.dtype):
      return x
    if name in raw:
      return host_words(x, f"feature {name!r} `ids`")
    _check_row_ids(name, x, what)
    return x

  if isinstance(ids, (Keyed, KeyedJagged)):
    ids = _keyed_ready(jax.tree.map(cast, ids), raw, what)
  elif isinstance(ids, Mapping):
    ids = {f: feature(f, x) for f, x in ids.items()}
  return ids, jax.tree.map(cast, weights)


def _keyed_ready(x: Any, raw: Sequence[str], what: str) -> Any:
  """A keyed input whose numpy 64-bit ids do not fit an int32: its plain
  features' row ids checked, its whole array split into words."""
  values = x.values if isinstance(x, Keyed) else x.ids
  if not isinstance(values, np.ndarray) or not split_on_host(values.dtype):
    return x
  slots = _keyed_slots(x)
  for k, name in enumerate(x.names):
    if name not in raw:
      _check_row_ids(name, values[slots == k], what)
  words = host_words(values, f"gradtx.{type(x).__name__} `ids`")
  if isinstance(x, Keyed):
    return Keyed(x.names, words, x.weights)
  return KeyedJagged(x.names, words, x.lengths, x.weights)


def _keyed_slots(x: Any) -> np.ndarray:
  """Each value's feature (its index in ``x.names``) in a keyed input with
  numpy ids; ``len(names)`` for a jagged slot past the bags, and every
  feature's where lengths are traced (each value then checked as every
  feature's)."""
  if isinstance(x, Keyed):
    shape = np.shape(x.values)
    k = np.arange(shape[1]).reshape((1, -1) + (1,) * (len(shape) - 2))
    return np.broadcast_to(k, shape)
  try:
    lengths = np.asarray(x.lengths).astype(np.int64)
  except jax.errors.TracerArrayConversionError:
    return np.zeros(np.shape(x.ids), np.int64) - 1  # matches no feature
  ends = np.cumsum(lengths.sum(axis=1))
  return np.searchsorted(ends, np.arange(np.shape(x.ids)[0]), side="right")


def _check_row_ids(name: str, x: np.ndarray, what: str) -> None:
  """Numpy row ids of a plain feature fit an int32 (a wider id would read
  as padding eagerly and wrap onto another row under ``jax.jit``)."""
  bad = (x < np.iinfo(np.int32).min) | (x > np.iinfo(np.int32).max)
  if np.any(bad):
    raise ValueError(
      f"gradtx.TableStack.{what}: feature {name!r} has row id "
      f"{x[bad].flat[0]}, past int32: no table has that many rows, and it "
      "would read as padding here and as another row under jax.jit. Pass "
      "the feature's row ids (a hashed table's raw ids go to `stack.admit`"
      ", or to `stack.lookup` with `vocab=`)."
    )


def check_lengths(ids: Any, what: str) -> None:
  """The jagged features of ``ids`` (a dict's :class:`Jagged` ones, a
  :class:`KeyedJagged`) hold their bags: no length is negative and the
  lengths sum to no more than the capacity (the ids' length). Concrete
  lengths are checked at once (a ValueError naming the feature, the sum
  and the capacity); traced ones by ``checkify`` checks, which cost
  nothing unless the caller turns them on (``checkify.checkify(step,
  errors=checkify.user_checks)``); ``what``: the TableStack method."""
  if isinstance(ids, KeyedJagged):
    jagged = [(list(ids.names), ids.lengths, _shape(ids.ids))]
  elif isinstance(ids, Mapping) and not isinstance(ids, Keyed):
    jagged = [
      ([f], x.lengths, _shape(x.ids))
      for f, x in ids.items()
      if isinstance(x, Jagged)
    ]
  else:
    return
  where = f"gradtx.TableStack.{what}"
  for names, lengths, shape in jagged:
    capacity = shape[0] if len(shape) == 1 else None
    if not hasattr(lengths, "dtype"):  # a list, of traced values maybe
      try:
        lengths = np.asarray(lengths)
      except jax.errors.TracerArrayConversionError:
        lengths = jnp.asarray(lengths)
    dtype = lengths.dtype
    if capacity is None or not jnp.issubdtype(dtype, jnp.integer):
      continue  # feature_form / keyed_batch refuse the form itself
    try:
      concrete = np.asarray(lengths).astype(np.int64)
    except jax.errors.TracerArrayConversionError:
      _check_traced_lengths(names, jnp.asarray(lengths), capacity, where)
      continue
    per_feature = concrete.reshape(len(names), -1)
    ends = np.cumsum(per_feature.sum(axis=1))
    for k, name in enumerate(names):
      if (per_feature[k] < 0).any():
        raise ValueError(
          f"{where}: feature {name!r} has a negative length "
          f"{per_feature[k].min()} in its jagged `lengths`; a bag holds 0 "
          "ids or more (0: an empty bag)."
        )
      if ends[k] > capacity:
        raise ValueError(
          f"{where}: feature {name!r}: its bags end at jagged slot {ends[k]} "
          f"(the `lengths` sum to {ends[-1]}), past the capacity {capacity} "
          f"of the `ids`: {ends[-1] - capacity} ids would be dropped. Size "
          "the capacity for the largest batch (the sum of its lengths), or "
          "split the batch."
        )


def _check_traced_lengths(
  names: list[str], lengths: jax.Array, capacity: int, where: str
) -> None:
  total = jnp.sum(lengths.astype(jnp.int32))
  which = "feature " + repr(names[0]) if len(names) == 1 else f"keys {names}"
  which = which.replace("{", "{{").replace("}", "}}")
  checkify.debug_check(
    jnp.min(lengths) >= 0,
    f"{where}: {which}: a jagged length is negative ({{low}})",
    low=jnp.min(lengths),
  )
  checkify.debug_check(
    total <= capacity,
    f"{where}: {which}: the jagged `lengths` sum to {{total}}, past the "
    f"capacity {capacity} of the ids: {{dropped}} ids dropped",
    total=total,
    dropped=total - capacity,
  )


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


def parse(
  ids: Any,
  weights: Any,
  hashed: Sequence[str],
  what: str,
  *,
  raw: bool = False,
  names: Sequence[str] | None = None,
) -> tuple[Any, int | None]:
  """The one parse of a stack's input for the TableStack method ``what``:
  ``(forms, batch)``, every row id narrowed to int32 (:func:`row_ids`).

  Without ``raw`` (a lookup of rows) a keyed input stays whole, its
  arrays' forms checked (:func:`keyed_batch`) and its ids narrowed, and
  ``batch`` is its ``B``. With ``raw`` (``admit``, a lookup through the
  maps) the hashed features' ids stay raw: a keyed input is read as its
  dict (:func:`plain_features`, its weights the features'). Each feature
  of a dict named in ``names`` (default: every one) becomes its
  :class:`Feature` (:func:`feature_form`), the others staying as given;
  ``batch`` is then None."""
  if isinstance(ids, (Keyed, KeyedJagged)):
    if not raw:
      batch = keyed_batch(ids, hashed)
      # the ids come first among a keyed input's children
      (given, *rest), names = ids.tree_flatten()
      field = "values" if isinstance(ids, Keyed) else "ids"
      where = f"gradtx.TableStack.{what}: gradtx.{type(ids).__name__}"
      narrowed = row_ids(given, f"{where} `{field}`")
      return type(ids).tree_unflatten(names, (narrowed, *rest)), batch
    if isinstance(ids, Keyed) and ids.weights is not None:
      weights = {f: ids.weights[:, k] for k, f in enumerate(ids.names)}
    ids = plain_features(ids, hashed)
  weights = dict(weights or {})
  parsed = set(ids if names is None else names)
  forms = {}
  for f, x in ids.items():
    form = feature_form(f, x, weights.get(f), what) if f in parsed else x
    if f in parsed and not (raw and f in hashed):
      form = form._replace(ids=_row_ids_of(f, form.ids, what))
    forms[f] = form
  return forms, None


def _row_ids_of(name: str, x: Any, what: str) -> jax.Array:
  where = f"gradtx.TableStack.{what}: feature {name!r}"
  if isinstance(x, Words):
    raise TypeError(
      f"{where} has raw gradtx.Words ids; pass `vocab=` to map them "
      "read-only, or the ids `stack.admit` returned."
    )
  return row_ids(x, f"{where} `ids`")


def plain_features(x: Keyed | KeyedJagged, hashed: Sequence[str]) -> dict:
  """A keyed input as its dict, feature by feature: the hashed features'
  ids as given (raw), the others' as row ids (:func:`row_ids`)."""
  out = {}
  for f in x.names:
    v = x[f]
    if f not in hashed:
      what = f"gradtx.TableStack: feature {f!r} `ids`"
      if isinstance(v, Jagged):
        v = v._replace(ids=row_ids(v.ids, what))
      else:
        v = row_ids(v, what)
    out[f] = v
  return out


def _check_lengths(name: str, lengths: jax.Array, what: str) -> None:
  if not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise TypeError(
      f"gradtx.TableStack.{what}: feature {name!r} has `lengths` of dtype "
      f"{lengths.dtype}; pass integers (`.astype(jnp.int32)`)."
    )


def keyed_batch(x: Keyed | KeyedJagged, hashed: Sequence[str]) -> int:
  """The batch of a keyed input, its arrays' forms checked; ``hashed``:
  the stack's hashed features, whose raw ids (words) a lookup without
  ``vocab=`` cannot read."""
  what = type(x).__name__
  words = x.values if isinstance(x, Keyed) else x.ids
  raw = [f for f in x.names if f in hashed]
  if isinstance(words, (Words, HostWords)) and raw:
    raise TypeError(
      f"gradtx.TableStack.lookup: the gradtx.{what} holds raw 64-bit ids "
      f"of the hashed features {raw}; pass `vocab=` to map them read-only, "
      "or the ids `stack.admit` returned."
    )
  shape = _shape(words)
  if isinstance(x, Keyed):
    if len(shape) not in (2, 3):
      raise ValueError(
        "gradtx.TableStack.lookup: a gradtx.Keyed of ids must have `values` "
        f"[B, F] or [B, F, L]; got {shape}."
      )
    return shape[0]
  lengths = jnp.asarray(x.lengths)
  _check_lengths(what, lengths, "lookup")
  if len(shape) != 1:
    raise ValueError(
      f"gradtx.TableStack.lookup: gradtx.KeyedJagged `ids` must be "
      f"[capacity]; got {shape}."
    )
  if x.weights is not None and _shape(x.weights) != shape:
    raise ValueError(
      "gradtx.TableStack.lookup: gradtx.KeyedJagged `weights` must have the "
      f"ids' shape {shape}; got {_shape(x.weights)}."
    )
  return lengths.shape[1]


def outside_traces(*trees: Any) -> bool:
  """Whether a call's arrays are all concrete JAX or numpy arrays that
  ``jax.jit`` takes as they are: no traced value (inside the user's
  ``jit`` the method's ops join the user's program) and no numpy 64-bit
  integers while ``jax_enable_x64`` is off (``jit`` would narrow them:
  :func:`host_ready` makes those of the usual input forms fit first)."""
  for leaf in jax.tree.leaves(trees):
    if isinstance(leaf, np.ndarray):
      if split_on_host(leaf.dtype):
        return False
    elif not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
      return False
  return True


def run_program(programs: dict, key: Any, fn: Callable, *args: Any) -> Any:
  """``fn(*args)``: outside any trace (:func:`outside_traces`) as one
  program, compiled once per ``key`` and kept in ``programs`` (a stack's:
  eagerly, op by op, the id map's placement loop would compile again on
  every call); inside one, as ops of the caller's program."""
  if not outside_traces(*args):
    return fn(*args)
  if key not in programs:
    programs[key] = jax.jit(fn)
  return programs[key](*args)
