"""Table stacks: the tables of one width and dtype stored as one array.

:class:`TableStack` keeps its tables by its plan (``_plan``'s
:class:`gradtx.StackPlan`, made once and in the open: FBGEMM's
table-batched embeddings, SparseCore's table stacking): every table of one
row width and dtype is a slice of rows of one array, and
:meth:`TableStack.lookup` reads all the features of a stack with one
gather and pools them with one segment sum. The stack is an ordinary
array leaf of the params, read only as whole rows, so
:func:`gradtx.sparse_value_and_grad` gives it one SparseRows gradient, and
every gradtx optimizer updates it with one deduplication, one rule call and
one scatter per state kind, whatever the number of features. Features
arrive as a dict, or keyed in one array (:class:`gradtx.Keyed`,
:class:`gradtx.KeyedJagged`) that the lookup reads with no op per feature;
their forms are ``_inputs``'. The class is the facade: each method checks
its arguments and calls one module below it, the data going down once:
the plan (``_plan``: params, which features read which arrays), the
admission of new ids (``_admission``), the pooled read (``_pooled``'s
``read_features``) and the id map (``_vocab``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from typing import Any

import jax
from jax.typing import ArrayLike

from gradtx import _vocab
from gradtx._admission import admit_ids, new_id_bounds
from gradtx._fresh_rows import FreshRows
from gradtx._inputs import Keyed, KeyedJagged, run_program
from gradtx._plan import (
  StackPlan,
  StackSpec,
  TableSpec,
  arrays_read,
  feature_combiners,
  init_params,
  plan_stacks,
  stack_params,
  unstack_params,
)
from gradtx._pooled import read_features
from gradtx._vocab import VocabState

__all__ = ["TableStack"]

# lookup's `output`: a dict of features, one array, a gtx.Keyed
OUTPUTS = ("dict", "concat", "keyed")


def _output(output: Any, concat: Any, keyed: Any) -> str:
  """``lookup``'s ``output``, from the deprecated ``concat`` / ``keyed``
  booleans where given (with a DeprecationWarning naming the new
  spelling)."""
  if concat is not None or keyed is not None:
    if concat and keyed:
      raise ValueError(
        "gradtx.TableStack.lookup: pass `output='concat'` (one [B, sum of "
        "dims] array) or `output='keyed'` (a gradtx.Keyed [B, F, dim])."
      )
    new = "concat" if concat else "keyed" if keyed else "dict"
    if output != "dict" and output != new:
      raise ValueError(
        f"gradtx.TableStack.lookup: `output={output!r}` and the deprecated "
        f"`concat={concat}` / `keyed={keyed}` disagree; pass `output` alone."
      )
    old = ", ".join(
      f"{k}={v}"
      for k, v in (("concat", concat), ("keyed", keyed))
      if v is not None
    )
    warnings.warn(
      f"gradtx.TableStack.lookup `{old}` is deprecated: pass `output={new!r}`.",
      DeprecationWarning,
      stacklevel=3,
    )
    output = new
  if output not in OUTPUTS:
    raise ValueError(
      f"gradtx.TableStack.lookup `output` must be one of {OUTPUTS}; got "
      f"{output!r}."
    )
  return output


class TableStack:
  """Embedding tables stored by width and dtype, looked up in one pass.

  Tables of one ``dim`` and ``dtype`` are stacked into one array (a table's
  rows follow the previous table's); ``features`` name which table each
  input feature reads, so several features may share a table (a user's
  history of items reads the item table). With ``batch_size``, the tables
  a step would read at least 4 times per row (a 3-row table at batch 2048)
  form a dense stack of their width and dtype (``"<dtype>x<dim>_dense"``),
  whose gradient is one summed row per table row (see
  :func:`gradtx.sparse_value_and_grad`), smaller than a row per read; a
  hashed table is never in it (its id map works on a sparse stack's rows).
  A table that no feature reads stays an array of its own, outside the
  stacks. Many tables of one width are a few arrays, so the step's program
  does not grow with the number of tables. ``print(stack)`` shows the
  plan.

  The params are a dict of plain arrays: one ``[rows, dim]`` array per stack
  (named ``"<dtype>x<dim>"``, ``"<dtype>x<dim>_lane<k>"``,
  ``"<dtype>x<dim>_dense"``) and one per table kept outside, so any model
  library holds them, and :meth:`unstack` / :meth:`stack` convert to and
  from one array per table (export, serving, per-table checkpoints).

  Args:
    tables: table name -> :class:`TableSpec`.
    features: feature name -> table name; default, one feature per table
      under the table's name.
    batch_size: the examples per step, if known: tables read at least 4
      times per row at this batch (one id per example and feature) form
      the dense stack of their width and dtype.
    shards: the devices each stack's rows are split over (a row-sharded
      stack): every table's rows are spread evenly over them.
    lanes: the most stacks the tables of one width and dtype are spread over
      (``"<dtype>x<dim>"``, then ``"<dtype>x<dim>_lane1"``, ...), balanced by
      the features that read them. Each stack is one chain of gather, update
      and scatter; independent chains can run on different cores of a CPU, one
      chain cannot; a GPU or TPU runs them one after the other. None (the
      default): two where ``batch_size`` is at least 2048, one otherwise:
      without ``batch_size``, for a smaller batch, for a row-sharded stack.
      The rule reads the plan's arguments, never the host, so the params keys
      are the same on every host, and the batch, not the number of features,
      so the program keeps its shape as features are added. ``print(stack)``
      shows the choice and what each platform runs; pass ``lanes=1`` for one
      stack.

  Attributes:
    plan: the :class:`gradtx.StackPlan`: the tables, features, stacks and
      the tables outside, printed by ``print(stack)``.
    stacks: the plan's stacks, params key -> :class:`gradtx.StackSpec`.
    tables, features, outside: the plan's.

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
    lanes: int | None = None,
  ):
    self.plan: StackPlan = plan_stacks(
      tables, features, batch_size=batch_size, shards=shards, lanes=lanes
    )
    plan = self.plan
    self.tables: dict[str, TableSpec] = plan.tables
    self.features: dict[str, str] = plan.features
    self.batch_size = plan.batch_size
    self.shards = plan.shards
    self.lanes = plan.lanes
    self.stacks: dict[str, StackSpec] = plan.stacks
    self.outside: dict[str, str] = plan.outside  # table -> why
    self.maps: dict[str, _vocab.Layout] = plan.maps

  # -- the plan -------------------------------------------------------------
  def location(self, table: str) -> tuple[str, int]:
    """``(params key, first row)`` of ``table``: a stack's name and the
    table's offset in it, or the table's own name and 0 outside."""
    return self.plan.location(table)

  def __repr__(self) -> str:
    return repr(self.plan)

  __str__ = __repr__

  def _programs(self) -> dict[Any, Any]:
    """This stack's compiled programs, by method and options: a method
    called outside any trace runs as one of them instead of op by op."""
    return self.__dict__.setdefault("_compiled", {})

  def __getstate__(self) -> dict[str, Any]:
    # a pickled or copied stack (a Ray worker's, say) compiles its own
    state = dict(self.__dict__)
    state.pop("_compiled", None)
    return state

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
    programs = self._programs()  # one jitted init a stack: traced once
    if ("init",) not in programs:
      programs[("init",)] = jax.jit(functools.partial(init_params, self.plan))
    return programs[("init",)](key)

  def stack(self, per_table: Mapping[str, ArrayLike]) -> dict[str, jax.Array]:
    """Params from one array per table (a per-table model or checkpoint)."""
    return stack_params(self.plan, per_table)

  def unstack(self, params: Mapping[str, Any]) -> dict[str, Any]:
    """One ``[rows, dim]`` array per table, from the params (or from a tree
    shaped like them: optimizer moments, a dense gradient)."""
    return unstack_params(self.plan, params)

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
    max_new: int | Mapping[str, int] | None = None,
    max_new_fraction: float | Mapping[str, float] | None = None,
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

    Called outside ``jax.jit`` (in a notebook, say), it runs as one
    program, compiled once per stack, argument shapes and bounds.

    Args:
      vocab: the maps (:meth:`init_vocab`).
      ids: feature name -> ids, as :meth:`lookup` takes them, or a
        :class:`gradtx.Keyed` / :class:`gradtx.KeyedJagged` of them (read
        feature by feature, returned as the dict of its features); a
        hashed table's features take raw ids: int32, uint32, int64 or
        uint64 (numpy ones split on the host when ``jax_enable_x64`` is
        off; inside a jitted step pass :meth:`gradtx.Words.of` of them,
        a keyed input's whole array) or :class:`gradtx.Words`. Every
        value of an unsigned type or of Words is an id; a negative one of
        a signed type is padding.
      weights: per-id weights of ``[B, L]`` features (0: padding).
      max_new: the most new ids each hashed table places in one step, as
        a count: an int for every table, or a dict table name -> int for
        the tables it names. A table's first new ids in order compete for
        its rows; the others read zeros for this step (counted in
        ``rejected``) and are placed when read again. No table's new ids
        take another's share. Its work (the placement, the fresh rows'
        values and :func:`reset_rows`) follows the sum of the bounds, not
        the ids: raise a table's bound when its ``rejected`` stays high
        while it has room (``starved``).
      max_new_fraction: the bound as a fraction in ``(0, 1]`` of the
        table's own id slots in ``ids`` (at least 64, or all of them when
        there are fewer): a float for every table, or a dict table name
        -> float. A table bounded by neither argument takes
        ``0.125``; a table may not be bounded by both. (A float
        ``max_new`` is the deprecated spelling of ``max_new_fraction``.)

    Returns:
      ``(ids, vocab, fresh)``: the features' ids as rows for :meth:`lookup`
      (other features unchanged), the new maps, and stack name ->
      :class:`gradtx.FreshRows` (the rows given out and their new values).
    """
    _vocab.check_vocab(vocab, self.maps, "admit")
    bounds = new_id_bounds(self.plan, max_new, max_new_fraction)
    return admit_ids(self.plan, self._programs(), vocab, ids, weights, bounds)

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

  def vocab_stats(self, vocab: Mapping[str, VocabState]) -> dict[str, dict]:
    """What to watch, per hashed table (cheap and jittable): ``live`` rows
    and ``occupancy``, the last step's ``inserted`` new ids, ``evicted``
    live ids and ``rejected`` id reads (no row: padding for that step),
    ``starved`` (the consecutive steps, up to the last, in which the
    table turned reads away while it had free rows and placed no new id),
    ``mean_age`` (steps since the row was given out) and ``mean_count``
    (reads of its id), and the live rows' ``age_buckets``,
    ``idle_buckets`` (steps since last read) and ``count_buckets`` in
    log2 buckets ``0, 1, 2-3, 4-7, ...``. Called outside ``jax.jit``, one
    program compiled once per stack."""
    _vocab.check_vocab(vocab, self.maps, "vocab_stats")
    return run_program(
      self._programs(), ("vocab_stats",), self._vocab_stats, vocab
    )

  def _vocab_stats(self, vocab):
    out = {}
    for name, layout in self.maps.items():
      out.update(_vocab.stats(vocab[name], layout))
    return out

  # -- the lookup -----------------------------------------------------------
  def lookup(
    self,
    params: Mapping[str, jax.Array],
    ids: Mapping[str, Any] | Keyed | KeyedJagged,
    *,
    weights: Mapping[str, ArrayLike] | None = None,
    combiner: str | Mapping[str, str] | None = None,
    output: str = "dict",
    vocab: Mapping[str, VocabState] | None = None,
    bounds_check: bool = False,
    concat: bool | None = None,
    keyed: bool | None = None,
  ) -> dict[str, jax.Array] | jax.Array | Keyed:
    """Every feature's pooled rows: one gather and one segment sum a stack.

    Ids per feature, all with the same batch ``B``:

    * ``[B]``: one row per example;
    * ``[B, L]``: a bag of ``L`` ids per example, with optional ``[B, L]``
      ``weights`` (a weight 0 marks padding), pooled by ``combiner``;
    * :class:`Jagged`: flat ids padded to a static capacity, per-example
      lengths and optional weights. Lengths that sum past the capacity
      (the ids that would not fit) or are negative raise a ValueError
      outside ``jax.jit``; inside it a ``checkify`` check counts the ids
      that did not fit, dropped unless the step is wrapped in
      ``checkify.checkify(step, errors=checkify.user_checks)``.

    or every feature at once, keyed by name: a :class:`Keyed` ``[B, F]``
    matrix (or ``[B, F, L]`` bags) or a :class:`KeyedJagged`, read whole
    with no per-feature op, so the program's size does not grow with the
    number of features (a dict adds a few ops per feature).

    An id outside ``[0, rows)`` of its table (negative ones included) is
    padding: it reads nothing and gets no gradient; so is an id of weight
    0. A bag pools by its feature's combiner: ``"sum"`` (weighted sum),
    ``"mean"`` (divided by the sum of its weights, padding excluded) or
    ``"sqrtn"`` (divided by the square root of the sum of its squared
    weights); an empty bag pools to zeros. Features of one stack pooled
    by different combiners still share its one gather and one segment
    sum (the norms are extra columns of it). Called outside ``jax.jit``,
    it runs as one program, compiled once per stack, argument shapes and
    options.

    Args:
      params: the params of :meth:`init` (or any dict with those keys).
      ids: feature name -> ids, every feature of ``features`` that a model
        reads, a subset allowed; or a :class:`Keyed` / :class:`KeyedJagged`
        of such features.
      weights: feature name -> per-id weights of a ``[B, L]`` feature (a
        keyed input carries its own).
      combiner: how each feature pools: None (the default): by its
        table's :class:`gradtx.TableSpec` ``combiner``, ``"sum"`` where
        the table declares none; ``"sum"``, ``"mean"`` or ``"sqrtn"``:
        every feature so; a dict feature name -> combiner: the features it
        names so, the others by their tables'.
      output: what comes back: ``"dict"`` (the default), feature name ->
        ``[B, dim]``; ``"concat"``, one ``[B, sum of dims]`` array, the
        features in :meth:`concat_order`, the stack's declared feature
        order grouped by stack, whatever the order of ``ids``' keys
        (FBGEMM's pooled output): a head that reads all the features at
        once then reads the stack's pooled rows as they are, with no split
        into features and no stacking back; ``"keyed"``, a :class:`Keyed`
        of the pooled rows, ``values`` ``[B, F, dim]`` in
        :meth:`concat_order` (every feature read must have one ``dim``): a
        head that reads each feature with weights of its own reads them
        as one array (``jnp.einsum("bfd,fd->b", out.values, w)``), with no
        op per feature.
      vocab: the id maps (:meth:`init_vocab`): the features of hashed
        tables then take raw ids, read-only (evaluation): a known id reads
        its row, an unknown one zeros, and nothing is inserted or evicted.
        Without it, they take the rows :meth:`admit` returned. (A keyed
        input is then read as its dict, feature by feature.)
      bounds_check: raise a ValueError naming the feature and the id for
        an id read outside its table's rows other than -1 (padding; so
        are ids of weight 0 and jagged slots past the bags), where
        without it such an id reads zeros and gets no gradient (an
        off-by-one or a stale vocabulary in the pipeline trains on
        zeros). Called outside ``jax.jit`` it runs op by op and raises at
        once; under ``jax.jit`` a host callback checks the ids before the
        read and fails the computation (``gradtx.lookup``'s check). Off
        by default: it costs the step a round trip to the host
        (``benchmarks/results/bounds_check.md``).
      concat, keyed: deprecated: ``concat=True`` is ``output="concat"``,
        ``keyed=True`` is ``output="keyed"``.

    Returns:
      feature name -> ``[B, dim]`` rows in the table's dtype; with
      ``output="concat"`` one ``[B, sum of dims]`` array; with
      ``output="keyed"`` a :class:`Keyed`.
    """
    output = _output(output, concat, keyed)
    combiners = feature_combiners(self.plan, combiner)
    return read_features(
      self.plan,
      self._programs(),
      params,
      ids,
      weights,
      combiners,
      output,
      vocab,
      bounds_check,
    )

  def concat_order(self, ids: Any) -> list[str]:
    """The features of ``lookup(..., output="concat")``'s array (and of
    ``output="keyed"``'s ``Keyed``), in order:
    grouped by stack (in the order of ``stacks``, then the tables outside),
    each group in the order of the stack's ``features``. The order depends
    only on which features ``ids`` holds, not on the order of its keys, so
    it is the same eagerly and under ``jax.jit`` (which sorts a dict's
    keys)."""
    return [f for _, feats in arrays_read(self.plan, ids) for f in feats]
