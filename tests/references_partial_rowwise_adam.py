"""Independent numpy reference of FBGEMM's PARTIAL_ROWWISE_ADAM.

Written from FBGEMM's optimizer template (pytorch/FBGEMM,
``fbgemm_gpu/codegen/genscript/optimizers.py``, ``partial_rowwise_adam()``:
the per-row precomputation and the per-element weight update) and its test
(``fbgemm_gpu/test/tbe/training/backward_optimizers_test.py``, the
``PARTIAL_ROWWISE_ADAM`` branch of ``execute_backward_optimizers_``); the
step counter is the module's ``iter``, incremented once per training step
before the update (``split_table_batched_embeddings_ops_training.py``).
Nothing here imports gradtx or optax; float64, one row at a time.

For each step :math:`t = 1, 2, \\dots` (one counter for every row: a row
first touched at step 5 is bias-corrected with :math:`t = 5`) and each row
:math:`r` with a gradient :math:`g_r` (duplicates summed first, FBGEMM's
EXACT semantics; the raw gradient, weight decay not added):

* :math:`v_r \\leftarrow \\beta_2 v_r + (1 - \\beta_2)\\,\\mathrm{mean}_j
  g_{rj}^2` (one float per row),
* :math:`m_r \\leftarrow \\beta_1 m_r + (1 - \\beta_1)\\, g_r` (per element),
* :math:`\\theta_r \\leftarrow \\theta_r - \\eta_t \\left( \\frac{m_r / (1 -
  \\beta_1^t)}{\\sqrt{v_r / (1 - \\beta_2^t)} + \\epsilon} + \\lambda
  \\theta_r \\right)`, :math:`\\theta_r` the row before the step (decoupled
  weight decay, scaled by the learning rate, on the touched rows only).

Rows without a gradient keep :math:`\\theta, m, v`.

Leaves (FBGEMM has only tables; these are the choices the tests pin down):
a row is a slice along axis 0. A ``[V, *row]`` leaf keeps ``v`` of shape
``[V]``, the mean running over every element of the row; a dense gradient
touches every row (what FBGEMM does when every id appears). A 1-D leaf has
rows of one element, so ``v`` is per element (plain Adam with FBGEMM's
weight decay); a scalar is one row of one element.
"""

from __future__ import annotations

import numpy as np
from references_optimizers import _RowOptimizer


class PartialRowwiseAdam(_RowOptimizer):
  def __init__(self, params, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
    self.b1, self.b2, self.eps, self.wd = b1, b2, eps, wd
    super().__init__(params, lr)

  def init_state(self, p):
    return {"mu": np.zeros_like(p), "nu": np.zeros(p.shape[:1])}

  def row(self, key, r, g, lr):
    p, s = self.p[key], self.state[key]
    t = self.count + 1  # the step being taken, as FBGEMM's iter
    s["nu"][r] = self.b2 * s["nu"][r] + (1 - self.b2) * np.mean(g * g)
    s["mu"][r] = self.b1 * s["mu"][r] + (1 - self.b1) * g
    m_hat = s["mu"][r] / (1 - self.b1**t)
    v_hat = s["nu"][r] / (1 - self.b2**t)
    p[r] = p[r] - lr * (m_hat / (np.sqrt(v_hat) + self.eps) + self.wd * p[r])


def fbgemm_one_step(weight, dense_grad, lr, b1, b2, eps, wd):
  """FBGEMM's own test expectation after one step from zero state (its
  ``iter`` is 1): ``(m1, m2, weights)`` from the dense gradient of the
  table; only the rows with a gradient are compared for ``weights``."""
  m2 = np.mean(dense_grad**2, axis=1) * (1 - b2)
  m1 = dense_grad * (1 - b1)
  v_hat = (m2 / (1 - b2))[:, None]
  m_hat = m1 / (1 - b1)
  new = weight - lr * m_hat / (np.sqrt(v_hat) + eps) - lr * wd * weight
  return m1, m2, new
