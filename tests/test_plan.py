"""The stack plan's default lanes (``TableStack(lanes=None)``)."""

import jax
import pytest

import gradtx as gtx
from gradtx import _plan


def _specs(n=4, rows=20000, dim=4):
  return {f"t{i}": gtx.TableSpec(rows + i, dim) for i in range(n)}


@pytest.fixture
def two_cores(monkeypatch):
  # what _host_lanes answers on a CPU host of two cores or more, whatever
  # the machine running the tests
  monkeypatch.setattr(_plan, "_host_lanes", lambda: 2)


def test_default_lanes_split_a_big_step_on_a_cpu(two_cores):
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
def test_default_lanes_keep_one_stack(two_cores, kwargs):
  stack = gtx.TableStack(_specs(), **kwargs)
  assert stack.lanes == 1
  assert list(stack.stacks) == ["float32x4"]
  assert "lanes" not in str(stack)


def test_default_lanes_split_each_width_of_two_tables_or_more(two_cores):
  # 3 tables of width 4, one table of width 8 (alone in its width: nothing
  # to split): only width 4 splits; 2 features or 300 split alike
  specs = {**_specs(3), "wide": gtx.TableSpec(40000, 8)}
  stack = gtx.TableStack(specs, batch_size=4096)
  assert list(stack.stacks) == ["float32x4", "float32x4_lane1", "float32x8"]
  assert len(gtx.TableStack(_specs(2), batch_size=2048).stacks) == 2
  assert len(gtx.TableStack(_specs(300), batch_size=2048).stacks) == 2


def test_host_lanes_follow_the_backend_and_the_cores(monkeypatch):
  monkeypatch.setattr(_plan.os, "sched_getaffinity", lambda _: {0, 1})
  assert _plan._host_lanes() == (2 if jax.default_backend() == "cpu" else 1)
  monkeypatch.setattr(_plan.os, "sched_getaffinity", lambda _: {0})
  assert _plan._host_lanes() == 1
  monkeypatch.setattr(_plan.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(_plan.os, "sched_getaffinity", lambda _: {0, 1, 2})
  assert _plan._host_lanes() == 1


def test_lanes_none_or_a_positive_int():
  with pytest.raises(ValueError, match="`lanes` must be a positive int"):
    gtx.TableStack(_specs(), lanes=0)
  with pytest.raises(ValueError, match="or None"):
    gtx.TableStack(_specs(), lanes=1.5)
