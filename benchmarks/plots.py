"""Plots and the docs' Benchmarks page, made from ``benchmarks/results``.

  python -m benchmarks.plots

Writes PNGs to ``docs/assets/bench/`` and regenerates ``docs/benchmarks.md``
from the result tables, so the docs always show the latest measured run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks._common import RESULTS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ASSETS = ROOT / "docs" / "assets" / "bench"
PAGE = ROOT / "docs" / "benchmarks.md"


def _load(name: str) -> dict | None:
  path = RESULTS / f"{name}.json"
  return json.loads(path.read_text()) if path.exists() else None


def _col(data: dict, header: str) -> list:
  i = data["headers"].index(header)
  return [row[i] for row in data["rows"]]


def _num(x) -> float | None:
  return x if isinstance(x, (int, float)) else None


def plot_lazy_adam(data: dict) -> str:
  rows = [int(t.split(" x ")[0].replace(",", "")) for t in _col(data, "table")]
  fig, ax = plt.subplots(figsize=(6, 3.6))
  for header, label in [
    ("gtx ms", "gtx.lazy_adam"),
    ("jnp ref ms", "plain-jnp lazy step"),
    ("optax.adam ms", "optax.adam (dense)"),
  ]:
    pts = [(r, _num(v)) for r, v in zip(rows, _col(data, header), strict=True)]
    pts = [(r, v) for r, v in pts if v is not None]
    ax.plot(*zip(*pts, strict=True), marker="o", label=label)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("table rows (dim 64, 8,192 ids per step)")
  ax.set_ylabel("ms per step")
  ax.set_title("Lazy vs dense Adam step time")
  ax.legend()
  fig.tight_layout()
  fig.savefig(ASSETS / "lazy_adam.png", dpi=120)
  plt.close(fig)
  return "lazy_adam.png"


def plot_sparse_grad(data: dict) -> str:
  fig, axes = plt.subplots(1, 2, figsize=(7, 3.2))
  row = data["rows"][0]
  h = data["headers"]
  axes[0].bar(
    ["dense", "sparse"], [row[h.index("dense ms")], row[h.index("sparse ms")]]
  )
  axes[0].set_ylabel("ms per gradient")
  axes[1].bar(
    ["dense", "sparse"],
    [row[h.index("dense temp+out MiB")], row[h.index("sparse temp+out MiB")]],
  )
  axes[1].set_ylabel("compiled temp + output MiB")
  fig.suptitle(f"Gradient of an embedding model, {row[0]} table")
  fig.tight_layout()
  fig.savefig(ASSETS / "sparse_grad.png", dpi=120)
  plt.close(fig)
  return "sparse_grad.png"


def plot_accumulate(data: dict) -> str:
  rows = [r for r in data["rows"] if _num(r[1]) is not None]
  names = [r[0].replace(", ", ",\n") for r in rows]
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
  axes[0].barh(names, [r[1] for r in rows])
  axes[0].set_xlabel("silent micro-step, ms")
  axes[1].barh(names, [r[5] for r in rows])
  axes[1].set_xlabel("compiled memory (arg + out + temp), MiB")
  axes[1].set_yticklabels([])
  fig.suptitle("Gradient accumulation, k = 4")
  fig.tight_layout()
  fig.savefig(ASSETS / "accumulate.png", dpi=120)
  plt.close(fig)
  return "accumulate.png"


def plot_mirrored(data: dict) -> str:
  row = data["rows"][0]
  h = data["headers"]
  sparse = row[h.index("sparse all-gather MiB (shapes)")]
  dense = row[h.index("dense all-reduce MiB (shapes)")]
  fig, ax = plt.subplots(figsize=(5, 3))
  ax.bar(["sparse all-gather", "dense all-reduce"], [sparse, dense])
  ax.set_ylabel("MiB moved per step")
  ax.set_title(f"Cross-replica reduction, {row[0]}, {row[2]} replicas")
  fig.tight_layout()
  fig.savefig(ASSETS / "mirrored.png", dpi=120)
  plt.close(fig)
  return "mirrored.png"


SECTIONS = [
  ("sparse_grad", "Sparse vs dense gradient", plot_sparse_grad),
  ("lazy_adam", "Lazy Adam vs dense Adam", plot_lazy_adam),
  ("accumulate", "Gradient accumulation", plot_accumulate),
  ("async_staleness", "Stale gradients in asynchronous training", None),
  ("mirrored", "Mirrored replication", plot_mirrored),
]


def main() -> None:
  ASSETS.mkdir(parents=True, exist_ok=True)
  parts = [
    "# Benchmarks\n",
    "Every benchmark compares its variants side by side in one process and "
    "reports ratios; the machine each ran on is named with its table. "
    "Regenerate everything with `make bench` (`python -m benchmarks`); this "
    "page is written by `python -m benchmarks.plots` from "
    "`benchmarks/results/`.\n",
  ]
  summary = RESULTS / "summary.md"
  if summary.exists():
    parts.append(summary.read_text().replace("## Headline", "## Headline", 1))
  for name, title, plot in SECTIONS:
    data = _load(name)
    if data is None:
      continue
    if plot is not None:
      image = plot(data)
    else:
      image = f"{name}.png"
      shutil.copy(RESULTS / image, ASSETS / image)
    table = (RESULTS / f"{name}.md").read_text().split("\n", 1)[1]
    parts.append(f"## {title}\n\n![{title}](assets/bench/{image})\n{table}")
  PAGE.write_text("\n".join(parts))
  print(f"wrote {PAGE.relative_to(ROOT)} and {len(SECTIONS)} plots")


if __name__ == "__main__":
  main()
