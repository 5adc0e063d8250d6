"""The benchmarks' writer: ``benchmarks/results/<name>.md`` and ``.json``
(:func:`write_results`), with the machine, the code measured, the run's
settings and load, and the spread of every timing; :func:`result_path`
names other outputs (plots) with the run's suffix (``_quick``).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import _timing
from benchmarks._timing import load_note

RESULTS = Path(__file__).resolve().parent / "results"
# appended to every results file's name: "_quick" under --quick
SUFFIX_ENV = "GRADTX_BENCH_SUFFIX"


def machine() -> dict[str, Any]:
  """What the numbers were measured on."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(
        (x.split(":", 1)[1].strip() for x in f if x.startswith("model name")),
        cpu,
      )
  except OSError:
    pass
  out = {"cpu": cpu, "cores": os.cpu_count()}
  out.update(backend="cpu", device="cpu", devices=1, jax="not installed")
  try:
    import jax
  except ImportError:
    return {**out, "python": platform.python_version()}
  dev = jax.devices()[0]
  out.update(
    backend=jax.default_backend(),
    device=getattr(dev, "device_kind", str(dev)),
    devices=jax.device_count(),
    jax=jax.__version__,
  )
  return {**out, "python": platform.python_version()}


def oversubscribed(consequence: str) -> str:
  """A caution for a note where the load average exceeded the cores."""
  if max(os.getloadavg()) <= (os.cpu_count() or 1):
    return ""
  return (
    " OVERSUBSCRIBED: the load average exceeded the core count during the "
    f"run, {consequence}"
  )


def commit() -> str:
  """The last commit that changed ``gradtx/``, and whether it is dirty."""

  def git(*cmd: str) -> str:
    return subprocess.run(
      ["git", "-C", str(RESULTS.parent.parent), *cmd],
      capture_output=True,
      text=True,
      check=True,
    ).stdout.strip()

  try:
    last = git("log", "-1", "--format=%h", "--", "gradtx")
    dirty = git("status", "--porcelain", "--", "gradtx")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return last + (" with uncommitted changes" if dirty else "")


def markdown_table(headers: Sequence[str], rows: Sequence) -> str:
  def cell(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)

  lines = ["| " + " | ".join(headers) + " |"]
  lines.append("|" + "|".join("---" for _ in headers) + "|")
  lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
  return "\n".join(lines)


def columns(spec: str) -> list[str]:
  """A table's headers written as its markdown row: ``"a | b | c"``."""
  return [c.strip() for c in spec.split(" | ")]


def headline(metric: str, value: Any, target: str | None = None) -> dict:
  """One headline figure (``python -m benchmarks`` gathers them)."""
  out = {"metric": metric, "value": value}
  return out if target is None else {**out, "target": target}


def result_path(name: str, ext: str) -> Path:
  """``results/<name><suffix><ext>``, its folder made."""
  RESULTS.mkdir(exist_ok=True)
  return RESULTS / f"{name}{os.environ.get(SUFFIX_ENV, '')}{ext}"


def _settings_note() -> str:
  out, run = [], _timing.RUN
  if run.huge_pages is not None:
    out.append(
      "Every system's tables and optimizer state on transparent huge pages "
      "(`gtx.use_huge_pages`; the same madvise for torch's tensors)."
      if run.huge_pages
      else "Tables on the OS's default 4 KiB pages (no `--huge-pages`)."
    )
  if run.memory_reused is not None:
    out.append(
      "Host memory reused as gradtx sets it at import, for the whole "
      "process (every system's step reuses freed memory for its "
      "temporaries)."
      if run.memory_reused
      else "malloc as it is (`--fresh-memory`: each step faults its "
      "temporaries in afresh)."
    )
  out.append(
    f"Load average (1/5/15 min) at the start: {run.load_start}, at the "
    f"end: {load_note()} (the machine is shared: compare ratios within a "
    "row)."
  )
  return " ".join(out)


def write_results(name, title, headers, rows, *, notes="", extra=None) -> str:
  """Prints and saves ``results/<name><suffix>.md`` (title, machine, table,
  ``notes``, the run's settings) and ``.json`` (also ``extra``, the load
  and the timings' spreads since the previous results file)."""
  m, run = machine(), _timing.RUN
  table = markdown_table(headers, rows)
  md = (
    f"## {title}\n\n"
    f"Machine: {m['cpu']}, {m['cores']} cores, backend {m['backend']} "
    f"({m['device']} x{m['devices']}), JAX {m['jax']}.\n\n{table}\n"
  )
  if notes:
    md += f"\n{notes}\n"
  md += f"\n{_settings_note()}\n"
  print(md)
  result_path(name, ".md").write_text(md)
  payload = {
    "title": title,
    "machine": m,
    "headers": list(headers),
    "rows": [list(r) for r in rows],
    "notes": notes,
    **(extra or {}),
    "load": {"start": run.load_start, "end": load_note()},
    "quick": run.quick,
    "timing": run.timings,
  }
  result_path(name, ".json").write_text(json.dumps(payload, indent=2))
  run.timings = []  # the next results file gets the timings made after
  return md


def figure(*args: Any, **kw: Any) -> tuple[Any, Any]:
  """``plt.subplots(*args, **kw)`` on matplotlib's Agg backend."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  return plt.subplots(*args, **kw)


def save_figure(fig: Any, path: Path | str, dpi: int = 120) -> None:
  """``fig`` laid out tight, written to ``path`` and closed."""
  import matplotlib.pyplot as plt

  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  plt.close(fig)
