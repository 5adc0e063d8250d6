"""Huge pages for embedding tables and optimizer state on CPU.

A lazy step touches a few thousand random rows of each table (params and
every state leaf). With 4 KiB pages each touched row is on its own page, so
every row read or written is a TLB miss, and in a virtual machine (nested
paging) a TLB miss costs a two-dimensional page walk. Backing the tables by
2 MiB transparent huge pages makes those walks rare (the effect on a whole
step: benchmarks/results/design_figures.md; the whole-step benchmarks run
on huge pages). Linux backs a buffer by huge pages only when asked
(``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` on most
distributions) and XLA never asks, so :func:`use_huge_pages` does.

A step's temporaries are the other cost: XLA allocates them with
``malloc`` on every run, and glibc serves a large block by a fresh
``mmap`` and unmaps it when freed (or trims it off a heap), so each run
faults every page of it in again, zeroed: about 5,400 page faults for one
``[86016, 64]`` float32 buffer. :func:`reuse_host_memory` keeps freed
memory in the process instead; gradtx applies it when it is imported where
JAX runs on the CPU (it must come before JAX starts its CPU threads), and
``GRADTX_REUSE_HOST_MEMORY=0`` opts out. :func:`format_bytes` writes the
byte counts that gradtx prints (plans, sparsity reports).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import pkgutil
import sys
from typing import Any

import jax

from gradtx._precision import QuantizedRows

__all__ = ["bytes_per_row", "reuse_host_memory", "use_huge_pages"]

_HUGE = 2 << 20  # 2 MiB, the x86-64 / arm64 transparent huge page
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25  # Linux >= 6.1: back the range by huge pages now


def _madvise() -> Any:
  if not sys.platform.startswith("linux"):
    return None
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.madvise
  except (OSError, AttributeError):
    return None
  fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
  fn.restype = ctypes.c_int
  return fn


def _advise(ptr: int, nbytes: int, madvise: Any, collapse: bool) -> int:
  """Advises the whole 2 MiB pages inside ``[ptr, ptr + nbytes)``."""
  start = (ptr + _HUGE - 1) & ~(_HUGE - 1)
  end = (ptr + nbytes) & ~(_HUGE - 1)
  if end <= start:
    return 0
  if madvise(start, end - start, _MADV_HUGEPAGE) != 0:
    return 0
  if collapse:
    # Best effort: an old kernel (EINVAL) or no free huge page (EAGAIN,
    # ENOMEM) leaves the pages as they are; new faults still get huge pages.
    madvise(start, end - start, _MADV_COLLAPSE)
  return end - start


def use_huge_pages(
  tree: Any, *, min_bytes: int = 4 << 20, collapse: bool = True
) -> Any:
  r"""Backs the large CPU arrays of ``tree`` by transparent huge pages.

  For each array of at least ``min_bytes`` on a CPU device (each addressable
  shard), asks Linux to back the whole 2 MiB pages of its buffer by huge
  pages (``madvise(MADV_HUGEPAGE)``) and, with ``collapse``, to do it now
  (``MADV_COLLAPSE``, Linux 6.1 or later; it takes time in proportion to
  the bytes). Values are
  not changed and nothing is copied. Call it once on the params and the
  optimizer state after ``tx.init``; a jitted step that donates them updates
  the same buffers in place, so they stay on huge pages. (Without donation
  every step returns new buffers, which are back on small pages.)

  Why: a sparse step reads and writes rows scattered over the tables; with
  4 KiB pages almost every row costs a TLB miss (see the module notes).
  The number of TLB misses per step drops from about
  :math:`n \times (\text{tables touched})` to about the number of distinct
  2 MiB pages touched.

  A no-op off Linux, for arrays on other devices, for arrays smaller than
  ``min_bytes`` and where the kernel refuses (transparent huge pages set to
  ``never``).

  Args:
    tree: a pytree of arrays (params, optimizer state, or both). Other
      leaves (None, Python scalars, numpy arrays) are left alone.
    min_bytes: smallest array advised.
    collapse: back the existing pages by huge pages at once (otherwise only
      pages first touched later are huge).

  Returns:
    ``tree`` itself, so it can wrap an expression.

  Raises:
    ValueError: when called on traced values (inside ``jit``); call it on
      the concrete arrays, outside the step.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> params = {"emb": jnp.zeros((65536, 64)), "w": jnp.ones(3)}
    >>> tx = gtx.lazy_adam(1e-3)
    >>> state = gtx.use_huge_pages(tx.init(params))
    >>> params = gtx.use_huge_pages(params)
    >>> float(params["emb"].sum()), params["w"].tolist()
    (0.0, [1.0, 1.0, 1.0])
  """
  leaves = jax.tree.leaves(tree)
  if any(isinstance(x, jax.core.Tracer) for x in leaves):
    raise ValueError(
      "gradtx.use_huge_pages needs concrete arrays, not traced values: call "
      "it outside jit, on the params and optimizer state the step is given."
    )
  madvise = _madvise()
  if madvise is None:
    return tree
  for x in leaves:
    if not isinstance(x, jax.Array) or x.nbytes < min_bytes:
      continue
    for shard in x.addressable_shards:
      if shard.device.platform != "cpu":
        continue
      data = shard.data
      if data.nbytes < min_bytes or data.is_deleted():
        continue
      # A buffer still being written refuses the collapse (EINVAL).
      data.block_until_ready()
      _advise(data.unsafe_buffer_pointer(), data.nbytes, madvise, collapse)
  return tree


# glibc's mallopt parameters and their defaults
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_REUSE = [(_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_ARENA_MAX, 1)]
_GLIBC_DEFAULTS = [(_M_MMAP_MAX, 65536), (_M_TRIM_THRESHOLD, 128 * 1024)]

# The opt-out of the default, read once when gradtx is imported.
OPT_OUT_VARIABLE = "GRADTX_REUSE_HOST_MEMORY"


def reuse_host_memory(enable: bool = True) -> bool:
  """Keeps the memory this process frees for its next allocations (glibc).

  gradtx calls this itself when it is imported on a machine whose JAX
  runs on the CPU (no GPU or TPU plugin installed, or ``JAX_PLATFORMS``
  starting with ``cpu``), so a step is fast without any call of yours.
  To keep glibc's own behaviour, set the environment variable
  ``GRADTX_REUSE_HOST_MEMORY=0`` before Python imports gradtx, or call
  ``gtx.reuse_host_memory(False)``.

  Why: every run of a jitted step allocates its temporaries (gathered
  rows, gradient rows, updates: tens of MiB for a table stack) and frees
  them at the end. By default glibc maps each large block fresh and unmaps
  it when freed, so every step faults all of its pages in again, zeroed,
  one 4 KiB page at a time. With this setting large blocks come from the
  heap (no ``mmap`` of their own), the heap is never trimmed, and threads
  share one arena (a thread's own arena gives large freed blocks back to
  the system), so a step reuses the pages the previous step freed. (Now
  and then a step still faults its temporaries in afresh: when a smaller
  allocation has split a freed block, the heap grows once more.) It takes
  full effect only before JAX starts its CPU threads: threads that
  allocated already keep their own arenas, which is why gradtx applies it
  at import. It affects every library in the process (torch too).

  The cost: the process keeps its peak heap, so its resident memory does
  not shrink after a large temporary is freed. A no-op off Linux and where
  the C library is not glibc.

  Args:
    enable: ``True`` applies the setting; ``False`` gives glibc back its
      defaults for large blocks and trimming (the opt-out; the one-arena
      limit stays for threads that already share it).

  Returns:
    Whether the settings were applied.

  Examples:
    >>> import gradtx as gtx
    >>> gtx.reuse_host_memory(False)  # opt out  # doctest: +SKIP
    True
  """
  if not sys.platform.startswith("linux"):
    return False
  try:
    mallopt = ctypes.CDLL(None).mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  mallopt.restype = ctypes.c_int
  settings = _REUSE if enable else _GLIBC_DEFAULTS
  return all(mallopt(param, value) == 1 for param, value in settings)


def _runs_on_cpu() -> bool:
  """Whether JAX will run on the CPU, told without starting a backend."""
  platforms = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  plugins = importlib.metadata.entry_points(group="jax_plugins")
  if len(plugins):
    return False
  try:
    import jax_plugins  # a namespace package, where a plugin is installed
  except ImportError:
    jax_plugins = None
  if jax_plugins is not None and any(
    pkgutil.iter_modules(jax_plugins.__path__)
  ):
    return False
  return importlib.util.find_spec("libtpu") is None


def _reuse_by_default() -> bool:
  value = os.environ.get(OPT_OUT_VARIABLE, "1").strip().lower()
  if value in ("0", "false", "no", "off"):
    return False
  return _runs_on_cpu() and reuse_host_memory()


# Applied at import, before JAX starts its CPU threads (see
# reuse_host_memory); gradtx/__init__.py imports this module.
REUSING_HOST_MEMORY = _reuse_by_default()


def bytes_per_row(tx: Any, params: Any) -> dict[str, float]:
  """Bytes per row of each table, its parameter and the optimizer state
  ``tx`` keeps for it: what a table costs in memory, row by row.

  A table is a parameter leaf with at least 2 dimensions. Its state is
  every leaf of ``tx.init(params)`` whose key path ends with the table's
  (optax and gradtx states hold trees shaped like the params, so
  ``state[0].mu['emb']`` belongs to ``['emb']``). Nothing is allocated: the
  state is traced with ``jax.eval_shape``.

  Args:
    tx: a gradient transformation.
    params: the params (arrays or ``jax.ShapeDtypeStruct``).

  Returns:
    ``{path: bytes per row}`` for each table, paths as
    ``jax.tree_util.keystr`` writes them.

  Examples:
    >>> import jax.numpy as jnp
    >>> import gradtx as gtx
    >>> params = {"emb": jnp.zeros((1000, 64)), "w": jnp.zeros(64)}
    >>> gtx.bytes_per_row(gtx.lazy_adam(1e-3), params)    # p + m + v
    {"['emb']": 768.0}
    >>> gtx.bytes_per_row(gtx.rowwise_adagrad(0.1), params)   # p + 1 float
    {"['emb']": 260.0}
    >>> bf16 = {"emb": jnp.zeros((1000, 64), jnp.bfloat16)}
    >>> gtx.bytes_per_row(  # p + (64 codes + 1 float32 scale) for m and v
    ...   gtx.lazy_adam(1e-3, mu_dtype="int8", nu_dtype="int8"), bf16)
    {"['emb']": 264.0}
  """
  state = jax.eval_shape(tx.init, params)
  # A QuantizedRows leaf holds codes and scales under the table's path.
  state_leaves = jax.tree_util.tree_flatten_with_path(
    state, is_leaf=lambda x: isinstance(x, QuantizedRows)
  )[0]
  out = {}
  for path, p in jax.tree_util.tree_flatten_with_path(params)[0]:
    if len(getattr(p, "shape", ())) < 2:
      continue
    rows = p.shape[0]
    total = p.size * p.dtype.itemsize
    n = len(path)
    for spath, s in state_leaves:
      if n and tuple(spath[-n:]) == tuple(path) and s.shape[:1] == (rows,):
        total += sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(s))
    out[jax.tree_util.keystr(path)] = total / rows
  return out


def format_bytes(n: float) -> str:
  """``n`` bytes for people: ``"512 B"``, ``"46.9 KiB"``, ``"1.5 GiB"``."""
  for unit in ("B", "KiB", "MiB"):
    if abs(n) < 1024:
      return f"{int(n)} B" if unit == "B" else f"{n:,.1f} {unit}"
    n /= 1024
  return f"{n:,.1f} GiB"
