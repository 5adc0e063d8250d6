"""Platform-dependent code: the one wrapper of ``lax.platform_dependent``.

A tactic that pays on one platform is chosen inside the program, for the
platform it is lowered for, never from the host that traces it: a step
exported on a CPU host for cuda or tpu is the program a GPU or TPU host
builds (``jax.export(..., platforms=["cuda"])`` reads it without a
device).

Two families of code, both staged out by :func:`platform_dependent`:

- **cpu**: XLA:CPU runs one kernel at a time on a few cores, and its
  scatters are sequential loops, so a scatter-add over duplicate ids is
  deterministic and cheap; the CPU keeps its own tactics (the hash
  deduplication, the unique-row chunk loop, the materialize barrier).
- **accelerator** (CUDA, ROCm, TPU and any other platform): wide devices
  whose scatter-add over duplicates is atomic (GPUs: the order of the
  additions, so the bits, changes from run to run) and whose while loops
  cost a launch and a host sync a trip. They deduplicate by sort, sum
  duplicates by a segmented scan over the sorted rows, and run every
  unique row at once: no while loop in a sparse update and no float
  scatter-add over unsorted duplicate ids, the same bits run after run.

Callers look the wrapper up through this module
(``_platform.platform_dependent(...)``), never by a name of their own: the
test suite patches it to take the accelerator code on CPU
(``tests/conformance.py``, ``gpu_branches``), and the patch reaches every
caller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def platform_dependent(
  *args: Any, cpu: Callable[..., Any], accelerator: Callable[..., Any]
) -> Any:
  """``cpu(*args)`` on CPU, ``accelerator(*args)`` elsewhere (CUDA, ROCm,
  TPU): ``lax.platform_dependent``, both branches traced, the one of the
  platform the program is lowered for kept.

  Examples:
    >>> import jax.numpy as jnp
    >>> from gradtx import _platform
    >>> def accelerator(x):
    ...   return x + 1
    >>> def cpu(x):
    ...   return x * 10
    >>> _platform.platform_dependent(
    ...   jnp.float32(2), cpu=cpu, accelerator=accelerator
    ... )
    Array(20., dtype=float32)
  """
  return lax.platform_dependent(*args, cpu=cpu, default=accelerator)


def prefix_sum(x: jax.Array) -> jax.Array:
  """The inclusive running sum of an integer or boolean vector, as int32:
  ``jnp.cumsum`` on CPU; on accelerators a log-depth parallel scan
  (``lax.associative_scan``), since a GPU's cumulative sum can lower to a
  sequential loop (``chlo.scan`` legalized to ``stablehlo.while``).

  Examples:
    >>> import jax.numpy as jnp
    >>> from gradtx import _platform
    >>> _platform.prefix_sum(jnp.array([True, False, True, True]))
    Array([1, 1, 2, 3], dtype=int32)
  """
  x = x.astype(jnp.int32)
  return platform_dependent(
    x,
    cpu=lambda x: jnp.cumsum(x, dtype=jnp.int32),
    accelerator=lambda x: lax.associative_scan(lax.add, x),
  )
