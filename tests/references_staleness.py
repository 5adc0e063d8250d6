"""Independent plain-Python/numpy reference of stale-gradient dropping.

Written from the semantics of TensorFlow's DropStaleGradientOptimizer: the
worker remembers the global step when it reads the variables; when its
gradients arrive, staleness = global_step - remembered step; if staleness <=
the allowed staleness the wrapped optimizer applies them (and the global step
advances), otherwise nothing is applied and a stale counter grows. Plus the
staleness-aware rescaling of Zhang et al. (IJCAI 2016): an accepted gradient
is divided by max(1, staleness).

Nothing here imports gradtx.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class NumpyAdam:
  """Adam (Kingma & Ba, 2015) on a dict of float64 arrays (Rows leaves are
  made dense first), optax's eps placement: ``-lr * m_hat / (sqrt(v_hat) +
  eps)``."""

  def __init__(self, lr: float, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8):  # fmt: skip
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
    self.t = 0
    self.m: dict[str, np.ndarray] = {}
    self.v: dict[str, np.ndarray] = {}

  def update(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    self.t += 1
    out = {}
    for k, g in grads.items():
      g = _dense(g)
      m = self.m.get(k, np.zeros_like(g))
      v = self.v.get(k, np.zeros_like(g))
      m = self.b1 * m + (1 - self.b1) * g
      v = self.b2 * v + (1 - self.b2) * g * g
      self.m[k], self.v[k] = m, v
      m_hat = m / (1 - self.b1**self.t)
      v_hat = v / (1 - self.b2**self.t)
      out[k] = -self.lr * m_hat / (np.sqrt(v_hat) + self.eps)
    return out


class NumpySGD:
  """Plain SGD: ``-lr * g`` (Rows leaves give dense updates)."""

  def __init__(self, lr: float):
    self.lr = lr

  def update(self, grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: -self.lr * _dense(g) for k, g in grads.items()}


class Rows(NamedTuple):
  """A row-sparse gradient: rows ``indices[i]`` get ``values[i]`` (summed);
  ids outside ``[0, num_rows)`` are padding."""

  indices: np.ndarray
  values: np.ndarray
  num_rows: int

  def dense(self) -> np.ndarray:
    vals = np.asarray(self.values, np.float64)
    out = np.zeros((self.num_rows,) + vals.shape[1:])
    for i, v in zip(np.asarray(self.indices), vals, strict=True):
      if 0 <= i < self.num_rows:
        out[i] += v
    return out

  def touched(self) -> list[int]:
    return sorted({int(i) for i in self.indices if 0 <= i < self.num_rows})


def _dense(g) -> np.ndarray:
  return g.dense() if isinstance(g, Rows) else np.asarray(g, np.float64)


def _scaled(g, factor: float):
  if isinstance(g, Rows):
    return g._replace(values=factor * np.asarray(g.values, np.float64))
  return factor * np.asarray(g, np.float64)


class NumpyLazyAdam:
  """Lazy Adam (TF LazyAdamOptimizer semantics): dense leaves are Adam; for
  a Rows leaf only the rows it names (duplicates summed) update their
  moments and parameters, with the global step's bias corrections.
  Returns dense update arrays (zero on untouched rows)."""

  def __init__(self, lr: float, b1: float = 0.9, b2: float = 0.999,
               eps: float = 1e-8):  # fmt: skip
    self.lr, self.b1, self.b2, self.eps = lr, b1, b2, eps
    self.t = 0
    self.m: dict[str, np.ndarray] = {}
    self.v: dict[str, np.ndarray] = {}

  def update(self, grads: dict) -> dict[str, np.ndarray]:
    self.t += 1
    c1, c2 = 1 - self.b1**self.t, 1 - self.b2**self.t
    out = {}
    for k, g in grads.items():
      dense = _dense(g)
      m = self.m.setdefault(k, np.zeros_like(dense))
      v = self.v.setdefault(k, np.zeros_like(dense))
      rows = g.touched() if isinstance(g, Rows) else slice(None)
      m[rows] = self.b1 * m[rows] + (1 - self.b1) * dense[rows]
      v[rows] = self.b2 * v[rows] + (1 - self.b2) * dense[rows] ** 2
      u = np.zeros_like(dense)
      u[rows] = -self.lr * (m[rows] / c1) / (np.sqrt(v[rows] / c2) + self.eps)
      out[k] = u
    return out


class NumpyAccumulate:
  """Runs ``inner`` on the mean of every ``k`` gradients; zeros between.
  Rows leaves are accumulated by concatenating their rows."""

  def __init__(self, inner, k: int):
    self.inner, self.k = inner, k
    self.held: list[dict] = []

  def update(self, grads: dict) -> dict[str, np.ndarray]:
    self.held.append(grads)
    if len(self.held) < self.k:
      return {key: np.zeros_like(_dense(g)) for key, g in grads.items()}
    mean = {}
    for key, g in grads.items():
      parts = [h[key] for h in self.held]
      if isinstance(g, Rows):
        mean[key] = Rows(
          np.concatenate([p.indices for p in parts]),
          np.concatenate([np.asarray(p.values, np.float64) for p in parts])
          / self.k,
          g.num_rows,
        )
      else:
        mean[key] = sum(np.asarray(p, np.float64) for p in parts) / self.k
    self.held = []
    return self.inner.update(mean)


class DropStaleReference:
  """Simulates the drop-stale wrapper one received gradient at a time.

  Attributes:
    global_step: gradients applied so far.
    stale_counter: gradients dropped so far.
    last_staleness: staleness of the most recent gradient received.
  """

  def __init__(self, inner, max_staleness: int | None, rescale: bool = False):
    self.inner = inner
    self.max_staleness = max_staleness
    self.rescale = rescale
    self.global_step = 0
    self.stale_counter = 0
    self.last_staleness = 0

  def receive(self, grads: dict[str, np.ndarray], read_step: int):
    """Returns (accepted, updates); updates are zeros when dropped."""
    staleness = self.global_step - read_step
    self.last_staleness = staleness
    limit_ok = self.max_staleness is None or staleness <= self.max_staleness
    if staleness < 0 or not limit_ok:
      self.stale_counter += 1
      return False, {k: np.zeros_like(_dense(g)) for k, g in grads.items()}
    if self.rescale:
      factor = 1.0 / max(1, staleness)
      grads = {k: _scaled(g, factor) for k, g in grads.items()}
    updates = self.inner.update(grads)
    self.global_step += 1
    return True, updates

  def dropped_fraction(self) -> float:
    received = self.global_step + self.stale_counter
    return self.stale_counter / received if received else 0.0
