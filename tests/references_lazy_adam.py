"""Independent numpy references for lazy Adam, written from the formulas.

Nothing here imports gradtx or optax.

* :class:`LazyAdam` is TensorFlow's LazyAdam / PyTorch's SparseAdam: sum the
  duplicate rows of a sparse gradient, then update the first and second
  moments and the parameter of those rows only, with the bias corrections of
  the global step count. The epsilon sits where optax puts it,
  ``m_hat / (sqrt(v_hat + eps_root) + eps)`` (TensorFlow's ``epsilon`` is
  this one times ``sqrt(1 - b2^t)``).
* With ``catch_up=True`` a row that skipped ``k`` steps is first walked, one
  step at a time, through the ``k`` zero-gradient steps of dense Adam:
  ``m <- b1 m``, ``v <- b2 v`` and the direction of each skipped step is
  summed (no closed form, no approximation); the sum is applied with the
  learning rate of the step that touches the row.
* :func:`dense_adam_step` is one step of plain (dense) Adam.

Everything is float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def coalesce_rows(indices, values, num_rows: int) -> dict[int, np.ndarray]:
  """``{row: summed value}`` over the valid ids (padding dropped)."""
  out: dict[int, np.ndarray] = {}
  for i, v in zip(
    np.asarray(indices), np.asarray(values, np.float64), strict=True
  ):
    i = int(i)
    if 0 <= i < num_rows:
      out[i] = out.get(i, 0.0) + v
  return out


def adam_direction(m, v, t: int, b1, b2, eps, eps_root):
  """Bias-corrected Adam direction at step ``t`` (1-based)."""
  m_hat = m / (1.0 - b1**t)
  v_hat = v / (1.0 - b2**t)
  return m_hat / (np.sqrt(v_hat + eps_root) + eps)


def dense_adam_step(p, g, m, v, t: int, lr, b1, b2, eps, eps_root, wd=0.0):
  """One step of dense Adam(W); returns new ``(p, m, v)``."""
  m = b1 * m + (1 - b1) * g
  v = b2 * v + (1 - b2) * g * g
  u = adam_direction(m, v, t, b1, b2, eps, eps_root) + wd * p
  return p - lr * u, m, v


def skipped_drift(m, v, s: int, k: int, b1, b2, eps, eps_root):
  """What dense Adam adds to the direction over steps ``s+1 .. s+k`` with a
  zero gradient, starting from moments ``m``, ``v`` of step ``s``; returns
  ``(sum of directions, m, v)`` after those steps."""
  drift = np.zeros_like(m)
  for j in range(1, k + 1):
    m = b1 * m
    v = b2 * v
    drift = drift + adam_direction(m, v, s + j, b1, b2, eps, eps_root)
  return drift, m, v


class LazyAdam:
  """Lazy Adam(W) on a dict of numpy arrays.

  A gradient leaf is a dense array or a tuple ``(indices, values,
  num_rows)``. ``lr`` maps the 0-based step to the learning rate.
  """

  def __init__(
    self,
    params: dict[str, Any],
    lr: Callable[[int], float],
    b1=0.9,
    b2=0.999,
    eps=1e-8,
    eps_root=0.0,
    weight_decay=0.0,
    decay_mask: dict[str, bool] | None = None,
    catch_up: bool = False,
  ):
    self.p = {k: np.asarray(x, np.float64).copy() for k, x in params.items()}
    self.m = {k: np.zeros_like(x) for k, x in self.p.items()}
    self.v = {k: np.zeros_like(x) for k, x in self.p.items()}
    self.last = {k: np.zeros(x.shape[:1], np.int64) for k, x in self.p.items()}
    self.t = 0
    self.lr = lr
    self.b1, self.b2, self.eps, self.eps_root = b1, b2, eps, eps_root
    self.wd = weight_decay
    self.decay_mask = decay_mask or {}
    self.catch_up = catch_up

  def _row_step(self, key, sl, g, lr):
    b1, b2, eps, er = self.b1, self.b2, self.eps, self.eps_root
    m, v, p = self.m[key][sl], self.v[key][sl], self.p[key][sl]
    drift = 0.0
    if self.catch_up:
      s = int(self.last[key][sl])
      k = self.t - 1 - s
      drift, m, v = skipped_drift(m, v, s, k, b1, b2, eps, er)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = adam_direction(m, v, self.t, b1, b2, eps, er) + drift
    if self.decay_mask.get(key, True):
      u = u + self.wd * p
    self.m[key][sl], self.v[key][sl] = m, v
    self.p[key][sl] = p - lr * u
    self.last[key][sl] = self.t

  def step(self, grads: dict[str, Any]) -> None:
    lr = self.lr(self.t)
    self.t += 1
    for key, g in grads.items():
      if isinstance(g, tuple):
        indices, values, num_rows = g
        assert num_rows == self.p[key].shape[0]
        for row, gv in coalesce_rows(indices, values, num_rows).items():
          self._row_step(key, row, gv, lr)
      else:
        g = np.asarray(g, np.float64)
        if g.ndim == 0:
          self._row_step(key, (), g, lr)
        else:
          for row in range(g.shape[0]):
            self._row_step(key, row, g[row], lr)
