"""The id map of open vocabularies: its state, hashing, lookup and stats.

A hashed table (``gtx.TableSpec(..., hashed=gtx.Hashed(...))``) keeps, beside
the params, an id map: for every row, the raw id that owns it (two uint32
words, so 64-bit ids fit the default 32-bit JAX), the step it was last read,
how often it was read and when it was given out. The map is a pytree of
fixed-shape arrays (:class:`VocabState`), updated inside the jitted, donated
step by :meth:`gradtx.TableStack.admit`, and checkpointed like any state.

How an id finds its row (FBGEMM's zero-collision hashing): a hash of the id
names a home row, and the id may live in the ``probes`` rows from there
(wrapping around the table). A known id reads the row that holds it. A new
id takes a free row of its window while there is one; when the window is
full it evicts, by the table's policy, a row that no id of this step reads:
the least recently read (``"lru"``) or the least often read (``"lfu"``, ties
to the least recent), with ``ttl`` only a row unread for more than ``ttl``
steps. No two live ids ever share a row; an id that finds no row (its
window is full of rows this step reads, or admission turns it away) is
padding for this step: it reads zeros and gets no gradient.

New ids are placed by ``_placement`` (budgets, admission, the rounds,
the fresh rows' values); :func:`drop_reassigned` keeps a gradient computed
before a row was given out (a late one, in asynchronous training) off its
new owner.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gradtx._fresh_rows import drop_entries
from gradtx._sharded import is_split, spread_row
from gradtx._sparse_rows import SparseRows
from gradtx._static import is_int

__all__ = ["Hashed", "VocabState"]

POLICIES = ("lru", "lfu")
INT_MAX = np.iinfo(np.int32).max
_U32 = np.uint32
SKETCH_DEPTH = 2
# key_hi, key_lo, last_seen, count, born, claim: 4 bytes each
MAP_BYTES_PER_ROW = 24


@dataclasses.dataclass(frozen=True)
class Hashed:
  """Declares a table hashed: raw ids of any range, mapped to its rows.

  Args:
    policy: which row a new id evicts when its window is full: ``"lru"``
      (the least recently read) or ``"lfu"`` (the least often read, ties
      to the least recent).
    ttl: if set, only a row unread for more than ``ttl`` steps may be
      evicted; a new id that finds none is turned away for the step.
    min_count: admit a new id only once it was read this many times (a
      count-min sketch of two rows as wide as the table counts the ids
      still outside); 1 admits at once.
    admit_probability: admit a new id with this probability (a hash of the
      id and the step decides, so it is deterministic); 1 admits every id.
    probes: the rows an id may live in, from its home row on.
    seed: the hash seed (with the table's name).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import gradtx as gtx
    >>> stack = gtx.TableStack(
    ...     {"user": gtx.TableSpec(4, 2, hashed=gtx.Hashed(probes=4))})
    >>> params = stack.init(jax.random.key(0))
    >>> vocab = stack.init_vocab(jax.random.key(1))
    >>> raw = {"user": jnp.array([10**9 + 7, 42, 10**9 + 7, -1])}
    >>> ids, vocab, fresh = stack.admit(vocab, raw)
    >>> ids["user"]  # two ids, two rows; -1: padding
    Array([ 1,  2,  1, -1], dtype=int32)
    >>> params, _ = gtx.reset_rows(None, None, params, fresh)
    >>> int(stack.vocab_stats(vocab)["user"]["live"])
    2
  """

  policy: str = "lru"
  ttl: int | None = None
  min_count: int = 1
  admit_probability: float = 1.0
  probes: int = 8
  seed: int = 0

  def __post_init__(self):
    if self.policy not in POLICIES:
      raise ValueError(
        f"gradtx.Hashed `policy` must be one of {POLICIES}; got "
        f"{self.policy!r}."
      )
    for name, low in (("probes", 1), ("min_count", 1), ("seed", 0)):
      v = getattr(self, name)
      if not is_int(v) or v < low:
        raise ValueError(
          f"gradtx.Hashed `{name}` must be an int >= {low}; got {v!r}."
        )
    if self.ttl is not None and (not is_int(self.ttl) or self.ttl < 0):
      raise ValueError(
        f"gradtx.Hashed `ttl` must be None or an int >= 0 (steps); got "
        f"{self.ttl!r}."
      )
    p = self.admit_probability
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
      raise ValueError(
        "gradtx.Hashed `admit_probability` must be a float in (0, 1]; got "
        f"{p!r}."
      )


class VocabState(NamedTuple):
  """The id map of one stack's hashed tables: per-row arrays in the stack's
  row order (a row of a table that is not hashed is never used).

  Attributes:
    step: int32 ``[]``, the map's steps so far (``admit`` calls).
    key_hi, key_lo: uint32 ``[rows]``, the raw id that owns each row.
    last_seen: int32 ``[rows]``, the step that last read the row; -1: free.
    count: int32 ``[rows]``, the reads of the row's id (saturating).
    born: int32 ``[rows]``, the step the row was given to its id.
    claim: int32 ``[rows]``, scratch of the placement rounds; between steps
      every element is ``2**31 - 1``.
    inserted, evicted, rejected: int32 ``[tables]``, the last step's new ids
      given a row, of them those that evicted a live id, and the id reads
      that found no row (per hashed table, in the stack's order).
    live: int32 ``[tables]``, the rows owned by an id.
    starved: int32 ``[tables]``, the consecutive steps, up to the last,
      in which the table turned reads away while it had free rows and
      placed no new id (0 after a step that placed one, or had nothing
      to turn away, or no free row).
    sketch: int32 ``[2, width]``, the count-min sketch of the ids waiting
      for admission (width 1, unused, when no table has ``min_count`` > 1).
    rng: uint32 ``[2]``, the key data of the fresh rows' initializer.
  """

  step: jax.Array
  key_hi: jax.Array
  key_lo: jax.Array
  last_seen: jax.Array
  count: jax.Array
  born: jax.Array
  claim: jax.Array
  inserted: jax.Array
  evicted: jax.Array
  rejected: jax.Array
  live: jax.Array
  starved: jax.Array
  sketch: jax.Array
  rng: jax.Array


# -- hashing ------------------------------------------------------------------
def fmix(x: Any) -> Any:
  """MurmurHash3's 32-bit finalizer (uint32 in, uint32 out; numpy or jax)."""
  x = x ^ (x >> _U32(16))
  x = x * _U32(0x85EBCA6B)
  x = x ^ (x >> _U32(13))
  x = x * _U32(0xC2B2AE35)
  return x ^ (x >> _U32(16))


def hash_words(hi: Any, lo: Any, seed: Any) -> Any:
  """The 32-bit hash of 64-bit ids ``(hi, lo)`` under a uint32 ``seed``."""
  return fmix(lo ^ fmix(hi ^ seed))


def table_seed(name: str, seed: int) -> int:
  """A table's hash seed: its ``Hashed.seed`` and its name (stable across
  processes and plans)."""
  with np.errstate(over="ignore"):
    return int(fmix(np.uint32((zlib.crc32(name.encode()) ^ seed) & 0xFFFFFFFF)))


# -- the layout of one stack's map --------------------------------------------
@dataclasses.dataclass(frozen=True)
class Layout:
  """What the map of one stack needs from the plan: its hashed tables, their
  first logical rows, sizes, settings and initializers, the stack's row
  width and dtype, and where a logical row lives."""

  tables: tuple[str, ...]
  offsets: tuple[int, ...]
  rows: tuple[int, ...]
  settings: tuple[Hashed, ...]
  size: int  # rows of the stack's array
  shards: int  # the stack's round-robin split (_sharded.spread_row)
  # each table's initializer(key, shape, dtype) of the rows given to new
  # ids; None: the default normal of standard deviation 1 / sqrt(dim),
  # drawn by fresh_normal
  initializers: tuple[Callable[..., Any] | None, ...]
  dim: int
  dtype: Any

  def physical(self, p: Any) -> Any:
    return spread_row(p, self.size, self.shards)

  @property
  def probes(self) -> int:
    return max(h.probes for h in self.settings)

  @property
  def sketch_offsets(self) -> tuple[int, ...]:
    out, at = [], 0
    for r, h in zip(self.rows, self.settings, strict=True):
      out.append(at)
      at += r if h.min_count > 1 else 0
    return (*out, at)

  @property
  def sketch_bytes(self) -> int:
    return SKETCH_DEPTH * 4 * self.sketch_offsets[-1]

  @property
  def map_bytes(self) -> int:
    """Bytes of the map: six int32 words a row of the stack, the sketch."""
    return self.size * MAP_BYTES_PER_ROW + self.sketch_bytes


def init_state(layout: Layout, key: Any) -> VocabState:
  """An empty map: every row free."""
  n, t = layout.size, len(layout.tables)
  width = max(1, layout.sketch_offsets[-1])  # orbax refuses empty arrays
  if jnp.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  rng = jnp.asarray(key, jnp.uint32).reshape(-1)[-2:]
  return VocabState(
    step=jnp.zeros((), jnp.int32),
    key_hi=jnp.zeros(n, jnp.uint32),
    key_lo=jnp.zeros(n, jnp.uint32),
    last_seen=jnp.full(n, -1, jnp.int32),
    count=jnp.zeros(n, jnp.int32),
    born=jnp.zeros(n, jnp.int32),
    claim=jnp.full(n, INT_MAX, jnp.int32),
    inserted=jnp.zeros(t, jnp.int32),
    evicted=jnp.zeros(t, jnp.int32),
    rejected=jnp.zeros(t, jnp.int32),
    live=jnp.zeros(t, jnp.int32),
    starved=jnp.zeros(t, jnp.int32),
    sketch=jnp.zeros((SKETCH_DEPTH, width), jnp.int32),
    rng=rng,
  )


class Probe(NamedTuple):
  """Every id slot's window: table-local rows, array rows, which are in."""

  local: jax.Array  # int32 [n, P]
  phys: jax.Array  # int32 [n, P]
  inwin: jax.Array  # bool [n, P]


def probe(layout: Layout, tab: np.ndarray, h: jax.Array) -> Probe:
  rows = jnp.asarray(np.asarray(layout.rows, np.uint32)[tab])
  off = np.asarray(layout.offsets, np.int32)[tab]
  probes = np.asarray([s.probes for s in layout.settings], np.int32)[tab]
  j = np.arange(layout.probes, dtype=np.uint32)[None]
  local = (h % rows)[:, None] + j
  if min(layout.rows) >= layout.probes:  # wraps at most once: no remainder
    local = jnp.where(local >= rows[:, None], local - rows[:, None], local)
  else:
    local = local % rows[:, None]
  local = local.astype(jnp.int32)
  phys = layout.physical(local + off[:, None])
  return Probe(local, phys, jnp.asarray(j < probes[:, None]))


def match(state: VocabState, p: Probe, hi, lo, want) -> tuple[Any, Any]:
  """Where each wanted id's row is in its window: ``(found, column)``."""
  m = (
    p.inwin
    & want[:, None]
    & (state.last_seen[p.phys] >= 0)
    & (state.key_hi[p.phys] == hi[:, None])
    & (state.key_lo[p.phys] == lo[:, None])
  )
  return m.any(1), jnp.argmax(m, axis=1)


def pick(p: Probe, col: jax.Array) -> tuple[jax.Array, jax.Array]:
  c = col[:, None]
  return (
    jnp.take_along_axis(p.local, c, 1)[:, 0],
    jnp.take_along_axis(p.phys, c, 1)[:, 0],
  )


def find(
  state: VocabState, layout: Layout, hi, lo, tab: np.ndarray, valid
) -> jax.Array:
  """Read-only: each id's table-local row, or -1 (unknown or padding)."""
  check_not_split(state, "lookup")
  p = probe(layout, tab, id_hashes(layout, hi, lo, tab))
  found, col = match(state, p, hi, lo, valid)
  local, _ = pick(p, col)
  return jnp.where(found, local, -1)


def id_hashes(layout: Layout, hi, lo, tab: np.ndarray) -> jax.Array:
  seeds = np.asarray(
    [
      table_seed(t, s.seed)
      for t, s in zip(layout.tables, layout.settings, strict=True)
    ],
    np.uint32,
  )
  return hash_words(hi, lo, jnp.asarray(seeds[tab]))


def check_not_split(state: VocabState, what: str) -> None:
  """The map is not split over Explicit axes; ``what``: the TableStack
  method that reads it (``"admit"``, ``"lookup"``), named in the error."""
  if is_split(state.key_hi):
    raise ValueError(
      f"gradtx.TableStack.{what}: the id map's rows are split over Explicit "
      "mesh axes, which its probing does not support yet. Split them "
      "over Auto axes (`jax.make_mesh(..., axis_types=(AxisType.Auto,))`), "
      "or keep the map replicated (`jax.device_put(vocab, "
      "NamedSharding(mesh, P()))`) while the params stay row-sharded."
    )


# -- what users watch ---------------------------------------------------------
def _log2_buckets(x: jax.Array, live: jax.Array, buckets: int) -> jax.Array:
  """Counts of ``x`` (>= 0) in buckets ``0, 1, 2-3, 4-7, ...``."""
  b = jnp.where(
    x > 0, jnp.floor(jnp.log2(jnp.maximum(x, 1).astype(jnp.float32))) + 1, 0
  ).astype(jnp.int32)
  b = jnp.minimum(b, buckets - 1)
  return jax.ops.segment_sum(live.astype(jnp.int32), b, buckets)


def stats(state: VocabState, layout: Layout, buckets: int = 24) -> dict:
  """Per hashed table: occupancy, the last step's inserted / evicted /
  rejected, the steps it has been starved, and the age, idle time and
  read-count distributions of the live rows (log2 buckets: 0, 1, 2-3,
  4-7, ...)."""
  out = {}
  for k, (t, off, rows) in enumerate(
    zip(layout.tables, layout.offsets, layout.rows, strict=True)
  ):
    at = jnp.asarray(layout.physical(np.arange(off, off + rows)))
    last = state.last_seen[at]
    live = last >= 0
    n = live.sum()
    age = jnp.where(live, state.step - 1 - state.born[at], 0)
    idle = jnp.where(live, state.step - 1 - last, 0)
    count = jnp.where(live, state.count[at], 0)
    denom = jnp.maximum(n, 1).astype(jnp.float32)
    out[t] = {
      "live": n,
      "occupancy": n.astype(jnp.float32) / rows,
      "inserted": state.inserted[k],
      "evicted": state.evicted[k],
      "rejected": state.rejected[k],
      "starved": state.starved[k],
      "mean_age": age.sum().astype(jnp.float32) / denom,
      "mean_count": count.astype(jnp.float32).sum() / denom,
      "age_buckets": _log2_buckets(age, live, buckets),
      "idle_buckets": _log2_buckets(idle, live, buckets),
      "count_buckets": _log2_buckets(count, live, buckets),
    }
  return out


# -- gradients of rows given out since ---------------------------------------
def drop_reassigned(grad: Any, born: jax.Array, since: Any) -> Any:
  """``grad`` (a SparseRows or an array of the stack's rows) without its
  rows given out after the map's step ``since``: ``born[row] > since``."""
  since = jnp.asarray(since, jnp.int32)
  if isinstance(grad, SparseRows):
    idx = grad.indices
    gone = (idx < born.shape[0]) & (
      born[jnp.clip(idx, 0, born.shape[0] - 1)] > since
    )
    return drop_entries(grad, gone)
  gone = (born > since).reshape((-1,) + (1,) * (jnp.ndim(grad) - 1))
  return jnp.where(gone, jnp.zeros((), jnp.result_type(grad)), grad)


def check_vocab(vocab: Any, maps: Mapping[str, Layout], what: str) -> None:
  """``vocab`` is the dict of :class:`VocabState` the plan wants: its keys,
  and each map's shapes those of the stack's layout."""
  if not isinstance(vocab, Mapping) or set(vocab) != set(maps):
    got = list(vocab) if isinstance(vocab, Mapping) else type(vocab).__name__
    raise ValueError(
      f"gradtx.TableStack.{what}: `vocab` must be the dict "
      f"`stack.init_vocab(key)` returns, with keys {list(maps)}; got {got}."
    )
  for name, layout in maps.items():
    state = vocab[name]
    want = _shapes(layout)
    got = (
      tuple(tuple(jnp.shape(x)) for x in state)
      if isinstance(state, VocabState)
      else None
    )
    if got != want:
      if got is None:
        found = type(state).__name__
      elif len(got[1]) == 1 and len(got[7]) == 1:
        found = f"a map of {got[1][0]} rows and {got[7][0]} hashed table(s)"
      else:
        found = "a map of other shapes"
      raise ValueError(
        f"gradtx.TableStack.{what}: `vocab[{name!r}]` is not this stack's id "
        f"map: its hashed tables {list(layout.tables)} need a map of "
        f"{layout.size} rows and {len(layout.tables)} hashed table(s); got "
        f"{found}. Pass the maps this stack's `init_vocab(key)` made (the "
        "map of another stack or plan would give ids other rows)."
      )


@functools.lru_cache(maxsize=64)
def _shapes(layout: Layout) -> tuple[tuple[int, ...], ...]:
  """The shape of each field of ``layout``'s map."""
  state = jax.eval_shape(
    lambda k: init_state(layout, k), jax.ShapeDtypeStruct((2,), jnp.uint32)
  )
  return tuple(tuple(x.shape) for x in state)
