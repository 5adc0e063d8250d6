"""Static values: what a Python argument holds at trace time.

Arguments that set shapes or layouts (a row count, a block size) must be
Python integers; hyperparameters may be concrete or traced (under ``jit``
or ``optax.inject_hyperparams``), and a check that needs the value runs
only when it is concrete.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def is_int(x: Any) -> bool:
  """A Python or numpy integer, not a bool: what an int argument accepts."""
  return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def concrete(x: Any, cast: Callable[[Any], Any] = float) -> Any:
  """``cast(x)`` for a concrete value, None for a traced one (under ``jit``
  or ``optax.inject_hyperparams``).

  Examples:
    >>> import jax
    >>> from gradtx._static import concrete, is_int
    >>> is_int(3), is_int(True), is_int(3.0)
    (True, False, False)
    >>> seen = []
    >>> _ = jax.jit(lambda x: seen.append(concrete(x)) or x)(0.5)
    >>> concrete(0.5), seen
    (0.5, [None])
  """
  try:
    return cast(np.asarray(x))
  except (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerArrayConversionError,
    jax.errors.TracerIntegerConversionError,
  ):
    return None
