"""Real models from each framework, unmodified: their embedding tables get
SparseRows gradients equal to ``jax.grad``'s, and the compiled training
step (sparse gradients, a gradtx optimizer, apply) holds no table-sized
value besides the params and optimizer state it updates in place.

Row counts are primes (1009, 211) so that ``f32[1009,20]`` in the HLO can
only be the table (keep ``B * T != D``: XLA may transpose a ``[B * T, V]``
value into ``[V, B * T]``).
"""

import re

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from conformance import cast
from flax import nnx

import gradtx as gtx

V, D = 1009, 20  # the big table
V_TAGS, H = 211, 32  # a second table
B, T, C = 4, 6, 5  # batch, time, classes


def batch(seed=0, vocab=V):
  rng = np.random.RandomState(seed)
  return (
    cast(rng.randint(0, vocab, size=(B, T)), jnp.int32),
    cast(rng.randint(0, V_TAGS, size=(B,)), jnp.int32),
    cast(rng.randint(0, C, size=(B, T)), jnp.int32),
  )


def random_like(abstract):
  """Random arrays (built by numpy) for the ``jax.ShapeDtypeStruct`` leaves
  of ``abstract``; other leaves are kept."""
  rng = np.random.RandomState(0)
  return jax.tree.map(
    lambda s: (
      cast(rng.normal(0, 0.5, s.shape), s.dtype)
      if isinstance(s, jax.ShapeDtypeStruct)
      else s
    ),
    abstract,
  )


def init_params(init, *args):
  """Random params of the shapes ``init`` makes, without compiling it."""
  return random_like(jax.eval_shape(init, jax.random.key(0), *args))


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _is_sparse(x):
  return isinstance(x, gtx.SparseRows)


def _dense(g):
  """The dense array a SparseRows stands for, summed by numpy (float64)."""
  ids, values = np.asarray(g.indices), np.asarray(g.values, np.float64)
  out = np.zeros(g.shape, np.float64)
  ok = (ids >= 0) & (ids < g.num_rows)
  np.add.at(out, ids[ok], values[ok])
  return out


def compare_grads(value, grads, want_value, want, sparse, rtol=2e-5):
  """Checks gradtx's value and grads against ``jax.value_and_grad``'s.

  ``sparse`` maps a substring of a leaf's path to the number of rows its
  SparseRows gradient must hold (one per id read); every other leaf must
  come out dense.
  """
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  got = jax.tree_util.tree_flatten_with_path(grads, is_leaf=_is_sparse)[0]
  ref = jax.tree_util.tree_flatten_with_path(want)[0]
  assert [jax.tree_util.keystr(p) for p, _ in got] == [
    jax.tree_util.keystr(p) for p, _ in ref
  ]
  for (path, g), (_, w) in zip(got, ref, strict=True):
    dense = _dense(g) if _is_sparse(g) else g
    np.testing.assert_allclose(
      dense, w, rtol=rtol, atol=rtol / 20, err_msg=jax.tree_util.keystr(path)
    )
  found = {jax.tree_util.keystr(p): g.nnz for p, g in got if _is_sparse(g)}
  for name, rows in sparse.items():
    hits = [p for p in found if name in p]
    assert len(hits) == 1, f"{name} is not one SparseRows leaf: {found}"
    assert found[hits[0]] == rows, (name, found[hits[0]], rows)
  assert len(found) == len(sparse), found


_HARMLESS = ("parameter(", "get-tuple-element(", "bitcast(")


def table_sized_values(hlo_text, shapes):
  """HLO instructions that produce a value of one of ``shapes`` and are not
  a parameter, a view of one, or an (in-place) scatter into one."""
  pat = re.compile("|".join(rf"= [a-z0-9]+\[{r},{d}\]\{{" for r, d in shapes))
  return [
    line.strip()
    for line in hlo_text.splitlines()
    if pat.search(line)
    and not any(h in line for h in _HARMLESS)
    and "scatter" not in line.split("metadata=")[0]
  ]


def assert_no_table_sized_values(hlo_text, shapes):
  bad = table_sized_values(hlo_text, shapes)
  assert not bad, "\n".join(bad)


def make_step(loss, tx, grad=gtx.sparse_value_and_grad, apply=None):
  """One training step; it returns the grads too, for the comparison."""
  apply = apply or gtx.apply_updates

  def step(params, opt_state, *args):
    value, grads = grad(loss)(params, *args)
    updates, opt_state = tx.update(grads, opt_state, params)
    return apply(params, updates), opt_state, value, grads

  return step


def check_model(loss, params, args, sparse, shapes, apply=None, rtol=2e-5):
  """The whole check for a functional loss ``loss(params, *args)``.

  Compiles one donated step (gtx.sparse_value_and_grad, gtx.lazy_adam,
  ``apply``), asserts its HLO holds no value of the table ``shapes``, runs
  it and compares its value and grads with ``jax.value_and_grad``. Returns
  the params after the step.
  """
  want_value, want = jax.jit(jax.value_and_grad(loss))(params, *args)
  tx = gtx.lazy_adam(1e-2)
  opt_state = jax.jit(tx.init)(params)
  step = jax.jit(make_step(loss, tx, apply=apply), donate_argnums=(0, 1))
  compiled = step.lower(params, opt_state, *args).compile()
  assert_no_table_sized_values(compiled.as_text(), shapes)
  new_params, _, value, grads = compiled(  # donated: a copy (by numpy)
    jax.tree.map(lambda x: jnp.asarray(np.array(x)), params), opt_state, *args
  )
  compare_grads(value, grads, want_value, want, sparse, rtol=rtol)
  return new_params


def touched_rows_only(before, after, ids):
  before, after = np.asarray(before), np.asarray(after)
  changed = np.flatnonzero(np.any(before != after, axis=1))
  assert changed.size, "the step must change the read rows"
  assert set(changed.tolist()) <= set(np.asarray(ids).ravel().tolist())


# ----------------------------------------------------------------------------
# Flax linen: nn.Embed at the top level and inside nn.scan(nn.remat(...))


class LinenStep(nn.Module):
  @nn.compact
  def __call__(self, h, ids_t):
    x = nn.Embed(V, D, name="words")(ids_t)
    h = jnp.tanh(nn.Dense(H, name="mix")(jnp.concatenate([x, h], axis=-1)))
    return h, h


class LinenRNN(nn.Module):
  @nn.compact
  def __call__(self, ids, tags):
    h0 = nn.Embed(V_TAGS, H, name="tags")(tags)
    rnn = nn.scan(
      nn.remat(LinenStep),
      variable_broadcast="params",
      split_rngs={"params": False},
      in_axes=1,
      out_axes=1,
    )
    _, hs = rnn(name="rnn")(h0, ids)
    return nn.Dense(C, name="head")(hs)


def test_flax_linen_embed_in_scan_and_remat():
  model = LinenRNN()
  ids, tags, labels = batch(0)
  params = init_params(model.init, ids, tags)

  def loss(params, ids, tags, labels):
    return cross_entropy(model.apply(params, ids, tags), labels)

  new = check_model(
    loss,
    params,
    (ids, tags, labels),
    {"['words']": B * T, "['tags']": B},
    [(V, D), (V_TAGS, H)],
  )
  words = lambda p: p["params"]["rnn"]["words"]["embedding"]  # noqa: E731
  touched_rows_only(words(params), words(new), ids)


# ----------------------------------------------------------------------------
# Flax nnx: nnx.Embed, nnx.split / nnx.merge, nnx.Optimizer


class NnxModel(nnx.Module):
  def __init__(self, rngs):
    self.words = nnx.Embed(V, D, rngs=rngs)
    self.tags = nnx.Embed(V_TAGS, D, rngs=rngs)
    self.hidden = nnx.Linear(D, H, rngs=rngs)
    self.head = nnx.Linear(H, C, rngs=rngs)

  def __call__(self, ids, tags):
    x = self.words(ids) + self.tags(tags)[:, None, :]
    return self.head(nnx.gelu(self.hidden(x)))


def test_flax_nnx_embed_split_merge_optimizer():
  # the model's own graph, its params random by numpy (nothing compiled)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: NnxModel(nnx.Rngs(0))))
  model = nnx.merge(graphdef, random_like(state))
  ids, tags, labels = batch(1)
  graphdef, state = nnx.split(model)

  def loss(state, ids, tags, labels):
    return cross_entropy(nnx.merge(graphdef, state)(ids, tags), labels)

  want_value, want = jax.jit(jax.value_and_grad(loss))(state, ids, tags, labels)

  # The nnx training step: merge, sparse grads, optimizer.update, split.
  optimizer = nnx.Optimizer(model, gtx.lazy_adam(1e-2), wrt=nnx.Param)
  graph, both = nnx.split((model, optimizer))

  def step(both, ids, tags, labels):
    model, optimizer = nnx.merge(graph, both)
    mgraph, mstate = nnx.split(model)

    def loss(mstate):
      return cross_entropy(nnx.merge(mgraph, mstate)(ids, tags), labels)

    value, grads = gtx.sparse_value_and_grad(loss)(mstate)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), value, grads

  compiled = jax.jit(step, donate_argnums=0).lower(both, ids, tags, labels)
  compiled = compiled.compile()
  assert_no_table_sized_values(compiled.as_text(), [(V, D), (V_TAGS, D)])
  before = np.asarray(model.words.embedding[...])
  both, value, grads = compiled(both, ids, tags, labels)
  compare_grads(
    value, grads, want_value, want, {"['words']": B * T, "['tags']": B}
  )
  model, optimizer = nnx.merge(graph, both)
  touched_rows_only(before, model.words.embedding[...], ids)
  assert int(optimizer.step[...]) == 1


# ----------------------------------------------------------------------------
# Equinox: two eqx.nn.Embedding tables under jax.vmap, eqx.filter_jit


class EqxModel(eqx.Module):
  words: eqx.nn.Embedding
  tags: eqx.nn.Embedding
  head: eqx.nn.MLP

  def __init__(self, key):
    k1, k2, k3 = jax.random.split(key, 3)
    self.words = eqx.nn.Embedding(V, D, key=k1)
    self.tags = eqx.nn.Embedding(V_TAGS, D, key=k2)
    self.head = eqx.nn.MLP(D, C, H, depth=1, key=k3)

  def __call__(self, ids, tag):  # one example: ids [T], tag []
    x = jax.vmap(self.words)(ids).mean(0) + self.tags(tag)
    return self.head(jnp.tanh(x))


def test_equinox_embeddings_under_vmap_filter_jit():
  # the model's own structure, its params random by numpy (nothing compiled)
  model = random_like(eqx.filter_eval_shape(EqxModel, jax.random.key(0)))
  params, static = eqx.partition(model, eqx.is_inexact_array)
  ids, tags, labels = batch(2)

  def loss(params, ids, tags, labels):
    logits = jax.vmap(eqx.combine(params, static))(ids, tags)
    return cross_entropy(logits, labels[:, 0])

  want_value, want = jax.jit(jax.value_and_grad(loss))(
    params, ids, tags, labels
  )
  tx = gtx.lazy_adam(1e-2)

  @eqx.filter_jit(donate="all-except-first")
  def step(batch, model, opt_state):
    ids, tags, labels = batch
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(params):
      logits = jax.vmap(eqx.combine(params, static))(ids, tags)
      return cross_entropy(logits, labels[:, 0])

    value, grads = gtx.sparse_value_and_grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    new_model = eqx.combine(gtx.apply_updates(params, updates), static)
    return new_model, opt_state, value, grads

  opt_state = jax.jit(tx.init)(params)
  compiled = step.lower((ids, tags, labels), model, opt_state).compile()
  hlo = compiled.compiled.as_text()  # eqx.filter_jit's Compiled wraps jax's
  assert_no_table_sized_values(hlo, [(V, D), (V_TAGS, D)])
  before = np.asarray(model.words.weight)
  new_model, _, value, grads = compiled((ids, tags, labels), model, opt_state)
  compare_grads(value, grads, want_value, want, {".words": B * T, ".tags": B})
  touched_rows_only(before, new_model.words.weight, ids)


# ----------------------------------------------------------------------------
# Haiku: hk.Embed inside an LSTM core run by hk.dynamic_unroll


def haiku_forward(ids, labels):  # ids, labels [T, B]
  core = hk.DeepRNN([hk.Embed(V, D, name="embed"), hk.LSTM(H, name="lstm")])
  outs, _ = hk.dynamic_unroll(core, ids, core.initial_state(ids.shape[1]))
  return cross_entropy(hk.Linear(C, name="head")(outs), labels)


def test_haiku_embed_lstm_dynamic_unroll():
  f = hk.without_apply_rng(hk.transform(haiku_forward))
  ids, _, labels = batch(3)
  ids, labels = ids.T, labels.T
  params = init_params(f.init, ids, labels)
  # optax.apply_updates (what TrainState calls) in place of gtx's.
  new = check_model(
    f.apply,
    params,
    (ids, labels),
    {"['embed']": B * T},
    [(V, D)],
    apply=optax.apply_updates,
  )
  touched_rows_only(
    params["embed"]["embeddings"], new["embed"]["embeddings"], ids
  )


# ----------------------------------------------------------------------------
# A decoder-only language model: untied, factorised input embedding
# ([V, E] then E -> width), rematerialised blocks under nn.scan.

WIDTH, LAYERS = 32, 2


class Block(nn.Module):
  """Pre-norm causal self-attention (one head) and an MLP."""

  @nn.compact
  def __call__(self, x, _):
    h = nn.LayerNorm(name="ln")(x)
    qkv = nn.Dense(3 * WIDTH, use_bias=False, name="qkv")(h)
    q, k, v = jnp.split(qkv, 3, axis=-1)
    scores = jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(WIDTH)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))[None]
    att = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
    x = x + nn.Dense(WIDTH, name="out")(jnp.einsum("bts,bsd->btd", att, v))
    return x + nn.Dense(WIDTH, name="down")(nn.gelu(nn.Dense(64)(x))), None


class DecoderLM(nn.Module):
  @nn.compact
  def __call__(self, ids):
    x = nn.Dense(WIDTH, use_bias=False, name="proj")(
      nn.Embed(V, D, name="tok")(ids)
    )
    pos = self.param("pos", nn.initializers.normal(0.02), (T, WIDTH))
    x = x + pos[None, : ids.shape[1]]
    blocks = nn.scan(
      nn.remat(Block),
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=LAYERS,
    )
    x, _ = blocks(name="blocks")(x, None)
    return nn.Dense(V, use_bias=False, name="unembed")(nn.LayerNorm()(x))


def test_decoder_lm_untied_embedding_scanned_remat_blocks():
  model = DecoderLM()
  ids = batch(4)[0]
  params = init_params(model.init, ids)

  def loss(params, ids):
    logits = model.apply(params, ids)
    return cross_entropy(logits[:, :-1], ids[:, 1:])

  new = check_model(loss, params, (ids,), {"['tok']": B * T}, [(V, D)])
  tok = lambda p: p["params"]["tok"]["embedding"]  # noqa: E731
  touched_rows_only(tok(params), tok(new), ids)


def test_flax_embed_bf16_compute_dtype():
  # nn.Embed(dtype=bf16) casts the whole float32 table, then reads rows.
  model = nn.Embed(V, D, dtype=jnp.bfloat16)
  ids = batch(5)[0]
  params = init_params(model.init, ids)

  def loss(params, ids):
    return jnp.sum(jnp.tanh(model.apply(params, ids)).astype(jnp.float32))

  check_model(
    loss, params, (ids,), {"['embedding']": B * T}, [(V, D)], rtol=1e-2
  )
  # The check can fail: jax.value_and_grad's step builds [V, D] gradients.
  tx = optax.adam(1e-2)
  dense = jax.jit(make_step(loss, tx, grad=jax.value_and_grad))
  state = jax.eval_shape(tx.init, params)  # lowering needs only its shapes
  hlo = dense.lower(params, state, ids).compile().as_text()
  assert table_sized_values(hlo, [(V, D)])
