"""Reading jaxprs: which leaves a loss reads only as whole rows.

The only module of gradtx that reads jaxprs. They depend on JAX internals
that change between releases: what differs between the supported releases
is resolved in :mod:`gradtx._jax_compat`, the one other module that reads
JAX's internals. A loss is traced to a jaxpr (:func:`trace`). A
differentiated leaf (a "table") whose every use is a whole-row read is
*sparse* (:func:`analyze` finds a :class:`TableUse` per table):

* a ``gather`` of whole rows along axis 0 (``table[ids]``, ``jnp.take``,
  Flax ``nn.Embed`` / ``nnx.Embed``), vmap-batched ids included, in every
  gather mode;
* a ``dynamic_slice`` of one whole row (``table[i]`` with a scalar ``i``,
  Equinox ``eqx.nn.Embedding``);
* :func:`gradtx.lookup` (a ``jit`` named ``gtx_lookup``), re-bound as is;
* through a float-to-float cast of the whole table, nested ``jit``,
  ``checkpoint`` (policy kept) and the loop constants of ``scan``.

The jaxpr is then evaluated again (:func:`evaluate`) with each read
returning ``read(table, ids) + sink`` -- a zero input whose cotangent is
the gradient of the rows read -- and the ids of every read coming out
alongside (:func:`row_ids` makes row ids of them). Any other use keeps
the table dense; an unfamiliar higher-order primitive or parameter layout
does too, with a :class:`SparsityWarning`.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from gradtx._jax_compat import (
  open_jaxpr,
  scan_counts,
  source_info_util,
  vma_of,
)

LOOKUP_NAME = "gtx_lookup"
_JIT = ("jit", "pjit")
_REMAT = ("remat2", "checkpoint", "remat")
_GATHER_MODES = ("CLIP", "FILL_OR_DROP", "PROMISE_IN_BOUNDS")
# Higher-order primitives whose bodies are deliberately not followed: a read
# there keeps the table dense, without a warning.
_NOT_FOLLOWED = {
  "cond": "reads inside lax.cond/lax.switch are not followed",
  "while": "reads inside lax.while_loop are not followed",
  "custom_jvp_call": "a custom_jvp function of the table",
  "custom_vjp_call": "a custom_vjp function of the table",
  "custom_vjp_call_jaxpr": "a custom_vjp function of the table",
}
_GRADTX_DIR = os.path.dirname(os.path.abspath(__file__))


class SparsityWarning(UserWarning):
  """A table kept its dense gradient because gradtx met a construct it does
  not know.

  Raised (as a warning) by :func:`gradtx.sparse_value_and_grad` when a
  table is passed to a higher-order primitive gradtx does not follow (for
  example a ``shard_map`` inside the loss) or to a primitive whose
  parameters have a layout gradtx does not recognise (a newer JAX). The
  gradient is still exact, only dense. :func:`gradtx.sparsity_report` names
  the use and its source line.

  Examples:
    >>> import warnings
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, PartitionSpec as P
    >>> import gradtx as gtx
    >>> mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    >>> def loss(table, ids):
    ...   read = lambda t: t[ids]
    ...   rows = jax.shard_map(read, mesh=mesh, in_specs=P(), out_specs=P())
    ...   return rows(table).sum()
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   g = gtx.sparse_grad(loss)(jnp.ones((4, 2)), jnp.array([1]))
    >>> g.shape, caught[0].category.__name__
    ((4, 2), 'SparsityWarning')
  """


def input_avals(closed: Any) -> list[Any]:
  """The abstract values of a traced function's inputs."""
  return [v.aval for v in open_jaxpr(closed)[0].invars]


# ----------------------------------------------------------------------------
# analysis


@dataclasses.dataclass(frozen=True)
class Read:
  """One row-read site: ``ids_shape`` (stacked over enclosing scans) ids."""

  ids_shape: tuple[int, ...]
  vma: frozenset  # mesh axes the rows read vary along (shard_map)
  how: tuple = ()  # how its row ids follow from its raw ids (row_ids)


@dataclasses.dataclass(frozen=True)
class DenseUse:
  """The first use of a table that keeps its gradient dense."""

  what: str
  where: str = ""
  warn: bool = False


@dataclasses.dataclass(frozen=True)
class TableUse:
  """What a jaxpr does with one table (and its casts): reads, or a dense use;
  ``frozen``: some whole-row read goes through ``stop_gradient`` (no
  gradient there)."""

  reads: tuple[Read, ...]
  dense: DenseUse | None
  frozen: bool = False


@dataclasses.dataclass(frozen=True)
class View:
  """How a value derives from a table: the float casts applied to it, in
  order, and whether a ``stop_gradient`` came first (``frozen``)."""

  casts: tuple = ()
  frozen: bool = False


@dataclasses.dataclass(frozen=True)
class _RowRead:
  kind: str  # "gather" | "dynamic_slice" | "lookup"
  ids_shape: tuple[int, ...]
  vma: frozenset
  how: tuple = ()  # Read.how


@dataclasses.dataclass(frozen=True)
class _Cast:
  dtype: Any


@dataclasses.dataclass(frozen=True)
class _Frozen:
  """``stop_gradient`` of the table: a constant for autodiff."""


@dataclasses.dataclass(frozen=True)
class _Pvary:
  """A shard_map type cast (invariant -> varying) of whole tables."""


@dataclasses.dataclass(frozen=True)
class _Sub:
  kind: str  # "jit" | "remat" | "scan"
  jaxpr: Any  # core.Jaxpr, invars aligned with the eqn's operands
  consts: Sequence[Any]
  prefix: tuple[int, ...]  # (length,) for scan: reads are stacked


def _is_var(v: Any) -> bool:
  return isinstance(v, jcore.Var) and not isinstance(v, jcore.DropVar)


def location(eqn: Any) -> str:
  """``file:line`` of the user code that made ``eqn`` (model code first)."""
  tb = getattr(eqn.source_info, "traceback", None)
  frames = [
    f
    for f in source_info_util.user_frames(tb)
    if not os.path.abspath(f.file_name).startswith(_GRADTX_DIR)
  ]
  if not frames:
    return ""
  own = [
    f
    for f in frames
    if "site-packages" not in f.file_name and "dist-packages" not in f.file_name
  ]
  f = (own or frames)[0]
  return f"{f.file_name}:{f.start_line}"


def _dense(eqn: Any, what: str, warn: bool = False) -> DenseUse:
  return DenseUse(what, location(eqn), warn)


def _is_float(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


def _match(eqn: Any, pos: list[int]) -> Any:
  """How ``eqn`` uses the table(s) at operand positions ``pos``."""
  name = eqn.primitive.name
  try:
    return _match_known(eqn, pos, name)
  except Exception as e:  # an unfamiliar parameter layout: never crash
    return _dense(
      eqn,
      f"`{name}` with parameters gradtx does not recognise "
      f"({type(e).__name__}: {e})",
      warn=True,
    )


def _match_known(eqn: Any, pos: list[int], name: str) -> Any:
  params = eqn.params
  shape = tuple(eqn.invars[pos[0]].aval.shape)
  row_shape = shape[1:]
  if name == "gather":
    dn = params["dimension_numbers"]
    if pos != [0]:
      return _dense(eqn, "`gather` with the table as its indices")
    if dn.operand_batching_dims or dn.start_indices_batching_dims:
      return _dense(eqn, "`gather` batched over the table (vmap of tables)")
    if tuple(params["slice_sizes"]) != (1, *row_shape) or (
      0 not in dn.start_index_map
    ):
      return _dense(eqn, "`gather` that does not read whole rows")
    if getattr(params["mode"], "name", None) not in _GATHER_MODES:
      return _dense(eqn, f"`gather` in mode {params['mode']}", warn=True)
    ids_shape = tuple(eqn.invars[1].aval.shape[:-1])
    out_shape = tuple(eqn.outvars[0].aval.shape)
    offsets = tuple(dn.offset_dims)
    if len(out_shape) != len(ids_shape) + len(offsets) or list(offsets) != (
      sorted(offsets)
    ):
      raise ValueError(f"gather output {out_shape} with offset_dims {offsets}")
    how = ("gather", tuple(dn.start_index_map), params["mode"].name)
    return _RowRead("gather", ids_shape, vma_of(eqn.outvars[0].aval), how)
  if name == "dynamic_slice":
    if pos != [0] or len(eqn.invars) != 1 + len(shape):
      return _dense(eqn, "`dynamic_slice` with the table as a start index")
    if tuple(params["slice_sizes"]) != (1, *row_shape):
      return _dense(eqn, "`dynamic_slice` that does not read one whole row")
    vma = vma_of(eqn.outvars[0].aval)
    return _RowRead("dynamic_slice", (1,), vma, ("clamp",))
  if name == "convert_element_type":
    new = params["new_dtype"]
    if params.get("sharding") is None and _is_float(new):
      return _Cast(np.dtype(new))
    return _dense(eqn, f"`convert_element_type` to {new}")
  if name == "stop_gradient" and pos == [0]:
    return _Frozen()
  if name in ("pvary", "pcast") and params.get("to", "varying") == "varying":
    # shard_map(check_vma=True) marks an invariant table varying before a
    # read with varying ids; no value changes.
    if len(eqn.outvars) != len(eqn.invars):
      raise ValueError(f"{len(eqn.outvars)} outputs for {len(eqn.invars)}")
    return _Pvary()
  if name in _JIT:
    closed = params["jaxpr"]
    if params.get("name") == LOOKUP_NAME and pos == [0]:
      ids_aval = eqn.invars[1].aval
      out = eqn.outvars[0].aval
      if len(eqn.invars) == 2 and tuple(out.shape) == (
        tuple(ids_aval.shape) + row_shape
      ):
        ids_shape = tuple(ids_aval.shape)
        return _RowRead("lookup", ids_shape, vma_of(out), ("as_is",))
    jaxpr, consts = open_jaxpr(closed)
    _check_aligned(jaxpr, eqn)
    return _Sub("jit", jaxpr, consts, ())
  if name in _REMAT:
    jaxpr, consts = open_jaxpr(params["jaxpr"])
    _check_aligned(jaxpr, eqn, params, ("prevent_cse", "policy"))
    return _Sub("remat", jaxpr, consts, ())
  if name == "scan":
    jaxpr, consts = open_jaxpr(params["jaxpr"])
    n, _ = scan_counts(params)
    if any(p >= n for p in pos):
      return _dense(
        eqn,
        "passed to `scan` as carry or xs (only loop constants are followed)",
      )
    _check_aligned(jaxpr, eqn, params, ("length", "reverse", "unroll"))
    return _Sub("scan", jaxpr, consts, (int(params["length"]),))
  if name in _NOT_FOLLOWED:
    return _dense(eqn, f"passed to `{name}` ({_NOT_FOLLOWED[name]})")
  bodies = list(jcore.jaxprs_in_params(params))
  if bodies:
    # Warn where the body reads rows: a table; a dense weight is no news.
    return _dense(
      eqn,
      f"passed to `{name}`, a higher-order primitive gradtx does not follow",
      warn=any(_reads_rows(b) for b in bodies),
    )
  return _dense(eqn, f"used by `{name}`")


def _reads_rows(jaxpr: Any) -> bool:
  jaxpr, _ = open_jaxpr(jaxpr)
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in ("gather", "dynamic_slice") or eqn.params.get("name") == (
      LOOKUP_NAME
    ):
      return True
    if any(_reads_rows(b) for b in jcore.jaxprs_in_params(eqn.params)):
      return True
  return False


def _check_aligned(
  jaxpr: Any, eqn: Any, params: Any = None, keys: Sequence[str] = ()
) -> None:
  missing = [k for k in keys if k not in params]
  if missing:
    raise KeyError(f"no {missing} in the parameters")
  if len(jaxpr.invars) != len(eqn.invars):
    raise ValueError(
      f"{len(jaxpr.invars)} body inputs for {len(eqn.invars)} operands"
    )


class Analysis:
  """Finds the row reads of tables in jaxprs, every table in one walk;
  memoised per (jaxpr, tables)."""

  def __init__(self):
    self._memo: dict[Any, tuple[Any, dict[int, TableUse]]] = {}

  def uses(
    self, jaxpr: Any, members: dict[int, tuple[int, View]]
  ) -> dict[int, TableUse]:
    """What ``jaxpr`` does with each table: ``members`` maps an invar index
    to ``(table, view)`` (which table is there, and how the value derives
    from it); the result maps each table to its reads in program order, or
    the first use that keeps it dense. A value read through
    ``stop_gradient`` must be read as whole rows too: a frozen kernel or
    bias is no table."""
    key = (id(jaxpr), tuple(sorted(members.items())))
    hit = self._memo.get(key)
    if hit is not None and hit[0] is jaxpr:
      return hit[1]
    result = self._walk(jaxpr, members)
    self._memo[key] = (jaxpr, result)
    return result

  def _walk(
    self, jaxpr: Any, members: dict[int, tuple[int, View]]
  ) -> dict[int, TableUse]:
    alias = {jaxpr.invars[i]: tv for i, tv in members.items()}
    tables = sorted({t for t, _ in members.values()})
    reads: dict[int, list[Read]] = {t: [] for t in tables}
    frozen = dict.fromkeys(tables, False)
    dense: dict[int, DenseUse] = {}
    for eqn in jaxpr.eqns:
      uses: dict[int, list[int]] = {}
      for k, v in enumerate(eqn.invars):
        if _is_var(v) and v in alias and alias[v][0] not in dense:
          uses.setdefault(alias[v][0], []).append(k)
      subs: dict[int, tuple[_Sub, list[int]]] = {}
      for t, pos in uses.items():
        m = _match(eqn, pos)
        view = alias[eqn.invars[pos[0]]][1]
        if isinstance(m, DenseUse):
          if any(alias[eqn.invars[p]][1].frozen for p in pos):
            m = dataclasses.replace(m, what=f"{m.what} after `stop_gradient`")
          dense[t] = m
        elif isinstance(m, _Frozen):
          alias[eqn.outvars[0]] = (t, View(view.casts, True))
        elif isinstance(m, _RowRead):
          if view.frozen:
            frozen[t] = True  # a constant for autodiff: no sink
          else:
            reads[t].append(Read(m.ids_shape, m.vma, m.how))
        elif isinstance(m, _Cast):
          alias[eqn.outvars[0]] = (t, View((*view.casts, m.dtype), view.frozen))
        elif isinstance(m, _Pvary):
          for p in pos:
            alias[eqn.outvars[p]] = alias[eqn.invars[p]]
        else:
          subs[t] = (m, pos)
      if subs:  # every table the body gets, in one walk of it
        m = next(iter(subs.values()))[0]
        inner = {
          p: (j, alias[eqn.invars[p]][1])
          for j, (_, pos) in enumerate(subs.values())
          for p in pos
        }
        found = self.uses(m.jaxpr, inner)
        for j, t in enumerate(subs):
          use = found[j]
          reads[t].extend(
            dataclasses.replace(r, ids_shape=m.prefix + r.ids_shape)
            for r in use.reads
          )
          frozen[t] = frozen[t] or use.frozen
          if use.dense is not None:
            dense[t] = use.dense
    for v in jaxpr.outvars:
      if _is_var(v) and v in alias and alias[v][0] not in dense:
        dense[alias[v][0]] = DenseUse(
          "returned by the loss or a nested jit/checkpoint/scan"
        )
    return {
      t: TableUse(tuple(reads[t]), dense.get(t), frozen[t]) for t in tables
    }


def trace(fun: Callable[..., Any], leaves: Sequence[Any]) -> tuple[Any, Any]:
  """``fun(leaves)``'s closed jaxpr (flat outputs) and output treedef."""
  box = []

  def flat(*xs):
    out, tree = jax.tree.flatten(fun(list(xs)))
    box.append(tree)
    return out

  closed = jax.make_jaxpr(flat)(*leaves)
  return closed, box[-1]


def analyze(
  closed: Any, candidates: Sequence[bool]
) -> tuple[Analysis, list[TableUse | None]]:
  """One :class:`TableUse` per invar of ``closed`` (None where not a
  candidate)."""
  an = Analysis()
  jaxpr, _ = open_jaxpr(closed)
  if len(candidates) != len(jaxpr.invars):
    raise ValueError(f"{len(candidates)} flags for {len(jaxpr.invars)} inputs")
  found = an.uses(
    jaxpr, {i: (i, View()) for i, c in enumerate(candidates) if c}
  )
  return an, [found.get(i) for i in range(len(candidates))]


# ----------------------------------------------------------------------------
# re-evaluation with sinks

_lookup_reader: list[Callable[[Any, Any], Any]] = []


def register_lookup(read_rows: Callable[[Any, Any], Any]) -> None:
  """Registers the ``gtx_lookup`` jitted row reader (to read cast tables)."""
  _lookup_reader[:] = [read_rows]


class _Queue:
  """The sinks a table's reads consume, and the row ids they produce."""

  def __init__(self, sinks: Sequence[Any]):
    self.sinks = collections.deque(sinks)
    self.ids: list[Any] = []


@dataclasses.dataclass
class _Table:
  value: Any  # the table itself, in its own dtype: a constant for autodiff
  casts: tuple  # the dtypes it was cast to before this point, in order
  queue: _Queue


def evaluate(
  an: Analysis,
  closed: Any,
  args: Sequence[Any],
  sinks: dict[int, Sequence[Any]],
) -> tuple[list[Any], dict[int, list[Any]]]:
  """Evaluates ``closed`` on ``args`` with a sink at each read of the
  tables ``sinks`` names (invar index -> one sink per read, in the order of
  the analysis). Returns the outputs and, per table, the raw ids of each
  read (:func:`row_ids` makes its row ids)."""
  args = list(args)
  queues = {}
  for i, s in sinks.items():
    queues[i] = _Queue(s)
    args[i] = _Table(args[i], (), queues[i])
  outs = _eval(an, *open_jaxpr(closed), args)
  for q in queues.values():
    if q.sinks:
      raise RuntimeError("gradtx internal error: unused sinks")
  return outs, {i: q.ids for i, q in queues.items()}


def _eval(an: Analysis, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]):
  env: dict[Any, Any] = {}

  def read(v):
    return v.val if isinstance(v, jcore.Literal) else env[v]

  for v, x in zip(jaxpr.constvars, consts, strict=True):
    env[v] = x
  for v, x in zip(jaxpr.invars, args, strict=True):
    env[v] = x
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    pos = [k for k, x in enumerate(invals) if isinstance(x, _Table)]
    name_stack = (
      source_info_util.current_name_stack() + eqn.source_info.name_stack
    )
    with (
      source_info_util.user_context(
        eqn.source_info.traceback, name_stack=name_stack
      ),
      eqn.ctx.manager,
    ):
      if pos:
        outs = _rewrite(an, eqn, pos, invals)
      else:
        params = eqn.primitive.get_bind_params(eqn.params)
        ans = eqn.primitive.bind(*invals, **params)
        outs = ans if eqn.primitive.multiple_results else [ans]
    for v, x in zip(eqn.outvars, outs, strict=True):
      if not isinstance(v, jcore.DropVar):
        env[v] = x
  return [read(v) for v in jaxpr.outvars]


def _rewrite(an: Analysis, eqn: Any, pos: list[int], invals: list[Any]):
  m = _match(eqn, pos)
  if isinstance(m, _RowRead):
    return [_read_rows(eqn, m, invals)]
  if isinstance(m, _Cast):
    t = invals[0]
    return [_Table(t.value, (*t.casts, m.dtype), t.queue)]
  if isinstance(m, _Frozen):
    t = invals[0]
    x = t.value
    for dtype in t.casts:
      x = lax.convert_element_type(x, dtype)
    return [lax.stop_gradient(x)]
  if isinstance(m, _Pvary):
    raw = [x.value if isinstance(x, _Table) else x for x in invals]
    outs = eqn.primitive.bind(*raw, **eqn.primitive.get_bind_params(eqn.params))
    outs = outs if eqn.primitive.multiple_results else [outs]
    return [
      _Table(o, x.casts, x.queue) if isinstance(x, _Table) else o
      for o, x in zip(outs, invals, strict=True)
    ]
  if isinstance(m, _Sub):
    return _rewrite_body(an, eqn, m, invals)
  raise RuntimeError(  # the analysis saw the same eqn and said "sparse"
    f"gradtx internal error: a sparse table reached {m.what}"
  )


def _read_rows(eqn: Any, m: _RowRead, invals: list[Any]) -> Any:
  t = invals[0]
  params = eqn.primitive.get_bind_params(eqn.params)
  # The raw ids come out as they are: row_ids makes row ids of them outside
  # the differentiated function, where integer ops trace cheaper.
  if m.kind == "gather":
    ids = invals[1]
    rows = eqn.primitive.bind(t.value, ids, **params)
  elif m.kind == "dynamic_slice":
    rows = eqn.primitive.bind(t.value, *invals[1:], **params)
    ids = jnp.asarray(invals[1])
  else:  # the gtx_lookup jit: re-bound as is (it may dispatch on the table)
    ids = invals[1]
    if not t.casts:
      rows = eqn.primitive.bind(t.value, ids, **params)[0]
    else:
      rows = _lookup_reader[0](t.value, ids)
  sink = t.queue.sinks.popleft()
  t.queue.ids.append(ids)
  if m.kind == "gather":
    sink = _to_gather_layout(sink, eqn, len(m.ids_shape))
  # The sink is -0.0 (x + -0.0 is x for every x, -0.0 included), added in
  # the table's dtype; then every cast the loss applied to the table, in
  # order, on the rows read: each rounding and overflow of the forward pass
  # is kept (casts are elementwise, so they commute with the read), and each
  # read's gradient row goes back through them.
  out = rows + sink
  for dtype in t.casts:
    out = lax.convert_element_type(out, dtype)
  return out


def read_mode(read: Read) -> str:
  """How ``read``'s gather treats the row ids :func:`row_ids` gives:
  ``"lookup"`` (``gtx.lookup``'s read), ``"clip"`` (every id in range:
  JAX's clamping gather, a ``dynamic_slice``) or ``"fill"`` (padding
  ``num_rows`` reads zeros)."""
  how = read.how
  if how[0] == "as_is":
    return "lookup"
  if how[0] == "clamp" or how[2] == "CLIP":
    return "clip"
  return "fill"


def row_ids(read: Read, raw: Any, num_rows: int) -> jax.Array:
  """The int32 row ids of ``read`` from the raw ids :func:`evaluate` gave
  (a gather's indices, a dynamic_slice's start, a lookup's ids; stacked
  over enclosing scans): the row each id read, or padding
  (``num_rows``) where the read's gradient gives that id nothing."""
  how = read.how
  if how[0] == "as_is":
    return jnp.asarray(raw).astype(jnp.int32)
  if how[0] == "clamp":
    return _clamp_ids(jnp.asarray(raw), num_rows)
  _, start_index_map, mode = how
  row = raw[..., start_index_map.index(0)]
  if mode == "CLIP":
    # Full-width dimensions clamp their start to 0 whatever it is.
    return _clamp_ids(row, num_rows)
  # FILL_OR_DROP reads (and PROMISE_IN_BOUNDS scatters back) only in-bounds
  # windows: the row in [0, num_rows), every full-width start exactly 0.
  ok = _in_range(row, num_rows)
  for j, d in enumerate(start_index_map):
    if d != 0:
      ok = ok & (raw[..., j] == 0)
  return jnp.where(ok, row.astype(jnp.int32), num_rows)


# Ids come in every integer dtype (uint8 bytes, int16, uint32, int64 under
# x64): compare them in their own dtype, with bounds that dtype can hold
# (``num_rows`` itself may not fit: 256 wraps to 0 in uint8), and narrow to
# int32 only once they are known to lie in [0, num_rows).


def _clamp_ids(row: Any, num_rows: int) -> Any:
  """The row a clamped read of ``row`` reads, as int32."""
  hi = min(num_rows - 1, int(jnp.iinfo(row.dtype).max))
  lo = 0 if jnp.issubdtype(row.dtype, jnp.signedinteger) else None
  return jnp.clip(row, lo, np.asarray(hi, row.dtype)).astype(jnp.int32)


def _in_range(row: Any, num_rows: int) -> Any:
  """Whether ``row`` lies in [0, num_rows)."""
  hi = min(num_rows - 1, int(jnp.iinfo(row.dtype).max))
  ok = row <= np.asarray(hi, row.dtype)
  if jnp.issubdtype(row.dtype, jnp.signedinteger):
    ok = ok & (row >= 0)
  return ok


def _to_gather_layout(sink: Any, eqn: Any, nb: int) -> Any:
  """``[*ids_shape, *row_shape]`` -> the gather's output layout."""
  out_shape = tuple(eqn.outvars[0].aval.shape)
  offsets = list(eqn.params["dimension_numbers"].offset_dims)
  batch = [a for a in range(len(out_shape)) if a not in offsets]
  x = sink.reshape(sink.shape[:nb] + tuple(out_shape[a] for a in offsets))
  perm = [
    batch.index(a) if a in batch else nb + offsets.index(a)
    for a in range(len(out_shape))
  ]
  return x.transpose(perm) if perm != sorted(perm) else x


# A jit whose body reads tables, re-jitted with sinks in and ids out, per
# (body, tables' positions and casts): JAX keeps one body per jitted function
# and shapes, so an eager loss compiles its jitted blocks once, as JAX does.
_JITTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _body_fn(
  jaxpr_of: Callable[[], Any], consts: Sequence[Any], spec: tuple
) -> Callable:
  """The body re-evaluated with sinks in and ids out; ``jaxpr_of()`` gives
  the body's jaxpr (a weak reference for the cached jit: a strong one from
  the cache's value would keep its weak key alive forever)."""

  def run(args, raws, sinks):
    qs = [_Queue(s) for s in sinks]
    args = list(args)
    for p, g, casts in spec:
      args[p] = _Table(raws[g], casts, qs[g])
    outs = _eval(Analysis(), jaxpr_of(), consts, args)
    return outs, [q.ids for q in qs]

  return run


def _jitted_body(eqn: Any, m: _Sub, spec: tuple) -> Callable:
  per_body = _JITTED.setdefault(m.jaxpr, {})
  key = (spec, bool(eqn.params.get("inline", False)))
  fn = per_body.get(key)
  if fn is None:
    run = _body_fn(weakref.ref(m.jaxpr), m.consts, spec)
    fn = jax.jit(run, inline=key[1])
    per_body[key] = fn
  return fn


def _rewrite_body(an: Analysis, eqn: Any, m: _Sub, invals: list[Any]):
  """Re-binds a jit, checkpoint or scan whose body reads tables: the sinks
  go in as extra inputs (scan: xs), the ids come out as extra outputs
  (scan: ys). A jit stays a jit, so an eager call runs its block compiled,
  as JAX does (same values, same speed)."""
  by_table: dict[int, list[int]] = {}
  for p in sorted(i for i, x in enumerate(invals) if isinstance(x, _Table)):
    by_table.setdefault(id(invals[p].queue), []).append(p)
  members = list(by_table.values())
  found = an.uses(
    m.jaxpr,
    {p: (g, View(invals[p].casts)) for g, ps in enumerate(members) for p in ps},
  )
  raws, sinks = [], []
  for g, ps in enumerate(members):
    q = invals[ps[0]].queue
    raws.append(invals[ps[0]].value)
    sinks.append([q.sinks.popleft() for _ in found[g].reads])
  spec = tuple(
    (p, g, invals[p].casts) for g, ps in enumerate(members) for p in ps
  )
  plain = [None if isinstance(x, _Table) else x for x in invals]
  run = _body_fn(lambda: m.jaxpr, m.consts, spec)

  if m.kind == "jit":
    outs, ids = _jitted_body(eqn, m, spec)(plain, raws, sinks)
  elif m.kind == "remat":
    params = eqn.params
    outs, ids = jax.checkpoint(
      run, prevent_cse=params["prevent_cse"], policy=params["policy"]
    )(plain, raws, sinks)
  else:
    params = eqn.params
    nc, nk = scan_counts(params)
    consts = plain[:nc]

    def body(carry, x):
      xs, step_sinks = x
      outs, ids = run(consts + list(carry) + list(xs), raws, step_sinks)
      return outs[:nk], (outs[nk:], ids)

    carry, (ys, ids) = lax.scan(
      body,
      plain[nc : nc + nk],
      (plain[nc + nk :], sinks),
      length=params["length"],
      reverse=params["reverse"],
      unroll=params["unroll"],
    )
    outs = list(carry) + list(ys)
  for ps, table_ids in zip(members, ids, strict=True):
    invals[ps[0]].queue.ids.extend(table_ids)
  return outs
