"""A differential fuzzer for the rewrite: random losses against JAX.

Each example draws a program -- one or two tables, each read one to three
times (indexing, ``jnp.take`` and ``.at[].get`` in every mode,
``dynamic_slice``, a scalar index, ``gtx.lookup`` with or without its
bounds check) with ids of a drawn integer dtype, after a drawn chain of
casts of the table, maybe through ``stop_gradient`` (frozen), inside a
drawn wrapper (``jit``, ``remat`` with a policy, ``scan`` over ids,
``lax.map``, remat over vmap over ``lax.map``, ``fori_loop`` computing its
ids, ``vmap`` over ids or over tables, ``cond``, ``while_loop``, a
``custom_vjp``, a ``shard_map``), plus maybe a use that keeps the table
dense (a tied projection, a slice, a decay term), maybe other leaves that
are no tables (kernels, biases, scalars; frozen or not) and frozen tables,
and an aux output -- and checks ``gtx.sparse_value_and_grad`` against
``jax.value_and_grad``:

* the same error class when JAX raises, none when it does not;
* the same value and aux, and the same gradients (SparseRows densified);
* the sparse/dense verdict the program's construction implies, in the
  report, with a SparsityWarning exactly for the constructs gradtx warns on;
* no SparseRows for a leaf that is not read as rows;
* no leaked tracer (``jax.checking_leaks``, which turns JAX's caches off:
  one program in ``LEAK_SHARE``).

``make test`` runs a bounded, reproducible set on each environment, seeded
by its jax version, so that the two environments of ``make test`` check
different programs; ``make fuzz`` runs many more
(``GRADTX_FUZZ_EXAMPLES``, random seeds, every program leak-checked).
Every finding gets a regression test of its own in ``test_jaxpr.py``.
"""

import contextlib
import dataclasses
import os
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import gradtx as gtx
from gradtx._lookup import DENSE_READS_PER_ROW

D = 3
LONG = int(os.environ.get("GRADTX_FUZZ_EXAMPLES", "0"))
SETTINGS = settings(
  max_examples=LONG or 20,
  deadline=None,
  database=None,
  suppress_health_check=list(HealthCheck),
)
# The bounded run's seed: fixed for one environment, another for the other.
BOUNDED = (
  (lambda test: test) if LONG else seed(zlib.crc32(jax.__version__.encode()))
)

# Leak checks disable JAX's caches (every call compiles afresh): the bounded
# run checks one program in LEAK_SHARE, the long one all of them.
LEAK_SHARE = 1 if LONG else 4

ID_DTYPES = ("int32", "uint8", "int8", "int16", "uint16", "uint32")
READS = (
  "index",
  "take",
  "take_clip",
  "take_fill",
  "get_fill",
  "get_clip",
  "lookup",
  "lookup_checked",  # gtx.lookup(bounds_check=True), ids in range
)
SCALAR_READS = ("dynamic_slice", "scalar_index")
CASTS = ((), ("bfloat16",), ("bfloat16", "float32"), ("float16", "float32"))
# wrapper -> (keeps the table sparse, warns)
WRAPPERS = {
  "none": (True, False),
  "jit": (True, False),
  "remat": (True, False),
  "remat_dots": (True, False),
  "scan": (True, False),
  "map": (True, False),
  "remat_vmap_map": (True, False),
  "fori": (True, False),
  "vmap_ids": (True, False),
  "jit_in_scan": (True, False),
  "vmap_table": (False, False),
  "cond": (False, False),
  "switch": (False, False),
  "while": (False, False),
  "custom_vjp": (False, False),
  "shard_map": (False, True),
}
DENSE_USES = ("none", "tied", "slice", "decay", "reduction")
# wrappers that map or loop over a vector of ids
OVER_IDS = ("scan", "jit_in_scan", "map", "remat_vmap_map", "fori", "vmap_ids")
# Other leaves: (shape, whether it is a frozen table: read only as rows
# after stop_gradient). Only a frozen table may get a SparseRows.
LAYERS = {
  "kernel": ((D, D), False),
  "bias": ((D,), False),
  "frozen_kernel": ((D, D), False),
  "frozen_bias": ((D,), False),
  "frozen_scalar": ((), False),
  "frozen_table": ((5, D), True),
  "frozen_rows_and_sum": ((5, D), False),
}
# where a read goes through stop_gradient: not, before or after the casts
FREEZE = (None, None, None, "before", "after")


@dataclasses.dataclass(frozen=True)
class Read:
  kind: str
  wrapper: str
  id_dtype: str
  ids: tuple[int, ...]
  casts: tuple[str, ...]
  freeze: str | None = None  # stop_gradient "before" / "after" the casts


@dataclasses.dataclass(frozen=True)
class Program:
  rows: tuple[int, ...]  # per table
  reads: tuple[tuple[Read, ...], ...]  # per table
  dense_use: tuple[str, ...]  # per table
  aux: bool
  jit: bool
  seed: int
  layers: tuple[str, ...] = ()  # other leaves, of LAYERS


@st.composite
def programs(draw):
  n_tables = draw(st.integers(1, 2))
  rows = tuple(draw(st.sampled_from((5, 9, 300))) for _ in range(n_tables))
  reads = []
  for v in rows:
    table_reads = []
    for _ in range(draw(st.integers(1, 3))):
      scalar = draw(st.booleans()) and draw(st.booleans())
      kind = draw(st.sampled_from(SCALAR_READS if scalar else READS))
      dtype = draw(st.sampled_from(ID_DTYPES))
      info = np.iinfo(dtype)
      lo, hi = max(int(info.min), -v - 3), min(int(info.max), v + 3)
      if kind == "lookup_checked":  # in range: the check passes
        lo, hi = max(int(info.min), 0), min(int(info.max), v - 1)
      n = 1 if scalar else draw(st.integers(1, 5))
      ids = tuple(draw(st.integers(lo, hi)) for _ in range(n))
      wrapper = draw(st.sampled_from(sorted(WRAPPERS)))
      if scalar and wrapper in OVER_IDS:
        wrapper = "jit"
      casts = draw(st.sampled_from(CASTS))
      freeze = draw(st.sampled_from(FREEZE))
      table_reads.append(Read(kind, wrapper, dtype, ids, casts, freeze))
    reads.append(tuple(table_reads))
  dense_use = tuple(
    draw(st.sampled_from(DENSE_USES)) if draw(st.booleans()) else "none"
    for _ in rows
  )
  return Program(
    rows,
    tuple(reads),
    dense_use,
    draw(st.booleans()),
    draw(st.booleans()) or draw(st.booleans()),
    draw(st.integers(0, 2**16)),
    tuple(draw(st.lists(st.sampled_from(sorted(LAYERS)), max_size=2))),
  )


def _read_rows(t, ids, kind):
  """Rows of ``t`` (after casts) for ``ids``, as ``[..., D]``."""
  if kind == "index":
    return t[ids]
  if kind == "take":
    return jnp.take(t, ids, axis=0)
  if kind == "take_clip":
    return jnp.take(t, ids, axis=0, mode="clip")
  if kind == "take_fill":
    return jnp.take(t, ids, axis=0, mode="fill", fill_value=0.25)
  if kind == "get_fill":
    return t.at[ids].get(mode="fill", fill_value=-0.5)
  if kind == "get_clip":
    return t.at[ids].get(mode="clip")
  if kind == "dynamic_slice":
    return lax.dynamic_slice(t, (ids, jnp.zeros((), ids.dtype)), (1, D))
  if kind in ("lookup", "lookup_checked"):
    return gtx.lookup(t, ids, bounds_check=kind == "lookup_checked")
  return t[ids]  # scalar_index


def _cast(t, casts):
  for c in casts:
    t = t.astype(c)
  return t


def _score(rows, w):
  return jnp.sum(jnp.tanh(rows.astype(jnp.float32) @ w))


def _one_read(t, ids, r: Read, w, pad=False):
  """The loss term of one read inside its wrapper (``pad``: each id read
  twice, the second copy thrown away, for JAX's reference gradient; see
  ``_jax_one_id_bug``)."""

  def plain(t, ids):
    t = lax.stop_gradient(t) if r.freeze == "before" else t
    t = _cast(t, r.casts)
    t = lax.stop_gradient(t) if r.freeze == "after" else t
    if pad and r.kind in READS and ids.ndim == 1:
      n = ids.shape[0]
      return _score(_read_rows(t, jnp.concatenate([ids, ids]), r.kind)[:n], w)
    return _score(_read_rows(t, ids, r.kind), w)

  wr = r.wrapper
  if wr == "none":
    return plain(t, ids)
  if wr == "jit":
    return jax.jit(plain)(t, ids)
  if wr == "remat":
    return jax.checkpoint(plain)(t, ids)
  if wr == "remat_dots":
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return jax.checkpoint(plain, policy=policy)(t, ids)
  if wr in ("scan", "jit_in_scan"):
    step = jax.jit(plain) if wr == "jit_in_scan" else plain

    def body(c, i):
      return c + step(t, i[None]), None

    return lax.scan(body, jnp.float32(0), ids)[0]
  if wr == "map":
    return jnp.sum(lax.map(lambda i: plain(t, i[None]), ids))
  if wr == "remat_vmap_map":  # issue 27's construct

    def row(i):  # [1] ids
      return jnp.sum(lax.map(lambda j: plain(t, j[None]), i))

    policy = jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint(
      lambda ids: jnp.sum(jax.vmap(row)(ids[:, None])),
      policy=policy,
      prevent_cse=True,
    )(ids)
  if wr == "fori":
    v = t.shape[0]

    def body(k, c):  # ids computed in the loop, in their own dtype
      i = ((ids.astype(jnp.int32) + k) % v).astype(ids.dtype)
      return c + plain(t, i)

    return lax.fori_loop(0, 2, body, jnp.float32(0))
  if wr == "vmap_ids":
    return jnp.sum(jax.vmap(lambda i: plain(t, i[None]))(ids))
  if wr == "vmap_table":
    both = jnp.stack([t, t * 0.5])
    return jnp.sum(jax.vmap(lambda tt: plain(tt, ids))(both))
  if wr == "cond":
    zero = lambda t, i: 0.0 * jnp.sum(t, dtype=jnp.float32)  # noqa: E731
    return lax.cond(w[0] < 1e30, plain, zero, t, ids)
  if wr == "switch":
    zero = lambda t, i: 0.0 * jnp.sum(t, dtype=jnp.float32)  # noqa: E731
    index = (w[0] > 0).astype(jnp.int32)
    return lax.switch(index, [zero, plain], t, ids)
  if wr == "while":

    def body(c):
      return c[0] + 1, c[1] + plain(t, ids)

    return lax.while_loop(lambda c: c[0] < 1, body, (0, jnp.float32(0)))[1]
  if wr == "custom_vjp":

    @jax.custom_vjp
    def ident(x):
      return x

    ident.defvjp(lambda x: (x, None), lambda _, g: (g,))
    return plain(ident(t), ids)
  assert wr == "shard_map"
  mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
  read = jax.shard_map(
    lambda t: plain(t, ids), mesh=mesh, in_specs=P(), out_specs=P()
  )
  return read(t)


def _dense_use(t, use):
  if use == "tied":
    return jnp.sum(jnp.tanh(t @ jnp.ones((D,), t.dtype)) * 0.1)
  if use == "slice":
    return jnp.sum(t[:2] ** 2)
  if use == "decay":
    return 1e-3 * jnp.sum(t**2)
  if use == "reduction":
    return jnp.max(t) * 0.01
  return 0.0


def _layer(x, kind, w):
  """The loss term of another leaf, of ``LAYERS``."""
  f = lax.stop_gradient(x) if kind.startswith("frozen") else x
  if kind in ("kernel", "frozen_kernel"):
    return jnp.sum(jnp.tanh(w @ f))
  if kind in ("bias", "frozen_bias"):
    return jnp.sum(jnp.tanh(w + f))
  if kind == "frozen_scalar":
    return jnp.sum(w * f)
  rows = _score(f[jnp.array([0, 3, 3])], w)
  return rows + (0.1 * jnp.sum(f) if kind == "frozen_rows_and_sum" else 0.0)


def _jax_one_id_bug(prog: Program) -> bool:
  """Whether ``prog`` reads with 8-bit ids: there ``jax.grad`` of a read of
  one id is wrong on jax 0.10.2 (``jnp.take(t, uint8 [44])`` of a 300-row
  table reads row 44, and its gradient is zero: XLA:CPU's scatter of one
  index checks its bounds in the index's dtype, where 299 is 43; fixed by
  jax 0.12; a scan over ids reads one id per step), so JAX's reference
  reads each id twice and throws the copy away."""
  return any(
    np.dtype(r.id_dtype).itemsize == 1 for reads in prog.reads for r in reads
  )


def _build(prog: Program, pad=False):
  rng = np.random.RandomState(prog.seed)
  tables = [
    jnp.asarray(rng.normal(size=(v, D)) * 2, jnp.float32) for v in prog.rows
  ]
  params = {"w": jnp.asarray(rng.normal(size=(D,)), jnp.float32)}
  params.update({f"t{k}": t for k, t in enumerate(tables)})
  for k, kind in enumerate(prog.layers):
    shape = LAYERS[kind][0]
    params[f"l{k}"] = jnp.asarray(rng.normal(size=shape), jnp.float32)
  ids = [
    [
      np.asarray(r.ids, r.id_dtype).reshape(
        () if len(r.ids) == 1 and (r.kind in SCALAR_READS) else (-1,)
      )
      for r in reads
    ]
    for reads in prog.reads
  ]

  def loss(p, ids):
    total = jnp.float32(0)
    for k, reads in enumerate(prog.reads):
      t = p[f"t{k}"]
      for r, i in zip(reads, ids[k], strict=True):
        total = total + _one_read(t, i, r, p["w"], pad)
      total = total + _dense_use(t, prog.dense_use[k])
    for k, kind in enumerate(prog.layers):
      total = total + _layer(p[f"l{k}"], kind, p["w"])
    if prog.aux:
      return total, {"twice": 2 * total}
    return total

  return loss, params, ids


def _expected_sparse(prog: Program, k: int) -> tuple[bool, bool]:
  """(sparse, warns) for table k by construction."""
  # the first use that keeps a table dense is the one reported (and warned
  # about): the reads come first, in order, then the dense use
  for r in prog.reads[k]:
    keeps_sparse, warns = WRAPPERS[r.wrapper]
    if not keeps_sparse:
      return False, warns
  if prog.dense_use[k] != "none":
    return False, False
  return True, False


def _every_row(prog: Program, k: int) -> bool:
  """A sparse table k read this many times per row in one call gets one
  summed row per table row (reads through stop_gradient have no gradient:
  they do not count)."""
  reads = sum(
    len(r.ids) * (2 if r.wrapper == "fori" else 1)
    for r in prog.reads[k]
    if not r.freeze
  )
  return reads >= DENSE_READS_PER_ROW * prog.rows[k]


def _tol(prog: Program):
  low = any(r.casts for reads in prog.reads for r in reads)
  return dict(rtol=2e-2, atol=2e-2) if low else dict(rtol=1e-5, atol=1e-5)


def _call(f, prog, params, ids):
  return (jax.jit(f) if prog.jit else f)(params, ids)


@pytest.mark.leak_check
@BOUNDED
@SETTINGS
@given(programs())
def test_random_losses_match_jax(prog):
  check(prog, event)


def check(prog: Program, record=lambda _: None) -> None:
  """gtx against JAX on ``prog``; ``record`` notes what happened."""
  loss, params, ids = _build(prog)
  reference = _build(prog, pad=_jax_one_id_bug(prog))[0]
  jvg = jax.value_and_grad(reference, has_aux=prog.aux)
  try:
    want_v, want = _call(jvg, prog, params, ids)
  except Exception as e:  # jax refuses: gradtx must refuse too
    record(f"jax raised {type(e).__name__}")
    with pytest.raises(type(e)), warnings.catch_warnings():
      warnings.simplefilter("ignore", gtx.SparsityWarning)
      _call(
        gtx.sparse_value_and_grad(loss, has_aux=prog.aux), prog, params, ids
      )
    return
  gvg = gtx.sparse_value_and_grad(loss, has_aux=prog.aux)
  leaks = prog.seed % LEAK_SHARE == 0
  record(f"leak-checked: {leaks}")
  with (
    warnings.catch_warnings(record=True) as caught,
    jax.checking_leaks() if leaks else contextlib.nullcontext(),
  ):
    warnings.simplefilter("always")
    got_v, got = _call(gvg, prog, params, ids)
  warned = {str(w.message) for w in caught}
  assert all(issubclass(w.category, gtx.SparsityWarning) for w in caught)
  tol = _tol(prog)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, **tol), got_v, want_v
  )
  np.testing.assert_allclose(got["w"], want["w"], **tol)
  for k in range(len(prog.rows)):
    g = got[f"t{k}"]
    sparse, warns = _expected_sparse(prog, k)
    record(f"table {'sparse' if sparse else 'dense'}")
    assert isinstance(g, gtx.SparseRows) == sparse, (k, prog)
    if sparse and _every_row(prog, k):
      np.testing.assert_array_equal(g.indices, np.arange(prog.rows[k]))
    assert any(f"['t{k}']" in m for m in warned) == warns, (k, warned)
    dense = g.to_dense() if sparse else g
    assert dense.dtype == want[f"t{k}"].dtype
    np.testing.assert_allclose(dense, want[f"t{k}"], **tol)
  for k, kind in enumerate(prog.layers):
    g, table = got[f"l{k}"], LAYERS[kind][1]
    # no SparseRows for a leaf that is not read as rows (only)
    assert isinstance(g, gtx.SparseRows) == table, (kind, g)
    dense = g.to_dense() if table else g
    np.testing.assert_allclose(dense, want[f"l{k}"], **tol)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", gtx.SparsityWarning)
    report = gtx.sparsity_report(loss, has_aux=prog.aux)(params, ids)
  verdict = {r.path: (r.sparse, r.every_row) for r in report}
  for k in range(len(prog.rows)):
    sparse = _expected_sparse(prog, k)[0]
    every_row = sparse and _every_row(prog, k)
    assert verdict[f"['t{k}']"] == (sparse, every_row), (k, prog)
  by_path = {r.path: r for r in report}
  for k, kind in enumerate(prog.layers):
    r, table = by_path[f"['l{k}']"], LAYERS[kind][1]
    assert r.sparse == r.frozen == r.is_table == table, (kind, r)


# ----------------------------------------------------------------------------
# regressions: what the fuzzer found, each pinned


@pytest.mark.parametrize("wrapper", ["none", "scan", "fori"])
def test_one_uint8_id_past_the_wrap_reads_and_differentiates_its_row(wrapper):
  # Found by the fuzzer: on jax 0.10.2 JAX's own gradient of a read of one
  # uint8 id >= 44 of a 300-row table is zero (a scan reads one id a step,
  # a fori_loop is a scan); gtx's SparseRows holds the row read, as JAX's
  # gradient of the padded read (and jax 0.12's) does.
  ids = (44, 0) if wrapper == "scan" else (100,)
  r = Read("take", wrapper, "uint8", ids, ())
  check(Program((300,), ((r,),), ("none",), False, True, 0))


def test_a_bounds_checked_lookup_in_lax_map_under_remat_and_vmap():
  # issue 27, from a fuzzer outside: the bounds check's callback in a
  # differentiated loop leaked a trace (see test_jaxpr.py); seed 0: the
  # leak check runs in every run
  casts = ("float16", "float32")
  rs = (
    Read("lookup_checked", "remat_vmap_map", "int32", (4, 1, 4), casts),
    Read("index", "map", "int32", (2, 0), ()),
    Read("lookup_checked", "map", "uint8", (3,), ()),
  )
  check(Program((9,), (rs,), ("none",), False, False, 0))
