"""Independent numpy reference implementations, written from the formulas.

Nothing here imports gradtx: the tests compare gradtx against these.
"""

from __future__ import annotations

import numpy as np


def valid(indices: np.ndarray, num_rows: int) -> np.ndarray:
  """Mask of ids that name a row (the rest are padding)."""
  indices = np.asarray(indices)
  return (indices >= 0) & (indices < num_rows)


def to_dense(indices, values, num_rows: int) -> np.ndarray:
  """The dense array a row-sparse (indices, values) stands for."""
  values = np.asarray(values, np.float64)
  out = np.zeros((num_rows,) + values.shape[1:], np.float64)
  for i, v in zip(np.asarray(indices), values, strict=True):
    if 0 <= i < num_rows:
      out[i] += v
  return out


def unique_rows(indices, values, num_rows: int):
  """Each valid id once, at its first position, with its rows summed (in
  input order); every later duplicate and every padding id becomes
  ``num_rows`` (its value is not checked)."""
  indices = np.asarray(indices)
  values = np.asarray(values, np.float64)
  out_idx = np.full(len(indices), num_rows, np.int64)
  out_val = np.zeros_like(values)
  seen = set()
  for k, i in enumerate(indices):
    if 0 <= i < num_rows and int(i) not in seen:
      seen.add(int(i))
      out_idx[k] = i
      out_val[k] = values[indices == i].sum(axis=0)
  return out_idx, out_val


def coalesce(indices, values, num_rows: int):
  """Sorted unique valid ids with summed rows, padded to the input length
  with id ``num_rows`` and zero rows."""
  indices = np.asarray(indices)
  values = np.asarray(values, np.float64)
  n = len(indices)
  uniq = sorted({int(i) for i in indices if 0 <= i < num_rows})
  out_idx = np.full(n, num_rows, np.int64)
  out_val = np.zeros_like(values)
  for k, u in enumerate(uniq):
    out_idx[k] = u
    out_val[k] = values[indices == u].sum(axis=0)
  return out_idx, out_val
