"""Independent numpy references for k-step gradient accumulation.

Nothing here imports gradtx: written from the definition (tensorpack's
AccumGradOptimizer: sum the k gradients, apply every k-th call; optionally
divide by k).
"""

from __future__ import annotations

import numpy as np


def window_ends(ks, num_calls: int) -> list[bool]:
  """Whether each call ends a window, for per-window sizes ``ks(w)``."""
  ends = []
  w, filled = 0, 0
  for _ in range(num_calls):
    filled += 1
    if filled >= ks(w):
      ends.append(True)
      w, filled = w + 1, 0
    else:
      ends.append(False)
  return ends


def accumulated_sgd(
  params: np.ndarray, grads, ks, lr: float, *, mean: bool
) -> list[np.ndarray]:
  """Params after each call of SGD on k-step accumulated dense gradients.

  Args:
    params: initial params.
    grads: a list of dense gradients, one per call.
    ks: window size as a function of the window index.
    lr: learning rate.
    mean: divide the window's sum by its size.

  Returns:
    The params after each call (float64).
  """
  p = np.asarray(params, np.float64).copy()
  acc = np.zeros_like(p)
  out = []
  ends = window_ends(ks, len(grads))
  filled = 0
  for g, end in zip(grads, ends, strict=True):
    acc += np.asarray(g, np.float64)
    filled += 1
    if end:
      total = acc / filled if mean else acc
      p = p - lr * total
      acc = np.zeros_like(p)
      filled = 0
    out.append(p.copy())
  return out
