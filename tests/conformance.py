"""The conformance suite every gradtx transformation is run through.

A capability's test module builds :class:`Case` objects and runs every check
in :data:`CHECKS` on them::

  @pytest.mark.parametrize("case", CASES, ids=str)
  @pytest.mark.parametrize("check", CHECKS)
  def test_conformance(case, check):
    check(case)

The checks: jit agrees with eager; init from ``jax.ShapeDtypeStruct``; no
recompilation on a second update; state structure/shape/dtype/sharding kept
by update (on 8 devices); optax.chain with extra args; inside
``jax.shard_map`` and ``jax.pmap``; bf16 params keep their dtype; a jitted
step that donates params and state runs in a loop straight from ``init``
(no aliasing between state leaves and params).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradtx as gtx

NUM_ROWS = 32
DIM = 4
IDS_PER_STEP = 6


def standard_params(dtype: Any = jnp.float32) -> dict[str, jax.Array]:
  """A small embedding table plus dense leaves."""
  rng = np.random.RandomState(0)
  return {
    "emb": jnp.asarray(rng.normal(size=(NUM_ROWS, DIM)), dtype),
    "w": jnp.asarray(rng.normal(size=(DIM, 3)), dtype),
    "b": jnp.asarray(rng.normal(size=(3,)), dtype),
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
      jnp.asarray(ids, jnp.int32),
      jnp.asarray(rng.normal(size=(IDS_PER_STEP, DIM)), dtype),
      NUM_ROWS,
    ),
    "w": jnp.asarray(rng.normal(size=(DIM, 3)), dtype),
    "b": jnp.asarray(rng.normal(size=(3,)), dtype),
  }


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
  """

  name: str
  make_tx: Callable[[], optax.GradientTransformation]
  params: Callable[..., Any] = standard_params
  grads: Callable[..., Any] = standard_grads
  extra_args: Callable[[int], dict[str, Any]] = lambda step: {}
  steps: int = 3
  rtol: float = 1e-5

  def __str__(self) -> str:
    return self.name


def _extra(case: Case, i: int) -> dict[str, Any]:
  return {k: jnp.asarray(v) for k, v in case.extra_args(i).items()}


def step_fn(tx: optax.GradientTransformation) -> Callable[..., Any]:
  """``(params, state, grads, extra=None) -> (params, state)``: one update
  (``extra``: the keyword args of ``update``) and apply_updates."""

  def step(params, state, grads, extra=None):
    updates, state = tx.update(grads, state, params, **(extra or {}))
    return gtx.apply_updates(params, updates), state

  return step


def _run(case: Case, step: Callable[..., Any], dtype: Any = jnp.float32):
  tx = case.make_tx()
  params = case.params(dtype)
  state = tx.init(params)
  for i in range(case.steps):
    params, state = step(params, state, case.grads(i, dtype), _extra(case, i))
  return params, state


def _assert_close(a: Any, b: Any, rtol: float) -> None:
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb, f"tree mismatch: {ta} vs {tb}"
  for x, y in zip(la, lb, strict=True):
    assert jnp.shape(x) == jnp.shape(y)
    assert jnp.result_type(x) == jnp.result_type(y)
    np.testing.assert_allclose(
      np.asarray(x, np.float64),
      np.asarray(y, np.float64),
      rtol=rtol,
      atol=rtol,
    )


def _abstract(tree: Any) -> Any:
  # Flattened, so that states holding custom pytree nodes (a SparseRows
  # buffer, which has no __eq__) compare by structure and leaves.
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, [(jnp.shape(x), jnp.result_type(x)) for x in leaves]


def _types(tree: Any) -> Any:
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, [jax.typeof(x) for x in leaves]


_JITTED: dict[tuple[int, str], Any] = {}


def _jitted_run(case: Case) -> Any:
  """``case``'s steps under jit, run once per case (the reference of
  several checks)."""
  key = (id(case), case.name)
  if key not in _JITTED:
    _JITTED[key] = _run(case, jax.jit(step_fn(case.make_tx())))
  return _JITTED[key]


def check_jit(case: Case) -> None:
  """A jitted update gives the eager result."""
  eager = _run(case, step_fn(case.make_tx()))
  _assert_close(eager, _jitted_run(case), case.rtol)


def check_init_abstract(case: Case) -> None:
  """init works on ShapeDtypeStruct leaves and agrees with concrete init."""
  tx = case.make_tx()
  params = case.params()
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
  )
  shapes = jax.eval_shape(tx.init, abstract)
  assert _abstract(shapes) == _abstract(tx.init(params))


def check_no_recompile(case: Case) -> None:
  """A second update with the same shapes reuses the compiled step."""
  tx = case.make_tx()
  step = jax.jit(step_fn(tx))
  params = case.params()
  state = tx.init(params)
  for i in range(max(case.steps, 3)):
    params, state = step(params, state, case.grads(i), _extra(case, i))
  assert step._cache_size() == 1, "update recompiled"


def check_state_stable(case: Case) -> None:
  """Update keeps state structure, shapes, dtypes and shardings, on a mesh
  of 8 devices with replicated params."""
  mesh = jax.make_mesh((8,), ("d",))
  rep = NamedSharding(mesh, P())
  tx = case.make_tx()
  params = jax.device_put(case.params(), rep)
  state = jax.device_put(tx.init(params), rep)
  step = jax.jit(step_fn(tx))
  before = _types(state)
  sharding_before = jax.tree.map(lambda x: x.sharding, state)
  for i in range(case.steps):
    params, state = step(params, state, case.grads(i), _extra(case, i))
    assert _types(state) == before
    after = jax.tree.map(lambda x: x.sharding, state)
    assert jax.tree.all(
      jax.tree.map(
        lambda a, b: a.is_equivalent_to(b, 0), sharding_before, after
      )
    )


def check_chain_extra_args(case: Case) -> None:
  """Inside optax.chain, with the case's extra args plus an unknown one."""
  tx = case.make_tx()
  chained = optax.chain(gtx.scale(1.0), tx, optax.identity())
  alone = _jitted_run(case)
  params = case.params()
  state = chained.init(params)
  step = jax.jit(
    lambda p, s, g, e: (lambda u_s: (gtx.apply_updates(p, u_s[0]), u_s[1]))(
      chained.update(g, s, p, unrelated_arg=1.0, **e)
    )
  )
  for i in range(case.steps):
    params, state = step(params, state, case.grads(i), _extra(case, i))
  _assert_close(alone[0], params, case.rtol)


def _replicated_run(case: Case, mapper: Callable[..., Any]) -> Any:
  tx = case.make_tx()
  step = step_fn(tx)

  def body(params, grads_seq, extras):
    # The steps in a scan, as in a training loop (one step compiled).
    def one(carry, ge):
      return step(*carry, *ge), None

    carry = (params, tx.init(params))
    return jax.lax.scan(one, carry, (grads_seq, extras))[0][0]

  grads_seq = jax.tree.map(
    lambda *xs: jnp.stack(xs), *[case.grads(i) for i in range(case.steps)]
  )
  extras = jax.tree.map(
    lambda *xs: jnp.stack(xs), *[_extra(case, i) for i in range(case.steps)]
  )
  return mapper(body, case.params(), grads_seq, extras)


def check_shard_map(case: Case) -> None:
  """init and update inside jax.shard_map on 8 devices."""
  mesh = jax.make_mesh((8,), ("d",))

  def mapper(body, *args):
    f = jax.shard_map(
      body, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False
    )
    return jax.jit(f)(*args)

  expected = _jitted_run(case)[0]
  _assert_close(expected, _replicated_run(case, mapper), case.rtol)


def check_pmap(case: Case) -> None:
  """init and update inside legacy jax.pmap on 8 devices."""

  def mapper(body, *args):
    stacked = jax.tree.map(lambda x: jnp.stack([x] * 8), args)
    out = jax.pmap(body, axis_name="d")(*stacked)
    return jax.tree.map(lambda x: x[0], out)

  expected = _jitted_run(case)[0]
  _assert_close(expected, _replicated_run(case, mapper), case.rtol)


def check_bf16(case: Case) -> None:
  """bf16 params stay bf16; state dtypes do not drift."""
  tx = case.make_tx()
  step = jax.jit(step_fn(tx))
  params = case.params(jnp.bfloat16)
  state = tx.init(params)
  before = _abstract(state)
  for i in range(case.steps):
    params, state = step(
      params, state, case.grads(i, jnp.bfloat16), _extra(case, i)
    )
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
  assert _abstract(state) == before
  assert all(
    bool(jnp.all(jnp.isfinite(x.astype(jnp.float32))))
    for x in jax.tree.leaves(params)
  )


def check_donation(case: Case) -> None:
  """A step donating params and state runs in a loop straight from init;
  no state leaf aliases params or another state leaf."""
  tx = case.make_tx()
  params = case.params()
  state = tx.init(params)
  bufs = [
    x.unsafe_buffer_pointer()
    for x in jax.tree.leaves((params, state))
    if isinstance(x, jax.Array) and x.size > 0
  ]
  assert len(bufs) == len(set(bufs)), "state leaves share buffers"
  step = jax.jit(step_fn(tx), donate_argnums=(0, 1))
  for i in range(case.steps):
    params, state = step(params, state, case.grads(i), _extra(case, i))
  jax.block_until_ready((params, state))


CHECKS = [
  check_jit,
  check_init_abstract,
  check_no_recompile,
  check_state_stable,
  check_chain_extra_args,
  check_shard_map,
  check_pmap,
  check_bf16,
  check_donation,
]


def sparse_rows(rng, num_rows, row_shape, n, dtype=jnp.float32, scale=1.0):
  """Random ids with a forced duplicate and two padding ids."""
  ids = rng.randint(0, num_rows, size=n)
  ids[1] = ids[0]
  ids[2] = -1
  ids[3] = num_rows + 2
  vals = rng.normal(size=(n, *row_shape)) * scale
  return gtx.SparseRows(
    jnp.asarray(ids, jnp.int32), jnp.asarray(vals, dtype), num_rows
  )


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
    k: jnp.asarray(0 * zero + (not zero) * rng.normal(size=s), dtype)
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
      out[k] = jnp.asarray(rng.normal(size=s), dtype)
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


def run_with_reference(tx, make_ref, steps=12):
  """``steps`` jitted updates of ``tx`` from ``make_params()`` on
  ``make_grads(i)``, and the same gradients on the numpy reference
  ``make_ref(params)``: ``(params, state, reference)`` at the end."""
  params = make_params()
  state = tx.init(params)
  step = jax.jit(step_fn(tx))
  r = make_ref({k: np.asarray(v) for k, v in params.items()})
  for i in range(steps):
    g = make_grads(i)
    params, state = step(params, state, g)
    r.step(to_ref(g))
  return params, state, r
