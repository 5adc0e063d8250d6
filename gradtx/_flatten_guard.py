"""The guard of a SparseRows flatten: what a flatten is inside of, when
that would corrupt the SparseRows.

A SparseRows is a pytree whose leaves are its integer row ids and its rows,
so a function that maps over a gradient tree would treat the ids as numbers:
JAX's reducing collectives (``lax.pmean`` of a gradient tree), optax's
dense-math transformations (``optax.adam`` on a SparseRows gradient),
``optax.MultiSteps``' dense accumulator, ``eqx.apply_updates``. Each flatten
of a SparseRows walks up the stack once (:func:`flatten_hazard`) and, inside
one of those, raises a ``TypeError`` that names it and what to use instead.
JAX's module names come from :mod:`gradtx._jax_compat`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from gradtx import _jax_compat

_GRADTX_DIR = os.path.dirname(os.path.abspath(__file__))


def _reduction_error(name: str, where: str) -> str:
  at = f" at {where}" if where else ""
  return (
    f"`jax.lax.{name}` was applied to a tree holding a gradtx.SparseRows"
    f"{at}. It would combine the replicas' row ids elementwise and corrupt "
    "the gradient. For a cross-replica mean use "
    "`gtx.all_reduce(axis_name)(grads)` in place of "
    "`lax.pmean(grads, axis_name)`, for a sum "
    "`gtx.all_reduce(axis_name, 'sum')(grads)` in place of `lax.psum` (or "
    "put `gtx.all_reduce(axis_name)` first in the optax chain): it "
    "all-gathers the rows. A max, min or reduce-scatter has no row-sparse "
    "form: `gtx.densify()` the gradient first."
  )


def _dense_optax(what: str, fix: str) -> str:
  """The error for an optax transformation that does dense math on a leaf:
  ``what`` names it, ``fix`` says what to use instead."""
  return (
    f"{what} got a gradtx.SparseRows gradient. It does dense math on every "
    "leaf and would mix the SparseRows' integer row ids into the update. "
    f"{fix} Or put `gtx.densify()` in front of it (the table's gradient "
    "becomes a dense array), or keep it for the dense leaves and give the "
    "tables a gradtx optimizer: `optax.multi_transform({'sparse': <gradtx "
    "optimizer>, 'dense': <optax optimizer>}, gtx.sparse_labels(loss)(params, "
    "*batch))`."
  )


def _twin(*pairs: tuple[str, str]) -> str:
  uses = ", ".join(f"`{gtx}` for `{optax}`" for gtx, optax in pairs)
  return f"Use its gradtx twin, which keeps the gradient row-sparse: {uses}."


_NO_TWIN = (
  "gradtx has no row-sparse version of it (`gtx.row_transformation` writes "
  "one)."
)

# optax's dense-math transformations, by the module and name of the factory
# whose `update_fn` would receive the SparseRows -> (the optimizers of optax
# that chain it, the fix). An optimizer's own frame (optax.adam) is gone by
# update time: only its steps' are on the stack.
_T = "optax._src.transform"
_DENSE_OPTAX = {
  (_T, "scale_by_adam"): (
    ("optax.adam", "optax.adamw", "optax.nadam", "optax.lamb"),
    _twin(
      ("gtx.lazy_adam(learning_rate)", "optax.adam(learning_rate)"),
      ("gtx.lazy_adamw(learning_rate)", "optax.adamw(learning_rate)"),
      ("gtx.scale_by_lazy_adam()", "optax.scale_by_adam()"),
    ),
  ),
  (_T, "scale_by_rss"): (
    ("optax.adagrad",),
    _twin(
      ("gtx.adagrad(learning_rate)", "optax.adagrad(learning_rate)"),
      ("gtx.scale_by_rss()", "optax.scale_by_rss()"),
    ),
  ),
  ("optax.transforms._accumulation", "trace"): (
    ("optax.sgd(learning_rate, momentum=m)", "optax.rmsprop", "optax.lars"),
    _twin(
      (
        "gtx.lazy_sgd(learning_rate, momentum=m)",
        "optax.sgd(learning_rate, momentum=m)",
      ),
      ("gtx.lazy_trace(decay)", "optax.trace(decay)"),
    ),
  ),
  ("optax.transforms._adding", "add_decayed_weights"): (
    ("optax.adadelta", "optax.lars"),
    _twin(("gtx.add_decayed_weights(wd)", "optax.add_decayed_weights(wd)")),
  ),
  ("optax.transforms._clipping", "clip_by_global_norm"): (
    (),
    _twin(("gtx.clip_by_global_norm(m)", "optax.clip_by_global_norm(m)")),
  ),
  (_T, "scale"): (
    ("optax.sgd(learning_rate)", "optax.scale_by_learning_rate(learning_rate)"),
    _twin(
      ("gtx.scale(step_size)", "optax.scale(step_size)"),
      ("gtx.scale_by_learning_rate(lr)", "optax.scale_by_learning_rate(lr)"),
      ("gtx.lazy_sgd(learning_rate)", "optax.sgd(learning_rate)"),
    ),
  ),
  (_T, "scale_by_schedule"): (
    ("optax.sgd(schedule)", "optax.scale_by_learning_rate(schedule)"),
    _twin(
      (
        "gtx.scale_by_learning_rate(schedule, flip_sign=False)",
        "optax.scale_by_schedule(schedule)",
      ),
      (
        "gtx.scale_by_learning_rate(schedule)",
        "optax.scale_by_learning_rate(schedule)",
      ),
    ),
  ),
}
# The rest of optax's per-leaf math (its moment helpers first): no twin.
_DENSE_OPTAX_NO_TWIN = {
  (_T, "scale_by_rms"): ("optax.rmsprop",),
  (_T, "scale_by_stddev"): ("optax.rmsprop(learning_rate, centered=True)",),
  (_T, "scale_by_amsgrad"): ("optax.amsgrad",),
  (_T, "scale_by_adamax"): ("optax.adamax", "optax.adamaxw"),
  (_T, "scale_by_lion"): ("optax.lion",),
  (_T, "scale_by_belief"): ("optax.adabelief",),
  (_T, "scale_by_yogi"): ("optax.yogi",),
  (_T, "scale_by_radam"): ("optax.radam",),
  (_T, "scale_by_adadelta"): ("optax.adadelta",),
  (_T, "scale_by_adan"): ("optax.adan",),
  (_T, "scale_by_novograd"): ("optax.novograd",),
  (_T, "scale_by_sm3"): ("optax.sm3",),
  (_T, "scale_by_sign"): ("optax.sign_sgd", "optax.signum"),
  (_T, "scale_by_rprop"): ("optax.rprop",),
  (_T, "scale_by_trust_ratio"): ("optax.lamb", "optax.lars", "optax.fromage"),
  (_T, "scale_by_optimistic_gradient"): ("optax.optimistic_gradient_descent",),
  (_T, "scale_by_polyak"): ("optax.polyak_sgd",),
  (_T, "scale_by_lbfgs"): ("optax.lbfgs",),
  (_T, "scale_by_param_block_norm"): (),
  (_T, "scale_by_param_block_rms"): ("optax.adafactor",),
  (_T, "scale_by_distance_over_gradients"): (),
  (_T, "normalize_by_update_norm"): (),
  (_T, "centralize"): (),
  (_T, "apply_every"): (),
  ("optax._src.factorized", "scale_by_factored_rms"): ("optax.adafactor",),
  ("optax.transforms._accumulation", "ema"): ("optax.signum",),
  ("optax.transforms._adding", "add_noise"): ("optax.noisy_sgd",),
  ("optax.transforms._clipping", "clip"): (),
  ("optax.transforms._clipping", "clip_by_block_rms"): ("optax.adafactor",),
  ("optax.transforms._clipping", "adaptive_grad_clip"): (),
}


def _dense_optax_error(name: str, used_by: tuple[str, ...], fix: str) -> str:
  uses = ", ".join(f"`{u}`" for u in used_by)
  what = f"`optax.{name}`" + (f" (a step of {uses})" if uses else "")
  return _dense_optax(what, fix)


# Functions that would corrupt a SparseRows they flatten, by (module,
# qualified name) -> what to call instead: eqx.apply_updates (it maps over
# the updates first and so splits a SparseRows into its ids and rows),
# optax.MultiSteps' dense accumulation, and the update of every optax
# transformation above.
_SPLITS_UPDATES = {
  ("equinox._update", "apply_updates"): (
    "`eqx.apply_updates` maps over the updates first and would split a "
    "gradtx.SparseRows into its ids and rows. Apply sparse updates with "
    "`gtx.apply_updates(model, updates)` (an Equinox module is a pytree; a "
    "None update leaves its leaf alone, as in eqx), or with "
    "`optax.apply_updates(params, updates)` on the array part "
    "(`eqx.partition`)."
  ),
  ("optax.transforms._accumulation", "MultiSteps.update.<locals>._do_update"): (
    "`optax.MultiSteps` got a gradtx.SparseRows gradient: it adds each "
    "gradient into a dense accumulator shaped like the params, which cannot "
    "hold one. Use `gtx.accumulate(optimizer, every_k, rows_per_step=...)` in "
    "its place: it accumulates the rows (`rows_per_step` says how many a "
    "step's SparseRows holds, per table)."
  ),
  **{
    (module, f"{name}.<locals>.update_fn"): _dense_optax_error(name, *how)
    for (module, name), how in _DENSE_OPTAX.items()
  },
  **{
    (module, f"{name}.<locals>.update_fn"): _dense_optax_error(
      name, used_by, _NO_TWIN
    )
    for (module, name), used_by in _DENSE_OPTAX_NO_TWIN.items()
  },
}


def flatten_hazard() -> str | None:
  """The error message for the pytree flatten that called the caller of
  this function, when that flatten would corrupt a SparseRows; else None.

  Inside one of JAX's reducing collectives the message names the outermost
  one and the user's line that called it; inside a function of
  ``_SPLITS_UPDATES``, what to call instead. One walk up the stack per
  flatten: past JAX's tree utilities, then, from optax, past optax's frames
  (its tree helpers, ``optax.tree.*``) to the first one that is in
  ``_SPLITS_UPDATES``. optax's structure functions (``chain``,
  ``multi_transform``, ``masked``, ``inject_hyperparams``,
  ``apply_updates``) are not, so a SparseRows passes through them to the
  gradtx transformations inside.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> import gradtx as gtx
    >>> g = gtx.SparseRows(jnp.array([1]), jnp.ones((1, 2)), 4)
    >>> optax.scale(2.0).update(g, optax.EmptyState())
    Traceback (most recent call last):
    ...
    TypeError: `optax.scale` (a step of ...) got a gradtx.SparseRows gradient...
  """
  f = sys._getframe(2)
  while (
    f is not None and f.f_globals.get("__name__") in _jax_compat.TREE_MODULES
  ):
    f = f.f_back
  if f is None:
    return None
  module = f.f_globals.get("__name__", "")
  if module == _jax_compat.COLLECTIVES_MODULE:
    return _reduction(f)
  while True:
    hazard = _SPLITS_UPDATES.get((module, f.f_code.co_qualname))
    f = f.f_back
    if hazard is not None or f is None or not module.startswith("optax."):
      return hazard
    module = f.f_globals.get("__name__", "")


def _reduction(f: Any) -> str | None:
  """The error for the outermost reducing collective from frame ``f`` (in
  JAX's collectives module) up, naming the user's line that called it;
  None for a collective that keeps rows whole."""
  name = None
  collectives = _jax_compat.COLLECTIVES_MODULE
  while f is not None and f.f_globals.get("__name__") == collectives:
    if _jax_compat.REDUCING_COLLECTIVE.match(f.f_code.co_name):
      name = f.f_code.co_name
    f = f.f_back
  if name is None:
    return None
  while f is not None and os.path.abspath(f.f_code.co_filename).startswith(
    (_jax_compat.JAX_SOURCE_DIR + os.sep, _GRADTX_DIR + os.sep)
  ):
    f = f.f_back
  where = f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else ""
  return _reduction_error(name.lstrip("_"), where)
