"""Independent numpy references of the sparse optimizers, from the papers.

Nothing here imports gradtx or optax. Everything is float64, one row at a
time, in plain loops:

* Adagrad (Duchi et al. 2011, optax's form): ``G += g^2``,
  ``p -= lr * g / sqrt(G + eps)`` (no move where ``G == 0``); with
  ``eps_outside_sqrt``, Keras 2's and FBGEMM's EXACT_ADAGRAD form
  ``p -= lr * g / (sqrt(G) + eps)``.
* Row-wise Adagrad (FBGEMM's EXACT_ROWWISE_ADAGRAD): for a table row
  ``g += wd * p`` (L2 mode), ``G += mean(g^2)``, ``p -= lr * g / (sqrt(G) +
  eps)``; leaves of ndim < 2 keep one ``G`` per element.
* Lazy momentum SGD: ``t = g + mu * t``, ``p -= lr * t`` (Nesterov:
  ``p -= lr * (g + mu * t)``), on the touched rows only.
* FTRL-Proximal (McMahan et al. 2013, TensorFlow's kernel, Keras' beta);
  with L2 shrinkage (TensorFlow's ApplyFtrlV2, Keras' ``Ftrl``) the linear
  accumulator takes ``g + 2 * l2_shrinkage * w`` while ``n`` takes ``g^2``.

A sparse gradient ``(indices, values, num_rows)`` is summed per row first
(ids outside ``[0, num_rows)`` are padding); only those rows move. A dense
gradient moves every row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def summed_rows(indices, values, num_rows: int) -> dict[int, np.ndarray]:
  """``{row: sum of its values}`` over the valid ids."""
  out: dict[int, np.ndarray] = {}
  for i, v in zip(
    np.asarray(indices), np.asarray(values, np.float64), strict=True
  ):
    if 0 <= int(i) < num_rows:
      out[int(i)] = out.get(int(i), 0.0) + v
  return out


class _RowOptimizer:
  """Per-leaf bookkeeping; subclasses define ``init_state`` and ``row``."""

  def __init__(self, params: dict[str, np.ndarray], lr: Callable[[int], Any]):
    self.p = {k: np.asarray(v, np.float64).copy() for k, v in params.items()}
    self.lr = lr
    self.count = 0
    self.state = {k: self.init_state(v) for k, v in self.p.items()}

  def init_state(self, p: np.ndarray) -> Any:
    raise NotImplementedError

  def row(self, key: str, r: Any, g: np.ndarray, lr: float) -> None:
    """Updates ``self.p[key][r]`` and the state of row ``r`` in place."""
    raise NotImplementedError

  def step(self, grads: dict[str, Any]) -> None:
    lr = float(self.lr(self.count))
    for k, g in grads.items():
      if isinstance(g, tuple):  # (indices, values, num_rows)
        rows = summed_rows(*g)
      elif self.p[k].ndim == 0:
        rows = {(): np.asarray(g, np.float64)}
      else:
        rows = dict(enumerate(np.asarray(g, np.float64)))
      for r, gr in rows.items():
        self.row(k, r, np.asarray(gr, np.float64), lr)
    self.count += 1


class Adagrad(_RowOptimizer):
  def __init__(
    self,
    params,
    lr,
    initial_accumulator_value=0.1,
    eps=1e-7,
    eps_outside_sqrt=False,
  ):
    self.init_value, self.eps = initial_accumulator_value, eps
    self.eps_outside_sqrt = eps_outside_sqrt
    super().__init__(params, lr)

  def init_state(self, p):
    return np.full_like(p, self.init_value)

  def row(self, key, r, g, lr):
    G = self.state[key]
    G[r] = G[r] + g * g
    if self.eps_outside_sqrt:  # Keras 2 / FBGEMM, as published (no guard)
      self.p[key][r] = self.p[key][r] - lr * g / (np.sqrt(G[r]) + self.eps)
      return
    scale = np.where(G[r] > 0, 1 / np.sqrt(G[r] + self.eps), 0.0)
    self.p[key][r] = self.p[key][r] - lr * scale * g


class RowwiseAdagrad(_RowOptimizer):
  def __init__(
    self, params, lr, eps=1e-8, initial_accumulator_value=0.0, wd=0.0
  ):
    self.eps, self.init_value, self.wd = eps, initial_accumulator_value, wd
    super().__init__(params, lr)

  def init_state(self, p):
    shape = p.shape[:1] if p.ndim >= 2 else p.shape
    return np.full(shape, self.init_value, np.float64)

  def row(self, key, r, g, lr):
    p, G = self.p[key], self.state[key]
    g = g + self.wd * p[r]
    if p.ndim >= 2:  # one accumulator for the whole row
      G[r] += np.mean(g * g)
    else:
      G[r] = G[r] + g * g
    p[r] = p[r] - lr * g / (np.sqrt(G[r]) + self.eps)


class LazyMomentumSGD(_RowOptimizer):
  def __init__(self, params, lr, momentum=0.0, nesterov=False):
    self.mu, self.nesterov = momentum, nesterov
    super().__init__(params, lr)

  def init_state(self, p):
    return np.zeros_like(p)

  def row(self, key, r, g, lr):
    t = self.state[key]
    t[r] = g + self.mu * t[r]
    direction = g + self.mu * t[r] if self.nesterov else t[r]
    self.p[key][r] = self.p[key][r] - lr * direction


class Ftrl(_RowOptimizer):
  def __init__(
    self,
    params,
    lr,
    power=-0.5,
    initial_accumulator_value=0.1,
    l1=0.0,
    l2=0.0,
    beta=0.0,
    l2_shrinkage=0.0,
  ):
    self.power, self.init_value = power, initial_accumulator_value
    self.l1, self.l2, self.beta = l1, l2, beta
    self.l2_shrinkage = l2_shrinkage
    super().__init__(params, lr)

  def init_state(self, p):
    return {"n": np.full_like(p, self.init_value), "z": np.zeros_like(p)}

  def row(self, key, r, g, lr):
    n, z, w = self.state[key]["n"], self.state[key]["z"], self.p[key]
    n_new = n[r] + g * g  # n sums the raw gradient, not g_shrink
    sigma = (n_new ** (-self.power) - n[r] ** (-self.power)) / lr
    g_shrink = g + 2 * self.l2_shrinkage * w[r]  # w before this step
    z[r] = z[r] + g_shrink - sigma * w[r]
    n[r] = n_new
    # argmin_w  z w + l1 |w| + (1/2) (n^-p + beta) / lr w^2 + l2 w^2
    a = (n_new ** (-self.power) + self.beta) / lr + 2 * self.l2
    w[r] = np.where(
      np.abs(z[r]) <= self.l1, 0.0, -(z[r] - np.sign(z[r]) * self.l1) / a
    )
