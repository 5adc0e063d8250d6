"""JAX-version compatibility: what gradtx reads of JAX beyond its stable API.

gradtx supports jax 0.10.2 to 0.12. What it reads of JAX that is internal
or that differs between those releases is here, each difference resolved
once, so that the jaxpr reader (:mod:`gradtx._jaxpr`) and this module are
the only places that know JAX's internals:

* jaxpr layouts. jax 0.11 merged ``ClosedJaxpr`` into ``Jaxpr``
  (jax-ml/jax#39009): a ``Jaxpr`` carries its consts, ``jaxpr.jaxpr`` is a
  legacy alias of itself; :func:`open_jaxpr` gives (jaxpr, consts) from
  either. jax 0.11 replaced ``scan``'s ``num_consts`` / ``num_carry`` with
  the flat trees ``ft_in`` / ``ft_out`` (jax-ml/jax#39005):
  :func:`scan_counts` reads either. Every parameter of a primitive the
  reader reads is named in :data:`FOLLOWED_PARAMS` (tests/test_jaxpr.py
  checks each name on the running JAX).
* the varying mesh axes of shard_map's types (``manual_axis_type``, or
  ``vma`` on older JAX): :func:`vma_of`, :func:`varying_axes`,
  :func:`cast_varying`, :func:`shape_struct`.
* what XLA makes of ``lax.optimization_barrier``: older XLA:CPU (jax
  0.10) expands barriers before fusion, newer keeps them through it;
  :func:`barrier_computes_once` reads which from a small compiled program.
* JAX's own source: ``source_info_util`` (the user's line of an equation),
  the modules of its collectives and tree utilities (the SparseRows flatten
  guard, :mod:`gradtx._flatten_guard`, walks the stack past them), and the
  message of ``vmap``'s replicated-output error.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import re
from collections.abc import Sequence
from typing import Any

import jax
from jax import lax
from jax._src import source_info_util as source_info_util
from jax.extend import core as jcore

# ----------------------------------------------------------------------------
# jaxpr layouts

_CLOSED_IS_JAXPR = jcore.ClosedJaxpr is jcore.Jaxpr
_SCAN_COUNTS_OLD = ("num_consts", "num_carry")
_SCAN_COUNTS_NEW = ("ft_in", "ft_out")

# Primitive -> the parameters the rewriter reads (alternatives in a tuple:
# one of them must be there).
FOLLOWED_PARAMS: dict[str, tuple[Any, ...]] = {
  "gather": ("dimension_numbers", "slice_sizes", "mode"),
  "dynamic_slice": ("slice_sizes",),
  "convert_element_type": ("new_dtype",),
  "jit": ("jaxpr", "name"),
  "remat2": ("jaxpr", "prevent_cse", "policy"),
  "scan": (
    "jaxpr",
    "length",
    "reverse",
    "unroll",
    (_SCAN_COUNTS_OLD, _SCAN_COUNTS_NEW),
  ),
  "pvary": (),
  "stop_gradient": (),
}


def open_jaxpr(j: Any) -> tuple[Any, Sequence[Any]]:
  """``(jaxpr, consts)`` of a body parameter or a traced function: its
  constvars bind ``consts``, its invars the operands."""
  if _CLOSED_IS_JAXPR:
    return j, j.consts
  if isinstance(j, jcore.ClosedJaxpr):
    return j.jaxpr, j.consts
  return j, ()


def scan_counts(params: dict) -> tuple[int, int]:
  """``(num_consts, num_carry)`` of a ``scan`` equation.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from gradtx._jax_compat import open_jaxpr, scan_counts
    >>> def loop(c, xs):
    ...   return jax.lax.scan(lambda c, x: (c + x, 2 * x), c, xs)
    >>> jaxpr, consts = open_jaxpr(jax.make_jaxpr(loop)(0.0, jnp.ones(3)))
    >>> eqn = jaxpr.eqns[0]
    >>> eqn.primitive.name, scan_counts(eqn.params)
    ('scan', (0, 1))
  """
  if "num_consts" in params:
    return int(params["num_consts"]), int(params["num_carry"])
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


# ----------------------------------------------------------------------------
# shard_map's varying mesh axes


def vma_of(aval: Any) -> frozenset:
  """Mesh axes a value of abstract value ``aval`` varies along inside
  ``shard_map`` (its type's ``manual_axis_type``; ``vma`` on older JAX)."""
  mat = getattr(aval, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", None) or ())


def varying_axes(x: Any) -> frozenset:
  """Mesh axes along which shard_map's type checks see ``x`` vary.

  ``x`` is a value or a ``jax.ShapeDtypeStruct`` (from ``jax.eval_shape``).
  """
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  return vma_of(aval)


def cast_varying(x: Any, axes: frozenset) -> Any:
  """``x`` cast to vary over the mesh ``axes`` it does not vary over yet."""
  missing = tuple(sorted(axes - vma_of(jax.typeof(x))))
  return lax.pcast(x, missing, to="varying") if missing else x


def shape_struct(aval: Any) -> jax.ShapeDtypeStruct:
  """A ``jax.ShapeDtypeStruct`` of ``aval`` that keeps its varying axes."""
  return jax.ShapeDtypeStruct(
    aval.shape,
    aval.dtype,
    weak_type=aval.weak_type,
    manual_axis_type=getattr(aval, "manual_axis_type", None),
  )


# ----------------------------------------------------------------------------
# XLA's optimization barriers

# A producer constant that nothing else in the probe holds.
_PROBE_SCALE = 1.25


@functools.cache
def barrier_computes_once() -> bool:
  """Whether XLA computes a value behind ``lax.optimization_barrier`` once,
  with its producer's gather fused in, when two consumers read it (a
  scatter and an elementwise op, as the row engine's new state rows).

  Newer XLA keeps a barrier through fusion; older XLA:CPU (jax 0.10)
  expands it before, and then duplicates the cheap producer into each
  consumer and leaves the gather a kernel of its own, as if there were no
  barrier. Read once from a small program compiled for the CPU (whatever
  JAX's default backend is: only the CPU code asks, and a program traced
  on a GPU host carries the CPU's answer in its CPU branch only): the
  producer's scale appears once in it when the barrier holds, in each
  consumer when it does not. False where JAX has no CPU backend.

  Compiled on a thread of its own: the caller may be tracing a step under
  a mesh (``jax.set_mesh``) or a default device, whose thread-local
  settings would apply to the probe's program.
  """
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(_barrier_probe).result()


def _barrier_probe() -> bool:
  def probe(t, i):
    r = lax.optimization_barrier(jax.numpy.tanh(t[i]) * _PROBE_SCALE)
    return t.at[i].set(r, unique_indices=True), r * 3.0

  try:
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
  except RuntimeError:  # JAX_PLATFORMS without cpu
    return False
  args = (
    jax.ShapeDtypeStruct((64, 8), jax.numpy.float32, sharding=cpu),
    jax.ShapeDtypeStruct((16,), jax.numpy.int32, sharding=cpu),
  )
  text = jax.jit(probe, donate_argnums=0).lower(*args).compile().as_text()
  return text.count(f"constant({_PROBE_SCALE})") == 1


# ----------------------------------------------------------------------------
# JAX's own source

# JAX's collectives live in one module; those that combine the replicas'
# values elementwise (lax.psum, pmean, pmax, pmin, psum_scatter and their
# helpers) would combine SparseRows' row ids too.
COLLECTIVES_MODULE = "jax._src.lax.parallel"
REDUCING_COLLECTIVE = re.compile(r"_?p(sum|mean|max|min)")
# The modules of `jax.tree_util.*` and `jax.tree.*`: their frames stand
# between a flatten and the function that asked for it.
TREE_MODULES = frozenset({"jax._src.tree_util", "jax._src.tree"})
# The folder of JAX's own Python files.
JAX_SOURCE_DIR = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(jax.__file__))), "jax"
)


def is_replicated_output_error(e: Exception) -> bool:
  """Whether ``e`` is ``vmap``'s refusal to return as unmapped
  (``out_axes=None``) an output that varies along the mapped axis."""
  return isinstance(e, ValueError) and "out_axes is" in str(e)
