"""The benchmark harness (``benchmarks/_timing.py``, ``_results.py``,
``_common.py``): the spread it reports, the order in which it alternates
systems, the shared flags, the results files and the HLO readers, against
numpy and hand-counted references."""

import json

import numpy as np
import pytest

from benchmarks import _common as bench
from benchmarks import _results as results
from benchmarks import _timing as timing


@pytest.fixture
def run(monkeypatch, tmp_path):
  """A fresh run record and results folder, the suffix unset."""
  monkeypatch.setattr(timing, "RUN", timing._Run())
  monkeypatch.setattr(results, "RESULTS", tmp_path)
  monkeypatch.setenv(results.SUFFIX_ENV, "")  # restored after the test
  monkeypatch.delenv(results.SUFFIX_ENV)
  return timing.RUN


def test_spread_matches_numpy():
  rng = np.random.default_rng(0)
  seconds = rng.exponential(0.01, 4 * 5)
  got = timing.spread(list(seconds), burst=5)
  ms = seconds * 1e3
  rounds = np.median(ms.reshape(4, 5), axis=1)
  want = {
    "median": np.median(ms),
    "p10": np.percentile(ms, 10),
    "q1": np.percentile(ms, 25),
    "q3": np.percentile(ms, 75),
    "round_min": rounds.min(),
    "round_max": rounds.max(),
  }
  assert got.keys() == want.keys()
  for k, v in want.items():
    np.testing.assert_allclose(got[k], v, rtol=1e-12, err_msg=k)


def test_spread_of_one_call():
  got = timing.spread([0.002])
  assert set(got.values()) == {2.0}


def test_time_interleaved_alternates_and_records(run):
  calls = []

  def system(name):
    return lambda: calls.append(name)

  medians = timing.time_interleaved(
    {"a": system("a"), "b": system("b")},
    warmup=1,
    rounds=2,
    burst=2,
    settle=1,
    label="pair",
  )
  # warmup each, then per round: a settles once and runs twice, then b
  assert "".join(calls) == "ab" + "aaabbb" * 2
  assert medians.keys() == {"a", "b"}
  (record,) = run.timings
  assert record["label"] == "pair"
  assert (record["rounds"], record["burst"], record["settle"]) == (2, 2, 1)
  assert record["ms"].keys() == {"a", "b"}
  for k, v in record["ms"].items():
    np.testing.assert_allclose(v["median"], medians[k] * 1e3)


def test_time_interleaved_names_tuple_keys(run):
  timing.time_interleaved({("ours", 4): lambda: None}, warmup=0, rounds=1)
  assert run.timings[0]["label"] == "ours / 4"
  assert list(run.timings[0]["ms"]) == ["ours / 4"]


def test_schedule_time_uses_its_rounds(run):
  calls = []
  timing.Schedule(rounds=3, burst=1, settle=0).time(
    {"a": lambda: calls.append(1)}, warmup=0
  )
  assert len(calls) == 3
  assert run.timings[0]["label"] == "a"


def test_counter_counts_from_its_start():
  seen = []
  step = timing.Counter(seen.append, start=1)
  step()
  step()
  assert seen == [1, 2]


def test_parser_shared_flags_and_quick_sizes(run):
  p = bench.parser(
    "doc", schedule=timing.Schedule(6, 3, 1), steps=8, huge_pages=True
  )
  p.add_argument("--rows", type=int, default=1000)
  p.add_argument("--dim", type=int, default=64)
  args = bench.parse(p, [], quick={"rows": 10, "rounds": 2})
  assert (args.rounds, args.burst, args.settle, args.steps) == (6, 3, 1, 8)
  assert (args.rows, args.quick, args.huge_pages) == (1000, False, False)
  assert run.huge_pages is False and run.memory_reused is None

  quick = {"rows": 10, "dim": 8, "rounds": 2}
  args = bench.parse(p, ["--quick", "--dim", "32", "--huge-pages"], quick=quick)
  # --quick sets what the command line left at its default
  assert (args.rows, args.dim, args.rounds) == (10, 32, 2)
  assert run.quick and run.huge_pages
  assert results.result_path("x", ".md").name == "x_quick.md"


def test_parser_rejects_schedule_and_rounds():
  with pytest.raises(ValueError, match="schedule"):
    bench.parser("doc", schedule=timing.Schedule(), rounds=3)


def test_write_results_files(run, tmp_path):
  run.huge_pages = False
  timing.time_interleaved({"a": lambda: None}, warmup=0, rounds=2, label="t")
  md = results.write_results(
    "demo",
    "A title",
    ["system", "ms"],
    [["a", 1.5]],
    notes="Some notes.",
    extra={"headline": [{"metric": "m", "value": 1}]},
  )
  assert (tmp_path / "demo.md").read_text() == md
  lines = md.splitlines()
  assert lines[0] == "## A title"
  assert lines[2].startswith("Machine: ")
  assert "| a | 1.5 |" in lines
  assert "Some notes." in lines
  assert "4 KiB pages" in lines[-1] and "Load average" in lines[-1]
  data = json.loads((tmp_path / "demo.json").read_text())
  assert data["rows"] == [["a", 1.5]] and data["headers"] == ["system", "ms"]
  assert data["headline"] == [{"metric": "m", "value": 1}]
  assert data["load"].keys() == {"start", "end"}
  assert [t["label"] for t in data["timing"]] == ["t"]
  assert data["quick"] is False
  assert run.timings == []  # the next file gets only its own


def test_make_ids_ranges_and_zipf_head():
  rows, n = 1000, 20_000
  (uniform,) = bench.make_ids(rows, n, 1, "uniform", seed=1)
  (zipf,) = bench.make_ids(rows, n, 1, "zipf", seed=1)
  for ids in (uniform, zipf):
    assert ids.dtype == np.int32 and ids.shape == (n,)
    assert 0 <= ids.min() and ids.max() < rows
  # the hottest id of a bounded Zipf(s) takes 1 / sum_k k^-s of the draws
  share = np.bincount(zipf, minlength=rows).max() / n
  want = 1 / np.sum(np.arange(1, rows + 1.0) ** -bench.ZIPF_S)
  np.testing.assert_allclose(share, want, rtol=0.1)
  assert np.bincount(uniform).max() / n < 0.01


HLO = """\
  %ag = f32[8,64]{1,0} all-gather(f32[1,64]{1,0} %x), dimensions={0}
  %ar = (f32[16]{0}, /*index=1*/s32[4]{0}) all-reduce-start(%a, %b)
  %cp = bf16[2,3]{1,0} collective-permute(bf16[2,3]{1,0} %y)
  %add = f32[8,64]{1,0} add(%ag, %ag)
"""


def test_hlo_collectives_bytes():
  assert bench.hlo_collectives(HLO) == [
    ("all-gather", 8 * 64 * 4),
    ("all-reduce", 16 * 4 + 4 * 4),
    ("collective-permute", 2 * 3 * 2),
  ]
  assert bench.hlo_collectives(HLO, ("all-gather",)) == [
    ("all-gather", 8 * 64 * 4)
  ]


def test_step_runner_keeps_the_new_params_and_state():
  import jax
  import jax.numpy as jnp

  @jax.jit
  def step(p, s, x):
    return p + x, s + 1, jnp.sum(p * x)

  box = [jnp.zeros(3), jnp.zeros((), jnp.int32)]
  xs = [np.arange(3.0), np.ones(3)]
  run = timing.step_runner(step, box, lambda i: (xs[i % 2],))
  losses = [float(run(i)) for i in range(3)]
  p, want = np.zeros(3), []
  for i in range(3):  # the same steps in numpy
    want.append(np.sum(p * xs[i % 2]))
    p = p + xs[i % 2]
  np.testing.assert_allclose(box[0], p)
  assert int(box[1]) == 3
  np.testing.assert_allclose(losses, want)


def test_gpu_sh_dry_run(tmp_path):
  """benchmarks/gpu.sh --dry-run: every part of the GPU figures at toy
  sizes on the CPU (torch's where torch imports), so the script for the
  first lent GPU cannot rot."""
  import os
  import subprocess
  import sys
  from pathlib import Path

  root = Path(__file__).resolve().parent.parent
  env = dict(os.environ, PY=sys.executable, GPU_DRY_RUN_OUT=str(tmp_path))
  subprocess.run(
    ["bash", str(root / "benchmarks" / "gpu.sh"), "--dry-run"],
    env=env,
    check=True,
    capture_output=True,
    timeout=170,
  )
  md = (tmp_path / "gpu.md").read_text()
  assert "DRY RUN" in md
  for step in ("single table", "criteo", "bags", "hashed"):
    assert f"| {step} | " in md, step
  for step in ("keyed 26", "keyed 500"):
    assert f"| {step} | " in md, step
  payload = json.loads((tmp_path / "gpu.json").read_text())
  assert payload["dry_run"] and payload["steps"]
  assert "a model, not a measurement" in md


def test_clock_and_once():
  import time

  clock = timing.Clock()
  assert timing.once(lambda: time.sleep(0.01)) >= 0.01
  assert clock.wall() >= 0.01 and 0 <= clock.cpu()


def test_compile_phases_add_up():
  import jax
  import jax.numpy as jnp

  x = jax.ShapeDtypeStruct((4, 8), jnp.float32)
  got = bench.compile_phases(jax.jit(lambda a: jnp.tanh(a).sum(0)), x)
  phases = sum(got[f"{p}_s"] for p in ("trace", "lower", "compile"))
  assert 0 < phases <= got["total_s"]
  assert got["cpu_s"] >= 0 and got["hlo_lines"] > 0 and got["kernels"] >= 1


def test_columns_and_headline():
  assert results.columns("a | b, c | d") == ["a", "b, c", "d"]
  assert results.headline("m", 1.5) == {"metric": "m", "value": 1.5}
  assert results.headline("m", 2, ">= 1x")["target"] == ">= 1x"


def test_memory_budget_flag_and_default():
  p = bench.parser("doc")
  bench.add_memory_arg(p, 3)
  assert bench.memory_budget(p.parse_args(["--mem-gib", "0.5"])) == 2**29
  assert bench.memory_budget(p.parse_args([])) == 3 * 2**30  # on the CPU


@pytest.mark.parametrize("dense", [False, True])
def test_one_table_step_matches_numpy(dense):
  """models.one_table_step's loss and SGD update against numpy's
  sum(tanh(E[ids]) * ct) and its row gradient, duplicates summed."""
  import optax

  import gradtx as gtx
  from benchmarks import models

  data = models.one_table(50, 4, 16, "zipf", steps=2)
  tx = optax.sgd(0.1) if dense else gtx.lazy_sgd(0.1)
  run, box, copies = models.one_table_step(tx, data, dense=dense)
  table, ids, ct = data.table.astype(np.float64), data.ids_np[1], data.ct_np
  want_loss = np.sum(np.tanh(table[ids]) * ct)
  grad = np.zeros_like(table)
  np.add.at(grad, ids, (1 - np.tanh(table[ids]) ** 2) * ct)
  np.testing.assert_allclose(float(run(1)), want_loss, rtol=1e-5)
  np.testing.assert_allclose(box[0]["emb"], table - 0.1 * grad, atol=1e-6)
  assert copies == 0 or dense
