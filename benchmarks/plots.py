"""Plots and the docs' Benchmarks page, made from ``benchmarks/results``.

  python -m benchmarks.plots

Writes PNGs to ``docs/assets/bench/`` and regenerates ``docs/benchmarks.md``
from the result tables; and the plots that ``benchmarks.recsys`` and
``benchmarks.convergence`` write beside their results.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._results import RESULTS, figure, save_figure

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "docs" / "assets" / "bench"
PAGE = ROOT / "docs" / "benchmarks.md"


def _num(x) -> float | None:
  return x if isinstance(x, (int, float)) else None


def _groups(ax, vals: dict[str, list], width: float) -> None:
  """A bar per series (label -> values) side by side in each group."""
  for j, (label, v) in enumerate(vals.items()):
    at = [i + (j - len(vals) / 2 + 0.5) * width for i in range(len(v))]
    ax.bar(at, v, width, label=label)


def plot_lazy_adam(data: dict, h: list) -> Any:
  rows = [int(r[0].split(" x ")[0].replace(",", "")) for r in data["rows"]]
  fig, ax = figure(figsize=(6, 3.6))
  for header, label in [
    ("gtx ms", "gtx.lazy_adam"),
    ("jnp ref ms", "plain-jnp lazy step"),
    ("optax.adam ms", "optax.adam (dense)"),
  ]:
    col = [_num(r[h.index(header)]) for r in data["rows"]]
    pts = [(x, v) for x, v in zip(rows, col, strict=True) if v is not None]
    ax.plot(*zip(*pts, strict=True), marker="o", label=label)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("table rows (dim 64, 8,192 ids per step)")
  ax.set_ylabel("ms per step")
  ax.set_title("Lazy vs dense Adam step time")
  ax.legend()
  return fig


def plot_sparse_grad(data: dict, h: list) -> Any:
  fig, axes = figure(1, 2, figsize=(7, 3.2))
  row = data["rows"][0]
  for ax, unit, label in [
    (axes[0], "ms", "ms per gradient"),
    (axes[1], "temp+out MiB", "compiled temp + output MiB"),
  ]:
    ax.bar(
      ["dense", "sparse"],
      [row[h.index(f"dense {unit}")], row[h.index(f"sparse {unit}")]],
    )
    ax.set_ylabel(label)
  fig.suptitle(f"Gradient of an embedding model, {row[0]} table")
  return fig


def plot_accumulate(data: dict, h: list) -> Any:
  rows = [r for r in data["rows"] if _num(r[1]) is not None]
  names = [r[0].replace(", ", ",\n") for r in rows]
  fig, axes = figure(1, 2, figsize=(9, 3.6))
  axes[0].barh(names, [r[1] for r in rows])
  axes[0].set_xlabel("silent micro-step, ms")
  axes[1].barh(names, [r[5] for r in rows])
  axes[1].set_xlabel("compiled memory (arg + out + temp), MiB")
  axes[1].set_yticklabels([])
  fig.suptitle("Gradient accumulation, k = 4")
  return fig


def plot_mirrored(data: dict, h: list) -> Any:
  row = data["rows"][0]
  sparse = row[h.index("sparse all-gather MiB (shapes)")]
  dense = row[h.index("dense all-reduce MiB (shapes)")]
  fig, ax = figure(figsize=(5, 3))
  ax.bar(["sparse all-gather", "dense all-reduce"], [sparse, dense])
  ax.set_ylabel("MiB moved per step")
  ax.set_title(f"Cross-replica reduction, {row[0]}, {row[2]} replicas")
  return fig


def plot_train_step(data: dict, h: list) -> Any:
  rows = [r for r in data["rows"] if r[h.index("ids")] == "uniform"]
  labels = [f"{r[0].split(' x ')[0]}\n{r[h.index('loss')]}" for r in rows]
  fig, ax = figure(figsize=(7, 3.6))
  series = {
    "gtx ms": "gtx.lazy_adam",
    "torch SparseAdam ms": "torch SparseAdam",
    "optax.adam ms": "optax.adam (dense)",
  }
  vals = {
    v: [_num(r[h.index(k)]) or 0.0 for r in rows] for k, v in series.items()
  }
  _groups(ax, vals, 0.27)
  ax.set_xticks(range(len(rows)), labels)
  ax.set_yscale("log")
  ax.set_ylabel("ms per training step")
  ax.set_title("Whole training step, uniform ids (rows, loss)")
  ax.legend(fontsize=8)
  return fig


def plot_recsys(
  groups: list[dict], points: list[dict], tables: int, path
) -> None:
  """Step times per group (``run_group``'s results) and compile time
  against tables (``compile_point``'s)."""
  panels = (1 if groups else 0) + (1 if points else 0)
  if not panels:
    return
  fig, axes = figure(1, panels, figsize=(7 * panels, 4), squeeze=False)
  axes = list(axes[0])
  if groups:
    ax = axes.pop(0)
    names = list(dict.fromkeys(k for g in groups for k in g["ms"]))
    twins = {g["twin"] for g in groups} | {g["fbgemm"] for g in groups}

    def series_of(k):
      if k in ("gtx", "gtx stacked", "floor: random rows"):
        return k
      for t in twins:
        if t and k.startswith(t):
          kind = "torch twin" if t.startswith("torch") else "FBGEMM"
          return kind + k[len(t) :]
      return None  # the opt-only parts: in the table

    def ms(g, s):
      return next((v for k, v in g["ms"].items() if series_of(k) == s), nan)

    nan = float("nan")
    series = dict.fromkeys(x for x in map(series_of, names) if x)
    vals = {s: [ms(g, s) for g in groups] for s in series}
    _groups(ax, vals, 0.8 / len(vals))
    ax.set_xticks(
      range(len(groups)),
      [f"{g['optimizer']}\n{g['ids']}, {g['head']}" for g in groups],
      fontsize=6,
      rotation=90,
    )
    ax.set_yscale("log")
    ax.set_ylabel("ms per training step (log)")
    ax.set_title(f"DLRM-shaped step, {tables} tables (optimizer, ids, head)")
    ax.legend(fontsize=6, ncol=2)
  if points:
    ax = axes.pop(0)
    for opt_name in dict.fromkeys(p["optimizer"] for p in points):
      for variant, style in (("per-table", "o-"), ("stacked", "s--")):
        pts = [
          (p["tables"], p["total_s"])
          for p in points
          if p["optimizer"] == opt_name and p["variant"] == variant
        ]
        ax.plot(*zip(*pts, strict=True), style, label=f"{opt_name} {variant}")
    ax.set_xlabel("tables")
    ax.set_ylabel("trace + lower + compile, s")
    ax.set_title("Compile time of the whole step")
    ax.legend(fontsize=7)
  save_figure(fig, path)


def plot_convergence(
  curves: dict[str, dict[str, list]], twin_of: dict[str, str], path: Path
) -> None:
  """Held-out loss by step (top) and the low-precision variants' ratio to
  their float32 twin's (``twin_of``; bottom)."""
  import matplotlib

  n = len(curves)
  # 13 configs: tab20's dark shades, then its light ones.
  colors = [
    matplotlib.colormaps["tab20"](i)
    for i in [*range(0, 20, 2), *range(1, 20, 2)]
  ]
  fig, axes = figure(
    2, n, figsize=(6.5 * n, 7.5), squeeze=False, height_ratios=[3, 2]
  )
  for col, (task, by_config) in enumerate(curves.items()):
    top, bottom = axes[0, col], axes[1, col]
    finite = [y for c in by_config.values() for _, y in c[1:] if np.isfinite(y)]
    for k, (name, curve) in enumerate(by_config.items()):
      x, y = zip(*curve[1:], strict=True)
      twin = dict(by_config.get(twin_of.get(name, ""), []))
      style = "--" if name in twin_of else "-"
      kw = {"color": colors[k % len(colors)], "label": name, "marker": "."}
      top.plot(x, y, style, **kw)
      if twin:
        bottom.plot(x, [v / twin[s] for s, v in curve[1:]], style, **kw)
    # from the best loss to the median after the first interval
    lo = min(finite)
    hi = float(np.median([c[1][1] for c in by_config.values()]))
    top.set_ylim(lo - 0.05 * (hi - lo), hi)
    top.set_title(task)
    top.set_ylabel("held-out loss")
    bottom.axhline(1.0, color="gray", lw=0.8)
    bottom.axhline(1.01, color="gray", lw=0.8, ls=":")
    bottom.set_title("low precision / its float32 twin (dotted: +1%)")
    bottom.set_ylabel("held-out loss ratio")
    bottom.set_xlabel("step")
    for ax in (top, bottom):
      ax.grid(True, alpha=0.3)
  axes[0, -1].legend(fontsize=8)
  fig.suptitle("Held-out loss: cheaper optimizers and lower precision")
  save_figure(fig, path, dpi=110)


# Which malloc a dense baseline ran with, in the page's words.
DENSE_NOTE = (
  "Dense baselines (`jax.value_and_grad`, `optax.adam`, `MultiSteps`) run "
  "in the process that imports gradtx. Since gradtx 2026-12-03 (f5ce7a7) "
  "that import sets malloc to reuse freed host memory for the whole process "
  "on a CPU (`gtx.reuse_host_memory`), which makes a dense step beside "
  "gradtx several times faster than in a process without it. Each section "
  "with a dense baseline says which it ran with: **gradtx's malloc** "
  "(measured after that commit) or **glibc's malloc** (measured before: "
  "the dense step ran as in a process without gradtx; beside gradtx today "
  "it takes less, so the ratio there is smaller). Sections measured with "
  "`--fresh-memory` support say so in their last paragraph. The headline "
  "ratios below (`results/summary.md`, 2026-11-30) all predate the "
  "setting: their dense baselines ran with glibc's malloc.\n"
)
_GLIBC = (
  "Dense baseline: **glibc's malloc** (this run predates gradtx's "
  "import-time host-memory setting; not rerun since)."
)

# Text the page shows under a section's table.
NOTES = {
  "sparse_grad": _GLIBC,
  "lazy_adam": _GLIBC,
  "accumulate": _GLIBC,
  "optimizers": _GLIBC,
  "convergence": _GLIBC.replace("Dense baseline", "Dense baseline's time"),
  "train_step": (
    "Dense baseline (`optax.adam`): **gradtx's malloc** (measured in the "
    "process that imported gradtx, after its import-time host-memory "
    "setting).\n\n"
    "FBGEMM (TorchRec's fused CPU kernels) has no Adam on CPU. Its fused "
    "Adagrad, row-wise Adagrad and SGD run beside gtx's twins in the "
    "sparse optimizers table below (where `fbgemm_gpu` imports), and in a "
    "process of their own without JAX in the FBGEMM anchor table.\n\n"
    "GPUs: jaxlib 0.10.2 (this project's pin) to 0.11.0 compile f32 "
    "scatter-add to a compare-and-swap loop (jax#38806, xla#46225; "
    "reported fixed in 0.11.1): under index contention (many duplicates "
    "of a few rows) a scatter-add runs hundreds of times slower; a large "
    "table with uniform ids barely notices. `jax.grad` of a lookup is such"
    " a scatter-add (the optax.adam "
    "baseline, Zipf ids above all); gtx coalesces on GPUs with a segmented "
    "scan and writes unique rows, so its lazy step does not meet it. "
    "`benchmarks/gpu.sh` runs the guides' whole steps (single table, "
    "Criteo, bags, hashed; gtx beside torch and FBGEMM) on a lent GPU into "
    "`results/gpu.md`, beside the cost model of `python -m "
    "benchmarks.gpu_model` (`results/gpu_model.md`: a model read from the "
    "exported cuda programs, not a measurement); no GPU has run it yet."
  ),
}

# The page's sections: the results table, its title, the plot drawn of it.
PLOTS = {
  "train_step": plot_train_step,
  "sparse_grad": plot_sparse_grad,
  "lazy_adam": plot_lazy_adam,
  "accumulate": plot_accumulate,
  "mirrored": plot_mirrored,
}
SECTIONS = {
  "train_step": "Whole training step vs torch and optax",
  "optimizers": "Sparse optimizers vs torch and FBGEMM",
  "fbgemm_anchor": "FBGEMM anchor (optional)",
  "sparse_grad": "Sparse vs dense gradient",
  "lazy_adam": "Lazy Adam vs dense Adam",
  "convergence": "Convergence with cheaper optimizers and lower precision",
  "low_precision": "Low precision: the whole step's time",
  "recsys": "Recommender scale: many tables",
  "stacks": "Table stacks: per-table vs stack vs torch and FBGEMM",
  "vocab": "Open vocabularies: the id map's cost in the step",
  "vocab_parts": "Open vocabularies: where the id map's time goes",
  "vocab_quality": "Open vocabularies: held-out loss",
  "eager_calls": "A table stack's methods called outside jax.jit",
  "publish": "Publishing deltas to serving",
  "accumulate": "Gradient accumulation",
  "async_staleness": "Stale gradients in asynchronous training",
  "async_staleness_ray": "Asynchronous training: Ray processes vs threads",
  "mirrored": "Mirrored replication",
  "dense_threshold": "Where dense beats sparse (the reads-per-row rule)",
  "ab_versions": "Whole step before and after this round of changes",
  "lr_pass": "The learning rate's separate pass",
  "row_reader": "One row reader",
  "row_gather": "A row read alone: the gather against numpy",
  "cpu_overlap": "Independent row updates: does XLA:CPU overlap them",
}


def main() -> None:
  ASSETS.mkdir(parents=True, exist_ok=True)
  parts = [
    "# Benchmarks\n",
    "Every benchmark compares its variants side by side in one process and "
    "reports ratios; the machine each ran on is named with its table. "
    "Regenerate everything with `make bench` (`python -m benchmarks`); this "
    "page is written by `python -m benchmarks.plots` from "
    "`benchmarks/results/`.\n",
    DENSE_NOTE,
  ]
  summary = RESULTS / "summary.md"
  if summary.exists():
    parts.append(summary.read_text())
  for name, title in SECTIONS.items():
    path = RESULTS / f"{name}.json"
    if not path.exists():
      continue
    image = None
    if name in PLOTS:
      data = json.loads(path.read_text())
      image = f"{name}.png"
      save_figure(PLOTS[name](data, data["headers"]), ASSETS / image)
    elif (RESULTS / f"{name}.png").exists():
      image = f"{name}.png"
      shutil.copy(RESULTS / image, ASSETS / image)
    table = (RESULTS / f"{name}.md").read_text().split("\n", 1)[1]
    figure = f"![{title}](assets/bench/{image})\n" if image else ""
    note = f"\n{NOTES[name]}\n" if name in NOTES else ""
    parts.append(f"## {title}\n\n{figure}{table}{note}")
  PAGE.write_text("\n".join(parts))
  print(f"wrote {PAGE.relative_to(ROOT)} and {len(SECTIONS)} plots")


if __name__ == "__main__":
  main()
