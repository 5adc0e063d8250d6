"""The open-vocabulary step as one object: :class:`OpenVocab`.

A training step on hashed tables is the id map (``TableStack.admit``), the
fresh rows (``reset_rows``), the update with late gradients kept off new
owners (``TableStack.drop_reassigned``) and the publish with owners and
tombstones (``delta`` with ``stack=``, ``vocab=``, ``since_vocab=``).
:class:`OpenVocab` wraps any optax transformation and does them all: its
state (:class:`OpenVocabState`) holds the wrapped state, the id maps and
the publishing record, and its calls find that state wherever it sits in
an enclosing optimizer state (``optax.multi_transform``, ``optax.chain``),
as ``delta`` finds its record. It is itself a transformation, so it
chains and nests like one; it calls the bare functions, which stay public
for those who compose by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from gradtx._accumulate import AccumulateState
from gradtx._fresh_rows import reset_rows
from gradtx._inputs import Jagged, KeyedJagged
from gradtx._mirrored import gather_replicas, replica_axis
from gradtx._publish import Delta, TrackChangesState, delta
from gradtx._sparse_rows import SparseRows
from gradtx._stack import TableStack
from gradtx._staleness import DropStaleState
from gradtx._vocab import VocabState

__all__ = ["OpenVocab", "OpenVocabState"]


class OpenVocabState(NamedTuple):
  """State of :class:`OpenVocab`: one pytree of arrays (orbax saves and
  restores it as it is)."""

  inner_state: Any  # the wrapped transformation's state
  vocab: dict[str, VocabState]  # stack name -> id map (stack.init_vocab)
  # stack name -> int32 [], the map's step when the last admit mapped ids
  # (VocabState.step before it): rows given out after it are late
  mapped: dict[str, jax.Array]
  published: jax.Array  # int32 [], the tracker step of the last publish; -1
  # stack name -> id map as it was at the last publish (a copy)
  published_vocab: dict[str, VocabState]


def _is_state(x: Any) -> bool:
  return isinstance(x, OpenVocabState)


def _path(at: Any) -> tuple[Any, ...]:
  if at is None:
    return ()
  if isinstance(at, (str, int)):
    return (at,)
  if isinstance(at, tuple) and all(isinstance(k, (str, int)) for k in at):
    return at
  raise TypeError(
    "gradtx.OpenVocab `at` must be None (the params are the stack's), a key "
    "of the params where the stack's params sit (a str), or a tuple of keys "
    f"for a nested place; got {at!r}."
  )


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
  for k in path:
    if not isinstance(tree, Mapping) or k not in tree:
      return None
    tree = tree[k]
  return tree


def _set(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
  if not path:
    return value
  out = dict(tree)
  out[path[0]] = _set(tree[path[0]], path[1:], value)
  return type(tree)(out) if not isinstance(tree, dict) else out


def _nest(path: tuple[Any, ...], value: Any) -> Any:
  for k in reversed(path):
    value = {k: value}
  return value


def _masked(tree: Any, path: tuple[Any, ...], coarse: bool) -> Any:
  """``tree`` with every leaf outside ``path`` an ``optax.MaskedNode``, as
  ``optax.multi_transform`` gives a transformation the params of one label:
  per leaf, or (``coarse``) one node per sibling subtree on the way."""
  if not path:
    return tree
  if not isinstance(tree, Mapping):
    return tree
  out = {}
  for k, v in tree.items():
    if k == path[0]:
      out[k] = _masked(v, path[1:], coarse)
    elif coarse:
      out[k] = optax.MaskedNode()
    else:
      out[k] = jax.tree.map(lambda _: optax.MaskedNode(), v)
  return out


def _is_jagged(x: Any) -> bool:
  return isinstance(x, (Jagged, KeyedJagged))


def _gather_batch(tree: Any, axis_name: Any) -> Any:
  """Every replica's part of a batch of ids or weights, concatenated in
  replica order (the global batch), the same on every replica."""
  for x in jax.tree.leaves(tree, is_leaf=_is_jagged):
    if _is_jagged(x):
      raise ValueError(
        "gradtx.OpenVocab.admit on replicas: a gradtx.Jagged or "
        "gradtx.KeyedJagged feature is packed per replica and cannot be "
        "joined into the global batch by a gather; give hashed features as "
        "[B] or [B, L] ids (padding by a weight 0 or a negative id), "
        "gradtx.Words or a gradtx.Keyed."
      )
  return jax.tree.map(
    lambda x: gather_replicas(jnp.asarray(x), axis_name), tree
  )


def _own_part(tree: Any, axis_name: Any) -> Any:
  """This replica's part of every leaf of a global batch."""
  replicas, me = lax.axis_size(axis_name), lax.axis_index(axis_name)

  def part(x):
    size = x.shape[0] // replicas
    return lax.dynamic_slice_in_dim(x, me * size, size, axis=0)

  return jax.tree.map(part, tree)


_WRAPPERS = {AccumulateState: "accumulate", DropStaleState: "drop_stale"}


def _check_not_wrapped(state: Any, what: str) -> None:
  """Refuses an OpenVocab inside ``accumulate`` or ``drop_stale``: a
  gradient they hold back would reach the OpenVocab's update after later
  admits, its rows given out meanwhile kept, and their buffers' rows never
  made fresh."""
  is_wrapper = lambda x: isinstance(x, tuple(_WRAPPERS))  # noqa: E731
  for w in jax.tree.leaves(state, is_leaf=is_wrapper):
    if is_wrapper(w) and any(
      _is_state(x) for x in jax.tree.leaves(w, is_leaf=_is_state)
    ):
      name = _WRAPPERS[type(w)]
      raise ValueError(
        f"gradtx.OpenVocab.{what}: the OpenVocab is inside gradtx.{name}, "
        "which would hand it gradients of ids mapped before later admits "
        "gave their rows out, and hold rows its admit never makes fresh. "
        f"Put gradtx.{name} inside the OpenVocab: `gtx.OpenVocab(stack, "
        f"gtx.{name}(opt, ...), ...)`."
      )


def _shapes(tree: Any) -> tuple[Any, list[tuple[int, ...]]]:
  is_sparse = lambda x: isinstance(x, SparseRows)  # noqa: E731
  return jax.tree.structure(tree, is_leaf=is_sparse), [
    jnp.shape(x) for x in jax.tree.leaves(tree)
  ]


class OpenVocab(optax.GradientTransformationExtraArgs):
  """The open-vocabulary training step as one transformation.

  Wraps ``tx`` for the params holding a :class:`gradtx.TableStack`'s
  params at ``at``, and keeps, in its one state, the wrapped state, the
  stack's id maps and the publishing record. Three calls make the step
  and a fourth publishes::

    ov = gtx.OpenVocab(stack, tx, at="emb", key=jax.random.key(1))
    state = ov.init(params)

    @jax.jit(donate_argnums=(0, 1))
    def step(params, state, raw, labels):
      ids, params, state = ov.admit(state, params, raw)
      loss, grads = gtx.sparse_value_and_grad(loss_fn)(params, ids, labels)
      updates, state = ov.update(grads, state, params)
      return gtx.apply_updates(params, updates), state, loss

    d, state = ov.publish(params, state)  # outside jit, every N steps

  :meth:`admit` maps the batch's raw ids (``TableStack.admit``) and makes
  the rows given to new ids fresh in the params and in every leaf of the
  wrapped state (:func:`gradtx.reset_rows`): there is no step in which a
  new id reads an evicted id's row. :meth:`update` drops the gradient
  rows given out after the gradient's ids were mapped
  (``TableStack.drop_reassigned``: late gradients of asynchronous
  training, :func:`gradtx.drop_stale`, :func:`gradtx.accumulate`), then
  runs ``tx``. :meth:`publish` returns :func:`gradtx.delta` with the
  owners and tombstones and keeps its own last step and a copy of the
  last map. Each equals the bare calls bit for bit.

  It is an optax transformation: put it in ``optax.chain`` or, labelled
  with the stack's params (and only them), in ``optax.multi_transform``
  beside a dense optimizer, and pass the enclosing state to
  :meth:`admit`, :meth:`publish` and :meth:`mapped_at`: they find and
  replace its :class:`OpenVocabState` in it (one OpenVocab a state).
  Wrap what follows the stack's rows (``accumulate``, ``drop_stale``, the
  optimizer) inside it, so that :meth:`admit` resets their rows (an
  OpenVocab inside ``accumulate`` or ``drop_stale`` is refused); put
  :func:`gradtx.track_changes` in ``tx``, or after an enclosing
  ``multi_transform`` so that it records every leaf, to publish.

  Args:
    stack: the :class:`gradtx.TableStack`, with hashed tables.
    tx: the transformation to wrap (any optax one).
    at: where the stack's params (``stack.init``'s dict) sit in the
      params: a key, a tuple of keys for a nested place, or None when the
      params are the stack's.
    key: seeds the values of the rows given to new ids
      (``stack.init_vocab(key)``).
    max_new, max_new_fraction: each hashed table's bound of new ids a
      step, a count or a fraction of its id slots, as
      ``TableStack.admit`` takes them (of the global batch, with
      ``axis_name``).
    axis_name: the replica axis of a step run on every replica under
      ``jax.shard_map`` or ``jax.pmap``: :meth:`admit` gathers the
      replicas' raw ids and maps the global batch on every replica, so
      the maps, the fresh rows and the params stay the same on all of
      them (equal to one device's step on the global batch), and returns
      each replica the rows of its own part. Each replica does the map's
      work of the global batch. Inside a :class:`gradtx.Mirrored` step it
      takes the step's axis itself; default None elsewhere: one device,
      or a step under ``jax.jit`` whose batch the compiler shards.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import gradtx as gtx
    >>> stack = gtx.TableStack(
    ...     {"user": gtx.TableSpec(4, 2, hashed=gtx.Hashed(probes=4))})
    >>> params = {"emb": stack.init(jax.random.key(0)), "w": jnp.ones(2)}
    >>> ov = gtx.OpenVocab(stack, gtx.lazy_adam(0.1), at="emb",
    ...                    key=jax.random.key(1))
    >>> state = ov.init(params)
    >>> raw = {"user": jnp.array([7, 9])}
    >>> ids, params, state = ov.admit(state, params, raw)
    >>> ids["user"]  # rows of the stack; both fresh in params and state
    Array([3, 2], dtype=int32)
    >>> int(stack.vocab_stats(ov.vocab(state))["user"]["live"])
    2
  """

  def __new__(
    cls,
    stack: TableStack,
    tx: optax.GradientTransformation,
    *,
    at: Any = None,
    key: Any,
    max_new: int | Mapping[str, int] | None = None,
    max_new_fraction: float | Mapping[str, float] | None = None,
    axis_name: Any = None,
  ) -> OpenVocab:
    if not isinstance(stack, TableStack) or not stack.maps:
      raise TypeError(
        "gradtx.OpenVocab `stack` must be a gradtx.TableStack with a hashed "
        "table (`gtx.TableSpec(..., hashed=gtx.Hashed())`); got "
        f"{type(stack).__name__}."
      )
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
      raise TypeError(
        "gradtx.OpenVocab `tx` must be an optax GradientTransformation (with "
        f"init and update); got {type(tx).__name__}."
      )
    path = _path(at)
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if axis_name is not None and not all(
      isinstance(n, str) and n for n in names
    ):
      raise TypeError(
        "gradtx.OpenVocab `axis_name` must be None or the replica axis name "
        "of the step (a str, `gtx.Mirrored().axis_name`, or a tuple of "
        f"them); got {axis_name!r}."
      )
    inner = optax.with_extra_args_support(tx)

    def init_fn(params):
      here = _get(params, path)
      if not isinstance(here, Mapping) or not set(stack.stacks) <= set(here):
        raise ValueError(
          f"gradtx.OpenVocab: the params have no stack params at `at`={at!r}"
          f" (the dict `stack.init` returns, with keys {list(stack.stacks)}); "
          "pass the key where they sit."
        )
      vocab = stack.init_vocab(key)
      return OpenVocabState(
        inner_state=inner.init(params),
        vocab=vocab,
        mapped={k: jnp.copy(v.step) for k, v in vocab.items()},
        published=jnp.full((), -1, jnp.int32),
        published_vocab=jax.tree.map(jnp.copy, vocab),
      )

    def update_fn(updates, state, params=None, *, mapped_at=None, **extra):
      if not _is_state(state):
        raise TypeError(
          "gradtx.OpenVocab.update `state` must be its OpenVocabState (from "
          f"`init`); got {type(state).__name__}."
        )
      since = state.mapped if mapped_at is None else mapped_at
      grads = _get(updates, path)
      if isinstance(grads, Mapping):
        present = {
          k: g
          for k, g in grads.items()
          if k in stack.maps and isinstance(g, (SparseRows, jax.Array))
        }
        kept = stack.drop_reassigned(present, state.vocab, since)
        updates = _set(updates, path, {**grads, **kept})
      out, inner_state = inner.update(
        updates, state.inner_state, params, **extra
      )
      return out, state._replace(inner_state=inner_state)

    self = super().__new__(cls, init_fn, update_fn)
    self.stack = stack
    self.tx = tx
    self.at = at
    self.max_new = max_new
    self.max_new_fraction = max_new_fraction
    self.axis_name = axis_name
    self._inner = inner
    self._path = path
    return self

  # -- finding its state --------------------------------------------------
  def _find(self, state: Any, what: str) -> tuple[OpenVocabState, Any]:
    """Its state in ``state`` and a function putting a new one back."""
    leaves, treedef = jax.tree.flatten(state, is_leaf=_is_state)
    at = [i for i, x in enumerate(leaves) if _is_state(x)]
    if len(at) != 1:
      raise ValueError(
        f"gradtx.OpenVocab.{what}: `state` must hold one OpenVocabState (the "
        f"OpenVocab's state, or a state enclosing it); it holds {len(at)}."
      )
    (i,) = at
    _check_not_wrapped(state, what)
    rest = treedef.unflatten(leaves[:i] + [None] + leaves[i + 1 :])
    self._check_outside(rest, what)

    def put(new):
      return treedef.unflatten(leaves[:i] + [new] + leaves[i + 1 :])

    return leaves[i], put

  def _check_outside(self, rest: Any, what: str) -> None:
    """Refuses a tracker outside the OpenVocab that records the stack's
    rows: :meth:`admit` resets rows only in the state it wraps, so that
    tracker's record of the rows given out would not be reset."""
    is_tracker = lambda x: isinstance(x, TrackChangesState)  # noqa: E731
    for t in jax.tree.leaves(rest, is_leaf=is_tracker):
      if is_tracker(t) and jax.tree.leaves(_get(t.changed, self._path)):
        raise ValueError(
          f"gradtx.OpenVocab.{what}: a gradtx.track_changes outside the "
          "OpenVocab records the stack's rows, which the OpenVocab's admit "
          "makes fresh only in the state it wraps. Put the tracker in the "
          "OpenVocab's `tx` (`optax.chain(opt, gtx.track_changes())`, and "
          "one in the dense optimizer's chain beside it), or wrap the whole "
          "optimizer, tracker included, in the OpenVocab."
        )

  def _inner_params(self, params: Any, inner_state: Any) -> Any:
    """The params as the wrapped transformation saw them at ``init``:
    whole, or masked to the stack's by ``optax.multi_transform``."""
    want = _shapes(inner_state)
    tried = [params]
    if self._path:
      tried += [_masked(params, self._path, c) for c in (False, True)]
    for p in tried:
      if _shapes(jax.eval_shape(self._inner.init, p)) == want:
        return p
    raise ValueError(
      "gradtx.OpenVocab.admit: the OpenVocab's state was not built for "
      "`params`: pass the params whose `init` made the state; inside "
      "optax.multi_transform, label the stack's params at `at` (and only "
      "them) for the OpenVocab."
    )

  # -- the step -----------------------------------------------------------
  def admit(
    self,
    state: Any,
    params: Any,
    ids: Mapping[str, Any],
    *,
    weights: Mapping[str, Any] | None = None,
  ) -> tuple[dict[str, Any], Any, Any]:
    """Maps a batch's raw ids and makes the rows given to new ids fresh.

    ``TableStack.admit`` on the maps in the state, then
    :func:`gradtx.reset_rows` on the stack's params at ``at`` and on
    every leaf of the wrapped state that follows their rows. Call it in
    the jitted step, before the loss.

    Args:
      state: the OpenVocab's state, or an optimizer state holding it.
      params: the params (with the stack's at ``at``).
      ids: feature name -> raw ids, as ``TableStack.admit`` takes them.
      weights: per-id weights of ``[B, L]`` features (0: padding).

    Returns:
      ``(ids, params, state)``: the ids as rows for ``stack.lookup``, the
      params with the fresh rows written, and the state with the new maps
      and the fresh rows reset.
    """
    own, put = self._find(state, "admit")
    sub = _get(params, self._path)
    if not isinstance(sub, Mapping):
      raise ValueError(
        f"gradtx.OpenVocab.admit: the params have no stack params at "
        f"`at`={self.at!r}; pass the params the OpenVocab was built for."
      )
    seen = self._inner_params(params, own.inner_state)
    mapped = {k: v.step for k, v in own.vocab.items()}
    axis = self.axis_name if self.axis_name is not None else replica_axis()
    if axis is not None:
      ids = _gather_batch(ids, axis)
      weights = _gather_batch(weights, axis)
    rows, vocab, fresh = self.stack.admit(
      own.vocab,
      ids,
      weights=weights,
      max_new=self.max_new,
      max_new_fraction=self.max_new_fraction,
    )
    if axis is not None:
      rows = _own_part(rows, axis)
    new, inner_state = reset_rows(
      self._inner, own.inner_state, seen, _nest(self._path, fresh)
    )
    params = _set(params, self._path, _get(new, self._path))
    own = own._replace(inner_state=inner_state, vocab=vocab, mapped=mapped)
    return rows, params, put(own)

  def mapped_at(self, state: Any) -> dict[str, jax.Array]:
    """The maps' steps at the last :meth:`admit` (stack name -> int32
    scalar): keep it with a gradient applied later and pass it to
    ``update`` as ``mapped_at=``, so that the rows given to new ids
    meanwhile are dropped from it. Without ``mapped_at``, ``update``
    takes the last admit's: the gradient of this step's ids."""
    return self._find(state, "mapped_at")[0].mapped

  def vocab(self, state: Any) -> dict[str, VocabState]:
    """The id maps in ``state`` (for ``stack.vocab_stats`` and
    ``stack.lookup(..., vocab=)``)."""
    return self._find(state, "vocab")[0].vocab

  # -- publishing ---------------------------------------------------------
  def publish(self, params: Any, state: Any) -> tuple[Delta, Any]:
    """The rows changed since the last publish, with owners and tombstones.

    :func:`gradtx.delta` of the params with the stack and its maps, since
    the last publish (the first: since ``init``, the whole map); the state
    returned keeps this publish's step and a copy of the maps, so that a
    step donating the state cannot free them. Call it outside ``jit``,
    between steps; ``state`` must hold a :func:`gradtx.track_changes`
    record of every params leaf.

    Args:
      params: the params now.
      state: the OpenVocab's state, or an optimizer state holding it.

    Returns:
      ``(delta, state)``: the :class:`gradtx.Delta`, and the state with
      the new publishing record (carry it on).
    """
    own, put = self._find(state, "publish")
    last = int(own.published)
    first = last < 0
    d = delta(
      params,
      state,
      since=None if first else last,
      stack=self.stack,
      vocab=_nest(self._path, own.vocab),
      since_vocab=None if first else _nest(self._path, own.published_vocab),
    )
    own = own._replace(
      published=jnp.asarray(d.step, jnp.int32),
      published_vocab=jax.tree.map(jnp.copy, own.vocab),
    )
    return d, put(own)
