"""Asynchronous training with and without gtx.drop_stale.

Runs the real threaded trainer of ``examples/async_trainer.py`` for
max_staleness in {no limit, 4, 1} x workers in {1, 2, 4} (plus
``rescale=True`` with no limit), each repeated with several seeds, and
records the final eval loss, the dropped fraction, the staleness histogram
and the wall time. Writes ``results/async_staleness.{md,json}`` and a plot
of eval loss versus applied steps, ``results/async_staleness.png``.

With ``--ray`` it runs instead the trainer across processes of
``examples/ray_trainer.py`` (needs the ``ray`` extra) side by side with the
threaded one, on the same task, initial parameters, shards and batches:
1, 2, 4 and 8 workers x max_staleness in {no limit, N - 1, 1} x rescale
off and on, and records the held-out loss against wall time and the
gradients applied per second of both. Writes
``results/async_staleness_ray.{md,json,png}``.

``python -m benchmarks.staleness [--ray] [--quick]``
"""

from __future__ import annotations

import collections
import statistics

import numpy as np

from benchmarks._common import parse, parser
from benchmarks._results import (
  columns,
  figure,
  headline,
  result_path,
  save_figure,
  write_results,
)
from examples import async_trainer as at


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


def _summary(runs: list, initial: float, received: bool = True) -> dict:
  """What a table row shows of one engine's runs of one setting; dropped
  over the gradients ``received`` (threads) or applied + dropped (Ray)."""
  hist: collections.Counter = collections.Counter()
  for r in runs:
    hist.update(r.staleness_hist)
  total = sum(r.received if received else r.applied + r.dropped for r in runs)
  pct = {k: v / max(sum(hist.values()), 1) for k, v in sorted(hist.items())}
  loss, spread = _fmt_losses([r.final_loss for r in runs], initial)
  return {
    "loss": loss,
    "range": spread,
    "dropped": f"{sum(r.dropped for r in runs) / max(total, 1):.1%}",
    "mean_staleness": round(
      sum(k * v for k, v in hist.items())
      / max(total if received else sum(hist.values()), 1),
      2,
    ),
    "hist": " ".join(
      f"{k}:{'<1%' if v < 0.01 else f'{v:.0%}'}" for k, v in pct.items()
    ),
    "rate": sum(r.applied if not received else r.received for r in runs)
    / sum(r.wall_time for r in runs),
    "wall": statistics.median(r.wall_time for r in runs),
  }


def _run_json(seed: int, r, threads: bool = True) -> dict:
  out = {"seed": seed, "final_loss": _finite(r.final_loss)}
  out.update(applied=r.applied)
  if threads:
    out.update(received=r.received)
  out.update(dropped=r.dropped)
  if threads:
    out.update(dropped_fraction=r.dropped_fraction)
  hist = {str(k): v for k, v in r.staleness_hist.items()}
  return {
    **out,
    "staleness_hist": hist,
    "wall_time": r.wall_time,
    "stopped_by": r.stopped_by,
  }


def _setting(workers: int, limit: int | None, rescale: bool) -> list:
  """A row's first cells: workers, max_staleness, rescale."""
  return [
    workers,
    "none" if limit is None else limit,
    "yes" if rescale else "no",
  ]


def _label(workers: int, limit: int | None, rescale: bool) -> str:
  s = "none" if limit is None else str(limit)
  return f"N={workers} s={s}" + (" rescale" if rescale else "")


def _role(workers: int, limit: int | None, rescale: bool) -> str:
  """A setting's name across worker counts: none, N-1 or 1."""
  if limit is None:
    name = "none"
  elif limit == workers - 1:
    name = "N-1" if limit != 1 else "1 = N-1"
  else:
    name = str(limit)
  return name + (" + rescale" if rescale else "")


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


def _plot(curves, initial, path, panels, ray=False) -> None:
  """One panel a (engine, workers) of ``panels``; ``curves`` maps
  (engine, workers, limit, rescale) to (x, loss) points."""
  finite = [y for c in curves.values() for _, y in c if np.isfinite(y)]
  engines = sorted({p[0] for p in panels}, key=[e for e, _ in panels].index)
  width = len(panels) // len(engines)
  fig, axes = figure(
    len(engines),
    width,
    figsize=(5 * width, 4.5 if len(engines) == 1 else 8.5),
    sharey=True,
    squeeze=False,
  )
  for ax, (engine, workers) in zip(axes.flat, panels, strict=True):
    for (e, w, limit, rescale), curve in curves.items():
      if (e, w) != (engine, workers) or not curve:
        continue
      x, y = zip(*curve, strict=True)
      if ray:
        name = _role(workers, limit, rescale)
        color = {"none": "C3", "N-1": "C0"}.get(name.split(" + ")[0], "C2")
        ax.plot(x, y, color=color, ls="--" if rescale else "-", label=name)
        continue
      name = _label(workers, limit, rescale).split(" ", 1)[1]
      diverged = not (np.isfinite(y[-1]) and y[-1] < initial)
      ax.plot(x, y, label=name + (" (diverged)" if diverged else ""))
    # Diverging runs leave the plot through the top; the rest stay readable.
    ax.set_ylim(0.9 * min(finite), 1.15 * initial)
    if ray:
      where = (
        "threads in 1 process"
        if engine == "threads"
        else f"Ray: {workers + 1} processes on 2 cores"
      )
      ax.set_title(f"{workers} worker{'s' if workers > 1 else ''}, {where}")
    else:
      ax.set_title(
        f"{workers} workers"
        if workers > 1
        else "1 worker (never stale: the lines coincide)"
      )
    ax.set_xlabel("wall seconds" if ray else "applied steps")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="max_staleness", fontsize=8 if ray else None)
  for row, _ in enumerate(engines):
    axes[row][0].set_ylabel(
      "held-out loss (first seed)" if ray else "eval loss (median over seeds)"
    )
  fig.suptitle(
    "Asynchronous sparse SGD with gtx.drop_stale: threads (top) and Ray "
    "processes (bottom); note the different time axes"
    if ray
    else "Asynchronous sparse SGD with gtx.drop_stale"
  )
  save_figure(fig, path, dpi=90 if ray else 110)


def _threads(task, workers, limit, rescale, seed, steps, time_limit, lr):
  """One run of the threaded trainer."""
  return at.run_async(
    task,
    workers=workers,
    max_staleness=limit,
    num_steps=steps,
    time_limit=time_limit,
    learning_rate=lr,
    rescale=rescale,
    seed=seed,
  )


def _write(name, title, headers, rows, notes, *, curves, **extra) -> None:
  """The result files, with every curve's losses JSON-safe."""
  safe = {k: [(x, _finite(y)) for x, y in c] for k, c in curves.items()}
  write_results(
    name, title, headers, rows, notes=notes, extra={**extra, "curves": safe}
  )


def main(argv: list[str] | None = None) -> None:
  p = parser(__doc__.splitlines()[0], steps=600)
  p.add_argument("--repeats", type=int, default=None)
  p.add_argument("--learning-rate", type=float, default=0.5)
  p.add_argument("--ray", action="store_true", help="Ray processes vs threads")
  args = parse(p, argv, quick=dict(steps=60))
  args.time_limit = 10.0 if args.quick else 30.0
  if args.ray:
    ray_main(args)
    return
  steps, lr, time_limit = args.steps, args.learning_rate, args.time_limit
  repeats = args.repeats or (1 if args.quick else 3)
  task = at.make_task(seed=0)
  settings = [(w, s, False) for w in (1, 2, 4) for s in (None, 4, 1)]
  settings += [(w, None, True) for w in (1, 2, 4)]
  rows, curves, raw = [], {}, []
  for workers, limit, rescale in settings:
    runs = [
      _threads(task, workers, limit, rescale, seed, steps, time_limit, lr)
      for seed in range(repeats)
    ]
    initial = runs[0].curve[0][1]
    a = _summary(runs, initial)
    key = ("threads", workers, limit, rescale)
    curves[key] = _median_curve([r.curve for r in runs])
    rows.append(
      _setting(workers, limit, rescale)
      + [
        a["loss"],
        a["range"],
        a["dropped"],
        a["mean_staleness"],
        a["hist"],
        a["wall"],
        round(a["rate"]),
        ",".join(sorted({r.stopped_by for r in runs})),
      ]
    )
    raw.append(
      {
        "workers": workers,
        "max_staleness": limit,
        "rescale": rescale,
        "runs": [
          {**_run_json(seed, r), "curve": [(x, _finite(y)) for x, y in r.curve]}
          for seed, r in enumerate(runs)
        ],
      }
    )
    print(_label(workers, limit, rescale), rows[-1], flush=True)
  png = result_path("async_staleness", ".png")
  _plot(curves, initial, png, [("threads", w) for w in (1, 2, 4)])
  notes = (
    f"Real threads (examples/async_trainer.py): each run trains until "
    f"{steps} gradients have been applied (or {time_limit:.0f} s pass), "
    f"{repeats} seed(s) per setting. Sparse SGD, learning rate {lr}, batch "
    "32, bag-of-embeddings classifier over a 2000-row table (SparseRows "
    "gradients); eval loss on 2048 held-out examples (initial loss "
    f"{initial:.3f}). Staleness = global step at arrival - step at read; "
    "the histogram counts every received gradient, dropped ones included. "
    "A run is 'diverged' when its final eval loss is above the initial one "
    "(or not finite). Wall time excludes compilation. Thread timing on a "
    "shared machine is not deterministic: rerunning changes the numbers "
    f"somewhat. Plot: {png.name}."
  )
  cells = {(r[0], r[1], r[2]): r for r in rows}
  n = max(w for w, _, _ in settings)
  keys = [(n, "none", "no"), (n, 1, "no"), (n, "none", "yes")]
  heads = [
    headline(
      f"dropped fraction, {n} workers, max_staleness=1", cells[(n, 1, "no")][5]
    ),
    headline(
      f"final eval loss, {n} workers: no limit / max_staleness=1 / no limit"
      " + rescale",
      " / ".join(str(cells[k][3]) for k in keys),
    ),
  ]
  _write(
    "async_staleness",
    "Asynchronous training: drop_stale vs workers",
    columns(
      "workers | max_staleness | rescale | final eval loss (median of "
      "converged) | min - max | dropped | mean staleness | staleness "
      "histogram (received) | wall s (median) | grads/s | stopped by"
    ),
    rows,
    notes,
    headline=heads,
    steps=steps,
    repeats=repeats,
    curves={_label(*k[1:]): c for k, c in curves.items()},
    settings=raw,
  )


# ----------------------------------------------------------------------------
# Ray processes side by side with threads


def _ray_runs(rt, ps, ws, task, workers, limit, rescale, args, repeats):
  """Both engines' runs of one setting, seed by seed."""
  import ray

  runs: dict[str, list] = {"threads": [], "ray": []}
  lr = args.learning_rate
  for seed in range(repeats):
    config = rt.ServerConfig(
      max_staleness=limit, rescale=rescale, learning_rate=lr, seed=seed
    )
    ray.get(ps.reset.remote(config))
    ray.get([w.reset.remote(seed) for w in ws])
    runs["ray"].append(
      rt.train(ps, ws, num_steps=args.steps, time_limit=args.time_limit)
    )
    runs["threads"].append(
      _threads(
        task, workers, limit, rescale, seed, args.steps, args.time_limit, lr
      )
    )
  return runs


def ray_main(args) -> None:
  import ray

  from examples import ray_trainer as rt

  steps, lr = args.steps, args.learning_rate
  repeats = args.repeats or (1 if args.quick else 2)
  task_args = {"seed": 0}
  task = at.make_task(**task_args)
  rows, curves, raw = [], {}, []
  rt.init_ray()
  try:
    for workers in (1, 2, 4, 8):
      ps, ws = rt.start_actors(
        task_args, rt.ServerConfig(max_staleness=None), workers
      )
      try:
        # max_staleness in {none, N - 1, 1} (without repeats) x rescale
        limits = list(dict.fromkeys([None, workers - 1, 1]))
        for rescale in (False, True):
          for limit in limits:
            runs = _ray_runs(
              rt, ps, ws, task, workers, limit, rescale, args, repeats
            )
            initial = runs["threads"][0].curve[0][1]
            t, r = runs["threads"][0], runs["ray"][0]
            curves[("threads", workers, limit, rescale)] = [
              (sec, loss)
              for sec, (_, loss) in zip(t.curve_seconds, t.curve, strict=True)
            ]
            curves[("ray", workers, limit, rescale)] = [
              (sec, loss) for _, loss, sec in r.curve
            ]
            a = _summary(runs["threads"], initial, received=False)
            b = _summary(runs["ray"], initial, received=False)
            rows.append(
              _setting(workers, limit, rescale)
              + [
                a["loss"],
                b["loss"],
                a["dropped"],
                b["dropped"],
                a["mean_staleness"],
                b["mean_staleness"],
                round(a["rate"]),
                round(b["rate"]),
                f"{b['rate'] / a['rate']:.3f}",
                a["wall"],
                b["wall"],
              ]
            )
            raw.append(
              {
                "workers": workers,
                "max_staleness": limit,
                "rescale": rescale,
                **{
                  engine: [
                    _run_json(seed, x, threads=False)
                    for seed, x in enumerate(xs)
                  ]
                  for engine, xs in runs.items()
                },
              }
            )
            print(_label(workers, limit, rescale), rows[-1], flush=True)
      finally:
        rt.stop_actors([ps, *ws])
  finally:
    ray.shutdown()
  png = result_path("async_staleness_ray", ".png")
  panels = [(e, w) for e in ("threads", "ray") for w in (1, 2, 4, 8)]
  _plot(curves, initial, png, panels, ray=True)
  notes = (
    "The same task, initial parameters, data shards and batch sequences "
    "on two engines, run back to back for each setting: threads in one "
    "process (examples/async_trainer.py) and one process per worker plus "
    "a parameter-server process on a local Ray cluster "
    f"(examples/ray_trainer.py, Ray {ray.__version__}). Each run trains "
    f"until {steps} gradients have been applied (or {args.time_limit:.0f} s "
    f"pass), {repeats} seed(s) per setting; sparse SGD, learning rate {lr}, "
    "batch 32, a 2000-row table (SparseRows gradients); held-out loss on "
    f"2048 examples (initial {initial:.3f}); 'diverged' when it ends above "
    "the initial loss. Grads applied/s = accepted gradients / wall time "
    "(wall time from the first step to the last answer, compilation and "
    "process start excluded). The machine has 2 cores: 4 and 8 Ray workers "
    "are 5 and 9 processes sharing them (oversubscribed), and every Ray "
    "step pays a pull, an object-store read and a push between processes, "
    "where a thread reads a Python reference. Staleness is the global step "
    "at arrival - the step read; timing on a shared machine is not "
    f"deterministic. Plot: {png.name} (first seed)."
  )
  cells = {(r[0], r[1], r[2]): r for r in rows}
  keys = [(4, "none", "no"), (4, 3, "no"), (4, 1, "no"), (4, "none", "yes")]
  heads = [
    headline(
      "grads applied/s, Ray / threads, 4 workers, no limit",
      cells[(4, "none", "no")][11],
    ),
    headline(
      "held-out loss on Ray, 4 workers: no limit / max_staleness=3 / "
      "max_staleness=1 / no limit + rescale",
      " / ".join(str(cells[k][4]) for k in keys),
    ),
  ]
  _write(
    "async_staleness_ray",
    "Asynchronous training: Ray processes vs threads",
    columns(
      "workers | max_staleness | rescale | held-out loss, threads | "
      "held-out loss, Ray | dropped, threads | dropped, Ray | mean "
      "staleness, threads | mean staleness, Ray | grads applied/s, threads "
      "| grads applied/s, Ray | Ray / threads | wall s, threads | wall s, Ray"
    ),
    rows,
    notes,
    headline=heads,
    steps=steps,
    repeats=repeats,
    curves={f"{e} {_label(*k)}": c for (e, *k), c in curves.items()},
    settings=raw,
  )


if __name__ == "__main__":
  main()
