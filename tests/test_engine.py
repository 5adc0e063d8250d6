"""The row engine: one rule form, one pass per group of tables, one
conditional for the wrappers, every state dtype optax takes.

Grouped results are checked against the same optimizer run on each table
alone (the engine's one-table path) and against numpy's Adam; the wrappers'
trace counts and the compiled step's deduplications are counted.
"""

import functools

import hlo
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import references_lazy_adam as ref
from conformance import cast, each, sparse_rows, step_fn, together
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradtx as gtx

# Three tables of one row shape (a group), one of another width, a dense
# leaf: the layout of a recommender with a table per feature.
TABLES = {"t0": (30, 4), "t1": (17, 4), "t2": (41, 4), "u": (20, 3)}


def _params(seed=0):
  rng = np.random.RandomState(seed)
  out = {k: cast(rng.normal(size=s), jnp.float32) for k, s in TABLES.items()}
  out["w"] = cast(rng.normal(size=(4,)), jnp.float32)
  return out


def _grads(step):
  rng = np.random.RandomState(50 + step)
  out = {k: sparse_rows(rng, s[0], s[1:], 8) for k, s in TABLES.items()}
  out["w"] = cast(rng.normal(size=(4,)), jnp.float32)
  return out


def _lion_rule(g, p, m):
  del p
  u = jnp.sign(0.9 * m + 0.1 * g)
  return -0.01 * u, 0.99 * m + 0.01 * g


# the rows one gradient carries, per leaf (None: a dense leaf)
ROWS = {**{k: 8 for k in TABLES}, "w": None}

OPTIMIZERS = {
  "lazy_adam": lambda: gtx.lazy_adam(0.05),
  "lazy_adam_catch_up": lambda: gtx.lazy_adam(0.05, catch_up=True),
  "lazy_adam_int8": lambda: gtx.lazy_adam(
    0.05, mu_dtype="int8", nu_dtype="int8"
  ),
  "lazy_adamw": lambda: gtx.lazy_adamw(0.05, weight_decay=0.1),
  "adagrad": lambda: gtx.adagrad(0.1),
  "rowwise_adagrad": lambda: gtx.rowwise_adagrad(0.1, weight_decay=0.01),
  "ftrl": lambda: gtx.ftrl(0.1, l1_regularization_strength=0.01),
  "lazy_sgd_momentum": lambda: gtx.lazy_sgd(0.1, momentum=0.9),
  "row_transformation": lambda: gtx.row_transformation(
    _lion_rule, lambda p: (jnp.zeros_like(p),)
  ),
  # rows_per_step: every leaf's entry of ROWS (a table alone: 8)
  "accumulate(drop_stale(lazy_adam))": lambda rows=ROWS: gtx.accumulate(
    gtx.drop_stale(gtx.lazy_adam(0.05), None), 2, rows_per_step=rows
  ),
  "partial_rowwise_adam": lambda: gtx.partial_rowwise_adam(
    0.05, weight_decay=0.01
  ),
}


EXTRA = {"grad_step": 0}  # drop_stale's; the others ignore it


def _grouped(txs):
  """``(init, step)`` of each of ``txs`` on all of the params: ``init(params)
  -> carries``, ``step(carries, grads, extra) -> carries`` (``extra``:
  update's keyword args), one ``(params, state)`` per transformation (jit
  them)."""
  run = together(txs, [step_fn(tx) for tx in txs])

  def init(params):
    return [(params, tx.init(params)) for tx in txs]

  def step(carries, g, extra):
    return run(carries, [(g, extra)] * len(txs))

  return init, step


def _each_alone(makes):
  """:func:`_grouped` of each table alone, for each transformation factory
  of ``makes``: a transformation (``make()``) and update call (a group of
  one) per table. A carry is ``(params, {table: state})``; the params and
  gradients are the tables', ``grad_step`` is 0."""
  txs = [{k: make() for k in TABLES} for make in makes]

  def init(params):
    params = {k: params[k] for k in TABLES}
    return [
      (params, {k: tx.init({k: params[k]}) for k, tx in per_table.items()})
      for per_table in txs
    ]

  def step(carries, g, extra=None):
    del extra
    out = []
    for per_table, (p, s) in zip(txs, carries, strict=True):
      new_p, new_s = {}, {}
      for k, tx in per_table.items():
        u, new_s[k] = tx.update({k: g[k]}, s[k], {k: p[k]}, grad_step=0)
        new_p.update(gtx.apply_updates({k: p[k]}, u))
      out.append((new_p, new_s))
    return out

  return init, step


def _train(txs, params, steps=4):
  """``steps`` updates of all of ``params`` by each of ``txs``, all in one
  jitted program: ``[(params, state)]``, one per transformation."""
  init, step = _grouped(txs)
  carries, step = init(params), jax.jit(step)
  for i in range(steps):
    carries = step(carries, _grads(i), EXTRA)
  return carries


def _leaves_of(tree, k):
  return [
    leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    if f"'{k}'" in jax.tree_util.keystr(path)
  ]


def test_grouped_tables_equal_each_table_alone():
  # every optimizer at once, grouped and each table alone: one program for
  # the inits, one for the steps (each init's ops eagerly would compile for
  # their shapes)
  names = list(OPTIMIZERS)
  runs = [
    _grouped([OPTIMIZERS[n]() for n in names]),
    _each_alone(
      [
        functools.partial(OPTIMIZERS[n], 8)
        if n.startswith("accumulate")
        else OPTIMIZERS[n]
        for n in names
      ]
    ),
  ]
  carries = jax.jit(lambda p: [init(p) for init, _ in runs])(_params())
  step = jax.jit(
    lambda carries, g, extra: [
      run(c, g, extra) for (_, run), c in zip(runs, carries, strict=True)
    ]
  )
  for i in range(4):
    carries = step(carries, _grads(i), EXTRA)
  grouped, alone = carries

  def equal(k, _):
    (together, s_together), (single, s_single) = grouped[k], alone[k]
    for t in TABLES:
      np.testing.assert_allclose(
        np.asarray(together[t]), np.asarray(single[t]), rtol=1e-6, atol=1e-7
      )
      # and the table's state leaves, whatever the optimizer's state type
      a_leaves, b_leaves = _leaves_of(s_together, t), _leaves_of(s_single[t], t)
      assert len(a_leaves) == len(b_leaves) > 0
      for a, b in zip(a_leaves, b_leaves, strict=True):
        np.testing.assert_allclose(
          np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-6
        )

  each(names, equal)


def test_grouped_lazy_adam_matches_numpy():
  params = _params()
  ((got, _),) = _train([gtx.lazy_adam(0.05)], params, steps=3)
  p = {k: np.asarray(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  for t in range(1, 4):
    g = _grads(t - 1)
    for k in p:
      if k in TABLES:
        rows = ref.coalesce_rows(g[k].indices, g[k].values, g[k].num_rows)
        for r, gr in rows.items():
          m[k][r] = 0.9 * m[k][r] + 0.1 * gr
          v[k][r] = 0.999 * v[k][r] + 0.001 * gr**2
          d = ref.adam_direction(m[k][r], v[k][r], t, 0.9, 0.999, 1e-8, 0.0)
          p[k][r] = p[k][r] - 0.05 * d
      else:
        gd = np.asarray(g[k], np.float64)
        m[k] = 0.9 * m[k] + 0.1 * gd
        v[k] = 0.999 * v[k] + 0.001 * gd**2
        d = ref.adam_direction(m[k], v[k], t, 0.9, 0.999, 1e-8, 0.0)
        p[k] = p[k] - 0.05 * d
  for k in p:
    np.testing.assert_allclose(np.asarray(got[k]), p[k], rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("tables", [1, 3, 6])
def test_one_dedup_per_group_whatever_the_number_of_tables(tables):
  params = {f"t{i}": jnp.zeros((50 + i, 8)) for i in range(tables)}
  tx = gtx.lazy_adam(0.1)
  rng = np.random.RandomState(0)
  grads = {
    k: sparse_rows(rng, v.shape[0], v.shape[1:], 16) for k, v in params.items()
  }

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s

  compiled = jax.jit(step).lower(params, tx.init(params), grads).compile()
  assert hlo.dedups(compiled) == (1, 0)


# ----------------------------------------------------------------------------
# the wrappers' conditional: the rule traced once per leaf


def _counting_tx(counter):
  def rule(g, p, m):
    counter.append(1)
    m = 0.9 * m + g
    return -0.1 * m, m

  return gtx.row_transformation(rule, lambda p: (jnp.zeros_like(p),))


WRAPPERS = {
  "alone": lambda tx: tx,
  "drop_stale": lambda tx: gtx.drop_stale(tx, 1),
  "accumulate": lambda tx: gtx.accumulate(tx, 2, rows_per_step=ROWS),
  "accumulate(drop_stale)": lambda tx: gtx.accumulate(
    gtx.drop_stale(tx, 1), 2, rows_per_step=ROWS
  ),
  "drop_stale(accumulate)": lambda tx: gtx.drop_stale(
    gtx.accumulate(tx, 2, rows_per_step=ROWS), 1
  ),
  "drop_stale(drop_stale)": lambda tx: gtx.drop_stale(gtx.drop_stale(tx, 2), 1),
}


@pytest.mark.parametrize("wrap", list(WRAPPERS))
def test_rule_traced_once_per_leaf_under_any_nesting(wrap):
  counter = []
  tx = WRAPPERS[wrap](_counting_tx(counter))
  params = _params()
  grads = _grads(0)
  jax.jit(lambda g, s, p: tx.update(g, s, p, grad_step=0)).trace(
    grads, tx.init(params), params
  )
  # once per leaf (four tables, one dense leaf), however deep the nesting
  assert len(counter) == len(TABLES) + 1


@pytest.mark.parametrize("wrap", ["drop_stale", "accumulate"])
def test_wrappers_under_shard_map_check_vma(wrap):
  """Gradients that vary over the mesh axis, sparse and dense, through
  each wrapper's conditional with shard_map's type checks on; per device
  the result is the single-device one on that device's gradient."""
  mesh = jax.make_mesh((8,), ("d",))
  wrappers = {
    "drop_stale": lambda tx: gtx.drop_stale(tx, 1),
    "accumulate": lambda tx: gtx.accumulate(
      tx, 2, rows_per_step={"emb": 4, "w": None}
    ),
  }
  tx = wrappers[wrap](gtx.lazy_adam(0.1))
  # numpy: indexed per device below, jax arrays would compile each op
  params = {"emb": np.ones((16, 2), np.float32), "w": np.ones(2, np.float32)}
  rng = np.random.RandomState(0)
  ids = rng.randint(0, 16, size=(8, 4)).astype(np.int32)
  vals = rng.normal(size=(8, 4, 2)).astype(np.float32)
  dense = rng.normal(size=(8, 2)).astype(np.float32)

  def one_device(p, i, v, d):
    state = tx.init(p)
    for t in range(2):
      g = {"emb": gtx.SparseRows(i, v, 16), "w": d}
      u, state = tx.update(g, state, p, grad_step=t)
      p = gtx.apply_updates(p, u)
    return p

  def body(p, i, v, d):
    out = one_device(p, i[0], v[0], d[0])
    return jax.tree.map(lambda x: x[None], out)

  f = jax.jit(
    jax.shard_map(
      body,
      mesh=mesh,
      in_specs=(P(), P("d"), P("d"), P("d")),
      out_specs=P("d"),
      check_vma=True,
    )
  )
  split = NamedSharding(mesh, P("d"))
  got = f(
    jax.device_put(params, NamedSharding(mesh, P())),
    *(jax.device_put(x, split) for x in (ids, vals, dense)),
  )
  for dev in range(8):
    want = jax.jit(one_device)(params, ids[dev], vals[dev], dense[dev])
    for k in params:
      np.testing.assert_allclose(
        np.asarray(got[k])[dev], np.asarray(want[k]), rtol=1e-6
      )


# ----------------------------------------------------------------------------
# row-sharded tables in a group, on 8 devices


def test_grouped_row_sharded_tables_equal_single_device():
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  rng = np.random.RandomState(1)
  shapes = {"a": (64, 4), "b": (32, 4), "c": (16, 4)}
  host = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
  grads = [
    {k: sparse_rows(rng, s[0], s[1:], 10) for k, s in shapes.items()}
    for _ in range(3)
  ]
  tx = gtx.lazy_adam(0.05)

  def train(params, init, place_grads):
    state = init(params)

    @jax.jit
    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return gtx.apply_updates(p, u), s

    for g in grads:
      params, state = step(params, state, place_grads(g))
    return params

  want = train(
    {k: jnp.asarray(v) for k, v in host.items()}, jax.jit(tx.init), lambda g: g
  )
  with jax.set_mesh(mesh):
    sharded = {
      k: jax.device_put(v, NamedSharding(mesh, P("d", None)))
      for k, v in host.items()
    }
    got = train(sharded, functools.partial(gtx.sharded_init, tx), lambda g: g)
  for k in shapes:
    assert got[k].sharding.spec == P("d", None)
    np.testing.assert_allclose(
      np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6
    )


# ----------------------------------------------------------------------------
# complex parameters and state: what optax does


def _complex(rng, shape):
  # numpy: indexed eagerly, a jax array would compile a gather
  return (rng.normal(size=shape) + 1j * rng.normal(size=shape)).astype(
    np.complex64
  )


COMPLEX_PAIRS = {
  "adam_mu_complex": (
    lambda: gtx.lazy_adam(0.05, mu_dtype=jnp.complex64),
    lambda: optax.adam(0.05, mu_dtype=jnp.complex64),
  ),
  "adam": (lambda: gtx.lazy_adam(0.05), lambda: optax.adam(0.05)),
  "sgd_momentum_complex": (
    lambda: gtx.lazy_sgd(0.1, momentum=0.9, accumulator_dtype=jnp.complex64),
    lambda: optax.sgd(0.1, momentum=0.9, accumulator_dtype=jnp.complex64),
  ),
}


@pytest.mark.parametrize("pair", list(COMPLEX_PAIRS))
def test_complex_params_and_state_match_optax(pair):
  make_ours, make_theirs = COMPLEX_PAIRS[pair]
  rng = np.random.RandomState(2)
  params = {"emb": _complex(rng, (6, 3)), "w": _complex(rng, (3,))}
  ours, theirs = make_ours(), make_theirs()
  # the inits in one program, each step in one (not op by op)
  s_ours, s_theirs = jax.jit(lambda p: (ours.init(p), theirs.init(p)))(params)
  step_ours = jax.jit(step_fn(ours))

  @jax.jit
  def step_theirs(p, s, g):
    u, s = theirs.update(g, s, p)
    return optax.apply_updates(p, u), s

  p_ours = p_theirs = params
  for _ in range(3):
    g_emb = _complex(rng, (6, 3))
    g_w = _complex(rng, (3,))
    # every row touched once (in a shuffled order): the lazy update is the
    # dense one
    perm = rng.permutation(6)
    sparse = {
      "emb": gtx.SparseRows(jnp.asarray(perm), g_emb[perm], 6),
      "w": g_w,
    }
    p_ours, s_ours = step_ours(p_ours, s_ours, sparse)
    p_theirs, s_theirs = step_theirs(
      p_theirs, s_theirs, {"emb": g_emb, "w": g_w}
    )
  for k in params:
    assert p_ours[k].dtype == jnp.complex64
    np.testing.assert_allclose(
      np.asarray(p_ours[k]), np.asarray(p_theirs[k]), rtol=2e-6, atol=1e-6
    )
  ours_leaves = jax.tree.leaves(s_ours)
  theirs_leaves = jax.tree.leaves(s_theirs)
  assert [x.dtype for x in ours_leaves if x.ndim] == [
    x.dtype for x in theirs_leaves if x.ndim
  ]


def test_int8_state_refuses_complex_params():
  tx = gtx.lazy_adam(0.1, mu_dtype="int8")
  with pytest.raises(TypeError, match='"int8" optimizer state is for real'):
    tx.init({"emb": jnp.zeros((4, 2), jnp.complex64)})


@pytest.mark.parametrize(
  "make",
  [
    lambda: gtx.adagrad(0.1, accumulator_dtype=jnp.complex64),
    lambda: gtx.rowwise_adagrad(0.1, accumulator_dtype=jnp.complex64),
    lambda: gtx.ftrl(0.1, accumulator_dtype=jnp.complex64),
  ],
  ids=["adagrad", "rowwise_adagrad", "ftrl"],
)
def test_complex_accumulators_refused_where_optax_has_none(make):
  with pytest.raises(TypeError, match="floating-point dtype"):
    make()


# ----------------------------------------------------------------------------
# the GPU deduplication keeps the CPU one's layout (a group's slices)


@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_dedup_has_the_cpu_layout(seed):
  from gradtx._dedup import _unique_by_hash, _unique_by_sort

  rng = np.random.RandomState(seed)
  n, num_rows = 64, 20
  idx = rng.randint(0, num_rows + 3, size=n).astype(np.int32)
  idx = np.where(idx >= num_rows, num_rows, idx)  # padding, normalized
  vals = rng.normal(size=(n, 3)).astype(np.float32)
  u_hash, v_hash = jax.jit(_unique_by_hash, static_argnums=2)(
    jnp.asarray(idx), jnp.asarray(vals), num_rows
  )
  u_sort, v_sort = jax.jit(_unique_by_sort, static_argnums=2)(
    jnp.asarray(idx), jnp.asarray(vals), num_rows
  )
  np.testing.assert_array_equal(np.asarray(u_sort), np.asarray(u_hash))
  keep = np.asarray(u_hash) < num_rows
  np.testing.assert_allclose(
    np.asarray(v_sort)[keep], np.asarray(v_hash)[keep], rtol=1e-6
  )
  # each id's sum at its first position, as numpy sums it
  for pos in np.flatnonzero(keep):
    want = vals[idx == idx[pos]].astype(np.float64).sum(0)
    np.testing.assert_allclose(np.asarray(v_hash)[pos], want, rtol=1e-5)


def test_unique_row_loop_compacts_the_update_and_zeroes_its_tail(monkeypatch):
  """The loop over a table's unique rows (_rows._update_unique): the same
  params and state as the pass over every id slot, the update's unique ids
  first and zeros past them; an update of another dtype than the gradient
  (bf16 gradient, float32 moments) takes the pass over every slot."""
  from gradtx import _rows

  ids = jnp.array([5, 2, 5, 40, 9, 2, 2, 0, 7, 11, 3, 9, 1, 6, -1, 8])
  rng = np.random.RandomState(3)
  # numpy: cast eagerly, jax arrays would compile the convert
  table = rng.normal(size=(40, 3)).astype(np.float32)
  vals = rng.normal(size=(16, 3)).astype(np.float32)
  monkeypatch.setattr(_rows, "LOOP_CHUNK", 4)
  monkeypatch.setattr(_rows, "LOOP_MIN_IDS", 0)
  loops = _rows._loops
  p = {"t": table}
  state = jax.jit(gtx.lazy_adam(0.1).init)(p)  # one program, not op by op

  def run(looping, dtype):
    monkeypatch.setattr(_rows, "_loops", loops if looping else (lambda *a: 0))
    tx = gtx.lazy_adam(0.1)
    g = gtx.SparseRows(ids, vals.astype(dtype), 40)
    u, s = jax.jit(tx.update)({"t": g}, state, p)
    return u["t"], s

  u, s = run(True, jnp.float32)
  u_ref, s_ref = run(False, jnp.float32)
  live = [5, 2, 9, 0, 7, 11, 3, 1, 6, 8]  # first seen order, 40 and -1 out
  # sliced in numpy (a jax array's slices compile)
  u_ids, u_vals = np.asarray(u.indices), np.asarray(u.values)
  np.testing.assert_array_equal(u_ids[:10], live)
  np.testing.assert_array_equal(u_ids[10:], 40)
  np.testing.assert_array_equal(u_vals[10:], 0)
  # the same rule compiled at another shape: equal up to rounding
  np.testing.assert_allclose(
    *jax.jit(lambda a, b: (a.to_dense(), b.to_dense()))(u, u_ref), rtol=1e-6
  )
  for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(s_ref), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  # bf16 gradient rows, float32 update: written where they were
  u16, _ = run(True, jnp.bfloat16)
  assert u16.values.dtype == jnp.float32
  np.testing.assert_array_equal(
    u16.indices, run(False, jnp.bfloat16)[0].indices
  )


@pytest.mark.parametrize(
  "make",
  [
    lambda: gtx.lazy_adam(1e-3),
    lambda: gtx.lazy_adamw(1e-3, weight_decay=1e-4),
    lambda: gtx.adagrad(1e-2),
    lambda: gtx.lazy_sgd(1e-2, momentum=0.9),
    lambda: gtx.rowwise_adagrad(1e-2),
  ],
  ids=["lazy_adam", "lazy_adamw", "adagrad", "lazy_sgd_momentum", "rowwise"],
)
def test_state_rows_gathered_inside_the_new_rows_computation(make):
  """The slot pass's new state rows read the old ones by a gather fused
  into their computation, on every supported XLA (_rows._materialize: a
  barrier where XLA keeps it through fusion, a scatter copy where it
  expands it first, as XLA:CPU of jax 0.10 does, which left the gathers
  standalone and the single-table step slower)."""
  v, d, n = 5003, 16, 512
  rng = np.random.RandomState(0)
  p = {"t": cast(rng.normal(size=(v, d)), jnp.float32)}
  ids = cast(rng.randint(0, v, n), jnp.int32)
  g = {"t": gtx.SparseRows(ids, jnp.ones((n, d)), v)}
  tx = make()

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return gtx.apply_updates(p, u), s

  compiled = (
    jax.jit(step, donate_argnums=(0, 1)).lower(p, tx.init(p), g).compile()
  )
  assert hlo.standalone_gathers(compiled, v) == []
