"""The conformance suite every gradtx transformation is run through.

tests/test_conformance.py runs it, once for every transformation:

* :data:`CHECKS` on every case of :data:`CASES` (the sparse-aware
  transforms, accumulate, drop_stale, all_reduce, track_changes) and of
  :data:`OPTIMIZERS`: jit agrees with eager; init from
  ``jax.ShapeDtypeStruct``; no state leaf aliases params or another state
  leaf, and a jitted step donating them (replicated on 8 devices) runs in a
  loop from ``init`` and keeps the state's structure, shapes, dtypes and
  shardings; a second update does not recompile; optax.chain with extra
  args; inside ``jax.shard_map`` and ``jax.pmap``; bf16 params keep their
  dtype.
* :data:`ROW_CHECKS` on every row optimizer of :data:`OPTIMIZERS` (the
  built-ins, their 8-bit variants and a rule written with
  ``gtx.row_transformation``): untouched and padding rows keep their bits;
  the compiled step updates the table and its per-row state in place;
  ``optax.inject_hyperparams`` inside ``gtx.drop_stale`` gives the same
  steps, drops a stale gradient leaving params and state alone, and changes
  the step at run time without recompiling; a ``Mirrored`` step equals the
  single-device one; a table split by rows over 8 devices equals the
  single-device one and stays split.
* :func:`check_gpu_branches` on all of them: the accelerator (GPU, TPU)
  branches of gradtx's platform-dependent code (sorted dedup, the segmented-scan
  segment sum, the deduplicating scatter-add), taken on CPU, give the CPU
  branch's results.

A check takes the list of cases that run it and runs them all in one
jitted program (:func:`together`; XLA compiles a kernel once per program,
so this compiles in about half the time of a program per case), asserting
case by case and naming every case that fails (:func:`each`);
:func:`check_in_place`, which reads one case's compiled program, takes one
case. Most checks compare with the jitted run of the case's group
(:func:`reference`), computed once per group and process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo import dedups, row_ops, written_in_place
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradtx as gtx
from gradtx import _jax_compat, _platform

NUM_ROWS = 32
DIM = 4
IDS_PER_STEP = 6

# The accelerator branches on CPU: gradtx stages its platform-dependent code out
# through one wrapper, gradtx._platform.platform_dependent (the one private
# gradtx name the suite patches), which every caller looks up through its
# module.
_CPU_WRAPPER = _platform.platform_dependent


def _accelerator_branch_on_cpu(
  *args: Any, cpu: Callable[..., Any], accelerator: Callable[..., Any]
) -> Any:
  del cpu
  return lax.platform_dependent(*args, cpu=accelerator, default=accelerator)


def gpu_branches_active() -> bool:
  """Whether :func:`gpu_branches` is active."""
  return _platform.platform_dependent is not _CPU_WRAPPER


@contextlib.contextmanager
def gpu_branches() -> Iterator[None]:
  """Every platform-dependent call of gradtx traced inside takes its
  accelerator (GPU, TPU) branch on CPU, so that code runs without a device.

  Inside, ``jax.default_device`` is set to the device JAX uses anyway: it is
  part of every jit cache key, so a jitted function called on both sides of
  the switch is traced on each side, never served the other side's program
  (tests/test_conformance.py checks this on each supported JAX).
  """
  if gpu_branches_active():
    raise RuntimeError("gpu_branches() is already active")
  _platform.platform_dependent = _accelerator_branch_on_cpu
  try:
    with jax.default_device(jax.devices()[0]):
      yield
  finally:
    _platform.platform_dependent = _CPU_WRAPPER


def cast(x: Any, dtype: Any) -> jax.Array:
  """``jnp.asarray(x, dtype)``, cast by numpy and put on the device (jax
  compiles a convert, and ``jnp.asarray`` of a numpy array a staging
  program, for each shape and dtype; ``device_put`` compiles nothing; the
  bits are the same)."""
  return jax.device_put(np.asarray(x).astype(dtype))


# A SparseRows made dense by one jitted program (eagerly, ``to_dense`` would
# compile each of its ops for every shape).
to_dense = jax.jit(lambda g: g.to_dense())


def standard_params(dtype: Any = jnp.float32) -> dict[str, jax.Array]:
  """A small embedding table plus dense leaves."""
  rng = np.random.RandomState(0)
  return {
    "emb": cast(rng.normal(size=(NUM_ROWS, DIM)), dtype),
    "w": cast(rng.normal(size=(DIM, 3)), dtype),
    "b": cast(rng.normal(size=(3,)), dtype),
  }


def standard_grads(step: int, dtype: Any = jnp.float32) -> dict[str, Any]:
  """Gradients for ``standard_params``: SparseRows with a duplicate and a
  padding id for the table, dense for the rest. Deterministic in ``step``."""
  rng = np.random.RandomState(100 + step)
  ids = rng.randint(0, NUM_ROWS, size=IDS_PER_STEP)
  ids[1] = ids[0]  # a duplicate
  ids[-1] = NUM_ROWS  # padding
  return {
    "emb": gtx.SparseRows(
      cast(ids, jnp.int32),
      cast(rng.normal(size=(IDS_PER_STEP, DIM)), dtype),
      NUM_ROWS,
    ),
    "w": cast(rng.normal(size=(DIM, 3)), dtype),
    "b": cast(rng.normal(size=(3,)), dtype),
  }


@dataclasses.dataclass(frozen=True)
class Inject:
  """A case's transformation as ``optax.inject_hyperparams(factory,
  static_args)(**kwargs)``; ``vary`` names the hyperparameter changed at
  run time (a number, not a schedule)."""

  factory: Callable[..., optax.GradientTransformation]
  kwargs: dict[str, Any]
  static_args: tuple[str, ...] = ()
  vary: str = "learning_rate"


@dataclasses.dataclass
class Case:
  """One transformation to check.

  Attributes:
    name: shown in test ids.
    make_tx: builds a fresh transformation.
    params: builds params (takes a dtype).
    grads: builds the gradient for a step index (takes step, dtype).
    extra_args: extra keyword args for ``update`` at a step index.
    steps: how many updates each check runs.
    rtol: tolerance for comparing jit / shard_map / pmap results.
    inject: how to build it with ``optax.inject_hyperparams`` (row
      optimizers).
    pmap: whether :func:`check_pmap` runs. pmap runs the code
      :func:`check_shard_map` runs, on another mapping: row optimizers
      without collectives run it once per engine path (the fast path, 8-bit
      state with catch-up, a per-row ``[V]`` state, a user's rule).
  """

  name: str
  make_tx: Callable[[], optax.GradientTransformation]
  params: Callable[..., Any] = standard_params
  grads: Callable[..., Any] = standard_grads
  extra_args: Callable[[int], dict[str, Any]] = lambda step: {}
  steps: int = 3
  rtol: float = 1e-5
  inject: Inject | None = None
  pmap: bool = True

  def __str__(self) -> str:
    return self.name


def optimizer(
  name: str,
  factory: Callable[..., optax.GradientTransformation],
  *,
  static_args: tuple[str, ...] = (),
  vary: str = "learning_rate",
  rtol: float = 1e-5,
  pmap: bool = False,
  **kwargs: Any,
) -> Case:
  """A row optimizer's case: ``factory(**kwargs)``, for every check."""
  return Case(
    name,
    lambda: factory(**kwargs),
    rtol=rtol,
    inject=Inject(factory, kwargs, static_args, vary),
    pmap=pmap,
  )


def _extra(case: Case, i: int) -> dict[str, Any]:
  return {k: jnp.asarray(v) for k, v in case.extra_args(i).items()}


def step_fn(
  tx: optax.GradientTransformation, apply: Callable[..., Any] | None = None
) -> Callable[..., Any]:
  """``(params, state, grads, extra=None) -> (params, state)``: one update
  (``extra``: the keyword args of ``update``) and ``apply`` (default
  ``gtx.apply_updates``; ``optax.apply_updates`` for an optax reference)."""
  apply = apply or gtx.apply_updates

  def step(params, state, grads, extra=None):
    updates, state = tx.update(grads, state, params, **(extra or {}))
    return apply(params, updates), state

  return step


def _run(case: Case, step: Callable[..., Any], dtype: Any = jnp.float32):
  tx = case.make_tx()
  params = case.params(dtype)
  state = tx.init(params)
  for i in range(case.steps):
    params, state = step(params, state, case.grads(i, dtype), _extra(case, i))
  return params, state


def _assert_close(a: Any, b: Any, rtol: float, codes: bool = False) -> None:
  """Same trees, shapes and dtypes, values within ``rtol`` (and atol). With
  ``codes``, 8-bit codes (QuantizedRows) may differ by one, in under 3% of
  them: where another program's float32 state straddles a rounding
  boundary."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb, f"tree mismatch: {ta} vs {tb}"
  for x, y in zip(la, lb, strict=True):
    assert jnp.shape(x) == jnp.shape(y)
    assert jnp.result_type(x) == jnp.result_type(y)
    x, y = np.asarray(x), np.asarray(y)
    if codes and x.dtype in (np.int8, np.uint8):
      diff = np.abs(x.astype(np.int64) - y)
      assert diff.max() <= 1 and (diff > 0).mean() < 0.03, diff
      continue
    np.testing.assert_allclose(
      x.astype(np.float64), y.astype(np.float64), rtol=rtol, atol=rtol
    )


def _assert_identical(a: Any, b: Any) -> None:
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


def _max_diff(a: Any, b: Any) -> float:
  return max(
    float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max())
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
  )


def _abstract(tree: Any) -> Any:
  # Flattened, so that states holding custom pytree nodes (a SparseRows
  # buffer, which has no __eq__) compare by structure and leaves.
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, [(jnp.shape(x), jnp.result_type(x)) for x in leaves]


def _types(tree: Any) -> Any:
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, [jax.typeof(x) for x in leaves]


def _is_rows(x: Any) -> bool:
  return isinstance(x, gtx.SparseRows)


def _row_leaves(tree: Any, num_rows: int) -> list[Any]:
  """The leaves of ``tree`` with ``num_rows`` leading rows (a table's
  per-row state: moments, accumulators, 8-bit codes and scales)."""
  return [x for x in jax.tree.leaves(tree) if jnp.shape(x)[:1] == (num_rows,)]


# ----------------------------------------------------------------------------
# Many cases, one program (see the module's docstring)


def together(names: list[Any], steps: list[Callable[..., Any]]):
  """``(carries, inputs) -> carries``: ``steps[i](*carries[i],
  *inputs[i])`` for every step, as one function (jit it once). An error
  raised tracing a step names its ``names[i]`` (a case, or a string)."""

  def step(carries, inputs):
    out = []
    for name, f, c, i in zip(names, steps, carries, inputs, strict=True):
      try:
        out.append(f(*c, *i))
      except Exception as e:
        e.add_note(f"conformance case: {name}")
        raise
    return out

  return step


def num_steps(cases: list[Case]) -> int:
  (steps,) = {case.steps for case in cases}
  return steps


def inputs(cases: list[Case], i: int, dtype: Any = jnp.float32) -> list[Any]:
  """Step ``i``'s ``(grads, extra)`` of every case."""
  return [(case.grads(i, dtype), _extra(case, i)) for case in cases]


def initial(
  cases: list[Case], txs: list[Any], dtype: Any = jnp.float32
) -> list[Any]:
  """``(params, tx.init(params))`` of every case. Eager: an init's ops are
  shared by every case of the same shapes (a jitted init per check is a
  new program each time, and was slower)."""
  out = []
  for case, tx in zip(cases, txs, strict=True):
    params = case.params(dtype)
    out.append((params, tx.init(params)))
  return out


def each(cases: list[Any], assertion: Callable[[int, Any], None]) -> None:
  """``assertion(k, cases[k])`` for every case (a :class:`Case`, or a
  name); fails naming every case that failed, with its message."""
  failed = []
  for k, case in enumerate(cases):
    try:
      assertion(k, case)
    except AssertionError as e:
      failed.append(f"{case}: {e}")
  if failed:
    raise AssertionError(
      f"{len(failed)} of {len(cases)} cases failed:\n" + "\n".join(failed)
    )


_REFERENCE: dict[tuple[int, ...], Any] = {}


def _group(case: Case) -> list[Case]:
  for group in (CASES, OPTIMIZERS):
    if any(c is case for c in group):
      return group
  return [case]


def _position(group: list[Case], case: Case) -> int:
  return [c is case for c in group].index(True)


def _reference_run(group: list[Case]) -> tuple[Callable[..., Any], list[Any]]:
  """``(step, carries)``: the group's steps as one jitted program, run once
  per group and process (the reference of several checks), on the CPU
  branch."""
  key = tuple(id(c) for c in group)
  if key not in _REFERENCE:
    assert not gpu_branches_active(), "the reference is the CPU branch"
    txs = [case.make_tx() for case in group]
    step = jax.jit(together(group, [step_fn(tx) for tx in txs]))
    carries = initial(group, txs)
    types = _types(carries)
    for i in range(num_steps(group)):
      carries = step(carries, inputs(group, i))
      assert _types(carries) == types, "update changed the state's types"
    _REFERENCE[key] = (step, carries)
  return _REFERENCE[key]


def reference(case: Case) -> tuple[Any, Any]:
  """``(params, state)`` after ``case``'s steps under ``jax.jit``: computed
  with the other cases of its group (:data:`CASES` or :data:`OPTIMIZERS`),
  once per process."""
  group = _group(case)
  return _reference_run(group)[1][_position(group, case)]


def _jitted_runs(
  cases: list[Case],
  txs: list[Any],
  steps: list[Callable[..., Any]] | None = None,
  carries: list[Any] | None = None,
) -> list[Any]:
  """Every case's ``(params, state)`` after its steps (default: ``txs``'
  :func:`step_fn`), all in one jitted program, from ``carries`` (default:
  :func:`initial`)."""
  step = jax.jit(together(cases, steps or [step_fn(tx) for tx in txs]))
  if carries is None:
    carries = initial(cases, txs)
  for i in range(num_steps(cases)):
    carries = step(carries, inputs(cases, i))
  return carries


def _params_match_reference(
  cases: list[Case], params: list[Any], rtol: float = 0.0
) -> None:
  """Every case's ``params`` equal its reference's, to ``max(case.rtol,
  rtol)``."""
  each(
    cases,
    lambda k, case: _assert_close(
      params[k], reference(case)[0], max(case.rtol, rtol)
    ),
  )


# ----------------------------------------------------------------------------
# Every transformation


def check_jit(cases: list[Case]) -> None:
  """A jitted update gives the eager result."""

  def check(_, case):
    _assert_close(
      _run(case, step_fn(case.make_tx())), reference(case), case.rtol
    )

  each(cases, check)


def check_init_abstract(cases: list[Case]) -> None:
  """init works on ShapeDtypeStruct leaves and agrees with concrete init."""

  def check(_, case):
    tx = case.make_tx()
    params = case.params()
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
    )
    shapes = jax.eval_shape(tx.init, abstract)
    assert _abstract(shapes) == _abstract(tx.init(params))

  each(cases, check)


def check_state_stable(cases: list[Case]) -> None:
  """bf16 params, replicated on a mesh of 8 devices: no state leaf aliases
  params or another state leaf; a jitted step donating params and state
  runs in a loop from ``init``, keeps the state's structure, shapes, dtypes
  and shardings, and the params bf16 and finite. (The float32 reference
  run keeps the state's types too.)"""
  txs = [case.make_tx() for case in cases]
  carries = initial(cases, txs, jnp.bfloat16)

  def no_alias(k, _):
    bufs = [
      x.unsafe_buffer_pointer()
      for x in jax.tree.leaves(carries[k])
      if isinstance(x, jax.Array) and x.size > 0
    ]
    assert len(bufs) == len(set(bufs)), "state leaves share buffers"

  each(cases, no_alias)
  rep = NamedSharding(jax.make_mesh((8,), ("d",)), P())
  carries = jax.device_put(carries, rep)
  step = jax.jit(together(cases, [step_fn(tx) for tx in txs]), donate_argnums=0)
  types = [_types(state) for _, state in carries]
  shardings = [jax.tree.map(lambda x: x.sharding, s) for _, s in carries]

  def stable(k, _):
    state = carries[k][1]
    assert _types(state) == types[k]
    after = jax.tree.map(lambda x: x.sharding, state)
    assert jax.tree.all(
      jax.tree.map(lambda a, b: a.is_equivalent_to(b, 0), shardings[k], after)
    )

  for i in range(num_steps(cases)):
    carries = step(carries, inputs(cases, i, jnp.bfloat16))
    each(cases, stable)

  def bf16_and_finite(k, _):
    params = jax.tree.leaves(carries[k][0])
    assert all(x.dtype == jnp.bfloat16 for x in params)
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in params)

  each(cases, bf16_and_finite)


def check_no_recompile(cases: list[Case]) -> None:
  """Updates after the first, with the same shapes, reuse the compiled
  step (the reference's)."""
  assert num_steps(cases) >= 2
  for case in cases:
    step = _reference_run(_group(case))[0]
    assert step._cache_size() == 1, f"{case.name}: update recompiled"


def check_chain_extra_args(cases: list[Case]) -> None:
  """Inside optax.chain, with the case's extra args plus an unknown one."""

  def chained_step(case):
    chained = optax.chain(gtx.scale(1.0), case.make_tx(), optax.identity())

    def step(params, state, grads, extra):
      updates, state = chained.update(
        grads, state, params, unrelated_arg=1.0, **extra
      )
      return gtx.apply_updates(params, updates), state

    return chained, step

  chains, steps = zip(*[chained_step(case) for case in cases], strict=True)
  carries = _jitted_runs(cases, chains, steps)
  _params_match_reference(cases, [p for p, _ in carries])


def _stacked(trees: list[Any]) -> Any:
  # numpy, not jnp: no eager op compiled per leaf shape
  return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *trees)


def _replicated_run(cases: list[Case], mapper: Callable[..., Any]) -> Any:
  """Every case's params after its steps, run by ``mapper(body, params,
  grads, extras)`` (``body``: init, then the steps in a scan, as in a
  training loop; one step compiled)."""
  txs = [case.make_tx() for case in cases]

  def body(params, grads_seqs, extras):
    out = []
    for tx, p, gs, es in zip(txs, params, grads_seqs, extras, strict=True):
      step = step_fn(tx)

      def one(carry, ge, step=step):
        return step(*carry, *ge), None

      out.append(jax.lax.scan(one, (p, tx.init(p)), (gs, es))[0][0])
    return out

  n = num_steps(cases)
  grads = [_stacked([c.grads(i) for i in range(n)]) for c in cases]
  extras = [_stacked([_extra(c, i) for i in range(n)]) for c in cases]
  return mapper(body, [c.params() for c in cases], grads, extras)


def check_shard_map(cases: list[Case]) -> None:
  """init and update inside jax.shard_map on 8 devices."""
  mesh = jax.make_mesh((8,), ("d",))

  def mapper(body, *args):
    f = jax.shard_map(
      body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False
    )
    return jax.jit(f)(*args)

  _params_match_reference(cases, _replicated_run(cases, mapper))


def check_pmap(cases: list[Case]) -> None:
  """init and update inside legacy jax.pmap on 8 devices."""

  def mapper(body, *args):
    out = jax.pmap(body, axis_name="d")(*_stacked([args] * 8))
    return jax.tree.map(lambda x: np.asarray(x)[0], out)

  _params_match_reference(cases, _replicated_run(cases, mapper))


CHECKS = [
  check_jit,
  check_init_abstract,
  check_no_recompile,
  check_state_stable,
  check_chain_extra_args,
  check_shard_map,
  check_pmap,
]


# ----------------------------------------------------------------------------
# Every row optimizer


def check_untouched_rows(cases: list[Case]) -> None:
  """One more step after the reference's: the rows its gradient does not
  touch (padding ids included) keep their bits in the table and in every
  per-row state leaf; the touched rows change in each."""
  group = _group(cases[0])
  assert all(_group(c) is group for c in cases), "cases of one group"
  step, carries = _reference_run(group)
  n = num_steps(group)
  new = step(carries, inputs(group, n))

  def check(_, case):
    k = _position(group, case)
    (params, state), (new_params, new_state) = carries[k], new[k]
    g = case.grads(n)
    tables = 0
    for gl, old, updated in zip(
      jax.tree.leaves(g, is_leaf=_is_rows),
      jax.tree.leaves(params),
      jax.tree.leaves(new_params),
      strict=True,
    ):
      if not _is_rows(gl):
        continue
      tables += 1
      touched = touched_rows(gl)
      assert 0 < touched.sum() < len(touched)
      v = gl.num_rows
      pairs = [(old, updated)] + list(
        zip(_row_leaves(state, v), _row_leaves(new_state, v), strict=True)
      )
      for a, b in pairs:
        a, b = np.asarray(a), np.asarray(b)
        assert a[~touched].tobytes() == b[~touched].tobytes()
        assert not np.array_equal(a[touched], b[touched])
    assert tables, "the check can fail: a SparseRows gradient is needed"

  each(cases, check)


IN_PLACE_ROWS, IN_PLACE_DIM, IN_PLACE_IDS = 50_021, 8, 64


@functools.cache
def _bf16_scatter_upcast() -> bool:
  """Whether XLA:CPU converts a bfloat16 table to float32 to scatter into
  it (jaxlib 0.10.2 does, 0.12 does not)."""
  t = jax.ShapeDtypeStruct((64, 2), jnp.bfloat16)
  i = jax.ShapeDtypeStruct((4,), jnp.int32)
  u = jax.ShapeDtypeStruct((4, 2), jnp.bfloat16)
  add = jax.jit(lambda t, i, u: t.at[i].add(u), donate_argnums=0)
  return any("convert" in x for x in row_ops(add.lower(t, i, u).compile(), 64))


def check_in_place(cases: list[Case]) -> None:
  """The compiled step on a 50,021-row table, donating params and state,
  writes the table and every per-row state leaf in place: each op making a
  whole-table value is a scatter, temporaries stay below a twentieth of
  the table, and every ``[V, ...]`` buffer aliases its donated input; the
  ids are deduplicated once (the update says they are unique, so
  apply_updates does not again). Read from the compiled program (nothing
  runs). One case: the program is the case's alone."""
  (case,) = cases
  v, d, n = IN_PLACE_ROWS, IN_PLACE_DIM, IN_PLACE_IDS
  tx = case.make_tx()
  params = {
    "emb": jax.ShapeDtypeStruct((v, d), jnp.float32),
    "w": jax.ShapeDtypeStruct((3,), jnp.float32),
  }
  state = jax.eval_shape(tx.init, params)
  grads = jax.eval_shape(
    lambda: {
      "emb": gtx.SparseRows(
        jnp.arange(n, dtype=jnp.int32) * 7, jnp.ones((n, d)), v
      ),
      "w": jnp.ones(3),
    }
  )
  compiled = (
    jax.jit(step_fn(tx), donate_argnums=(0, 1))
    .lower(params, state, grads)
    .compile()
  )
  per_row = _row_leaves((params, state), v)
  assert dedups(compiled) == (1, 0), dedups(compiled)
  if any(x.dtype == jnp.bfloat16 for x in per_row) and _bf16_scatter_upcast():
    pytest.skip(
      "this jaxlib's XLA:CPU computes a bfloat16 scatter in float32 (a "
      "whole-table convert); the newest supported jaxlib scatters bf16"
    )
  ops = row_ops(compiled, v)
  assert ops, "the check can fail: the table updates must show up"
  for line in ops:
    assert written_in_place(line), line
  row_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in per_row)
  mem = compiled.memory_analysis()
  assert mem.temp_size_in_bytes < v * d * 4 / 20
  assert mem.alias_size_in_bytes >= row_bytes, (mem, row_bytes)


def check_inject_and_drop_stale(cases: list[Case]) -> None:
  """``optax.inject_hyperparams`` of the factory, inside ``gtx.drop_stale(.,
  1)``, inside ``optax.chain`` with an unknown extra arg: fresh gradients
  give the plain steps (to float32 accuracy: injected hyperparameters are
  float32 arrays); a gradient two steps stale leaves the params and the
  inner state bit for bit; changing an injected hyperparameter in the state
  changes the next step without recompiling. (The row optimizers' chain
  check.)"""

  def make(case):
    inj = case.inject
    injected = optax.inject_hyperparams(
      inj.factory, static_args=inj.static_args
    )(**inj.kwargs)
    return optax.chain(
      gtx.scale(1.0), gtx.drop_stale(injected, 1), optax.identity()
    )

  txs = [make(case) for case in cases]
  step = jax.jit(together(cases, [step_fn(tx) for tx in txs]))
  n = num_steps(cases)

  def at(i, grad_step):
    extra = {"grad_step": jnp.int32(grad_step), "unrelated_arg": 1.0}
    return [(case.grads(i), extra) for case in cases]

  carries = initial(cases, txs)
  for i in range(n):
    carries = step(carries, at(i, i))
  _params_match_reference(cases, [p for p, _ in carries], 1e-5)
  dropped = step(carries, at(n, n - 2))  # stale by 2

  def kept(k, _):
    (params, state), (new_params, new_state) = carries[k], dropped[k]
    assert int(gtx.staleness_stats(new_state)["num_dropped"]) == 1
    _assert_identical(
      (new_params, new_state[1].inner_state), (params, state[1].inner_state)
    )

  each(cases, kept)
  base = step(carries, at(n, n))
  for case, (_, state) in zip(cases, carries, strict=True):
    hyperparams = state[1].inner_state.hyperparams
    hyperparams[case.inject.vary] = hyperparams[case.inject.vary] * 10
  changed = step(carries, at(n, n))

  def changes(k, case):
    assert _max_diff(base[k][0], changed[k][0]) > 1e-3, case.inject.vary
    assert _max_diff(base[k][0], carries[k][0]) > 1e-3

  each(cases, changes)
  assert step._cache_size() == 1, "update recompiled"


def _per_replica(case: Case, i: int, replicas: int) -> list[np.ndarray]:
  """Step ``i``'s gradient as a batch of ``replicas`` (leading axis): the
  gradient times ``replicas`` on replica ``i % replicas``, zeros (the same
  ids) elsewhere, so all_reduce's mean is exactly the gradient."""
  out = []
  for x in jax.tree.leaves(case.grads(i)):
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.integer):
      out.append(np.stack([x] * replicas))
    else:
      out.append(
        np.stack(
          [
            x * replicas if r == i % replicas else 0 * x
            for r in range(replicas)
          ]
        )
      )
  return out


def check_mirrored(cases: list[Case]) -> None:
  """``gtx.Mirrored`` on 8 replicas, all_reduce first in the chain, each
  step's gradient on one replica (scaled by 8) and zeros on the others:
  params and state equal the single-device run."""
  m = gtx.Mirrored()
  txs = [optax.chain(gtx.all_reduce(m.axis_name), c.make_tx()) for c in cases]

  def train_step(tx, treedef):
    def step(params, state, batch):
      grads = jax.tree.unflatten(treedef, [x[0] for x in batch])
      updates, state = tx.update(grads, state, params)
      return gtx.apply_updates(params, updates), state

    return step

  together_ = together(
    cases,
    [
      train_step(tx, jax.tree.structure(case.grads(0)))
      for case, tx in zip(cases, txs, strict=True)
    ],
  )

  def step(params, states, batches):  # Mirrored's (params, state, batch)
    out = together_(
      list(zip(params, states, strict=True)), [(b,) for b in batches]
    )
    return [p for p, _ in out], [s for _, s in out]

  step = m.step(step, donate_argnums=(0, 1))
  params, states = zip(*initial(cases, txs), strict=True)
  params, states = m.replicate(list(params)), m.replicate(list(states))
  for i in range(num_steps(cases)):
    batch = [_per_replica(c, i, m.num_replicas) for c in cases]
    params, states = step(params, states, m.shard_batch(batch))
  carries = list(zip(params, states, strict=True))

  def equal(k, case):
    params, state = carries[k]
    want_params, want_state = reference(case)
    rtol = max(case.rtol, 2e-5)
    _assert_close(params, want_params, rtol, codes=True)
    _assert_close(state[1], want_state, rtol, codes=True)

  each(cases, equal)


def check_row_sharded(cases: list[Case]) -> None:
  """Each table (a leaf with a SparseRows gradient) split by rows over 8
  devices of an Explicit mesh, state from ``gtx.sharded_init``: the jitted
  steps equal the single-device run, and the table and every per-row state
  leaf stay split by rows."""
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  rep = NamedSharding(mesh, P())
  txs = [case.make_tx() for case in cases]

  def place(p, g):
    spec = P("d") if _is_rows(g) else P()
    return jax.device_put(p, NamedSharding(mesh, spec))

  with jax.set_mesh(mesh):
    carries = []
    for case, tx in zip(cases, txs, strict=True):
      params = jax.tree.map(
        place, case.params(), case.grads(0), is_leaf=_is_rows
      )
      carries.append((params, gtx.sharded_init(tx, params)))
    step = jax.jit(together(cases, [step_fn(tx) for tx in txs]))
    for i in range(num_steps(cases)):
      carries = step(carries, jax.device_put(inputs(cases, i), rep))

  def split(k, case):
    want = reference(case)
    _assert_close(carries[k], want, max(case.rtol, 2e-5), codes=True)
    for g in jax.tree.leaves(case.grads(0), is_leaf=_is_rows):
      if _is_rows(g):
        per_row = _row_leaves(carries[k], g.num_rows)
        assert len(per_row) >= 1 + bool(_row_leaves(want[1], g.num_rows))
        for x in per_row:
          assert x.sharding.spec[0] == "d", x.sharding

  each(cases, split)


ROW_CHECKS = [
  check_untouched_rows,
  check_in_place,
  check_inject_and_drop_stale,
  check_mirrored,
  check_row_sharded,
]

# Checks that read each case's compiled program on its own: one test per
# case (the others run all their cases in one program).
PER_CASE = (check_in_place,)


def checks_of(case: Case) -> list[Callable[[list[Case]], None]]:
  """The checks ``case`` runs: :data:`CHECKS`, and :data:`ROW_CHECKS` for a
  row optimizer. A row optimizer's chain check is
  :func:`check_inject_and_drop_stale`, and its shard_map check
  :func:`check_mirrored` (update inside Mirrored's shard_map on 8 devices,
  with a real reduction; init inside a mapped function: check_pmap)."""
  checks = CHECKS if case.pmap else [c for c in CHECKS if c is not check_pmap]
  if case.inject is None:
    return checks
  covered = (check_chain_extra_args, check_shard_map)
  return [c for c in checks if c not in covered] + ROW_CHECKS


def runs(groups: dict[str, list[Case]]) -> list[tuple[str, Any, list[Case]]]:
  """``(id, check, cases)`` for every check a case of ``groups`` runs: the
  group's cases that run it together, or one case alone for a check of
  :data:`PER_CASE`."""
  out = []
  for check in CHECKS + ROW_CHECKS:
    for name, group in groups.items():
      cases = [c for c in group if check in checks_of(c)]
      if check in PER_CASE:
        out += [(f"{check.__name__}-{c.name}", check, [c]) for c in cases]
      elif cases:
        out.append((f"{check.__name__}-{name}", check, cases))
  return out


# ----------------------------------------------------------------------------
# The GPU branches, on CPU


def check_gpu_branches(cases: list[Case]) -> None:
  """Traced inside :data:`gpu_branches` (each platform-dependent call takes
  its accelerator code: dedup by sorting, the segment sum by a segmented
  scan, the scatter-add of duplicate ids deduplicated first), the jitted
  steps give the CPU branch's params and state, for every case whose step
  has platform-dependent code (one at least).

  A row optimizer's are the same bits: it deduplicates once and its update
  has each id once, and a two-term sum (``standard_grads`` repeats an id
  once) has one order. Elsewhere they agree to rounding: an update with
  duplicate ids is added to the param one row at a time on CPU (each add
  rounded), its duplicates summed first and added once on GPUs.
  """

  def branches(case):
    tx = case.make_tx()
    params = case.params()
    init = str(jax.make_jaxpr(tx.init)(params))
    assert "platform_index" not in init, (
      f"{case}: init has platform-dependent code: run it inside the switch"
    )
    jaxpr = jax.make_jaxpr(step_fn(tx))(
      params, jax.eval_shape(tx.init, params), case.grads(0), _extra(case, 0)
    )
    return "platform_index" in str(jaxpr)

  cases = [case for case in cases if branches(case)]
  assert cases, "the check can fail: a step with platform-dependent code"
  want = [reference(case) for case in cases]  # the CPU branch
  txs = [case.make_tx() for case in cases]
  # init has one branch (asserted above): run outside the switch, its eager
  # ops are the reference's (inside, each would compile again)
  carries = initial(cases, txs)
  with gpu_branches():
    got = _jitted_runs(cases, txs, carries=carries)

  # The accelerator code computes a row optimizer's new rows once, behind
  # an optimization barrier; run on an XLA:CPU that drops barriers before
  # fusion (jax 0.10), XLA computes them again inside the update's fusion,
  # where a reduction may sum in another order: equal to rounding there.
  kept = _jax_compat.barrier_computes_once()

  def same(k, case):
    if case.inject is not None and kept:  # a row optimizer
      _assert_identical(got[k], want[k])
    else:
      _assert_close(got[k], want[k], case.rtol, codes=case.inject is not None)

  each(cases, same)


# ----------------------------------------------------------------------------
# The cases


def user_rule(
  learning_rate: Any, b1: float = 0.9, weight_decay: Any = 0.01
) -> optax.GradientTransformation:
  """A rule as a user writes it with ``gtx.row_transformation``: momentum
  shaped like its parameter, one accumulator per row (``[V]``), and the
  parameter rows read for a decay."""

  def init(p):
    return (jnp.zeros_like(p), jnp.zeros(p.shape[:1], jnp.float32))

  def rule(g, p, m, acc):
    acc = acc + jnp.mean(g * g, axis=tuple(range(1, g.ndim)))
    m = b1 * m + (1 - b1) * g
    scale = jnp.sqrt(acc).reshape(acc.shape + (1,) * (g.ndim - 1))
    return -learning_rate * (m / (scale + 1e-8) + weight_decay * p), m, acc

  return gtx.row_transformation(rule, init, needs_params=True)


_INT8 = {"mu_dtype": "int8", "nu_dtype": "int8"}

# Each built-in row optimizer, and the options that change its state or
# code path (momentum, catch-up, 8-bit and bf16 state, weight decay,
# schedules), once; and a user's rule. Options that only change the formula
# are checked against the numpy references in the optimizers' own modules.
OPTIMIZERS = [
  optimizer("lazy_adam", gtx.lazy_adam, pmap=True, learning_rate=0.05),
  optimizer(
    "lazy_adamw_schedule_catch_up",
    gtx.lazy_adamw,
    static_args=("catch_up",),
    vary="weight_decay",
    learning_rate=optax.cosine_decay_schedule(0.1, 10),
    weight_decay=0.1,
    catch_up=True,
  ),
  # A bf16 first moment rounds differently when jit fuses its update into
  # an FMA; one bf16 ulp of m moves later steps by ~1e-4 (optax.adam with
  # mu_dtype=bf16 does the same).
  optimizer(
    "lazy_adam_mu_bf16_nu_int8",
    gtx.lazy_adam,
    static_args=("mu_dtype", "block_size"),
    rtol=1e-3,
    learning_rate=0.05,
    mu_dtype=jnp.bfloat16,
    nu_dtype="int8",
  ),
  optimizer(
    "lazy_adamw_int8_catch_up",
    gtx.lazy_adamw,
    static_args=("block_size", "catch_up"),
    pmap=True,
    learning_rate=0.05,
    block_size=2,
    catch_up=True,
    **_INT8,
  ),
  optimizer("adagrad", gtx.adagrad, learning_rate=0.1),
  optimizer(
    "adagrad_int8",
    gtx.adagrad,
    static_args=("block_size",),
    learning_rate=0.1,
    accumulator_dtype="int8",
  ),
  optimizer(
    "rowwise_adagrad_schedule",
    gtx.rowwise_adagrad,
    vary="weight_decay",
    pmap=True,
    learning_rate=optax.cosine_decay_schedule(0.1, 10),
    weight_decay=0.01,
  ),
  optimizer(
    "ftrl_l2_shrinkage",
    gtx.ftrl,
    static_args=("accumulator_dtype",),
    learning_rate=0.1,
    l1_regularization_strength=0.01,
    l2_shrinkage_regularization_strength=0.05,
    accumulator_dtype=jnp.float32,
  ),
  optimizer("lazy_sgd", gtx.lazy_sgd, learning_rate=0.1),
  optimizer(
    "lazy_sgd_nesterov",
    gtx.lazy_sgd,
    learning_rate=0.05,
    momentum=0.9,
    nesterov=True,
  ),
  optimizer(
    "user_rule", user_rule, pmap=True, learning_rate=0.05, weight_decay=0.1
  ),
  optimizer(
    "partial_rowwise_adam_schedule",
    gtx.partial_rowwise_adam,
    vary="weight_decay",
    learning_rate=optax.cosine_decay_schedule(0.1, 10),
    b2=0.99,
    weight_decay=0.01,
  ),
]


def _bound_to_unit_axis(tx):
  """``tx`` with its axis "r" bound by a vmap of size 1, where the
  reduction is the identity: lets the suite run all_reduce outside a
  mapped step."""

  def update_fn(updates, state, params=None, **extra):
    def one(u):
      return tx.update(u, state, params, **extra)

    return jax.vmap(one, axis_name="r", axis_size=1, in_axes=None,
                    out_axes=None)(updates)  # fmt: skip

  return optax.GradientTransformationExtraArgs(tx.init, update_fn)


def _dense_standard_grads(step, dtype=jnp.float32):
  g = standard_grads(step, dtype)
  return {**g, "emb": g["emb"].to_dense()}


def lagging(i: int) -> dict[str, int]:
  """``grad_step`` of call ``i``: with max_staleness=1, accept, accept,
  drop (staleness 2), accept, ..."""
  return {"grad_step": max(0, i - 2)}


STANDARD_ROWS = {"emb": IDS_PER_STEP, "w": None, "b": None}

CASES = [
  # The sparse-aware transforms.
  # (scale_by_learning_rate with a constant rate is this scale.)
  Case("scale", lambda: gtx.scale(-0.1)),
  Case(
    "scale_by_learning_rate_schedule",
    lambda: gtx.scale_by_learning_rate(optax.cosine_decay_schedule(0.1, 5)),
  ),
  Case("clip_by_global_norm", lambda: gtx.clip_by_global_norm(0.5)),
  Case("add_decayed_weights", lambda: gtx.add_decayed_weights(0.01)),
  Case("densify", lambda: optax.chain(gtx.densify(), optax.sgd(0.1))),
  # accumulate: a sparse table + dense leaves, a schedule for k (1, then 2)
  # with its static bound, and a stateful sparse inner (its learning rate
  # schedule counts).
  Case(
    "accumulate_sparse_schedule",
    lambda: gtx.accumulate(
      gtx.scale_by_learning_rate(optax.linear_schedule(0.1, 0.01, 4)),
      lambda n: jnp.where(n < 1, 1, 2).astype(jnp.int32),
      rows_per_step=STANDARD_ROWS,
      max_every_k=2,
    ),
  ),
  # Dense only, bf16 params and gradients, float32 accumulator, Adam, k=2.
  Case(
    "accumulate_dense_adam_bf16_f32_accumulator",
    lambda: gtx.accumulate(optax.adam(0.1), 2, accumulator_dtype=jnp.float32),
    params=lambda dtype=None: standard_params(jnp.bfloat16),
    grads=lambda step, dtype=None: _dense_standard_grads(step, jnp.bfloat16),
    rtol=1e-2,
  ),
  Case(
    "accumulate_sparse_k1",
    lambda: gtx.accumulate(gtx.scale_by_learning_rate(0.1), 1),
  ),
  # drop_stale: sparse updates through accumulate's SparseRows buffers (a
  # row optimizer inside it: check_inject_and_drop_stale).
  Case(
    "drop_stale_accumulate_sgd_rescale",
    lambda: gtx.drop_stale(
      gtx.accumulate(
        gtx.scale_by_learning_rate(0.1), 2, rows_per_step=STANDARD_ROWS
      ),
      1,
      rescale=True,
    ),
    extra_args=lagging,
  ),
  # optax.inject_hyperparams makes max_staleness a traced int32 array.
  Case(
    "inject_drop_stale_densify_adam",
    lambda: optax.inject_hyperparams(gtx.drop_stale)(
      inner=optax.chain(gtx.densify(), optax.adam(0.1)), max_staleness=1
    ),
    extra_args=lagging,
  ),
  # track_changes passes the updates through; its record's checks:
  # tests/test_publish.py.
  Case("track_changes", lambda: gtx.track_changes()),
  # all_reduce alone; its chains with optimizers: check_mirrored.
  Case("all_reduce_mean", lambda: _bound_to_unit_axis(gtx.all_reduce("r"))),
]


# ----------------------------------------------------------------------------
# Helpers of the capability tests


def sparse_rows(rng, num_rows, row_shape, n, dtype=jnp.float32, scale=1.0):
  """Random ids with a forced duplicate and two padding ids."""
  ids = rng.randint(0, num_rows, size=n)
  ids[1] = ids[0]
  ids[2] = -1
  ids[3] = num_rows + 2
  vals = rng.normal(size=(n, *row_shape)) * scale
  return gtx.SparseRows(cast(ids, jnp.int32), cast(vals, dtype), num_rows)


def touched_rows(g: gtx.SparseRows) -> np.ndarray:
  """``[num_rows]`` bool: the rows ``g`` has a valid (non-padding) id of."""
  idx = np.asarray(g.indices)
  touched = np.zeros(g.num_rows, bool)
  touched[idx[(idx >= 0) & (idx < g.num_rows)]] = True
  return touched


# ----------------------------------------------------------------------------
# The optimizer tests' tree: two tables (one with [2, 2] rows), two dense
# leaves, against the numpy references of ``references_*``.

SHAPES = {"emb": (40, 3), "tab": (25, 2, 2), "w": (3, 2), "b": ()}
SPARSE = ("emb", "tab")


def make_params(seed=0, dtype=jnp.float32, zero=False):
  """Seeded normal leaves of SHAPES (zeros with ``zero``)."""
  rng = np.random.RandomState(seed)
  return {
    k: cast(0 * zero + (not zero) * rng.normal(size=s), dtype)
    for k, s in SHAPES.items()
  }


def make_grads(step, n=9, dtype=jnp.float32, sparse=SPARSE):
  """SparseRows of ``n`` ids with a duplicate and two padding ids (-1, too
  big) for the ``sparse`` leaves, dense for the others; seeded by ``step``."""
  rng = np.random.RandomState(1000 + step)
  out = {}
  for k, s in SHAPES.items():
    if k in sparse:
      out[k] = sparse_rows(rng, s[0], s[1:], n, dtype)
    else:
      out[k] = cast(rng.normal(size=s), dtype)
  return out


def to_ref(grads):
  """``make_grads``' gradients for a numpy reference: float64 arrays, and
  ``(indices, values, num_rows)`` for a SparseRows."""
  return {
    k: (np.asarray(g.indices), np.asarray(g.values, np.float64), g.num_rows)
    if isinstance(g, gtx.SparseRows)
    else np.asarray(g, np.float64)
    for k, g in grads.items()
  }


def run_with_references(configs, steps=12):
  """For each ``name: (make_tx, make_ref)`` of ``configs``: ``steps``
  updates of ``make_tx()`` from ``make_params()`` on ``make_grads(i)``
  (every config's in one jitted program), and the same gradients on the
  numpy reference ``make_ref(params)``. ``{name: (params, state,
  reference)}`` at the end."""
  names = list(configs)
  txs = [configs[n][0]() for n in names]
  params = make_params()
  # the inits in one program (eagerly, each op compiles for its shapes)
  carries = jax.jit(lambda p: [(p, tx.init(p)) for tx in txs])(params)
  step = jax.jit(together(names, [step_fn(tx) for tx in txs]))
  refs = [
    configs[n][1]({k: np.asarray(v) for k, v in params.items()}) for n in names
  ]
  for i in range(steps):
    g = make_grads(i)
    carries = step(carries, [(g,)] * len(names))
    for r in refs:
      r.step(to_ref(g))
  return {n: (*c, r) for n, c, r in zip(names, carries, refs, strict=True)}
