"""Asynchronous training with and without gtx.drop_stale.

Runs the real threaded trainer of ``examples/async_trainer.py`` for
max_staleness in {no limit, 4, 1} x workers in {1, 2, 4} (plus
``rescale=True`` with no limit), each repeated with several seeds, and
records the final eval loss, the dropped fraction, the staleness histogram
and the wall time. Writes ``results/async_staleness.{md,json}`` and a plot
of eval loss versus applied steps, ``results/async_staleness.png``.

``python -m benchmarks.staleness [--quick]``
"""

from __future__ import annotations

import argparse
import collections
import statistics

import numpy as np

from benchmarks._common import RESULTS, write_results
from examples import async_trainer as at


def _fmt_hist(hist: dict[int, int]) -> str:
  total = sum(hist.values())

  def pct(v):
    return "<1%" if v / total < 0.01 else f"{v / total:.0%}"

  return " ".join(f"{k}:{pct(v)}" for k, v in sorted(hist.items()))


def _finite(x: float) -> float | None:
  return float(x) if np.isfinite(x) else None


def _fmt_losses(losses: list[float], initial: float) -> tuple[str, str]:
  """(median, range) cells; a run whose loss ends above the initial loss (or
  not finite) is reported as diverged."""
  ok = [x for x in losses if np.isfinite(x) and x < initial]
  bad = len(losses) - len(ok)
  if not ok:
    return f"diverged ({bad}/{len(losses)})", "-"
  cell = f"{statistics.median(ok):.4g}"
  if bad:
    cell += f" ({bad}/{len(losses)} diverged)"
  return cell, f"{min(ok):.4g} - {max(ok):.4g}"


def _label(workers: int, limit: int | None, rescale: bool) -> str:
  s = "none" if limit is None else str(limit)
  return f"N={workers} s={s}" + (" rescale" if rescale else "")


def _plot(
  curves: dict[str, list[tuple[int, float]]], initial: float, path
) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  finite = [y for c in curves.values() for _, y in c if np.isfinite(y)]
  bottom = 0.9 * min(finite)
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
  for ax, workers in zip(axes, (1, 2, 4), strict=True):
    for label, curve in curves.items():
      if not label.startswith(f"N={workers} "):
        continue
      x, y = zip(*curve, strict=True)
      name = label.split(" ", 1)[1]
      if not (np.isfinite(y[-1]) and y[-1] < initial):
        name += " (diverged)"
      ax.plot(x, y, label=name)
    # Diverging runs leave the plot through the top; the rest stay readable.
    ax.set_ylim(bottom, 1.15 * initial)
    ax.set_title(
      f"{workers} workers"
      if workers > 1
      else "1 worker (never stale: the lines coincide)"
    )
    ax.set_xlabel("applied steps")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="max_staleness")
  axes[0].set_ylabel("eval loss (median over seeds)")
  fig.suptitle("Asynchronous sparse SGD with gtx.drop_stale")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _median_curve(curves: list[list[tuple[int, float]]]):
  by_step = collections.defaultdict(list)
  for c in curves:
    for step, loss in c:
      by_step[step].append(loss)
  # Only steps every repeat reached (runs stopped by time may be shorter).
  return [
    (s, float(np.median(v)))
    for s, v in sorted(by_step.items())
    if len(v) == len(curves)
  ]


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="a smoke run")
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--learning-rate", type=float, default=0.5)
  args = parser.parse_args(argv)
  steps = args.steps or (60 if args.quick else 600)
  repeats = args.repeats or (1 if args.quick else 3)
  time_limit = 10.0 if args.quick else 30.0
  task = at.make_task(seed=0)

  settings = [(w, s, False) for w in (1, 2, 4) for s in (None, 4, 1)]
  settings += [(w, None, True) for w in (1, 2, 4)]
  rows, curves, raw = [], {}, []
  initial_loss = float("nan")
  for workers, limit, rescale in settings:
    runs = [
      at.run_async(
        task,
        workers=workers,
        max_staleness=limit,
        num_steps=steps,
        time_limit=time_limit,
        learning_rate=args.learning_rate,
        rescale=rescale,
        seed=seed,
      )
      for seed in range(repeats)
    ]
    initial_loss = runs[0].curve[0][1]
    hist = collections.Counter()
    for r in runs:
      hist.update(r.staleness_hist)
    received = sum(r.received for r in runs)
    dropped = sum(r.dropped for r in runs)
    losses = [r.final_loss for r in runs]
    median_cell, range_cell = _fmt_losses(losses, initial_loss)
    mean_tau = sum(k * v for k, v in hist.items()) / max(received, 1)
    label = _label(workers, limit, rescale)
    curves[label] = _median_curve([r.curve for r in runs])
    rows.append(
      [
        workers,
        "none" if limit is None else limit,
        "yes" if rescale else "no",
        median_cell,
        range_cell,
        f"{dropped / max(received, 1):.1%}",
        round(mean_tau, 2),
        _fmt_hist(dict(hist)),
        statistics.median(r.wall_time for r in runs),
        round(received / sum(r.wall_time for r in runs)),
        ",".join(sorted({r.stopped_by for r in runs})),
      ]
    )
    raw.append(
      {
        "workers": workers,
        "max_staleness": limit,
        "rescale": rescale,
        "runs": [
          {
            "seed": seed,
            "final_loss": _finite(r.final_loss),
            "applied": r.applied,
            "received": r.received,
            "dropped": r.dropped,
            "dropped_fraction": r.dropped_fraction,
            "staleness_hist": {str(k): v for k, v in r.staleness_hist.items()},
            "wall_time": r.wall_time,
            "stopped_by": r.stopped_by,
            "curve": [(x, _finite(y)) for x, y in r.curve],
          }
          for seed, r in enumerate(runs)
        ],
      }
    )
    print(label, rows[-1], flush=True)

  RESULTS.mkdir(exist_ok=True)
  png = RESULTS / "async_staleness.png"
  _plot(curves, initial_loss, png)
  headers = [
    "workers",
    "max_staleness",
    "rescale",
    "final eval loss (median of converged)",
    "min - max",
    "dropped",
    "mean staleness",
    "staleness histogram (received)",
    "wall s (median)",
    "grads/s",
    "stopped by",
  ]
  notes = (
    f"Real threads (examples/async_trainer.py): each run trains until "
    f"{steps} gradients have been applied (or {time_limit:.0f} s pass), "
    f"{repeats} seed(s) per setting. Sparse SGD, learning rate "
    f"{args.learning_rate}, batch 32, bag-of-embeddings classifier over a "
    "2000-row table (SparseRows gradients); eval loss on 2048 held-out "
    f"examples (initial loss {initial_loss:.3f}). Staleness = global step at "
    "arrival - step at read; the histogram counts every received gradient, "
    "dropped ones included. A run is 'diverged' when its final eval loss "
    "is above the initial one (or not finite). Wall time excludes "
    "compilation. Thread timing "
    "on a shared machine is not deterministic: rerunning changes the "
    f"numbers somewhat. Plot: {png.name}."
  )
  cells = {(r[0], r[1], r[2]): r for r in rows}
  n = max(w for w, _, _ in settings)
  headline = [
    {
      "metric": f"dropped fraction, {n} workers, max_staleness=1",
      "value": cells[(n, 1, "no")][5],
    },
    {
      "metric": f"final eval loss, {n} workers: no limit / max_staleness=1"
      " / no limit + rescale",
      "value": " / ".join(
        str(cells[k][3])
        for k in [(n, "none", "no"), (n, 1, "no"), (n, "none", "yes")]
      ),
    },
  ]
  write_results(
    "async_staleness",
    "Asynchronous training: drop_stale vs workers",
    headers,
    rows,
    notes=notes,
    extra={
      "headline": headline,
      "steps": steps,
      "repeats": repeats,
      "curves": {k: [(x, _finite(y)) for x, y in c] for k, c in curves.items()},
      "settings": raw,
    },
  )


if __name__ == "__main__":
  main()
