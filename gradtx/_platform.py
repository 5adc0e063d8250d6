"""Platform-dependent code: the one wrapper of ``lax.platform_dependent``.

Where GPUs need other code than CPUs and TPUs (their scatter-add is atomic,
so a sum of duplicates would depend on the order of the additions), gradtx
stages both out through :func:`platform_dependent`. Callers look it up
through this module (``_platform.platform_dependent(...)``), never by a
name of their own: the test suite patches it to take the GPU code on CPU
(``tests/conformance.py``, ``gpu_branches``), and the patch reaches every
caller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax import lax


def platform_dependent(
  *args: Any, gpu: Callable[..., Any], default: Callable[..., Any]
) -> Any:
  """``gpu(*args)`` on CUDA and ROCm, ``default(*args)`` elsewhere (CPU,
  TPU): ``lax.platform_dependent``, both branches staged out.

  Examples:
    >>> import jax.numpy as jnp
    >>> from gradtx import _platform
    >>> def gpu(x):
    ...   return x + 1
    >>> def default(x):
    ...   return x * 10
    >>> _platform.platform_dependent(jnp.float32(2), gpu=gpu, default=default)
    Array(20., dtype=float32)
  """
  return lax.platform_dependent(*args, cuda=gpu, rocm=gpu, default=default)
