"""The accelerator (GPU, TPU) code of gradtx's platform choices, run on CPU
(``conformance.gpu_branches``), against the CPU code and numpy: the
one-pass update of a big table, the sorted sums of a table read many times
per row, the parallel running sum, the materialize probe read on the CPU
whatever the default backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import gpu_branches

import gradtx as gtx
from benchmarks import stablehlo
from gradtx import _jax_compat, _platform, _rows


def test_a_big_table_is_updated_in_one_pass_on_accelerators(monkeypatch):
  # A table's slice above the loop threshold: the CPU runs the unique-row
  # loop, an accelerator one pass over every slot. Both give the same
  # params and state (a row optimizer's rule on the same rows).
  monkeypatch.setattr(_rows, "LOOP_CHUNK", 4)
  monkeypatch.setattr(_rows, "LOOP_MIN_IDS", 0)
  ids = jnp.array([5, 2, 5, 40, 9, 2, 2, 0, 7, 11, 3, 9, 1, 6, -1, 8])
  rng = np.random.RandomState(3)
  p = {"t": rng.normal(size=(40, 3)).astype(np.float32)}
  vals = rng.normal(size=(16, 3)).astype(np.float32)
  tx = gtx.lazy_adam(0.1)
  state = jax.jit(tx.init)(p)

  def step(p, s, g):
    u, s = tx.update({"t": g}, s, p)
    return gtx.apply_updates(p, u), s

  g = gtx.SparseRows(ids, vals, 40)
  cpu = jax.jit(step).lower(p, state, g)
  assert "while" in cpu.as_text()  # the loop, on CPU
  want = jax.jit(step)(p, state, g)
  with gpu_branches():
    acc = jax.jit(step).lower(p, state, g)
    got = jax.jit(step)(p, state, g)
  assert "while" not in acc.as_text()
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def _every_row_loss(t, ids_a, ids_b):
  # two reads of a tiny table, many ids each: every_row (one summed row
  # per table row), with out-of-range ids as padding
  return jnp.sum(gtx.lookup(t, ids_a) ** 2) + jnp.sum(jnp.sin(t[ids_b]))


def test_a_table_read_many_times_per_row_is_summed_by_sort(monkeypatch):
  rng = np.random.RandomState(0)
  t = rng.normal(size=(6, 3)).astype(np.float32)
  ids_a = rng.randint(-1, 7, size=(40,)).astype(np.int32)  # -1, 6: padding
  ids_b = rng.randint(0, 6, size=(5, 8)).astype(np.int32)
  vg = jax.jit(gtx.sparse_value_and_grad(_every_row_loss))
  report = gtx.sparsity_report(_every_row_loss)(t, ids_a, ids_b)
  assert report.tables[0].every_row
  _, want = vg(t, ids_a, ids_b)
  with gpu_branches():
    _, got = jax.jit(gtx.sparse_value_and_grad(_every_row_loss))(
      t, ids_a, ids_b
    )
    text = jax.jit(gtx.sparse_value_and_grad(_every_row_loss)).lower(
      t, ids_a, ids_b
    )
  np.testing.assert_array_equal(got.indices, np.arange(6))
  np.testing.assert_allclose(got.values, want.values, rtol=1e-6, atol=1e-6)
  # numpy: each row's reads summed
  ref = np.zeros_like(t)
  for i in ids_a:
    if 0 <= i < 6:
      ref[i] += 2 * t[i]
  for i in ids_b.reshape(-1):
    ref[i] += np.cos(t[i])
  np.testing.assert_allclose(got.values, ref, rtol=1e-5, atol=1e-5)
  # no float scatter-add over the unsorted reads on the accelerator path,
  # where the CPU's is jax's transpose of the reads
  cpu = jax.jit(gtx.sparse_value_and_grad(_every_row_loss)).lower(
    t, ids_a, ids_b
  )
  assert _contended(cpu.as_text())
  assert not _contended(text.as_text())


def _contended(text):
  """The float scatter-adds of ``text`` whose indices are neither unique
  nor sorted."""
  prog = stablehlo.read(text)
  return [
    op
    for op in prog.float_scatter_adds()
    if not (
      op.attribute("unique_indices") or op.attribute("indices_are_sorted")
    )
  ]


def test_prefix_sum_is_cumsum_on_every_platform():
  x = jnp.array([True, False, True, True, False, True])
  want = np.cumsum(np.asarray(x)).astype(np.int32)
  np.testing.assert_array_equal(_platform.prefix_sum(x), want)
  with gpu_branches():
    got = jax.jit(_platform.prefix_sum)(x)
  np.testing.assert_array_equal(got, want)


def test_the_materialize_probe_compiles_for_the_cpu(monkeypatch):
  # Traced on a GPU host, the CPU branch still asks XLA:CPU (its answer is
  # about XLA:CPU's fusion), never the default backend's compiler.
  _jax_compat.barrier_computes_once.cache_clear()
  want = _jax_compat.barrier_computes_once()
  _jax_compat.barrier_computes_once.cache_clear()
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  try:
    assert _jax_compat.barrier_computes_once() == want
  finally:
    _jax_compat.barrier_computes_once.cache_clear()


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_an_exported_step_holds_no_loop_and_no_contended_scatter(platform):
  # A small step (a loop and a hash dedup on CPU) lowered for an
  # accelerator on this CPU host.
  tx = gtx.rowwise_adagrad(0.1)

  def step(params, state, ids):
    loss, g = gtx.sparse_value_and_grad(lambda p: jnp.sum(p["emb"][ids] ** 2))(
      params
    )
    u, state = tx.update(g, state, params)
    return gtx.apply_updates(params, u), state, loss

  params = {"emb": jax.ShapeDtypeStruct((30_000, 4), jnp.float32)}
  state = jax.eval_shape(tx.init, params)
  ids = jax.ShapeDtypeStruct((20_000,), jnp.int32)
  exp = jax.export.export(jax.jit(step), platforms=[platform])
  text = exp(params, state, ids).mlir_module()
  cpu = jax.export.export(jax.jit(step), platforms=["cpu"])
  assert "stablehlo.while" in cpu(params, state, ids).mlir_module()
  assert "stablehlo.while" not in text
