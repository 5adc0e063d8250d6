"""Update trees: the trees of arrays, SparseRows and None that optax
transformations pass along, and the small pieces every transformation
builds on.

``jax.tree.map`` would descend into a SparseRows (its ids and rows are
leaves) and stop at nothing for None; the maps here treat both as leaves
(:func:`tree_map`, :func:`map_updates`, :func:`tree_leaves`).
:func:`check_tree_match` raises the structure error that names both
arguments, :func:`stateless` builds a transformation without state, and
:func:`zero_counter` starts the int32 step counter of a state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from gradtx._sparse_rows import SparseRows


def is_update_leaf(x: Any) -> bool:
  """``is_leaf`` for update trees: None and SparseRows are leaves."""
  return x is None or isinstance(x, SparseRows)


def tree_map(f: Callable[..., Any], tree: Any, *rest: Any) -> Any:
  """``jax.tree.map`` that stops at SparseRows and None."""
  return jax.tree.map(f, tree, *rest, is_leaf=is_update_leaf)


def map_updates(
  dense: Callable[..., Any],
  tree: Any,
  *rest: Any,
  sparse: Callable[..., Any] | None = None,
) -> Any:
  """The sparse twin of ``jax.tree.map`` for update trees (optax's
  ``stateless_with_tree_map`` maps arrays only): None stays None; a
  SparseRows gets ``sparse(u, *rest_leaves)`` when given, else its values
  are mapped, ``u.with_values(dense(u.values, *rest_leaves))`` (facts kept);
  every other leaf is ``dense(jnp.asarray(x), *rest_leaves)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> from gradtx._update_trees import map_updates, tree_leaves
    >>> emb = gtx.SparseRows(jnp.array([1]), jnp.ones((1, 2)), 4)
    >>> u = {"emb": emb, "w": jnp.ones(3), "b": None}
    >>> half = map_updates(lambda x: x / 2, u)
    >>> half["emb"].values, half["b"]
    (Array([[0.5, 0.5]], dtype=float32), None)
    >>> [type(x).__name__ for x in tree_leaves(half)]
    ['SparseRows', 'ArrayImpl']
  """

  def f(u, *r):
    if u is None:
      return None
    if isinstance(u, SparseRows):
      if sparse is not None:
        return sparse(u, *r)
      return u.with_values(dense(u.values, *r))
    return dense(jnp.asarray(u), *r)

  return tree_map(f, tree, *rest)


def tree_leaves(tree: Any) -> list[Any]:
  """Leaves of ``tree``, with SparseRows kept whole and None dropped."""
  return [
    x for x in jax.tree.leaves(tree, is_leaf=is_update_leaf) if x is not None
  ]


def broadcast_prefix(prefix: Any, tree: Any) -> Any:
  """A tree like ``tree`` with each leaf of ``prefix`` (a pytree prefix of
  it, None a leaf) repeated over its subtree; None leaves of ``tree`` stay
  None. Raises ``ValueError`` when ``prefix`` is not a prefix of ``tree``
  (callers say which argument it was)."""
  try:
    return jax.tree.map(
      lambda x, sub: tree_map(lambda p: None if p is None else x, sub),
      prefix,
      tree,
      is_leaf=lambda x: x is None,
    )
  except (ValueError, TypeError) as e:
    raise ValueError(str(e)) from e


def zero_counter() -> jax.Array:
  """A fresh int32 scalar counter (a new buffer each call)."""
  return jnp.zeros([], jnp.int32)


def check_tree_match(
  tree: Any, reference: Any, *, name: str, reference_name: str
) -> None:
  """Raises a ValueError naming both arguments when the structures differ.

  SparseRows in ``tree`` count as leaves, so a SparseRows update at an array
  parameter's position matches.
  """
  got = jax.tree.structure(tree, is_leaf=is_update_leaf)
  want = jax.tree.structure(reference, is_leaf=is_update_leaf)
  try:
    jax.tree.map(lambda *_: None, tree, reference, is_leaf=is_update_leaf)
  except (ValueError, TypeError) as e:
    raise ValueError(
      f"`{name}` does not have the tree structure of `{reference_name}`: "
      f"got {got}, expected {want}. Pass a `{name}` with the same "
      f"nesting and keys as `{reference_name}`."
    ) from e


def stateless(
  update_fn: Callable[..., Any],
) -> optax.GradientTransformationExtraArgs:
  """A transformation with an empty state around ``update_fn``."""

  def init_fn(params):
    del params
    return optax.EmptyState()

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
