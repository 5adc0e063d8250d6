"""Sparse gradients of unmodified losses: the constructs recognised, the
fallbacks to dense (never a wrong answer), the report and require_sparse."""

import pathlib
import re

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import cast, to_dense
from jax import lax
from jax.extend import core as jcore

import gradtx as gtx
from gradtx import _jax_compat, _jaxpr

# Inputs are built in numpy and cast by numpy (conformance.cast): eagerly,
# jax compiles a convert for each shape and dtype.
V, D = 12, 3
RNG = np.random.RandomState(0)
TABLE = cast(RNG.normal(size=(V, D)), jnp.float32)
TABLE2 = cast(RNG.normal(size=(7, D)), jnp.float32)
W = cast(RNG.normal(size=(D,)), jnp.float32)
IDS = jnp.array([3, 1, 3, 11, 0, 5])  # a repeated id, both ends
BAD_IDS = jnp.array([3, -1, 12, 40, -20, 0])  # out of range both ways

# A SparseRows densified by one jitted program per shape (eagerly, every op
# of to_dense compiles on its own).


def _is_sparse(x):
  return isinstance(x, gtx.SparseRows)


def _leaves(tree):
  return jax.tree.leaves(tree, is_leaf=_is_sparse)


def _vg(loss, *args):
  """gtx's and JAX's ``(value, grads)``, both a ``value_and_grad`` in one
  jitted program: the program the rewrite runs, compiled alike, in one
  compilation. (XLA fuses ``jit(grad)`` differently from
  ``jit(value_and_grad)``; on jaxlib 0.12 the two differ in the last bit on
  some losses, so ``grad`` is not the reference.)"""
  gvg, jvg = gtx.sparse_value_and_grad(loss), jax.value_and_grad(loss)
  return jax.jit(lambda *a: (gvg(*a), jvg(*a)))(*args)


def _check(loss, params, *args, sparse=1, rtol=1e-5):
  """sparse_value_and_grad == jax.value_and_grad (to_dense); returns the
  sparse gradients."""
  # jitted: two compilations instead of one per eager op (test time)
  (got_v, got), (want_v, want) = _vg(loss, params, *args)
  np.testing.assert_allclose(got_v, want_v, rtol=rtol)
  assert jax.tree.structure(got, is_leaf=_is_sparse) == (
    jax.tree.structure(want)
  )
  n = 0
  for g, w in zip(_leaves(got), jax.tree.leaves(want), strict=True):
    if _is_sparse(g):
      n += 1
      assert g.dtype == w.dtype
      g = to_dense(g)
    np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-6)
  assert n == sparse, f"{n} sparse leaves, expected {sparse}"
  return got


def _mlp(h, w):
  return jnp.sum(jnp.tanh(h @ w) ** 2)


# ----------------------------------------------------------------------------
# constructs that come out sparse


def _scan_rnn(p, ids):
  def step(c, i):
    return jnp.tanh(c + p["t"][i]), None

  return jnp.sum(lax.scan(step, jnp.zeros(D), ids)[0] * p["w"])


def _greedy(p, ids):
  # ids computed inside the loop from the previous output
  def body(_, carry):
    tok, acc = carry
    h = p["t"][tok]
    return jnp.argmax(h * p["w"]).astype(tok.dtype) + 5, acc + _mlp(h, p["w"])

  return lax.fori_loop(0, 4, body, (ids[0], 0.0))[1]


def _remat_in_scan_in_jit(p, ids):
  @jax.jit
  def run(p, ids):
    def step(c, i):
      f = jax.checkpoint(lambda c, i: jnp.tanh(c + p["t"][i].sum(0) * p["w"]))
      return f(c, i), None

    return lax.scan(step, jnp.zeros(D), ids.reshape(3, 2))[0]

  return jnp.sum(run(p, ids) ** 2)


CONSTRUCTS = {
  "getitem": lambda p, i: _mlp(p["t"][i], p["w"]),
  "take": lambda p, i: _mlp(jnp.take(p["t"], i, axis=0), p["w"]),
  "take_clip": lambda p, i: _mlp(jnp.take(p["t"], i, 0, mode="clip"), p["w"]),
  "lookup": lambda p, i: _mlp(gtx.lookup(p["t"], i), p["w"]),
  "2d_ids": lambda p, i: _mlp(p["t"][i.reshape(2, 3)], p["w"]),
  "scalar_id": lambda p, i: _mlp(p["t"][i[1]], p["w"]),
  "vmap_scalar": lambda p, i: _mlp(jax.vmap(lambda j: p["t"][j])(i), p["w"]),
  "vmap_lookup": lambda p, i: _mlp(
    jax.vmap(lambda j: gtx.lookup(p["t"], j))(i.reshape(3, 2)), p["w"]
  ),
  "vmap_in_axes_none": lambda p, i: _mlp(
    jax.vmap(lambda q, j: q["t"][j], in_axes=(None, 0))(p, i), p["w"]
  ),
  "nested_jit": lambda p, i: jax.jit(_mlp)(
    jax.jit(lambda t: t[i])(p["t"]), p["w"]
  ),
  "remat": lambda p, i: jax.checkpoint(
    lambda p: _mlp(p["t"][i], p["w"]),
    policy=jax.checkpoint_policies.nothing_saveable,
  )(p),
  "scan_rnn": _scan_rnn,
  "greedy_fori_loop": _greedy,
  "remat_in_scan_in_jit": _remat_in_scan_in_jit,
  "dead_read": lambda p, i: (p["t"][i], _mlp(p["t"][i], p["w"]))[1],
}


@pytest.mark.parametrize("name", sorted(CONSTRUCTS))
def test_construct_is_sparse_and_matches_jax_grad(name):
  loss = CONSTRUCTS[name]
  p = {"t": TABLE, "w": W}
  g = _check(loss, p, IDS)
  report = gtx.sparsity_report(loss)(p, IDS)
  assert report.sparse_paths == ("['t']",)
  assert report[0].rows_per_step == g["t"].nnz


def test_eager_sparse_grad_matches():
  loss = CONSTRUCTS["scan_rnn"]
  p = {"t": TABLE, "w": W}
  v, g = gtx.sparse_value_and_grad(loss)(p, IDS)  # eager
  v2, g2 = jax.jit(jax.value_and_grad(loss))(p, IDS)  # the reference
  np.testing.assert_allclose(v, v2, rtol=1e-6)
  np.testing.assert_allclose(to_dense(g["t"]), g2["t"], rtol=1e-5, atol=1e-6)


def test_ids_in_program_order_top_level_then_scan():
  def loss(p, ids):
    first = p["t"][ids[:2]]  # top level: 2 ids
    return _scan_rnn(p, ids) + _mlp(first, p["w"])  # then 6 in the scan

  g = _check(loss, {"t": TABLE, "w": W}, IDS)
  ids = np.asarray(IDS)
  want = np.concatenate([ids[:2], ids])
  np.testing.assert_array_equal(g["t"].indices, want)


def test_two_tables_and_same_object_at_two_leaves():
  def loss(p, ids):
    a = p["a"][ids]
    b = jax.vmap(lambda j: p["b"][j % 7])(ids)
    return _mlp(a * b, p["w"]) + _mlp(p["c"][ids], p["w"])

  p = {"a": TABLE, "b": TABLE2, "c": TABLE, "w": W}
  g = _check(loss, p, IDS, sparse=3)
  np.testing.assert_array_equal(g["b"].indices, np.asarray(IDS) % 7)


@pytest.mark.parametrize(
  "mode, want",
  [
    ("clip", [3, 0, 11, 11, 0, 0]),  # the row each id actually read
    ("fill", [3, V, V, V, V, 0]),  # out of range: padding
    ("promise_in_bounds", [3, V, V, V, V, 0]),  # jax.grad drops them
  ],
)
def test_gather_modes_assign_the_rows_read(mode, want):
  def loss(t, ids):
    # jnp.take wraps negative ids first; lax.gather sees them raw.
    dn = lax.GatherDimensionNumbers((1,), (0,), (0,))
    rows = lax.gather(t, ids[:, None], dn, (1, D), mode=mode, fill_value=0)
    return _mlp(rows, W)

  g = _check(loss, TABLE, BAD_IDS)
  got = np.asarray(g.indices)
  got = np.where((got >= 0) & (got < V), got, V)
  np.testing.assert_array_equal(got, want)


def test_vmapped_clip_gather_on_non_row_dims():
  # eqx.nn.Embedding under vmap: a CLIP gather that also indexes dim 1.
  emb = eqx.nn.Embedding(weight=TABLE)
  ids = np.clip(np.asarray(BAD_IDS), 0, V - 1)
  g = _check(lambda m, i: _mlp(jax.vmap(m)(i), W), emb, ids)
  np.testing.assert_array_equal(g.weight.indices, ids)


def test_lookup_padding_and_bounds_check_kept():
  g = _check(lambda t, i: _mlp(gtx.lookup(t, i), W), TABLE, BAD_IDS)
  assert float(np.abs(np.asarray(to_dense(g))).sum()) > 0
  with pytest.raises(ValueError, match=r"outside \[0, 12\)"):
    gtx.sparse_grad(lambda t, i: gtx.lookup(t, i, bounds_check=True).sum())(
      TABLE, BAD_IDS
    )


def _checked_lookups_in_a_loop(x0, P, X):
  # issue 27, from a fuzzer: remat over vmap over lax.map, a bounds-checked
  # lookup of a float16 cast of the table beside a plain table[j]
  w, t0 = P[1] * x0[0], P[0][0]

  def f3(i):
    def f5(i, ta6):
      def g8(j):
        cast = lax.convert_element_type(ta6, jnp.float16)
        k = j.astype(jnp.int32) % 50 + X  # X: 0, or 50 for bad ids
        r10 = gtx.lookup(cast, k, bounds_check=True)
        r10 = r10.astype(jnp.float32).reshape(-1, 2) * w[None, :2] + 0.933
        f14 = ta6[j].astype(jnp.float32)
        return jnp.sum(jax.nn.relu(r10)) + jnp.sum(jnp.sin(f14) * (f14 + 0.9))

      return jnp.sum(lax.map(g8, i))

    return jnp.sum(jax.vmap(f5, in_axes=(0, None))(i, t0))

  ids = jnp.asarray(np.array([[[24, 32, 27]], [[38, 11, 45]]], np.int32))
  policy = jax.checkpoint_policies.nothing_saveable
  return jax.checkpoint(f3, policy=policy, prevent_cse=True)(ids)


@pytest.mark.leak_check
def test_a_bounds_checked_lookup_in_a_differentiated_loop_leaks_no_trace():
  # The lookup's bounds check was a jax.debug.callback: an effect, which
  # JAX's partial evaluation of the loop keeps in its trace's effect
  # handles, whose tracers point back at the trace (a reference cycle that
  # checking_leaks reported; jax.value_and_grad of this loss did too).
  rng = np.random.RandomState(8)
  x0 = jnp.asarray([1.25])
  P = (
    {0: cast(rng.normal(size=(50, 2)), jnp.float32)},
    cast(rng.normal(size=(2,)), jnp.float32),
  )
  loss = _checked_lookups_in_a_loop
  with jax.checking_leaks():  # jitted: one compilation, not one per op
    jvg = jax.value_and_grad(loss, argnums=(0, 1))
    want_v, want = jax.jit(jvg)(x0, P, 0)
    gvg = gtx.sparse_value_and_grad(loss, argnums=(0, -2))
    got_v, got = jax.jit(gvg)(x0, P, 0)
  np.testing.assert_allclose(got_v, want_v, rtol=1e-6)
  assert _is_sparse(got[1][0][0])
  for g, w in zip(_leaves(got), jax.tree.leaves(want), strict=True):
    g = to_dense(g) if _is_sparse(g) else g
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  # the check still fails the computation on an id out of range
  with pytest.raises(jax.errors.JaxRuntimeError, match=r"outside \[0, 50\)"):
    jax.block_until_ready(jax.jit(gtx.sparse_grad(loss, 1))(x0, P, 50))


def test_lookup_is_rebound_by_name_not_inlined():
  def loss(t, i):
    return _mlp(gtx.lookup(t, i), W)

  jaxpr = jax.make_jaxpr(gtx.sparse_grad(loss))(TABLE, IDS)
  names = [e.params.get("name") for e in jaxpr.jaxpr.eqns]
  assert _jaxpr.LOOKUP_NAME in names


def test_remat_policy_and_prevent_cse_kept():
  policy = jax.checkpoint_policies.nothing_saveable

  def loss(t, i):
    return jax.checkpoint(lambda t: _mlp(t[i], W), policy=policy)(t)

  jaxpr = jax.make_jaxpr(gtx.sparse_grad(loss))(TABLE, IDS)
  remats = [
    e
    for e in jaxpr.jaxpr.eqns
    if e.primitive.name == "remat2" and e.params["policy"] is policy
  ]
  assert remats and all(e.params["prevent_cse"] for e in remats)


def test_bf16_cast_table_flax_embed():
  model = nn.Embed(V, D, dtype=jnp.bfloat16)
  variables = jax.jit(model.init)(jax.random.key(0), IDS)

  def loss(v, ids):
    return _mlp(model.apply(v, ids).astype(jnp.float32), W)

  g = _check(loss, variables, IDS, rtol=1e-2)
  emb = g["params"]["embedding"]
  assert emb.dtype == jnp.float32  # the table's dtype, not bf16


def test_bf16_table_cast_to_f32():
  t16 = cast(TABLE, jnp.bfloat16)
  g = _check(lambda t, i: _mlp(t.astype(jnp.float32)[i], W), t16, IDS)
  assert g.dtype == jnp.bfloat16


def test_argnums_has_aux_and_unused_table():
  def loss(x, p, ids, use_b):
    out = _mlp(p["a"][ids] * x[None], p["w"])
    if use_b:
      out = out + _mlp(p["b"][ids % 7], p["w"])
    return out, {"n": ids.size}

  p = {"a": TABLE, "b": TABLE2, "w": W}
  x = jnp.ones(D)
  f = gtx.sparse_value_and_grad(loss, argnums=(0, 1), has_aux=True)
  f2 = jax.value_and_grad(loss, (0, 1), has_aux=True)
  # gtx's and jax's in one program
  both = jax.jit(lambda *a: (f(*a), f2(*a)), static_argnums=3)
  for use_b in (False, True):
    ((v, aux), (gx, gp)), ((v2, _), (gx2, gp2)) = both(x, p, IDS, use_b)
    assert int(aux["n"]) == 6
    np.testing.assert_allclose(v, v2, rtol=1e-6)
    np.testing.assert_allclose(gx, gx2, rtol=1e-5)
    assert _is_sparse(gp["a"]) and _is_sparse(gp["b"]) == use_b
    np.testing.assert_allclose(_dense(gp["b"]), gp2["b"], rtol=1e-5, atol=1e-6)


def _dense(x):
  return to_dense(x) if _is_sparse(x) else x


def test_sparse_grad_of_getitem_inside_shard_map():
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()), ("r",))
  loss = CONSTRUCTS["vmap_scalar"]

  def per_replica(p, i):
    g = gtx.sparse_grad(loss)(p, i)
    return jax.tree.map(lambda x: x[None], (g["t"].to_dense(), g["w"]))

  ids = (np.arange(16) % V).astype(np.int32)
  mapped = jax.shard_map(
    per_replica, mesh=mesh, in_specs=(P(), P("r")), out_specs=P("r")
  )
  # the shard_map and the reference, one program
  got, want = jax.jit(lambda p, i: (mapped(p, i), jax.grad(loss)(p, i)))(
    {"t": TABLE, "w": W}, ids
  )
  got = jax.device_get(got)
  np.testing.assert_allclose(got[0][0], want["t"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got[1][0], want["w"], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------
# never a wrong answer: any other use keeps jax's exact dense gradient


@jax.custom_jvp
def _cjvp(t):
  return t * 2.0


_cjvp.defjvp(lambda p, d: (_cjvp(p[0]), d[0] * 2.0))


@jax.custom_vjp
def _cvjp(t):
  return t * 2.0


_cvjp.defvjp(lambda t: (t * 2.0, None), lambda _, c: (c * 2.0,))

DENSE = {
  "tied_output": (
    lambda t, i: jnp.sum(jnp.tanh(t[i] @ t.T)),
    "used by `transpose`",
  ),
  "weight_decay": (
    lambda t, i: _mlp(t[i], W) + 1e-2 * jnp.sum(t**2),
    "used by `integer_pow`",
  ),
  "cond": (
    lambda t, i: lax.cond(i[0] > 2, lambda: _mlp(t[i], W), lambda: 0.0),
    "`cond`",
  ),
  "switch": (
    lambda t, i: lax.switch(i[0] % 2, [lambda: t[i].sum(), lambda: 0.0]),
    "`cond`",
  ),
  "custom_jvp": (lambda t, i: _mlp(_cjvp(t)[i], W), "custom_jvp"),
  "custom_vjp": (lambda t, i: _mlp(_cvjp(t)[i], W), "custom_vjp"),
  "static_slice": (lambda t, i: _mlp(t[:8][i % 8], W), "used by `slice`"),
  "partial_row": (
    lambda t, i: jnp.sum(jnp.tanh(t[i, :2])),
    "does not read whole rows",
  ),
  "scan_carry": (
    lambda t, i: lax.scan(lambda c, j: (c * 0.5, c[j].sum()), t, i)[1].sum(),
    "carry or xs",
  ),
  "scan_xs": (
    lambda t, i: (
      lax.scan(lambda c, r: (c + r, None), 0.0, t[:, 0])[0] + _mlp(t[i], W)
    ),
    "used by `slice`",
  ),
  "scan_xs_whole": (
    lambda t, i: lax.scan(lambda c, r: (c + r.sum(), None), 0.0, t)[0],
    "carry or xs",
  ),
  "read_then_dense_in_jit": (
    lambda t, i: jax.jit(lambda t: _mlp(t[i], W) + t.sum())(t),
    "used by `reduce_sum`",
  ),
  "cast_to_int": (
    lambda t, i: _mlp(t[i], W) + t.astype(jnp.int32)[i].sum(),
    "convert_element_type",
  ),
}


@pytest.mark.parametrize("name", sorted(DENSE))
def test_other_uses_keep_the_exact_dense_gradient(name):
  loss, reason = DENSE[name]
  got, want = _vg(loss, TABLE, IDS)  # warnings are errors
  assert not _is_sparse(got[1])
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])
  (record,) = gtx.sparsity_report(loss)(TABLE, IDS)
  assert not record.sparse and reason in record.reason
  assert record.where.startswith(__file__), record.where


def test_table_in_aux_is_dense():
  def loss(t, i):
    return _mlp(t[i], W), {"table": t}

  # both a value_and_grad in one program, compiled alike (see _vg)
  gvg = gtx.sparse_value_and_grad(loss, has_aux=True)
  jvg = jax.value_and_grad(loss, has_aux=True)
  ((v, aux), g), (_, want) = jax.jit(lambda *a: (gvg(*a), jvg(*a)))(TABLE, IDS)
  np.testing.assert_array_equal(g, want)
  np.testing.assert_array_equal(aux["table"], TABLE)
  (record,) = gtx.sparsity_report(loss, has_aux=True)(TABLE, IDS)
  assert "returned" in record.reason


def test_dense_leaves_exact_next_to_a_sparse_table():
  def loss(p, i):
    return jnp.sum(jnp.tanh(p["t"][i] @ p["m"]) ** 2) + jnp.sum(p["b"] ** 3)

  m = cast(RNG.normal(size=(D, 4)), jnp.float32)
  p = {"t": TABLE, "m": m, "b": W}
  (_, got), (_, want) = _vg(loss, p, IDS)
  np.testing.assert_allclose(got["m"], want["m"], rtol=1e-6)
  np.testing.assert_array_equal(got["b"], want["b"])


# ----------------------------------------------------------------------------
# unknown constructs: dense with a SparsityWarning, never a crash


def test_unknown_higher_order_primitive_warns_and_stays_exact():
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()[:1]), ("x",))

  def loss(t, i):
    read = jax.shard_map(lambda t: t[i], mesh=mesh, in_specs=P(), out_specs=P())
    return _mlp(read(t), W)

  with pytest.warns(
    gtx.SparsityWarning, match=r"differentiated array.*shard_map"
  ):
    got, want = _vg(loss, TABLE, IDS)
  np.testing.assert_array_equal(got[1], want[1])


def test_dense_weight_in_unknown_primitive_does_not_warn():
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()[:1]), ("x",))

  def loss(w, t, i):
    f = jax.shard_map(lambda w: w * 2, mesh=mesh, in_specs=P(), out_specs=P())
    return _mlp(t[i], f(w))

  # no warning (traced under jit: a warning is raised while tracing)
  g = jax.jit(gtx.sparse_grad(loss, argnums=(0, 1)))(W, TABLE, IDS)
  assert _is_sparse(g[1])


def test_unfamiliar_parameter_layout_warns(monkeypatch):
  monkeypatch.setattr(_jaxpr, "_GATHER_MODES", ())  # as if a new JAX
  loss = CONSTRUCTS["getitem"]
  p = {"t": TABLE, "w": W}
  with pytest.warns(gtx.SparsityWarning, match="gather"):
    got = gtx.sparse_grad(loss)(p, IDS)
  assert not _is_sparse(got["t"])
  np.testing.assert_array_equal(got["t"], jax.grad(loss)(p, IDS)["t"])

  def broken(*_):
    raise KeyError("num_consts")  # an eqn parameter that moved

  monkeypatch.setattr(_jaxpr, "_match_known", broken)
  with pytest.warns(gtx.SparsityWarning, match="num_consts"):
    got = gtx.sparse_grad(_scan_rnn)(p, IDS)
  np.testing.assert_array_equal(got["t"], jax.grad(_scan_rnn)(p, IDS)["t"])


# ----------------------------------------------------------------------------
# sparsity_report and require_sparse


def test_report_table_and_records():
  def loss(p, i):
    h = p["emb"][i] + p["tied"][i]
    return jnp.sum(h @ p["tied"].T) + jnp.sum(p["w"])

  p = {"emb": TABLE, "tied": TABLE, "w": W, "n": np.arange(3, dtype=np.int32)}
  report = gtx.sparsity_report(loss)(p, np.asarray(IDS).reshape(2, 3))
  by_path = {r.path: r for r in report}
  assert [r.path for r in report] == ["['emb']", "['n']", "['tied']", "['w']"]
  assert by_path["['emb']"].sparse and by_path["['emb']"].rows_per_step == 6
  tied = by_path["['tied']"]
  assert not tied.sparse and tied.reason == "used by `transpose`"
  line = int(tied.where.rsplit(":", 1)[1])
  assert tied.where.startswith(__file__)
  source = pathlib.Path(__file__).read_text().splitlines()
  assert 'p["tied"].T' in source[line - 1]
  assert "not a floating-point" in by_path["['n']"].reason
  text = report.details()
  assert re.search(r"\['emb'\]\s+float32\[12, 3\]\s+sparse\s+6", text)
  assert re.search(r"\['tied'\].*dense.*transpose.*test_jaxpr.py:\d+", text)
  summary = str(report)
  assert re.search(r"\['emb'\]\s+float32\[12, 3\]\s+sparse, 6 rows", summary)
  assert re.search(r"\['tied'\].*dense: used by `transpose`", summary)


def test_require_sparse_names_the_leaf_use_and_line():
  def loss(p, i):
    return _mlp(p["emb"][i], p["w"]) + 1e-3 * jnp.sum(p["emb"] ** 2)

  p = {"emb": TABLE, "w": W}
  f = gtx.sparse_value_and_grad(loss, require_sparse="['emb']")
  with pytest.raises(ValueError, match=r"\['emb'\].*integer_pow.*test_jaxpr"):
    f(p, IDS)
  with pytest.raises(ValueError, match=r"\['emb'\]"):
    gtx.sparse_grad(loss, require_sparse=lambda path: "emb" in path)(p, IDS)
  with pytest.raises(ValueError, match=r"\['embedding'\].*The leaves are"):
    gtx.sparse_grad(loss, require_sparse=["['embedding']"])(p, IDS)
  ok = gtx.sparse_grad(CONSTRUCTS["getitem"], require_sparse=["['t']"])
  assert _is_sparse(jax.jit(ok)({"t": TABLE, "w": W}, IDS)["t"])


# ----------------------------------------------------------------------------
# efficiency: no [V, D] value in the compiled step


def test_no_table_sized_value_in_compiled_step():
  num_rows, dim = 40_000, 8
  model = nn.Embed(num_rows, dim)

  def loss(p, ids):
    def step(c, i):
      f = jax.checkpoint(
        lambda c, i: jnp.tanh(c + model.apply(p["emb"], i) * p["w"])
      )
      return f(c, i), None

    return jnp.sum(lax.scan(step, jnp.zeros(dim), ids)[0] ** 2)

  # shapes only: lowered and compiled, never run
  params = {
    "emb": jax.eval_shape(
      model.init, jax.random.key(0), jax.ShapeDtypeStruct((1,), jnp.int32)
    ),
    "w": jax.ShapeDtypeStruct((dim,), jnp.float32),
  }
  ids = jax.ShapeDtypeStruct((5,), jnp.int32)

  def step(p, ids):
    g = gtx.sparse_grad(loss)(p, ids)
    return gtx.apply_updates(p, g)

  def dense_step(p, ids):
    return jax.tree.map(lambda a, b: a - b, p, jax.grad(loss)(p, ids))

  pattern = rf"= f32\[{num_rows},{dim}\]"
  # The table itself (a parameter, loop-invariant tuple elements of the scan)
  # and the in-place scatter of apply_updates into the donated table.
  allowed = ("parameter(", "get-tuple-element(", "scatter")

  def produced(f):
    hlo = jax.jit(f, donate_argnums=0).lower(params, ids).compile().as_text()
    assert "input_output_alias={ {0}: (0, {}" in hlo  # updated in place
    return [
      ln
      for ln in hlo.splitlines()
      if re.search(pattern, ln) and not any(a in ln for a in allowed)
    ]

  assert produced(dense_step)  # the check can fail
  assert not produced(step), produced(step)


# ----------------------------------------------------------------------------
# the running JAX has the parameters the rewriter reads


def _followed_constructs(t, ids, in_shard_map=True):
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
  read = jax.shard_map(
    lambda t, i: t.astype(jnp.bfloat16)[i],
    mesh=mesh,
    in_specs=(P(), P("x")),
    out_specs=P("x"),
  )
  return (
    t[ids].sum()
    + t[ids[0]].sum()
    + jax.jit(lambda t: t[ids])(t).sum()
    + jax.checkpoint(lambda t: t[ids])(t).sum()
    + lax.scan(lambda c, i: (c + t[i].sum(), None), 0.0, ids)[0]
    + (read(t, ids).sum() if in_shard_map else 0.0)
    + lax.stop_gradient(t)[ids].sum()
  )


def _params_by_primitive(jaxpr, found):
  jaxpr, _ = _jax_compat.open_jaxpr(jaxpr)
  for eqn in jaxpr.eqns:
    found.setdefault(eqn.primitive.name, set()).update(eqn.params)
    for body in jcore.jaxprs_in_params(eqn.params):
      _params_by_primitive(body, found)
  return found


def test_followed_primitives_have_the_parameters_the_rewriter_reads():
  found = _params_by_primitive(
    jax.make_jaxpr(_followed_constructs)(TABLE, IDS), {}
  )
  for name, wanted in _jax_compat.FOLLOWED_PARAMS.items():
    assert name in found, f"no `{name}` primitive on jax {jax.__version__}"
    for w in wanted:
      options = w if isinstance(w, tuple) else ((w,),)
      options = [o if isinstance(o, tuple) else (o,) for o in options]
      assert any(set(o) <= found[name] for o in options), (
        f"`{name}` on jax {jax.__version__} has {sorted(found[name])}, "
        f"none of {options}"
      )
  # and the rewrite reads them sparse, without a warning (a shard_map inside
  # the loss is not followed: the pvary it holds is read in Mirrored steps)
  (record,) = gtx.sparsity_report(
    lambda t, i: _followed_constructs(t, i, in_shard_map=False)
  )(TABLE, IDS)
  assert record.sparse, record.reason


# ----------------------------------------------------------------------------
# exact where a differential fuzzer found gtx and JAX apart


def _embed_256(p, i):
  return jnp.sum(jnp.tanh(nn.Embed(256, D).apply(p, i)) ** 2)


_T300 = cast(RNG.normal(size=(300, D)), jnp.float32)
_NARROW = {
  # name: (loss, table, ids), each id in the dtype a real script passes
  "embed_uint8_256": (
    _embed_256,
    nn.Embed(256, D).init(jax.random.key(0), jnp.zeros(1, jnp.uint8)),
    jnp.array([72, 105, 33, 0, 200, 255], jnp.uint8),
  ),
  "take_uint8_300": (
    lambda t, i: _mlp(jnp.take(t, i, axis=0), W),
    _T300,
    jnp.array([72, 105, 33, 0, 200, 255, 255], jnp.uint8),
  ),
  "take_int16_32768": (
    lambda t, i: _mlp(jnp.take(t, i, axis=0), W),
    cast(RNG.normal(size=(32768, D)), jnp.float32),
    jnp.array([-1, 5, 32767, -32768, 0], jnp.int16),
  ),
  "index_uint16": (
    lambda t, i: _mlp(t[i], W),
    _T300,
    jnp.array([5, 65535, 299, 0], jnp.uint16),
  ),
  "take_clip_uint32": (
    lambda t, i: _mlp(jnp.take(t, i, axis=0, mode="clip"), W),
    _T300,
    jnp.array([5, 4_000_000_000, 299, 2**31], jnp.uint32),
  ),
  "get_fill_uint32": (
    lambda t, i: _mlp(t.at[i].get(mode="fill", fill_value=0.5), W),
    _T300,
    jnp.array([5, 4_000_000_000, 299, 300, 2**31], jnp.uint32),
  ),
  "dynamic_slice_uint8": (
    lambda t, i: _mlp(lax.dynamic_slice(t, (i, jnp.uint8(0)), (1, D)), W),
    _T300,
    jnp.uint8(200),
  ),
  "vector_take_int8_257": (
    lambda t, i: jnp.sum(jnp.sin(jnp.take(t, i))),
    cast(RNG.normal(size=(257,)), jnp.float32),
    jnp.array([127, -3, 0], jnp.int8),
  ),
  "scalar_int8_257": (
    lambda t, i: jnp.sum(jnp.sin(t[i])),
    cast(RNG.normal(size=(257,)), jnp.float32),
    jnp.int8(127),
  ),
}


@pytest.mark.parametrize("name", sorted(_NARROW))
def test_ids_of_every_integer_dtype_read_the_row_jax_reads(name):
  loss, table, ids = _NARROW[name]
  _check(loss, table, ids, rtol=1e-6)


def test_int64_ids_under_x64_read_the_row_jax_reads():
  with jax.enable_x64(True):
    table = cast(RNG.normal(size=(50, D)), jnp.float32)
    ids = jnp.array([3, 2**40 + 1, -1, 49, 2**33], jnp.int64)
    for mode in ("clip", "fill"):
      _check(
        lambda t, i, m=mode: _mlp(jnp.take(t, i, 0, mode=m), W), table, ids
      )


_CASTS = {
  # a bf16 round trip: its rounding changes the value
  "bf16_round_trip": lambda t, i: _mlp(
    t.astype(jnp.bfloat16).astype(jnp.float32)[i], W
  ),
  # float16 overflows to inf in the forward pass
  "float16_overflow": lambda t, i: jnp.sum(
    jnp.tanh(t.astype(jnp.float16).astype(jnp.float32)[i] * 1e-5)
  ),
  # a bf16 compute policy on params, then nn.Embed(dtype=float32)
  "bf16_policy_then_embed_f32": lambda t, i: _mlp(
    nn.Embed(V, D, dtype=jnp.float32).apply(
      {"params": {"embedding": t.astype(jnp.bfloat16)}}, i
    ),
    W,
  ),
}


@pytest.mark.parametrize("name", sorted(_CASTS))
def test_cast_chains_keep_every_rounding_and_overflow(name):
  loss = _CASTS[name]
  table = np.array(TABLE)  # numpy: float32 ops, the same bits as jnp's
  if "overflow" in name:
    table[3] = 1e5
  else:
    table = table * np.float32(3)
  table = jnp.asarray(table)
  ids = np.array([3, 1, 11, 0, 5], np.int32)  # unique: each row exact
  (got_v, got), (want_v, want) = _vg(loss, table, ids)
  assert _is_sparse(got)
  np.testing.assert_array_equal(got_v, want_v)
  np.testing.assert_array_equal(to_dense(got), want)
  # eagerly too (every op rounds on its own)
  got_v, got = gtx.sparse_value_and_grad(loss)(table, jnp.asarray(ids))
  want_v, want = jax.value_and_grad(loss)(table, jnp.asarray(ids))
  np.testing.assert_array_equal(got_v, want_v)
  np.testing.assert_array_equal(to_dense(got), want)


def test_zero_sink_keeps_negative_zero_rows():
  table = np.array(TABLE)
  table[1] = -0.0

  def loss(t, i):  # 1 / -0.0 is -inf: the sign of a zero row shows
    return jnp.sum(jnp.where(1.0 / t[i] > 0, t[i], 2 * t[i]))

  (got_v, got), (want_v, want) = _vg(loss, table, np.array([1, 2], np.int32))
  np.testing.assert_array_equal(got_v, want_v)
  np.testing.assert_array_equal(to_dense(got), want)


def _block_loss():
  ws = [cast(RNG.normal(size=(D, D)) / 2, jnp.bfloat16) for _ in range(6)]

  @jax.jit
  def block(t, ids):
    h = t[ids]
    for w in ws:
      h = jnp.tanh(h @ w)
    return h

  return lambda t, i: jnp.sum(block(t, i).astype(jnp.float32))


def test_eager_call_runs_a_jitted_block_compiled_as_jax_does():
  loss = _block_loss()
  table = cast(TABLE, jnp.bfloat16)
  (eqn,) = [
    e for e in jax.make_jaxpr(loss)(table, IDS).eqns if "jaxpr" in e.params
  ]
  body, _ = _jax_compat.open_jaxpr(eqn.params["jaxpr"])
  fns = []
  for _ in range(2):
    got_v, got = gtx.sparse_value_and_grad(loss)(table, IDS)
    # the block is re-jitted once: the same jitted function every call, so
    # JAX compiles it once
    fns.append(list(_jaxpr._JITTED[body].values()))
  assert len(fns[0]) == 1 and fns[0] == fns[1]
  want_v, want = jax.value_and_grad(loss)(table, IDS)
  np.testing.assert_array_equal(got_v, want_v)
  np.testing.assert_allclose(
    np.asarray(to_dense(got), np.float32),
    np.asarray(want, np.float32),
    atol=1e-2,
  )


def test_eager_only_python_gets_jax_dense_gradient_with_a_warning():
  def loss(t, ids):
    u = jnp.unique(ids)  # concrete size: eager only
    return _mlp(t[u], W) + jnp.sum(t[np.asarray(u)][:, 0])

  with pytest.warns(gtx.SparsityWarning, match="eager-only Python"):
    got_v, got = gtx.sparse_value_and_grad(loss)(TABLE, IDS)
  want_v, want = jax.value_and_grad(loss)(TABLE, IDS)
  np.testing.assert_array_equal(got_v, want_v)
  np.testing.assert_array_equal(got, want)
  # under jit, the error jax itself raises
  with pytest.raises(jax.errors.ConcretizationTypeError):
    jax.jit(gtx.sparse_value_and_grad(loss))(TABLE, IDS)


def test_repeated_argnums_are_rejected_as_jax_rejects_them():
  def loss(a, b):
    return jnp.sum(a[IDS] * b[IDS])

  with pytest.raises(TypeError):
    jax.value_and_grad(loss, argnums=(0, 0))(TABLE, TABLE)
  for argnums in ((0, 0), (1, -1)):
    with pytest.raises(TypeError, match="same argument twice"):
      gtx.sparse_value_and_grad(loss, argnums=argnums)(TABLE, TABLE)


# ----------------------------------------------------------------------------
# dense where dense is cheaper, overrides, frozen tables, the summary


def _bert_like(p, ids, segments):
  # BERT's 2-row segment table read at every position, beside a big table
  h = p["emb"][ids] + p["seg"][segments]
  return jnp.sum(jnp.tanh(h @ p["w"]))


def _bert_params():
  rng = np.random.RandomState(3)
  return {
    "emb": cast(rng.normal(size=(500, D)), jnp.float32),
    "seg": cast(rng.normal(size=(2, D)), jnp.float32),
    "w": W,
  }


_TOKENS = cast(np.random.RandomState(4).randint(0, 500, (4, 16)), jnp.int32)
_SEGMENTS = cast(np.random.RandomState(5).randint(0, 2, (4, 16)), jnp.int32)


def test_a_table_read_many_times_per_row_gets_every_row_once_and_says_why():
  p = _bert_params()
  report = gtx.sparsity_report(_bert_like)(p, _TOKENS, _SEGMENTS)
  by = {r.path: r for r in report}
  assert by["['emb']"].sparse and by["['emb']"].rows_per_step == 64
  assert not by["['emb']"].every_row
  seg = by["['seg']"]
  assert seg.sparse and seg.every_row and seg.rows_per_step == 2
  assert seg.reads == 64 and seg.is_table
  assert "2 rows, 64 reads per step: one summed row per table row" in (
    seg.reason
  )
  assert "sparse, every row: 2 rows, 64 reads" in str(report)
  (_, got), (_, want) = _vg(
    lambda p, i: _bert_like(p, i, _SEGMENTS), p, _TOKENS
  )
  assert isinstance(got["emb"], gtx.SparseRows)
  seg_g = got["seg"]
  assert isinstance(seg_g, gtx.SparseRows)
  np.testing.assert_array_equal(seg_g.indices, [0, 1])
  np.testing.assert_allclose(seg_g.values, want["seg"], rtol=1e-6)

  # require_sparse keeps a row per read; dense= makes the big table dense
  @jax.jit
  def overridden(p, tokens, segments):  # both, one program
    g = gtx.sparse_grad(_bert_like, require_sparse="['seg']")(
      p, tokens, segments
    )
    assert isinstance(g["seg"], gtx.SparseRows) and g["seg"].nnz == 64
    g2 = gtx.sparse_grad(_bert_like, dense=lambda path: "emb" in path)(
      p, tokens, segments
    )
    return g["seg"].to_dense(), g2

  seg_dense, g = overridden(p, _TOKENS, _SEGMENTS)
  np.testing.assert_allclose(seg_dense, want["seg"], rtol=1e-5)
  assert not isinstance(g["emb"], gtx.SparseRows)
  np.testing.assert_allclose(g["emb"], want["emb"], rtol=1e-5, atol=1e-7)
  assert (
    "asked for dense"
    in gtx.sparsity_report(_bert_like, dense="['emb']")(p, _TOKENS, _SEGMENTS)[
      0
    ].reason
  )
  with pytest.raises(ValueError, match="both in `dense` and in"):
    gtx.sparse_grad(_bert_like, dense="['seg']", require_sparse="['seg']")(
      p, _TOKENS, _SEGMENTS
    )
  with pytest.raises(ValueError, match="`dense` names"):
    gtx.sparse_grad(_bert_like, dense="['nope']")(p, _TOKENS, _SEGMENTS)


def test_the_threshold_is_reads_per_row():
  # just below and at DENSE_READS_PER_ROW reads per row
  from gradtx._lookup import DENSE_READS_PER_ROW

  rows = 8
  for reads, sparse in (
    (int(DENSE_READS_PER_ROW * rows) - 1, True),
    (int(DENSE_READS_PER_ROW * rows), False),
  ):
    table = np.ones((rows, D), np.float32)
    ids = (np.arange(reads) % rows).astype(np.int32)
    (r,) = gtx.sparsity_report(lambda t, i: _mlp(t[i], W))(table, ids)
    assert r.sparse and r.every_row != sparse and r.reads == reads


def test_a_frozen_table_gets_no_gradient_and_no_update():
  def loss(p, ids):  # Flax's sst2 example freezes the embedding this way
    return _mlp(lax.stop_gradient(p["emb"])[ids], p["w"])

  p = {"emb": TABLE, "w": W}
  (record, _) = gtx.sparsity_report(loss)(p, IDS)
  assert record.frozen and record.is_table
  assert "frozen (stop_gradient): no gradient, no update" in str(
    gtx.sparsity_report(loss)(p, IDS)
  )
  (v, g), (want_v, want) = _vg(loss, p, IDS)
  np.testing.assert_array_equal(v, want_v)
  assert isinstance(g["emb"], gtx.SparseRows) and g["emb"].nnz == 0
  np.testing.assert_array_equal(to_dense(g["emb"]), want["emb"])  # zeros
  np.testing.assert_array_equal(g["w"], want["w"])
  tx = gtx.lazy_adam(0.1)

  @jax.jit
  def update(g, p):  # init, update and apply, one program
    u, state = tx.update(g, tx.init(p), p)
    return gtx.apply_updates(p, u), state

  new, state = update(g, p)
  np.testing.assert_array_equal(new["emb"], TABLE)  # no row touched
  np.testing.assert_array_equal(state[0].mu["emb"], 0.0)
  # a table read both frozen and not: the unfrozen reads' rows only
  g = jax.jit(
    gtx.sparse_grad(lambda t, i: _mlp(lax.stop_gradient(t)[i] + t[i], W))
  )(TABLE, IDS)
  assert g.nnz == IDS.size


@pytest.mark.parametrize(
  "make",
  [
    lambda: gtx.lazy_adam(0.1),
    lambda: gtx.lazy_adamw(0.1, weight_decay=0.5),
    lambda: gtx.rowwise_adagrad(0.1, weight_decay=0.5),
    lambda: gtx.adagrad(0.1),
    lambda: gtx.ftrl(0.1, l1_regularization_strength=0.1),
    lambda: gtx.lazy_sgd(0.1, momentum=0.9),
    lambda: gtx.accumulate(
      gtx.lazy_adam(0.1), 2, rows_per_step={"emb": 1, "w": None}
    ),
  ],
  ids=[
    "lazy_adam",
    "lazy_adamw",
    "rowwise_adagrad",
    "adagrad",
    "ftrl",
    "sgd",
    "accumulate",
  ],
)
def test_a_frozen_table_keeps_every_row_under_gtx_optimizers(make):
  def loss(p, ids):
    return _mlp(lax.stop_gradient(p["emb"])[ids], p["w"])

  tx = make()

  def step(p, s, ids):
    u, s = tx.update(gtx.sparse_grad(loss)(p, ids), s, p)
    return gtx.apply_updates(p, u), s

  step = jax.jit(step, donate_argnums=(0, 1))
  p = {"emb": jnp.array(np.asarray(TABLE)), "w": jnp.array(np.asarray(W))}
  s = jax.jit(tx.init)(p)
  # the table's state rows: the state leaves shaped like the table's rows
  rows_of = lambda s: [x for x in jax.tree.leaves(s) if x.shape[:1] == (V,)]  # noqa: E731
  init_rows = [np.asarray(x) for x in rows_of(s)]
  assert init_rows
  for _ in range(4):
    p, s = step(p, s, IDS)
  np.testing.assert_array_equal(p["emb"], TABLE)
  assert not np.array_equal(p["w"], W)
  for got, want in zip(rows_of(s), init_rows, strict=True):
    np.testing.assert_array_equal(got, want)


def _frozen_layer_loss(p, ids):
  # issue 27: a frozen dense layer (kernel and bias) on top of a table
  h = p["emb"][ids].mean(0) @ lax.stop_gradient(p["frozen_w"])
  h = h + lax.stop_gradient(p["frozen_b"])
  return jnp.sum(jnp.tanh(h) * p["w"])


def _frozen_layer_params():
  rng = np.random.RandomState(7)
  return {
    "emb": TABLE,
    "frozen_w": cast(rng.normal(size=(D, D)), jnp.float32),
    "frozen_b": cast(rng.normal(size=(D,)), jnp.float32),
    "w": W,
  }


def test_a_frozen_kernel_or_bias_gets_jax_zeros_not_sparse_rows():
  p = _frozen_layer_params()
  g = _check(_frozen_layer_loss, p, IDS)
  for k in ("frozen_w", "frozen_b"):
    assert not _is_sparse(g[k]) and g[k].shape == p[k].shape
    np.testing.assert_array_equal(g[k], 0.0)
  report = gtx.sparsity_report(_frozen_layer_loss)(p, IDS)
  assert [r.path for r in report.tables] == ["['emb']"]
  by = {r.path: r for r in report}
  assert not by["['frozen_w']"].frozen and not by["['frozen_w']"].sparse
  assert "after `stop_gradient`" in by["['frozen_w']"].reason
  assert str(report).startswith("1 table(s): 1 sparse, 0 dense, 0 frozen")
  labels = gtx.sparse_labels(_frozen_layer_loss)(p, IDS)
  assert labels == {
    "emb": "sparse",
    "frozen_w": "dense",
    "frozen_b": "dense",
    "w": "dense",
  }


def test_only_whole_row_reads_after_stop_gradient_make_a_frozen_table():
  def rows_then_matmul(t, i):  # frozen rows, and the frozen table as kernel
    f = lax.stop_gradient(t)
    return _mlp(f[i], W) + jnp.sum(f.T @ jnp.ones(V))

  def jitted_rows(t, i):  # frozen outside a jit, read as rows inside it
    f = lax.stop_gradient(t).astype(jnp.bfloat16)
    return jax.jit(lambda f: _mlp(f[i].astype(jnp.float32), W))(f)

  def row_bias(t, i):  # a per-id bias table, frozen: read as rows
    return _mlp(TABLE[i] + lax.stop_gradient(t)[i][:, None], W)

  def returned(t, i):  # the frozen value leaves the loss
    return _mlp(t[i], W), lax.stop_gradient(t)

  cases = [
    (rows_then_matmul, TABLE, False),
    (jitted_rows, TABLE, True),
    (row_bias, np.arange(V, dtype=np.float32), True),
  ]
  for loss, t, table in cases:
    (r,) = gtx.sparsity_report(loss)(t, IDS)
    assert r.frozen == table and r.is_table == table, (loss, r)
    g = _check(loss, t, IDS, sparse=int(table))
    if table:
      assert g.nnz == 0
    else:
      np.testing.assert_array_equal(g, 0.0)
  (r,) = gtx.sparsity_report(returned, has_aux=True)(TABLE, IDS)
  assert not r.sparse and "returned" in r.reason


def test_report_summary_first_then_details():
  p = _bert_params()
  p["b"] = np.zeros(D, np.float32)

  def loss(p, ids, segments):
    return _bert_like(p, ids, segments) + jnp.sum(p["b"])

  report = gtx.sparsity_report(loss)(p, _TOKENS, _SEGMENTS)
  text = str(report)
  first = text.splitlines()[0]
  assert first.startswith("2 table(s): 2 sparse, 0 dense, 0 frozen")
  assert "gradient bytes saved per step" in first
  assert "['emb']" in text and "64 rows per step" in text
  assert "['seg']" in text and "sparse, every row" in text
  assert "2 other leaf(s)" in text and "['b']" not in text
  assert "['b']" in report.details() and "['w']" in report.details()
  assert [r.path for r in report.tables] == ["['emb']", "['seg']"]


def test_nnx_value_paths_with_or_without_the_suffix():
  from flax import nnx

  class Model(nnx.Module):
    def __init__(self):
      self.emb = nnx.Embed(50, D, rngs=nnx.Rngs(0))
      self.seg = nnx.Embed(2, D, rngs=nnx.Rngs(1))

    def __call__(self, ids, segments):
      return jnp.sum(jnp.tanh(self.emb(ids) + self.seg(segments)))

  graphdef, state = nnx.split(Model())

  def loss(state, ids, segments):
    return nnx.merge(graphdef, state)(ids, segments)

  ids = cast(np.asarray(_TOKENS) % 50, jnp.int32)
  paths = [r.path for r in gtx.sparsity_report(loss)(state, ids, _SEGMENTS)]
  seg = [q for q in paths if "seg" in q][0]
  emb = [q for q in paths if "emb" in q][0]
  seg_names = (seg, seg.removesuffix(".value"))
  emb_names = (emb, emb.removesuffix(".value"))

  @jax.jit
  def grads(state, ids, segments):  # the four, one program
    return [
      gtx.sparse_grad(loss, require_sparse=name)(state, ids, segments)
      for name in seg_names
    ] + [
      gtx.sparse_grad(loss, dense=[name])(state, ids, segments)
      for name in emb_names
    ]

  out = grads(state, ids, _SEGMENTS)
  for g in out[:2]:
    assert isinstance(
      jax.tree.leaves(g["seg"], is_leaf=_is_sparse)[0], gtx.SparseRows
    )
  for g in out[2:]:
    assert not _is_sparse(jax.tree.leaves(g["emb"], is_leaf=_is_sparse)[0])


def test_re_jitted_blocks_are_not_kept_after_their_jit_is_gone():
  import gc

  def make():
    @jax.jit
    def block(t, i):
      return jnp.tanh(t[i])

    return lambda t, i: block(t, i).sum()

  gc.collect()
  before = len(_jaxpr._JITTED)
  for _ in range(3):
    f = make()
    gtx.sparse_value_and_grad(f)(TABLE, IDS)
    del f
  gc.collect()
  assert len(_jaxpr._JITTED) <= before
