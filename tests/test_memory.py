"""gtx.use_huge_pages: tables advised for huge pages, values untouched;
gtx.reuse_host_memory: a step's temporaries no longer faulted in afresh."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradtx as gtx

ROWS, DIM = 16_384, 128  # 8 MiB of float32: at least three whole 2 MiB pages


def _thp_mode() -> str | None:
  try:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
      text = f.read()
  except OSError:
    return None
  return text.split("[", 1)[1].split("]", 1)[0]


def _vma_flags(addr: int) -> dict[str, str]:
  """The /proc/self/smaps fields of the mapping holding ``addr``."""
  fields, inside = {}, False
  with open("/proc/self/smaps") as f:
    for line in f:
      head = line.split()[0]
      if "-" in head and ":" not in head:
        lo, hi = (int(x, 16) for x in head.split("-"))
        if inside:
          break
        inside = lo <= addr < hi
      elif inside:
        key, _, value = line.partition(":")
        fields[key] = value.strip()
  return fields


def _libc() -> str:
  import platform

  return platform.libc_ver()[0]


def _first_whole_page(x: jax.Array) -> int:
  huge = 2 << 20
  return (x.unsafe_buffer_pointer() + huge - 1) & ~(huge - 1)


def test_values_and_tree_unchanged():
  rng = np.random.default_rng(0)
  table = jnp.asarray(rng.standard_normal((ROWS, DIM)).astype(np.float32))
  tree = {"emb": table, "w": jnp.ones(3), "none": None, "n": np.zeros(2)}
  before = np.asarray(table).copy()
  out = gtx.use_huge_pages(tree)
  assert out is tree
  assert out["emb"] is table
  np.testing.assert_array_equal(np.asarray(out["emb"]), before)


@pytest.mark.skipif(
  not sys.platform.startswith("linux") or _thp_mode() in (None, "never"),
  reason="needs Linux transparent huge pages (not 'never')",
)
def test_buffer_is_advised_for_huge_pages():
  table = jnp.zeros((ROWS, DIM)) + 1.0
  small = jnp.zeros((8, DIM)) + 1.0  # under min_bytes: left alone
  gtx.use_huge_pages({"emb": table, "small": small}, collapse=False)
  fields = _vma_flags(_first_whole_page(table))
  # MADV_HUGEPAGE marks the mapping eligible ("hg" in VmFlags).
  assert "hg" in fields["VmFlags"].split(), fields["VmFlags"]
  assert fields.get("THPeligible") == "1"


def test_donated_step_keeps_results_and_buffer():
  rng = np.random.default_rng(1)
  table = rng.standard_normal((ROWS, DIM)).astype(np.float32)
  ids = jnp.asarray(rng.integers(0, ROWS, (2, 64)).astype(np.int32))
  tx = gtx.lazy_adam(1e-2)

  def step(params, state, ids):
    loss, g = gtx.sparse_value_and_grad(
      lambda p: jnp.sum(jnp.tanh(p["emb"][ids]))
    )(params)
    u, state = tx.update(g, state, params)
    return gtx.apply_updates(params, u), state, loss

  results = []
  for advise in (False, True):
    params = {"emb": jnp.asarray(table)}
    state = tx.init(params)
    if advise:
      gtx.use_huge_pages((params, state))
    ptr = params["emb"].unsafe_buffer_pointer()
    jstep = jax.jit(step, donate_argnums=(0, 1))
    for k in range(2):
      params, state, _ = jstep(params, state, ids[k])
    if advise:  # updated in place: still the advised buffer
      assert params["emb"].unsafe_buffer_pointer() == ptr
    results.append(np.asarray(params["emb"]))
  np.testing.assert_array_equal(results[0], results[1])


def test_sharded_table_each_shard():
  mesh = jax.make_mesh(
    (jax.device_count(),), ("d",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  rows = 8 * ROWS
  table = jax.device_put(
    jnp.arange(rows * 4, dtype=jnp.float32).reshape(rows, 4) * 0 + 2.0,
    NamedSharding(mesh, P("d", None)),
  )
  # Each shard is ROWS x 4 floats (256 KiB): advise shards of any size.
  assert gtx.use_huge_pages(table, min_bytes=0) is table
  np.testing.assert_array_equal(np.asarray(table), 2.0)


def test_traced_values_refused():
  with pytest.raises(ValueError, match="outside jit"):
    jax.jit(gtx.use_huge_pages)(jnp.zeros((4, 2)))


# ----------------------------------------------------------------------------
# bytes_per_row


def test_bytes_per_row_counts_the_table_and_its_state():
  import optax

  params = {
    "emb": jnp.zeros((1000, 64)),
    "small": jnp.zeros((10, 8), jnp.bfloat16),
    "w": jnp.zeros(64),
  }
  got = gtx.bytes_per_row(gtx.lazy_adam(1e-3), params)
  assert got == {"['emb']": 768.0, "['small']": 3 * 16.0}
  assert gtx.bytes_per_row(gtx.rowwise_adagrad(0.1), params) == {
    "['emb']": 256.0 + 4,
    "['small']": 16.0 + 4,
  }
  # a bf16 first moment, in a chain with clipping, on abstract params
  tx = optax.chain(
    gtx.clip_by_global_norm(1.0), gtx.lazy_adam(1e-3, mu_dtype=jnp.bfloat16)
  )
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params
  )
  assert gtx.bytes_per_row(tx, abstract)["['emb']"] == 256 + 128 + 256
  # optax's own dense Adam counts the same way
  assert gtx.bytes_per_row(optax.adam(1e-3), params)["['emb']"] == 768.0


_FAULTS = """
import resource, sys
import jax, jax.numpy as jnp, numpy as np
import gradtx as gtx
if sys.argv[1] == "opt-out":
  assert gtx.reuse_host_memory(False)
rows, dim, n = 200_000, 64, 65_536  # 16 MiB of gradient rows a feature
stack = gtx.TableStack({t: gtx.TableSpec(rows, dim) for t in "ab"})
tx = gtx.lazy_sgd(0.1)
params = stack.init(jax.random.key(0))
state = tx.init(params)

def loss(p, ids):
  return sum(jnp.sum(jnp.tanh(e)) for e in stack.lookup(p, ids).values())

def step(p, s, ids):
  v, g = gtx.sparse_value_and_grad(loss)(p, ids)
  u, s = tx.update(g, s, p)
  return gtx.apply_updates(p, u), s, v

step = jax.jit(step, donate_argnums=(0, 1))
rng = np.random.default_rng(0)
batches = [
  {t: rng.integers(0, rows, n).astype(np.int32) for t in "ab"}
  for _ in range(4)
]
faults = []
for k in range(15):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  params, state, v = step(params, state, batches[k % 4])
  v.block_until_ready()
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(faults[3:])[6])  # the median step after the warm-up
"""


def _faults_per_run(mode: str) -> int:
  import os
  import subprocess

  env = dict(os.environ)
  env.pop("GRADTX_REUSE_HOST_MEMORY", None)
  if mode == "env-opt-out":
    env["GRADTX_REUSE_HOST_MEMORY"] = "0"
  out = subprocess.run(
    [sys.executable, "-c", _FAULTS, mode],
    capture_output=True,
    text=True,
    check=True,
    timeout=120,
    env=env,
  )
  return int(out.stdout.split()[-1])


@pytest.mark.skipif(
  not sys.platform.startswith("linux") or _libc() != "glibc",
  reason="reuse_host_memory tunes glibc's malloc",
)
def test_host_memory_is_reused_by_default_with_an_opt_out():
  # A stack step's temporaries: tens of MiB, about 17,000 pages of 4 KiB.
  # The median step counts: with the memory reused most steps fault
  # nothing, and a step now and then faults its temporaries in afresh (a
  # freed block split by a smaller allocation, so the heap grows once
  # more). gradtx applies the setting at import; both opt-outs (the
  # environment variable, the call) give glibc's behaviour back.
  fresh = _faults_per_run("env-opt-out")
  if fresh < 4096:  # this malloc keeps freed blocks already
    pytest.skip(f"{fresh} page faults a step with glibc's own settings")
  assert _faults_per_run("default") < fresh / 4
  assert _faults_per_run("opt-out") > fresh / 2


def test_reuse_host_memory_by_default_only_where_jax_runs_on_cpu(
  monkeypatch,
):
  from gradtx import _memory

  calls = []
  monkeypatch.setattr(_memory, "reuse_host_memory", lambda: calls.append(1))
  monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
  monkeypatch.delenv("GRADTX_REUSE_HOST_MEMORY", raising=False)
  assert not _memory._reuse_by_default()
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  _memory._reuse_by_default()
  assert calls == [1]
  monkeypatch.setenv("GRADTX_REUSE_HOST_MEMORY", "0")
  assert not _memory._reuse_by_default()
  assert calls == [1]
