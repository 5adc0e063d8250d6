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
their forms and the pooled read are ``_pooled``'s.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from gradtx import _vocab
from gradtx._fresh_rows import FreshRows
from gradtx._inputs import (
  Keyed,
  KeyedJagged,
  host_ready,
  keyed_batch,
  outside_traces,
  plain_features,
)
from gradtx._plan import (
  COMBINERS,
  StackPlan,
  StackSpec,
  TableSpec,
  default_tables,
  plan_stacks,
)
from gradtx._pooled import (
  dict_reader,
  keyed_reader,
  pool_rows,
  raw_slots,
  split_features,
)
from gradtx._sharded import is_split, split_like, unsplit
from gradtx._static import is_int
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

  def _program(self, key: Any, fn: Callable[..., Any]) -> Any:
    """``jax.jit(fn)``, made once per ``key`` for this stack: a method
    called outside any trace runs as one compiled program instead of op by
    op (eagerly, the id map's placement loop compiled again on every
    call)."""
    programs = self.__dict__.setdefault("_programs", {})
    if key not in programs:
      programs[key] = jax.jit(fn)
    return programs[key]

  def __getstate__(self) -> dict[str, Any]:
    # a pickled or copied stack (a Ray worker's, say) compiles its own
    state = dict(self.__dict__)
    state.pop("_programs", None)
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
      rows = default_tables(key, index, sizes, dim, dtype)
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
    bounds = self._new_id_bounds(max_new, max_new_fraction)
    raw = self._hashed_features()
    # the program takes a dict's hashed features alone: the others come
    # back as they were given
    keyed = isinstance(ids, (Keyed, KeyedJagged))
    given, given_weights = host_ready(
      ids if keyed else {f: x for f, x in ids.items() if f in raw},
      {f: w for f, w in (weights or {}).items() if f in raw},
      raw,
      "admit",
    )
    if outside_traces(vocab, given, given_weights):
      run = self._program(
        ("admit", bounds), lambda v, i, w: self._admit(v, i, w, bounds)
      )
      out, vocab, fresh = run(vocab, given, given_weights)
      return (out if keyed else {**ids, **out}), vocab, fresh
    if not keyed:  # the others come back as they were given
      given = {**ids, **given}
      given_weights = {**(weights or {}), **given_weights}
    return self._admit(vocab, given, given_weights, bounds)

  def _hashed_features(self) -> list[str]:
    hashed = {t for layout in self.maps.values() for t in layout.tables}
    return [f for f, t in self.features.items() if t in hashed]

  def _admit(self, vocab, ids, weights, bounds):
    if isinstance(ids, (Keyed, KeyedJagged)):  # read feature by feature
      if isinstance(ids, Keyed) and ids.weights is not None:
        weights = {f: ids.weights[:, k] for k, f in enumerate(ids.names)}
      ids = plain_features(ids, self._hashed_features())
    out = dict(ids)
    new_vocab, fresh = dict(vocab), {}
    for name, layout in self.maps.items():
      slots = raw_slots(layout, self.features, ids, weights, "admit")
      if slots is None:
        continue
      counts, fractions = map(dict, bounds)
      # an int a count, a float a fraction (_new_id_bounds made them so)
      bound = _vocab.budgets(layout, slots.tab, {**fractions, **counts})
      rows, new_vocab[name], fresh[name] = _vocab.admit(
        vocab[name], layout, slots.hi, slots.lo, slots.tab, slots.valid, bound
      )
      out.update(slots.rebuild(rows))
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

  def _new_id_bounds(
    self, max_new: Any, fraction: Any
  ) -> tuple[tuple[tuple[str, Any], ...], ...]:
    """``admit``'s bounds of new ids, checked: ``(counts, fractions)``,
    each ``((table, bound), ...)`` (hashable: a program's key), a table
    in neither at the default fraction. A float ``max_new`` (or a dict's
    float) is a fraction, deprecated."""
    hashed = [t for layout in self.maps.values() for t in layout.tables]
    where = "gradtx.TableStack.admit"

    def per_table(v: Any, arg: str) -> dict[str, Any]:
      if v is None:
        return {}
      if not isinstance(v, Mapping):
        return dict.fromkeys(hashed, v)
      unknown = [t for t in v if t not in hashed]
      if unknown:
        raise ValueError(
          f"{where} `{arg}` names {unknown}, which are not hashed tables; "
          f"the hashed tables are {hashed}."
        )
      return dict(v)

    counts = per_table(max_new, "max_new")
    fractions = per_table(fraction, "max_new_fraction")
    # the deprecated spelling: a float max_new is a fraction
    old = {
      t: counts.pop(t) for t in list(counts) if isinstance(counts[t], float)
    }
    bad = {
      t: v
      for t, v in {**old, **fractions}.items()
      if isinstance(v, bool)
      or not isinstance(v, (int, float))
      or not 0 < v <= 1
    }
    if bad:
      raise ValueError(
        f"{where} `max_new_fraction` must be a float in (0, 1] (a fraction "
        "of the table's id slots), or a dict table name -> float; got "
        f"{bad!r}."
      )
    bad = {t: v for t, v in counts.items() if not (is_int(v) and v >= 1)}
    if bad:
      raise ValueError(
        f"{where} `max_new` must be an int >= 1 (a count of new ids), or a "
        f"dict table name -> int; got {bad!r}. For a fraction of the "
        "table's id slots pass `max_new_fraction`."
      )
    both = [t for t in hashed if t in fractions and (t in counts or t in old)]
    if both:
      raise ValueError(
        f"{where}: tables {both} are bounded by both `max_new` and "
        "`max_new_fraction`; give each table one bound."
      )
    if old:
      new = old if isinstance(max_new, Mapping) else max_new
      warnings.warn(
        f"{where} `max_new={max_new!r}` (a float: a fraction of the id "
        f"slots) is deprecated: pass `max_new_fraction={new!r}`; `max_new` "
        "takes an int count.",
        DeprecationWarning,
        stacklevel=3,
      )
    fractions.update(old)
    return (
      tuple((t, int(counts[t])) for t in hashed if t in counts),
      tuple((t, float(fractions[t])) for t in hashed if t in fractions),
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
    log2 buckets ``0, 1, 2-3, 4-7, ...``. Called outside ``jax.jit``, one
    program compiled once per stack."""
    _vocab.check_vocab(vocab, self.maps, "vocab_stats")
    if outside_traces(vocab):
      return self._program(("vocab_stats",), self._vocab_stats)(vocab)
    return self._vocab_stats(vocab)

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
    raw = [] if vocab is None else self._hashed_features()
    ids, weights = host_ready(ids, weights, raw, "lookup")
    options = (self._combiners(combiner), output)
    # checked op by op outside jit, so that a bad id raises at once
    if not bounds_check and outside_traces(params, ids, weights, vocab):
      run = self._program(
        ("lookup", *options),
        lambda p, i, w, v: self._lookup(p, i, w, *options, v),
      )
      return run(params, ids, weights, vocab)
    return self._lookup(params, ids, weights, *options, vocab, bounds_check)

  def _lookup(
    self, params, ids, weights, combiners, output, vocab, check=False
  ):
    self._check_params(params, "lookup")
    combiners = dict(combiners)
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
      if whole:
        ids, whole = plain_features(ids, self._hashed_features()), False
      else:
        ids = dict(ids)  # rows replace raw ids below: not in the caller's
      for name, layout in self.maps.items():
        slots = raw_slots(layout, self.features, ids, weights, "lookup")
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
      batch = keyed_batch(ids, self._hashed_features())
      read = keyed_reader(ids)
    else:
      batch, read = dict_reader(
        ids, weights, [f for f in self.features if f in set(names)]
      )
    out, parts = {}, []
    for where, feats in self._by_array(names):
      s = self.stacks.get(where)
      tables = [self.features[f] for f in feats]
      pooled = pool_rows(
        params[where],
        read(feats),
        batch,
        [0] if s is None else [s.offsets[s.tables.index(t)] for t in tables],
        [self.tables[t].rows for t in tables],
        s,
        [combiners[f] for f in feats],
        feats if check else None,
      )
      if split is not None:
        pooled = split_like(pooled, split)
      if output == "concat":
        parts.append(pooled.reshape(pooled.shape[0], -1))
      elif output == "keyed":
        parts.append(pooled)
      else:
        out.update(split_features(pooled, feats))
    if output == "keyed":
      dims = {p.shape[-1] for p in parts}
      if len(dims) > 1:
        raise ValueError(
          "gradtx.TableStack.lookup `output='keyed'` needs features of one "
          f"width; these have widths {sorted(dims)}. Pass "
          "`output='concat'` (one [B, sum of dims] array) or read the dict."
        )
      values = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
      return Keyed(self.concat_order(names), values)
    if output == "concat":
      return jnp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    return {f: out[f] for f in names}

  def _combiners(self, combiner: Any) -> tuple[tuple[str, str], ...]:
    """Each feature's combiner (``lookup``'s ``combiner`` over its
    table's), checked: ``((feature, combiner), ...)``, hashable (a
    program's key)."""
    given = combiner if isinstance(combiner, Mapping) else {}
    unknown = [f for f in given if f not in self.features]
    if unknown:
      raise ValueError(
        f"gradtx.TableStack.lookup `combiner` names unknown features "
        f"{unknown}; the features are {list(self.features)}."
      )
    every = None if isinstance(combiner, Mapping) else combiner
    out = []
    for f, t in self.features.items():
      c = given.get(f, every) or self.tables[t].combiner or "sum"
      if c not in COMBINERS:
        raise ValueError(
          f"gradtx.TableStack.lookup `combiner` must be one of {COMBINERS}, "
          f"or a dict feature name -> one of them; got {c!r}"
          + (f" for feature {f!r}." if f in given else ".")
        )
      out.append((f, c))
    return tuple(out)

  def _by_array(self, features: Any) -> list[tuple[str, list[str]]]:
    """``(params key, features)`` per array read: the stacks in order, then
    each table outside; features in the order of ``features`` declared to
    the stack (never the order given: ``jax.jit`` sorts a dict's keys)."""
    given = set(features)
    declared = [f for f in self.features if f in given]
    by_array = []
    for name, s in self.stacks.items():
      feats = [f for f in declared if self.features[f] in s.tables]
      if feats:
        by_array.append((name, feats))
    for t in self.outside:
      feats = [f for f in declared if self.features[f] == t]
      if feats:
        by_array.append((t, feats))
    return by_array

  def concat_order(self, ids: Any) -> list[str]:
    """The features of ``lookup(..., output="concat")``'s array (and of
    ``output="keyed"``'s ``Keyed``), in order:
    grouped by stack (in the order of ``stacks``, then the tables outside),
    each group in the order of the stack's ``features``. The order depends
    only on which features ``ids`` holds, not on the order of its keys, so
    it is the same eagerly and under ``jax.jit`` (which sorts a dict's
    keys)."""
    return [f for _, feats in self._by_array(ids) for f in feats]
