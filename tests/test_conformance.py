"""Every gradtx transformation through the conformance suite
(tests/conformance.py): each check on every case that runs it (the
transformations together, the row optimizers together), and the cases
again with the GPU branches taken on CPU."""

import hlo
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import (
  CASES,
  OPTIMIZERS,
  check_gpu_branches,
  gpu_branches,
  runs,
)

import gradtx as gtx

GROUPS = {"transforms": CASES, "optimizers": OPTIMIZERS}
RUNS = runs(GROUPS)


@pytest.mark.parametrize(
  "check, cases", [r[1:] for r in RUNS], ids=[r[0] for r in RUNS]
)
def test_conformance(check, cases):
  check(cases)


@pytest.mark.parametrize("cases", GROUPS.values(), ids=GROUPS)
def test_gpu_branches(cases):
  check_gpu_branches(cases)


def test_gpu_branches_switch_is_part_of_the_trace():
  # deduplicated() hashes on CPU and sorts on GPUs, into the same layout:
  # the same jitted function, called outside, inside and outside the
  # switch, runs the branch of each side (never a program traced on the
  # other side), and both give the same ids.
  g = gtx.SparseRows(jnp.array([5, 2, 5, -1, 9, 2, 0]), jnp.ones((7, 2)), 9)
  dedup = jax.jit(lambda g: g.deduplicated().indices)
  want = [5, 2, 9, 9, 9, 9, 0]
  np.testing.assert_array_equal(dedup(g), want)
  assert hlo.dedups(dedup.lower(g).compile()) == (1, 0)
  with gpu_branches():
    np.testing.assert_array_equal(dedup(g), want)
    loops, sorts = hlo.dedups(dedup.lower(g).compile())
    assert loops == 0 and sorts >= 1
    np.testing.assert_array_equal(g.deduplicated().indices, want)  # eager
    with pytest.raises(RuntimeError, match="already active"):
      with gpu_branches():
        pass
  np.testing.assert_array_equal(dedup(g), want)
  np.testing.assert_array_equal(g.deduplicated().indices, want)
  assert hlo.dedups(dedup.lower(g).compile()) == (1, 0)
