"""Asynchronous training with and without gtx.drop_stale.

The threaded trainer of ``examples/async_trainer.py`` over workers x
max_staleness, several seeds each (``results/async_staleness``, with a
plot); with ``--ray``, the trainer across processes of
``examples/ray_trainer.py`` (the ``ray`` extra) side by side with it on the
same task, shards and batches (``results/async_staleness_ray``).

``python -m benchmarks.staleness [--ray] [--quick]``
"""

from __future__ import annotations

import collections
import itertools
import statistics

import numpy as np

from benchmarks import optimizer_steps as runner
from benchmarks._common import version
from benchmarks._results import figure, headline, result_path, save_figure
from examples import async_trainer as at


def _finite(x: float) -> float | None:
  return float(x) if np.isfinite(x) else None


def _safe(curve: list) -> list:
  return [(x, _finite(y)) for x, y in curve]


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
  seen = sum(hist.values())
  total = sum(r.received if received else r.applied + r.dropped for r in runs)
  pct = {k: v / max(seen, 1) for k, v in sorted(hist.items())}
  loss, spread = _fmt_losses([r.final_loss for r in runs], initial)
  rate = sum(r.received if received else r.applied for r in runs)
  staleness = sum(k * v for k, v in hist.items())
  return {
    "loss": loss,
    "range": spread,
    "dropped": f"{sum(r.dropped for r in runs) / max(total, 1):.1%}",
    "staleness": round(staleness / max(total if received else seen, 1), 2),
    "hist": " ".join(
      f"{k}:{'<1%' if v < 0.01 else f'{v:.0%}'}" for k, v in pct.items()
    ),
    "wall": statistics.median(r.wall_time for r in runs),
    "rate": rate / sum(r.wall_time for r in runs),
  }


def _run_json(seed: int, r, threads: bool = True) -> dict:
  keys = ("applied", "received", "dropped", "dropped_fraction")
  out = {"seed": seed, "final_loss": _finite(r.final_loss)}
  out.update((k, getattr(r, k)) for k in (keys if threads else keys[::2]))
  out["staleness_hist"] = {str(k): v for k, v in r.staleness_hist.items()}
  return {**out, "wall_time": r.wall_time, "stopped_by": r.stopped_by}


def _setting(workers: int, limit: int | None, rescale: bool) -> list:
  """A row's first cells: workers, max_staleness, rescale."""
  return [workers, "none" if limit is None else limit, "yes" * rescale or "no"]


def _label(workers: int, limit: int | None, rescale: bool) -> str:
  s = "none" if limit is None else str(limit)
  return f"N={workers} s={s}" + (" rescale" if rescale else "")


def _raw(setting: tuple, **runs: list) -> dict:
  """A setting's entry of the json's settings."""
  workers, limit, rescale = setting
  return dict(workers=workers, max_staleness=limit, rescale=rescale, **runs)


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


WORKERS = {False: (1, 2, 4), True: (1, 2, 4, 8)}  # threads alone, with Ray
# the headlines: metric, the rows' column, the settings at 4 workers whose
# cells it joins (AT4: their rows' first cells, their names)
HEADS = {
  False: [("dropped fraction", 5, [1]), ("final eval loss", 3, [None, 1, "r"])],
  True: [
    ("grads applied/s, Ray / threads", 11, [None]),
    ("held-out loss on Ray", 4, [None, 3, 1, "r"]),
  ],
}
AT4 = {
  None: ((4, "none", "no"), "no limit"),
  1: ((4, 1, "no"), "max_staleness=1"),
  3: ((4, 3, "no"), "max_staleness=3"),
  "r": ((4, "none", "yes"), "no limit + rescale"),
}


def _plot(curves, initial, path, ray: bool) -> None:
  """One panel an (engine, workers); ``curves`` maps (engine, workers,
  limit, rescale) to (x, loss) points."""
  engines, counts = ("threads", "ray") if ray else ("threads",), WORKERS[ray]
  finite = [y for c in curves.values() for _, y in c if np.isfinite(y)]
  fig, axes = figure(
    len(engines),
    len(counts),
    figsize=(5 * len(counts), 8.5 if ray else 4.5),
    sharey=True,
    squeeze=False,
  )
  panels = itertools.product(engines, counts)
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
  for row in axes:
    row[0].set_ylabel(
      "held-out loss (first seed)" if ray else "eval loss (median over seeds)"
    )
  fig.suptitle(
    "Asynchronous sparse SGD with gtx.drop_stale: threads (top) and Ray "
    "processes (bottom); note the different time axes"
    if ray
    else "Asynchronous sparse SGD with gtx.drop_stale"
  )
  save_figure(fig, path, dpi=90 if ray else 110)


def _threads(task, setting: tuple, seed: int, a):
  """One run of the threaded trainer."""
  return at.run_async(
    task,
    **_raw(setting),
    num_steps=a.steps,
    time_limit=a.time_limit,
    learning_rate=a.learning_rate,
    seed=seed,
  )


def _cases(ctx) -> list:
  """max_staleness in {no limit, 4, 1} x workers, then no limit + rescale."""
  ctx.found.update(task=at.make_task(seed=0), curves={}, raw=[])
  settings = [(w, s, False) for w in WORKERS[False] for s in (None, 4, 1)]
  return settings + [(w, None, True) for w in WORKERS[False]]


def _case(setting, ctx):
  """One setting's seeds on threads."""
  f, a = ctx.found, ctx.args
  runs = [_threads(f["task"], setting, seed, a) for seed in range(a.repeats)]
  f["initial"] = runs[0].curve[0][1]
  s = _summary(runs, f["initial"])
  f["curves"][("threads", *setting)] = _median_curve([r.curve for r in runs])
  json_runs = [
    {**_run_json(i, r), "curve": _safe(r.curve)} for i, r in enumerate(runs)
  ]
  f["raw"].append(_raw(setting, runs=json_runs))
  cells = [s[k] for k in ("loss", "range", "dropped", "staleness", "hist")]
  stopped = ",".join(sorted({r.stopped_by for r in runs}))
  return [_setting(*setting) + cells + [s["wall"], round(s["rate"]), stopped]]


def _ray_cases(ctx):
  """Ray's actors for each worker count: max_staleness in {none, N - 1, 1}
  (once each) x rescale off and on."""
  import ray

  from examples import ray_trainer as rt

  _cases(ctx)
  rt.init_ray()
  try:
    for workers in WORKERS[True]:
      config = rt.ServerConfig(max_staleness=None)
      ps, ws = ctx.found["actors"] = rt.start_actors(
        {"seed": 0}, config, workers
      )
      try:
        for rescale in (False, True):
          for limit in dict.fromkeys([None, workers - 1, 1]):
            yield workers, limit, rescale
      finally:
        rt.stop_actors([ps, *ws])
  finally:
    ray.shutdown()


def _ray_case(setting, ctx):
  """Both engines' runs of one setting, seed by seed."""
  import ray

  from examples import ray_trainer as rt

  (_, limit, rescale), a, f = setting, ctx.args, ctx.found
  ps, ws = f["actors"]
  runs: dict[str, list] = {"threads": [], "ray": []}
  for seed in range(a.repeats):
    config = rt.ServerConfig(
      max_staleness=limit,
      rescale=rescale,
      learning_rate=a.learning_rate,
      seed=seed,
    )
    ray.get(ps.reset.remote(config))
    ray.get([w.reset.remote(seed) for w in ws])
    runs["ray"].append(
      rt.train(ps, ws, num_steps=a.steps, time_limit=a.time_limit)
    )
    runs["threads"].append(_threads(f["task"], setting, seed, a))
  f["initial"] = initial = runs["threads"][0].curve[0][1]
  t, r = runs["threads"][0], runs["ray"][0]
  f["curves"][("threads", *setting)] = [
    (sec, loss) for sec, (_, loss) in zip(t.curve_seconds, t.curve, strict=True)
  ]
  f["curves"][("ray", *setting)] = [(sec, loss) for _, loss, sec in r.curve]
  th, ry = (_summary(runs[e], initial, received=False) for e in runs)
  json_runs = {
    e: [_run_json(i, x, False) for i, x in enumerate(xs)]
    for e, xs in runs.items()
  }
  f["raw"].append(_raw(setting, **json_runs))
  cells = [s[k] for k in ("loss", "dropped", "staleness") for s in (th, ry)]
  rates = [round(th["rate"]), round(ry["rate"])]
  rates.append(f"{ry['rate'] / th['rate']:.3f}")
  return [_setting(*setting) + cells + rates + [th["wall"], ry["wall"]]]


def _notes(a, initial: float, png: str) -> str:
  if not a.ray:
    return (
      f"Real threads (examples/async_trainer.py): each run trains until "
      f"{a.steps} gradients have been applied (or {a.time_limit:.0f} s pass), "
      f"{a.repeats} seed(s) per setting. Sparse SGD, learning rate "
      f"{a.learning_rate}, batch "
      "32, bag-of-embeddings classifier over a 2000-row table (SparseRows "
      "gradients); eval loss on 2048 held-out examples (initial loss "
      f"{initial:.3f}). Staleness = global step at arrival - step at read; "
      "the histogram counts every received gradient, dropped ones included. "
      "A run is 'diverged' when its final eval loss is above the initial one "
      "(or not finite). Wall time excludes compilation. Thread timing on a "
      "shared machine is not deterministic: rerunning changes the numbers "
      f"somewhat. Plot: {png}."
    )
  return (
    "The same task, initial parameters, data shards and batch sequences "
    "on two engines, run back to back for each setting: threads in one "
    "process (examples/async_trainer.py) and one process per worker plus "
    "a parameter-server process on a local Ray cluster "
    f"(examples/ray_trainer.py, Ray {version('ray')}). Each run trains "
    f"until {a.steps} gradients have been applied (or {a.time_limit:.0f} s "
    f"pass), {a.repeats} seed(s) per setting; sparse SGD, learning rate "
    f"{a.learning_rate}, "
    "batch 32, a 2000-row table (SparseRows gradients); held-out loss on "
    f"2048 examples (initial {initial:.3f}); 'diverged' when it ends above "
    "the initial loss. Grads applied/s = accepted gradients / wall time "
    "(wall time from the first step to the last answer, compilation and "
    "process start excluded). The machine has 2 cores: 4 and 8 Ray workers "
    "are 5 and 9 processes sharing them (oversubscribed), and every Ray "
    "step pays a pull, an object-store read and a push between processes, "
    "where a thread reads a Python reference. Staleness is the global step "
    "at arrival - the step read; timing on a shared machine is not "
    f"deterministic. Plot: {png} (first seed)."
  )


def _finish(rows, ctx):
  a, f = ctx.args, ctx.found
  png = result_path("async_staleness" + "_ray" * a.ray, ".png")
  _plot(f["curves"], f["initial"], png, a.ray)
  cells, heads = {tuple(r[:3]): r for r in rows}, []
  for metric, col, limits in HEADS[a.ray]:
    keys, names = zip(*(AT4[s] for s in limits), strict=True)
    metric += ", 4 workers" + (", " if len(keys) == 1 else ": ")
    value = " / ".join(str(cells[k][col]) for k in keys)
    heads.append(headline(metric + " / ".join(names), value))
  tag = "{} " if a.ray else ""
  curves = {
    tag.format(e) + _label(*k): _safe(c) for (e, *k), c in f["curves"].items()
  }
  return _notes(a, f["initial"], png.name), dict(
    headline=heads,
    steps=a.steps,
    repeats=a.repeats,
    settings=f["raw"],
    curves=curves,
  )


THREADS = runner.Scenario(
  name="async_staleness",
  title="Asynchronous training: drop_stale vs workers",
  columns="workers | max_staleness | rescale | final eval loss (median of "
  "converged) | min - max | dropped | mean staleness | staleness "
  "histogram (received) | wall s (median) | grads/s | stopped by",
  doc=__doc__.splitlines()[0],
  cases=_cases,
  case=_case,
  finish=_finish,
  flags={
    "--repeats": dict(type=int, default=None),
    "--learning-rate": 0.5,
    "--ray": dict(action="store_true", help="Ray processes vs threads"),
  },
  quick=dict(steps=60),
  options=dict(steps=600),
)
RAY = THREADS._replace(
  name="async_staleness_ray",
  title="Asynchronous training: Ray processes vs threads",
  columns="workers | max_staleness | rescale | held-out loss, threads | "
  "held-out loss, Ray | dropped, threads | dropped, Ray | mean "
  "staleness, threads | mean staleness, Ray | grads applied/s, threads "
  "| grads applied/s, Ray | Ray / threads | wall s, threads | wall s, Ray",
  cases=_ray_cases,
  case=_ray_case,
)


def main(argv: list[str] | None = None) -> None:
  args = runner.parse_args(THREADS, argv)
  args.time_limit = 10.0 if args.quick else 30.0
  args.repeats = args.repeats or (1 if args.quick else 2 if args.ray else 3)
  runner.run(RAY if args.ray else THREADS, args=args)


if __name__ == "__main__":
  main()
