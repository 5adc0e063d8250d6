"""The stack plan's default lanes (``TableStack(lanes=None)``)."""

import os

import jax
import numpy as np
import pytest

import gradtx as gtx


def _specs(n=4, rows=20000, dim=4):
  return {f"t{i}": gtx.TableSpec(rows + i, dim) for i in range(n)}


def test_default_lanes_split_a_big_step():
  # a batch of 2048: two lanes
  stack = gtx.TableStack(_specs(), batch_size=2048)
  assert stack.lanes == 2
  assert list(stack.stacks) == ["float32x4", "float32x4_lane1"]
  assert sorted(t for s in stack.stacks.values() for t in s.tables) == [
    "t0",
    "t1",
    "t2",
    "t3",
  ]
  assert "up to 2 lanes" in str(stack)
  # the same plan as asking for two
  asked = gtx.TableStack(_specs(), batch_size=2048, lanes=2)
  assert {k: s.tables for k, s in stack.stacks.items()} == {
    k: s.tables for k, s in asked.stacks.items()
  }


@pytest.mark.parametrize(
  "kwargs",
  [
    {},  # no batch_size: the step's reads are unknown
    {"batch_size": 2047},  # a smaller batch
    {"batch_size": 4096, "lanes": 1},  # asked for one
    {"batch_size": 4096, "shards": 2},  # row-sharded: the mesh splits it
  ],
)
def test_default_lanes_keep_one_stack(kwargs):
  stack = gtx.TableStack(_specs(), **kwargs)
  assert stack.lanes == 1
  assert list(stack.stacks) == ["float32x4"]
  assert "lanes" not in str(stack)


def test_default_lanes_split_each_width_of_two_tables_or_more():
  # 3 tables of width 4, one table of width 8 (alone in its width: nothing
  # to split): only width 4 splits; 2 features or 300 split alike
  specs = {**_specs(3), "wide": gtx.TableSpec(40000, 8)}
  stack = gtx.TableStack(specs, batch_size=4096)
  assert list(stack.stacks) == ["float32x4", "float32x4_lane1", "float32x8"]
  assert len(gtx.TableStack(_specs(2), batch_size=2048).stacks) == 2
  assert len(gtx.TableStack(_specs(300), batch_size=2048).stacks) == 2


def test_the_plan_does_not_depend_on_the_host(monkeypatch):
  # A stack built on a GPU host, or on a CPU of one core, has the plan and
  # the params keys of one built here: a program exported on a CPU host
  # for a GPU is the one a GPU host builds.
  def plan():
    stack = gtx.TableStack(_specs(), batch_size=4096)
    return str(stack), {k: s.tables for k, s in stack.stacks.items()}

  here = plan()
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0}, raising=False)
  monkeypatch.setattr(os, "cpu_count", lambda: 1)
  assert plan() == here
  assert "on GPU and TPU" in here[0] and "on CPU" in here[0]


def test_lanes_none_or_a_positive_int():
  with pytest.raises(ValueError, match="`lanes` must be a positive int"):
    gtx.TableStack(_specs(), lanes=0)
  with pytest.raises(ValueError, match="or None"):
    gtx.TableStack(_specs(), lanes=1.5)


@pytest.mark.parametrize("shards", [1, 3, 4])
def test_a_stack_maps_its_rows_both_ways(shards):
  # round robin over the shards (StackSpec's docstring), and back; each
  # array row's table read from the offsets
  stack = gtx.TableStack(
    {"a": gtx.TableSpec(5, 4), "b": gtx.TableSpec(7, 4)}, shards=shards
  )
  s = stack.stacks["float32x4"]
  logical = np.arange(s.rows)
  per = s.size // shards
  want = (logical % shards) * per + logical // shards
  np.testing.assert_array_equal(s.physical(logical), want)
  np.testing.assert_array_equal(s.logical(s.physical(logical)), logical)
  np.testing.assert_array_equal(
    s.table_of(s.physical(logical)), (logical >= 5).astype(int)
  )
