"""Row-sparse gradients of unmodified losses: ``sparse_value_and_grad``,
``sparse_grad``, ``sparsity_report``, ``sparse_labels`` (the explicit read,
``lookup``, is ``_lookup``'s).

The jaxpr reading lives in :mod:`gradtx._jaxpr`; this module routes each
leaf's gradient (which leaves come out sparse: ``_Route``), checks what
the user required, and differentiates the rewritten loss. Flax nnx
modules are taken as ``nnx.value_and_grad`` takes them (their
``nnx.Param`` state, or an ``nnx.DiffState``'s, differentiated; the rest
written back), through flax's public API, looked up only when the caller
imported it.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradtx import _jaxpr
from gradtx._jax_compat import varying_axes
from gradtx._lookup import DENSE_READS_PER_ROW
from gradtx._memory import format_bytes
from gradtx._rowio import dense_sums
from gradtx._sparse_rows import SparseRows
from gradtx._update_trees import map_updates

# Leaves named by path (``jax.tree_util.keystr``; nnx's ``.value`` optional),
# several paths, or a predicate on the path: ``require_sparse`` and ``dense``.
PathSelector = str | Sequence[str] | Callable[[str], bool] | None

# The differentiated positional arguments: an int, an ``nnx.DiffState`` (a
# module's variables by filter), or a sequence of them; Any, as gradtx does
# not import flax.
Argnums = int | Sequence[int] | Any

# ----------------------------------------------------------------------------
# sparse_value_and_grad


class LeafSparsity(NamedTuple):
  """How :func:`sparse_value_and_grad` treats one differentiated leaf."""

  path: str  # jax.tree_util.keystr of the leaf in the differentiated args
  shape: tuple[int, ...]
  dtype: str
  sparse: bool  # the gradient is a SparseRows
  rows_per_step: int  # ids read per call: the SparseRows length (0: dense)
  reason: str  # why dense, or why a SparseRows holds every row ("" if not)
  where: str  # file:line of the use that kept it dense ("" if none)
  reads: int = 0  # whole-row reads per call, also where it stays dense
  frozen: bool = False  # read only through stop_gradient: no gradient
  every_row: bool = False  # a SparseRows of every row, each summed once

  @property
  def is_table(self) -> bool:
    """Read as whole rows somewhere (or frozen): an embedding table."""
    return self.reads > 0 or self.frozen


class SparsityReport(tuple):
  """Per-leaf :class:`LeafSparsity` records, in tree-flattening order.

  ``str(report)`` is a summary people can scan: the tables found (leaves
  read as whole rows), which came out sparse with their rows per step and
  the gradient bytes saved, which stayed dense and why (with the source
  line), and a count of the other leaves. :meth:`details` is the full
  per-leaf table.
  """

  @property
  def sparse_paths(self) -> tuple[str, ...]:
    """Paths of the leaves that get a SparseRows gradient."""
    return tuple(r.path for r in self if r.sparse)

  @property
  def tables(self) -> tuple[LeafSparsity, ...]:
    """The records of the leaves read as whole rows (or frozen)."""
    return tuple(r for r in self if r.is_table)

  def summary(self) -> str:
    """The tables, their verdicts and the bytes saved, one line each."""
    tables = self.tables
    lines = []
    sparse = [r for r in tables if r.sparse and not r.frozen]
    saved = 0.0
    for r in (r for r in sparse if not r.every_row):
      item = np.dtype(r.dtype).itemsize
      row = int(np.prod(r.shape[1:])) * item
      dense_bytes = r.shape[0] * row
      sparse_bytes = r.rows_per_step * (row + 4)
      saved += dense_bytes - sparse_bytes
    lines.append(
      f"{len(tables)} table(s): {len(sparse)} sparse, "
      f"{sum(not r.sparse for r in tables)} dense, "
      f"{sum(r.frozen for r in tables)} frozen; gradient bytes saved per "
      f"step: {format_bytes(saved)}"
    )
    names = [(r.path or "(array)", f"{r.dtype}{list(r.shape)}") for r in tables]
    wide = [max((len(n[k]) for n in names), default=0) for k in (0, 1)]
    for r, (path, shape) in zip(tables, names, strict=True):
      if r.frozen:
        verdict = "frozen (stop_gradient): no gradient, no update"
      elif r.every_row:
        verdict = f"sparse, every row: {r.reason}"
      elif r.sparse:
        verdict = f"sparse, {r.rows_per_step:,} rows per step"
      else:
        at = f" ({r.where})" if r.where else ""
        verdict = f"dense: {r.reason}{at}"
      lines.append(
        f"  {path.ljust(wide[0])}  {shape.ljust(wide[1])}  {verdict}"
      )
    others = len(self) - len(tables)
    if others:
      lines.append(
        f"{others} other leaf(s) (weights, biases: not read as rows) keep "
        "their dense gradient; report.details() lists every leaf"
      )
    return "\n".join(lines)

  def details(self) -> str:
    """Every leaf: path, shape, gradient kind, rows per step and why a leaf
    stays dense, with the source line of the use that decided it."""
    head = ("leaf", "shape", "gradient", "rows/step", "why dense")
    rows = [head] + [
      (
        r.path,
        f"{r.dtype}{list(r.shape)}",
        "frozen" if r.frozen else "sparse" if r.sparse else "dense",
        str(r.rows_per_step) if r.sparse else "",
        r.reason + (f" ({r.where})" if r.where else ""),
      )
      for r in self
    ]
    widths = [max(len(row[k]) for row in rows) for k in range(4)]
    return "\n".join(
      (
        "  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True))
        + "  "
        + row[4]
      ).rstrip()
      for row in rows
    )

  def __str__(self) -> str:
    return self.summary()

  def __repr__(self) -> str:
    return f"SparsityReport({list(self)!r})"


class _Route(NamedTuple):
  """Where each differentiated leaf's gradient goes (a SparseRows or
  dense): the traced loss, the jaxpr reader's analysis of it and the
  per-leaf report."""

  leaves: list[Any]
  treedef: Any
  closed: Any
  out_tree: Any
  analysis: Any
  uses: list[Any]  # a _jaxpr.TableUse per leaf (None: not a candidate)
  report: SparsityReport


# Errors of Python that needs concrete values inside the loss: jax runs it
# eagerly, gradtx must trace it.
_NEEDS_CONCRETE = (
  jax.errors.ConcretizationTypeError,
  jax.errors.TracerArrayConversionError,
  jax.errors.TracerBoolConversionError,
  jax.errors.TracerIntegerConversionError,
  jax.errors.NonConcreteBooleanIndexError,
)


def _is_diff_state(a: Any) -> bool:
  nnx = sys.modules.get("flax.nnx")
  return nnx is not None and isinstance(a, nnx.DiffState)


def _normalize_argnums(argnums: Any) -> tuple[tuple[Any, ...], bool]:
  """``argnums`` as a tuple of ints and ``nnx.DiffState``s, and whether it
  was one (the gradients are then not a tuple)."""
  if isinstance(argnums, int) or _is_diff_state(argnums):
    return (argnums,), True
  argnums = tuple(argnums)
  if not argnums or not all(
    isinstance(a, int) or _is_diff_state(a) for a in argnums
  ):
    raise TypeError(
      f"`argnums` must be an int or a non-empty tuple of ints (an "
      f"nnx.DiffState in place of an int for an nnx module); got {argnums}."
    )
  return argnums, False


def _check_argnums(argnums: tuple[int, ...], single: bool, nargs: int) -> None:
  for a in argnums:
    if a >= nargs or a < -nargs:
      raise ValueError(
        f"`argnums` {argnums[0] if single else argnums} out of range for "
        f"{nargs} positional arguments."
      )
  if len({a % nargs for a in argnums}) != len(argnums):
    raise TypeError(  # jax.value_and_grad fails on it too (a TypeError)
      f"`argnums` {argnums} names the same argument twice; differentiate "
      "each argument once."
    )


def _leaf_record(
  path: str, aval: Any, use: Any, force_dense: bool, force_sparse: bool
) -> LeafSparsity:
  shape, dtype = tuple(aval.shape), str(aval.dtype)
  if use is None:
    why = (
      "not a floating-point array"
      if not jnp.issubdtype(aval.dtype, jnp.floating)
      else "a scalar (no rows)"
    )
    return LeafSparsity(path, shape, dtype, False, 0, why, "")
  reads = sum(int(np.prod(r.ids_shape)) for r in use.reads)
  if use.dense is not None:
    d = use.dense
    return LeafSparsity(path, shape, dtype, False, 0, d.what, d.where, reads)
  if not use.reads:
    if use.frozen:  # no gradient at all: an empty SparseRows, no update
      return LeafSparsity(path, shape, dtype, True, 0, "", "", 0, True)
    why = "not used by the loss (zero gradient)"
    return LeafSparsity(path, shape, dtype, False, 0, why, "")
  if force_dense:
    why = "asked for dense (`dense=`)"
    return LeafSparsity(path, shape, dtype, False, 0, why, "", reads)
  if not force_sparse and reads >= DENSE_READS_PER_ROW * shape[0]:
    why = (
      f"{shape[0]:,} rows, {reads:,} reads per step: one summed row per "
      "table row is cheaper than a row per read"
    )
    return LeafSparsity(
      path, shape, dtype, True, shape[0], why, "", reads, every_row=True
    )
  return LeafSparsity(path, shape, dtype, True, reads, "", "", reads)


def _strip_value(path: str) -> str:
  # nnx variables flatten to a `.value` leaf: both spellings name it.
  return path[: -len(".value")] if path.endswith(".value") else path


def _selected(spec: Any, paths: Sequence[str], arg: str) -> set[str]:
  """The paths a ``require_sparse`` / ``dense`` argument names: a path
  (with or without nnx's ``.value``), a sequence of them, or a predicate."""
  if spec is None:
    return set()
  if callable(spec):
    return {p for p in paths if spec(p) or spec(_strip_value(p))}
  names = [spec] if isinstance(spec, str) else list(spec)
  by_name = {}
  for p in paths:
    by_name[p] = p
    by_name.setdefault(_strip_value(p), p)
  unknown = [n for n in names if n not in by_name]
  if unknown:
    raise ValueError(
      f"`{arg}` names {unknown}, which are not differentiated leaves. The "
      f"leaves are {list(paths)} (jax.tree_util.keystr paths)."
    )
  return {by_name[n] for n in names}


# ----------------------------------------------------------------------------
# nnx modules


class _Call(NamedTuple):
  """One call of the loss as the rewrite sees it: ``fun(*args, **kwargs)``
  differentiated with respect to the positional ``args`` at ``argnums``."""

  fun: Callable[..., Any]
  args: tuple[Any, ...]
  kwargs: dict[str, Any]
  argnums: tuple[int, ...]
  single: bool
  has_aux: bool
  # a leaf's path from its keys: keystr, or an nnx module's attribute form
  spell: Callable[[tuple[Any, ...]], str] = jax.tree_util.keystr
  # the nnx objects among the arguments (None: none), whose state other
  # than the differentiated variables the loss's aux carries back
  nodes: tuple[Any, ...] | None = None


def attribute_path(keys: tuple[Any, ...]) -> str:
  """The path of a leaf of an ``nnx.State`` as the module spells it:
  ``.embed.embedding.value`` for ``['embed']['embedding'].value``."""
  return jax.tree_util.keystr(
    tuple(
      jax.tree_util.GetAttrKey(k.key)
      if isinstance(k, jax.tree_util.DictKey)
      and isinstance(k.key, str)
      and k.key.isidentifier()
      else k
      for k in keys
    )
  )


def _prepare(
  fun: Callable[..., Any],
  argnums: tuple[Any, ...],
  single: bool,
  has_aux: bool,
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
) -> _Call:
  """The call to rewrite. Plain arguments pass as they are. nnx objects
  (modules, ``nnx.Rngs``) are handled as ``nnx.value_and_grad`` handles
  them: a differentiated module stands for its ``nnx.Param`` state (or the
  variables of an ``nnx.DiffState``'s filter), and every other variable of
  every nnx argument (Dropout's RNG counts, BatchNorm's statistics) is
  merged back in a copy the loss may update, whose new values the aux
  carries out to be written back (:func:`_finish`)."""
  positions = tuple(a.argnum if _is_diff_state(a) else a for a in argnums)
  _check_argnums(positions, single, len(args))
  positions = tuple(a % len(args) for a in positions)
  # Whoever passed nnx objects imported flax: look it up, never import it.
  nnx = sys.modules.get("flax.nnx")
  keys: list[int | str] = []
  if nnx is not None:
    keys = [i for i, a in enumerate(args) if isinstance(a, nnx.Pytree)]
    keys += [k for k, v in kwargs.items() if isinstance(v, nnx.Pytree)]
  filters = {}
  for a, i in zip(argnums, positions, strict=True):
    if i in keys:
      # as nnx.value_and_grad: an int differentiates the nnx.Param state
      filters[i] = a.filter if _is_diff_state(a) else nnx.Param
    elif _is_diff_state(a):
      raise TypeError(
        f"`argnums` nnx.DiffState({a.argnum}, ...) names positional "
        f"argument {a.argnum}, a {type(args[i]).__name__}: an "
        "nnx.DiffState selects variables of an nnx module. Pass the "
        "module there, or give an int for an argument that is a pytree "
        "(an nnx.State included)."
      )
  plain = _Call(fun, args, kwargs, positions, single, has_aux)
  if not keys:
    return plain
  node_of = {key: n for n, key in enumerate(keys)}
  predicates = {
    node_of[i]: nnx.filterlib.to_predicate(f) for i, f in filters.items()
  }

  def differentiated(path, variable):
    is_diff = predicates.get(path[0])
    return is_diff is not None and is_diff(path[1:], variable)

  nodes = tuple(args[k] if isinstance(k, int) else kwargs[k] for k in keys)
  graphdef, diff, rest = nnx.split(nodes, differentiated, ...)
  states = list(args)
  for i in filters:
    n = node_of[i]
    states[i] = diff[n] if n in diff else nnx.State({})

  def of_states(*args_, **kwargs_):
    joint = nnx.State({node_of[i]: args_[i] for i in filters})
    # A copy: the loss runs under gradtx's trace, and nnx lets a variable
    # change only under the trace that made it.
    merged = nnx.merge(graphdef, joint, rest, copy=True)
    args_, kwargs_ = list(args_), dict(kwargs_)
    for key, node in zip(keys, merged, strict=True):
      if isinstance(key, int):
        args_[key] = node
      else:
        kwargs_[key] = node
    out = fun(*args_, **kwargs_)
    value, aux = out if has_aux else (out, None)
    # Only the state that is not differentiated: a table in the aux would
    # be a use of the table other than its row reads (a dense gradient).
    return value, (aux, nnx.split(merged, differentiated, ...)[2])

  modules = [i in filters for i in positions]  # per differentiated argument

  def spell(path):
    module = modules[0] if single else modules[path[0].idx]
    return attribute_path(path) if module else jax.tree_util.keystr(path)

  return plain._replace(
    fun=of_states, args=tuple(states), has_aux=True, spell=spell, nodes=nodes
  )


def _finish(call: _Call, has_aux: bool, out: Any) -> Any:
  """``fun``'s output from the rewritten call's: for nnx arguments, their
  updated state written back to them and the user's aux (if any)."""
  if call.nodes is None:
    return out
  value, (aux, rest) = out
  sys.modules["flax.nnx"].update(call.nodes, rest)
  return (value, aux) if has_aux else value


def _route(call: _Call, dense: Any = None, require: Any = None) -> _Route:
  fun, args, kwargs, argnums = call.fun, call.args, call.kwargs, call.argnums
  single, has_aux = call.single, call.has_aux
  diff = tuple(args[a] for a in argnums)
  leaves, treedef = jax.tree.flatten(diff)
  paths = [
    call.spell(p)
    for p, _ in jax.tree_util.tree_flatten_with_path(
      diff[0] if single else diff
    )[0]
  ]

  def call_fun(new_leaves):
    new_args = list(args)
    new_diff = jax.tree.unflatten(treedef, new_leaves)
    for a, d in zip(argnums, new_diff, strict=True):
      new_args[a] = d
    out = fun(*new_args, **kwargs)
    return out if has_aux else (out, None)

  closed, out_tree = _jaxpr.trace(call_fun, leaves)
  avals = _jaxpr.input_avals(closed)
  candidates = [
    jnp.issubdtype(a.dtype, jnp.floating) and len(a.shape) >= 1 for a in avals
  ]
  analysis, uses = _jaxpr.analyze(closed, candidates)
  forced = _selected(dense, paths, "dense")
  required = _selected(require, paths, "require_sparse")
  both = sorted(forced & required)
  if both:
    raise ValueError(
      f"{both} named both in `dense` and in `require_sparse`: name each leaf "
      "in one of them."
    )
  report = SparsityReport(
    _leaf_record(p, a, g, p in forced, p in required)
    for p, a, g in zip(paths, avals, uses, strict=True)
  )
  return _Route(leaves, treedef, closed, out_tree, analysis, uses, report)


def _name(path: str) -> str:
  return f"leaf {path}" if path else "the differentiated array"


def _check_required(require: Any, report: SparsityReport) -> None:
  wanted = _selected(require, [r.path for r in report], "require_sparse")
  for r in report:
    if r.path in wanted and not r.sparse:
      at = f" at {r.where}" if r.where else ""
      raise ValueError(
        f"gradtx.sparse_value_and_grad: `require_sparse` asks for a sparse "
        f"gradient of {_name(r.path)}, but it stays dense: {r.reason}{at}. "
        "Read the table only as whole rows (table[ids], jnp.take, an embedding "
        "layer, gtx.lookup), outside lax.cond and custom_jvp/custom_vjp "
        "functions; see gtx.sparsity_report."
      )


def _warn_unknown(report: SparsityReport, uses: Sequence[Any]) -> None:
  for r, g in zip(report, uses, strict=True):
    if g is not None and g.dense is not None and g.dense.warn:
      at = f" at {r.where}" if r.where else ""
      warnings.warn(
        f"gradtx.sparse_value_and_grad: {_name(r.path)} keeps a dense "
        "gradient: "
        f"{r.reason}{at}.",
        _jaxpr.SparsityWarning,
        stacklevel=4,
      )


def _value_and_grad(call: _Call, dense: Any, require_sparse: Any) -> Any:
  """:func:`sparse_value_and_grad` of one prepared call."""
  fun, args, kwargs, single = call.fun, call.args, call.kwargs, call.single
  argnums, has_aux = call.argnums[0] if single else call.argnums, call.has_aux
  try:
    route = _route(call, dense, require_sparse)
  except _NEEDS_CONCRETE as e:
    # Eager-only Python (a concrete jnp.unique, numpy indexing) cannot be
    # traced; jax.value_and_grad runs it eagerly, and raises as it would.
    out = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)(
      *args, **kwargs
    )
    warnings.warn(
      "gradtx.sparse_value_and_grad: the loss needs concrete values of "
      "arrays it computes (eager-only Python: "
      f"{type(e).__name__}), so gradtx cannot trace it; every gradient "
      "is jax.value_and_grad's dense one. Make the loss traceable "
      "(jit-compatible) to get SparseRows.",
      _jaxpr.SparsityWarning,
      stacklevel=3,
    )
    return out
  _check_required(require_sparse, route.report)
  _warn_unknown(route.report, route.uses)
  leaves = route.leaves
  frozen = [i for i, r in enumerate(route.report) if r.frozen]
  # every table read as whole rows gets a sink, an every_row one too: its
  # rows are summed by _dedup.dense_sums (no atomics on accelerators), not
  # by jax's transpose of the gather (a float scatter-add of every read)
  sparse = [i for i, r in enumerate(route.report) if r.sparse and not r.frozen]
  if not sparse and not frozen:  # nothing to do: exactly jax's gradients
    out, grads = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)(
      *args, **kwargs
    )
    # As below: no table copy when a dense gradient skips the reads.
    return out, _order_after(grads, out[0] if has_aux else out)
  dense_slots = [
    i for i in range(len(leaves)) if i not in sparse and i not in frozen
  ]
  sinks: dict[int, list[jax.Array]] = {}
  made: dict[Any, jax.Array] = {}  # reads of one shape share one sink array
  for s in sparse:
    t = leaves[s]
    sinks[s] = []
    for r in route.uses[s].reads:
      # Under shard_map's type checks the sink must vary over the same
      # mesh axes as the rows it is added to.
      vma = tuple(sorted(r.vma))
      key = (r.ids_shape + tuple(t.shape[1:]), jnp.dtype(t.dtype), vma)
      if key not in made:
        # -0.0: adding it leaves every row as it is, -0.0 rows included
        sink = jnp.full(key[0], -0.0, t.dtype)
        made[key] = lax.pcast(sink, vma, to="varying") if vma else sink
      sinks[s].append(made[key])

  def inner(dense_leaves, sinks_):
    full = list(leaves)
    for i, x in zip(dense_slots, dense_leaves, strict=True):
      full[i] = x
    outs, ids = _jaxpr.evaluate(route.analysis, route.closed, full, sinks_)
    loss, aux = jax.tree.unflatten(route.out_tree, outs)
    return loss, (aux, ids)

  (value, (aux, ids)), (g_dense, g_sinks) = jax.value_and_grad(
    inner, argnums=(0, 1), has_aux=True
  )([leaves[i] for i in dense_slots], sinks)

  out = [None] * len(leaves)
  for i, g in zip(dense_slots, g_dense, strict=True):
    out[i] = g
  for s in sparse:
    t = leaves[s]
    row = tuple(t.shape[1:])
    reads = route.uses[s].reads
    read_ids = [
      _jaxpr.row_ids(r, i, t.shape[0])
      for r, i in zip(reads, ids[s], strict=True)
    ]
    # As jax.grad: under shard_map's type checks the gradient of a
    # replicated table is the sum over the axes its ids vary along, which
    # for rows is the gather of every replica's rows.
    axes = frozenset().union(*(r.vma for r in reads))
    axes = tuple(sorted(axes - varying_axes(t)))
    if route.report[s].every_row and not axes:
      # each read's rows in its own shape: no copy to flatten them
      modes = [_jaxpr.read_mode(r) for r in reads]
      out[s] = _every_row(read_ids, g_sinks[s], t.shape[0], modes)
      continue
    idx = _concat([i.reshape(-1) for i in read_ids])
    vals = _concat([g.reshape((-1,) + row) for g in g_sinks[s]])
    if axes:
      idx = lax.all_gather(idx, axes, tiled=True, to="invarying")
      vals = lax.all_gather(vals, axes, tiled=True, to="invarying")
    out[s] = SparseRows(idx, vals, t.shape[0])
    if route.report[s].every_row:
      out[s] = _every_row([idx], [vals], t.shape[0], ["fill"])
  for f in frozen:  # no gradient: no row for an optimizer to touch
    t = leaves[f]
    out[f] = SparseRows(
      jnp.zeros([0], jnp.int32),
      jnp.zeros((0, *t.shape[1:]), t.dtype),
      t.shape[0],
      unique=True,
      normalized=True,
    )
  grads = jax.tree.unflatten(route.treedef, out)
  grads = grads[0] if single else grads
  # Every forward read of a table before any in-place write of its update:
  # else XLA copies a donated table when the gradient does not read the
  # rows (a loss linear in the table). See _order_after.
  grads = _order_after(grads, value)
  return ((value, aux), grads) if has_aux else (value, grads)


def sparse_value_and_grad(
  fun: Callable[..., Any],
  argnums: Argnums = 0,
  has_aux: bool = False,
  *,
  require_sparse: PathSelector = None,
  dense: PathSelector = None,
) -> Callable[..., Any]:
  """Like ``jax.value_and_grad``, with SparseRows gradients for tables.

  The loss needs no change. Every differentiated leaf whose every use in
  ``fun`` is a whole-row read gets a :class:`SparseRows` gradient: the ids
  of all its reads and, for each id, the gradient of the loss with respect
  to the row it read. Every other leaf gets exactly ``jax.value_and_grad``'s
  dense gradient. No dense ``[num_rows, dim]`` buffer is built: ``fun`` is
  traced to a jaxpr and evaluated again with a zero "sink" added to each
  row read; a sink's cotangent is the gradient of the rows read.

  Whole-row reads, recognised wherever they occur:

  * ``table[ids]``, ``jnp.take(table, ids, axis=0)`` (any ``mode``), Flax
    ``nn.Embed`` / ``nnx.Embed``, Haiku ``hk.Embed``: a ``gather`` of whole
    rows, also with vmap-batched ids;
  * ``table[i]`` with a scalar ``i`` (``eqx.nn.Embedding`` on one id, also
    under ``jax.vmap`` with the table unbatched);
  * :func:`lookup`;
  * all of these after a float cast of the whole table (``nn.Embed(dtype=
    jnp.bfloat16)``; the gradient keeps the table's dtype), inside nested
    ``jax.jit``, ``jax.checkpoint`` / ``nn.remat`` /
    ``eqx.filter_checkpoint`` (policy kept) and ``lax.scan`` /
    ``fori_loop`` bodies where the table is a loop constant (ids may be
    computed inside the loop).

  A table keeps its dense gradient when it has any other use: a tied output
  projection, a weight-decay term, reads inside ``lax.cond`` /
  ``lax.switch`` / ``while_loop``, a ``custom_jvp`` / ``custom_vjp``
  function of the table, the table returned (in aux), a static slice
  ``table[:8]``, a partial-row read, the table as scan carry or xs, any
  other primitive. An unfamiliar higher-order primitive (a ``shard_map``
  inside the loss) or parameter layout also keeps it dense, with a
  :class:`SparsityWarning`. :func:`sparsity_report` shows what happened.

  One row per table row where that is smaller: a table read at least 4
  times per row in one call (BERT's 2-row segment table read at every
  position) gets the SparseRows of all its rows, ids ``0..rows-1``, each
  row its summed gradient; a table's gradient form is a property of the
  model, never of the batch size, so a short last batch gives a gradient
  tree of the same structure (and :func:`sparse_labels` the same labels).
  The shapes are static, so this is decided at trace time;
  ``require_sparse`` keeps a row per read,
  ``dense`` makes a table dense. A table read only through
  ``lax.stop_gradient`` (a frozen table: every use of its ``stop_gradient``
  value a whole-row read) gets an empty SparseRows: no gradient, and no
  row for a lazy optimizer to touch. A frozen kernel or bias is no table:
  it gets ``jax.grad``'s dense zeros.

  The SparseRows of a table holds the ids of its reads in program order
  (depth-first through nested jit/checkpoint/scan bodies), each read's ids
  flattened row-major; a read inside a scan contributes its ids of every
  iteration, in iteration order. An id the read gives no gradient to is
  padding: an out-of-range id of a ``mode="fill"`` or ``promise_in_bounds``
  gather (``table[ids]``) or of :func:`lookup`; ``mode="clip"`` ids come
  out clipped, like the rows they read. Under ``shard_map(check_vma=True)``
  the rows of every replica are gathered, as ``jax.grad`` sums them.

  Flax nnx modules are passed in as to ``nnx.value_and_grad``. A module
  at an int of ``argnums`` is differentiated with respect to its
  ``nnx.Param`` variables (``nnx.DiffState(i, filter)`` in place of ``i``
  picks the variables ``filter`` selects) and its gradients are an
  ``nnx.State`` of those variables. The loss may update every other
  variable of every nnx argument, differentiated or not (the RNG counts of
  ``nnx.Dropout``, the batch statistics of ``nnx.BatchNorm``): the new
  values are written back to the modules, as ``nnx.value_and_grad`` does.
  Paths (in ``require_sparse``, ``dense`` and the report) are spelled as
  the module names its attributes: ``".embed.embedding.value"``.

  Args:
    fun: the loss; returns a scalar (or ``(scalar, aux)`` with ``has_aux``).
    argnums: which positional argument(s) to differentiate: an int, an
      ``nnx.DiffState`` for an nnx module, or a tuple of them.
    has_aux: as in ``jax.value_and_grad``.
    require_sparse: leaves that must come out sparse: a path
      (``jax.tree_util.keystr`` of the leaf, as :func:`sparsity_report`
      prints it, e.g. ``"['emb']"``; an nnx ``.value`` suffix may be left
      off), a sequence of paths, or a predicate on the path. A ValueError
      names each such leaf that stays dense, the use that kept it dense and
      its source line. A required leaf gets a row per read even where it
      is read many times per row.
    dense: leaves to keep dense although they are read only as whole rows
      (same forms as ``require_sparse``).

  Returns:
    A function with ``fun``'s signature returning ``(value, grads)`` (or
    ``((value, aux), grads)``), ``grads`` shaped like the differentiated
    argument(s), with SparseRows at the tables.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import gradtx as gtx
    >>> params = {"emb": jnp.ones((1000, 4)), "w": jnp.ones(4)}
    >>> def loss(p, ids):
    ...   return jnp.sum(p["emb"][ids] @ p["w"])
    >>> value, g = gtx.sparse_value_and_grad(loss)(params, jnp.array([3, 7]))
    >>> g["emb"].indices, g["emb"].values.shape, g["w"].shape
    (Array([3, 7], dtype=int32), (2, 4), (4,))
  """
  argnum_tuple, single = _normalize_argnums(argnums)

  def value_and_grad_fn(*args, **kwargs):
    call = _prepare(fun, argnum_tuple, single, has_aux, args, kwargs)
    out, grads = _value_and_grad(call, dense, require_sparse)
    return _finish(call, has_aux, out), grads

  return value_and_grad_fn


def sparse_grad(
  fun: Callable[..., Any],
  argnums: Argnums = 0,
  has_aux: bool = False,
  *,
  require_sparse: PathSelector = None,
  dense: PathSelector = None,
) -> Callable[..., Any]:
  """Like ``jax.grad``, with SparseRows gradients for tables.

  See :func:`sparse_value_and_grad`; this returns only the gradients (and
  ``aux`` with ``has_aux``: ``(grads, aux)``).

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> g = gtx.sparse_grad(lambda t, i: jnp.take(t, i, axis=0).sum())(
    ...     jnp.zeros((5, 2)), jnp.array([4, 4]))
    >>> g.to_dense()[4]
    Array([2., 2.], dtype=float32)
  """
  vg = sparse_value_and_grad(
    fun,
    argnums=argnums,
    has_aux=has_aux,
    require_sparse=require_sparse,
    dense=dense,
  )

  def grad_fn(*args, **kwargs):
    value, grads = vg(*args, **kwargs)
    return (grads, value[1]) if has_aux else grads

  return grad_fn


def sparsity_report(
  fun: Callable[..., Any],
  argnums: Argnums = 0,
  has_aux: bool = False,
  *,
  require_sparse: PathSelector = None,
  dense: PathSelector = None,
) -> Callable[..., SparsityReport]:
  """Which leaves :func:`sparse_value_and_grad` makes sparse, and why not.

  Traces ``fun`` (nothing runs on the device) and returns a
  :class:`SparsityReport`: one :class:`LeafSparsity` per differentiated
  leaf with its path, whether its gradient is a SparseRows, the rows it
  reads per call and, for a dense leaf, the first use that kept it dense
  with its source line.

  Args:
    fun: the loss, as for :func:`sparse_value_and_grad`.
    argnums: which positional argument(s) are differentiated, as for
      :func:`sparse_value_and_grad` (an ``nnx.DiffState`` for a module).
    has_aux: whether ``fun`` returns ``(loss, aux)``.

  Returns:
    A function with ``fun``'s signature returning the report. Tracing
    leaves nnx arguments as they were (no RNG count advances).

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> params = {"emb": jnp.ones((100, 4)), "out": jnp.ones((100, 4))}
    >>> def loss(p, ids):
    ...   h = p["emb"][ids]
    ...   return jnp.sum(h @ p["out"].T)
    >>> report = gtx.sparsity_report(loss)(params, jnp.array([[1, 2, 3]]))
    >>> report.sparse_paths
    ("['emb']",)
    >>> report[0].rows_per_step, report[1].reason
    (3, 'used by `transpose`')
  """
  argnum_tuple, single = _normalize_argnums(argnums)

  def report_fn(*args, **kwargs):
    call = _prepare(fun, argnum_tuple, single, has_aux, args, kwargs)
    return _route(call, dense, require_sparse).report

  return report_fn


def sparse_labels(
  fun: Callable[..., Any],
  argnums: Argnums = 0,
  has_aux: bool = False,
  *,
  sparse_label: Any = "sparse",
  dense_label: Any = "dense",
  require_sparse: PathSelector = None,
  dense: PathSelector = None,
) -> Callable[..., Any]:
  """Labels for ``optax.multi_transform``: which leaves get a sparse
  gradient, as :func:`sparse_value_and_grad` decides.

  Embedding tables want another optimizer than the dense layers (row-wise
  Adagrad on the tables, Adam on the MLP: the recommender standard), and
  the rewrite already knows which leaves are tables. This traces ``fun``
  (nothing runs on the device) and labels every leaf of the differentiated
  argument(s) ``sparse_label`` (its gradient is a SparseRows, frozen tables
  included) or ``dense_label``. ``optax.multi_transform`` then gives each
  optimizer only the leaves it owns, so no Adam state is made for a table.

  Args:
    fun: the loss, as for :func:`sparse_value_and_grad`.
    argnums: which positional argument(s) are differentiated, as for
      :func:`sparse_value_and_grad` (an ``nnx.DiffState`` for a module).
    has_aux: whether ``fun`` returns ``(loss, aux)``.
    sparse_label: the label of the sparse leaves.
    dense_label: the label of every other leaf.
    require_sparse: as in :func:`sparse_value_and_grad`.
    dense: as in :func:`sparse_value_and_grad`.

  Returns:
    A function with ``fun``'s signature returning the labels, a tree shaped
    like the differentiated argument (a tuple of them for a tuple
    ``argnums``). For an nnx module the labels are those of the variables
    :func:`sparse_value_and_grad` differentiates (its ``nnx.Param`` state,
    or an ``nnx.DiffState``'s), and for a module or an ``nnx.State`` they
    are in the form ``nnx.Optimizer`` hands its transformation, the pure
    state (``nnx.as_pure``, no ``nnx.Param`` wrappers): so
    ``nnx.Optimizer(model, optax.multi_transform(transforms, labels),
    wrt=nnx.Param)`` (``wrt=`` a ``DiffState``'s filter) takes them as they
    are. Tracing leaves nnx arguments
    as they were (no RNG count advances).

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradtx as gtx
    >>> params = {"emb": jnp.zeros((1000, 4)), "w": jnp.ones((4, 2))}
    >>> def loss(p, ids):
    ...   return jnp.sum(p["emb"][ids] @ p["w"])
    >>> labels = gtx.sparse_labels(loss)(params, jnp.array([3, 7]))
    >>> labels
    {'emb': 'sparse', 'w': 'dense'}
    >>> tx = optax.multi_transform(
    ...     {"sparse": gtx.rowwise_adagrad(0.1), "dense": optax.adam(1e-3)},
    ...     labels)
  """

  argnum_tuple, single = _normalize_argnums(argnums)

  def labels_fn(*args, **kwargs):
    call = _prepare(fun, argnum_tuple, single, has_aux, args, kwargs)
    route = _route(call, dense, require_sparse)
    labels = [sparse_label if r.sparse else dense_label for r in route.report]
    tree = jax.tree.unflatten(route.treedef, labels)
    # Whoever passed nnx objects imported flax: look it up, never import it.
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None:
      tree = tuple(nnx.as_pure(t) for t in tree)
    return tree[0] if single else tree

  return labels_fn


def _every_row(
  ids: list[jax.Array], rows: list[jax.Array], num_rows: int, modes: list
) -> SparseRows:
  """The SparseRows of every row of a table read many times per row (ids
  ``0..num_rows-1``), each row the sum of the rows its reads got (``rows[k]``
  at ``ids[k]``, padding ``num_rows``, read as ``modes[k]``), so a table
  keeps one gradient form whatever the batch size."""
  return SparseRows(
    jnp.arange(num_rows, dtype=jnp.int32),
    dense_sums(ids, rows, num_rows, modes),
    num_rows,
    unique=True,
    normalized=True,
  )


def _concat(parts: list[jax.Array]) -> jax.Array:
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _order_after(tree: Any, value: jax.Array) -> Any:
  """``tree`` unchanged, with a data dependency on ``value`` XLA keeps.

  Why: when a row gradient does not read the rows (a loss linear in the
  table), nothing orders the forward read of a donated table before the
  in-place scatter that applies the update, so XLA's copy insertion copies
  the whole table (twice) to keep the read safe. ``lax.optimization_barrier``
  does not help: XLA:CPU deletes barriers before copy insertion. Making
  every gradient leaf depend on the loss (which depends on every read that
  matters) orders all reads before all writes, and the update stays in
  place. The dependency is ``x - zero`` with ``zero = 0 * (value != value)``:
  exactly ``x`` for every float (``-0.0``, inf and NaN included), a product
  XLA does not fold (``0 * x`` is not 0 for NaN), one scalar per dtype.
  A leaf that does not vary over all the mesh axes ``value`` varies over
  (inside ``shard_map``) is left alone: tying it would change its type.
  """
  value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.inexact):
    return tree
  flag = jnp.any(value != value)
  axes = varying_axes(flag)
  zeros: dict[Any, jax.Array] = {}  # one scalar per dtype, not per leaf

  def tie(x):
    if not jnp.issubdtype(x.dtype, jnp.inexact) or axes - varying_axes(x):
      return x
    if x.dtype not in zeros:
      zeros[x.dtype] = flag.astype(x.dtype) * jnp.zeros([], x.dtype)
    return x - zeros[x.dtype]

  return map_updates(tie, tree)
