"""Admission of a table stack's raw ids: ``TableStack.admit`` below the
facade.

:func:`new_id_bounds` checks ``admit``'s bounds of new ids per hashed
table (``max_new`` a count, ``max_new_fraction`` a fraction of the
table's id slots); :func:`admit_ids` makes the inputs fit on the host,
joins each map's raw ids (``_pooled.raw_slots``), gives each hashed
table its budget and places the new ids (``_placement``), and hands the rows
back in each feature's own form, as one compiled program outside any
trace.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from gradtx import _placement
from gradtx._inputs import (
  Feature,
  Jagged,
  Keyed,
  KeyedJagged,
  host_ready,
  parse,
  run_program,
)
from gradtx._plan import StackPlan, hashed_features
from gradtx._pooled import raw_slots
from gradtx._static import is_int

Bounds = tuple[tuple[tuple[str, Any], ...], ...]


def admit_ids(
  plan: StackPlan,
  programs: dict,
  vocab: Mapping[str, Any],
  ids: Any,
  weights: Mapping[str, Any] | None,
  bounds: Bounds,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
  """``TableStack.admit``: ``(ids, vocab, fresh)``, the hashed features'
  raw ids as rows (the other features as given), the new maps and each
  map's :class:`gradtx.FreshRows`.

  Examples:
    >>> import jax, numpy as np
    >>> import gradtx as gtx
    >>> from gradtx._admission import admit_ids
    >>> stack = gtx.TableStack(
    ...     {"item": gtx.TableSpec(64, 4, hashed=gtx.Hashed())})
    >>> vocab = stack.init_vocab(jax.random.key(0))
    >>> ids, vocab, fresh = admit_ids(
    ...     stack.plan, {}, vocab, {"item": np.array([10**12, 7])}, None,
    ...     ((), ()))
    >>> ids["item"].shape, int(vocab["float32x4"].live[0])
    ((2,), 2)
  """
  raw = hashed_features(plan)
  # the program takes a dict's hashed features alone: the others come
  # back as they were given
  keyed = isinstance(ids, (Keyed, KeyedJagged))
  given, given_weights = host_ready(
    ids if keyed else {f: x for f, x in ids.items() if f in raw},
    {f: w for f, w in (weights or {}).items() if f in raw},
    raw,
    "admit",
  )

  def admit(v, i, w):
    return _admit(plan, v, i, w, bounds)

  out, vocab, fresh = run_program(
    programs, ("admit", bounds), admit, vocab, given, given_weights
  )
  return (out if keyed else {**ids, **out}), vocab, fresh


def _admit(plan, vocab, ids, weights, bounds):
  hashed = hashed_features(plan)
  # a keyed input read feature by feature; the hashed features parsed
  forms, _ = parse(ids, weights, hashed, "admit", raw=True, names=hashed)
  out = {f: x for f, x in forms.items() if not isinstance(x, Feature)}
  new_vocab, fresh = dict(vocab), {}
  for name, layout in plan.maps.items():
    slots = raw_slots(layout, plan.features, forms)
    if slots is None:
      continue
    counts, fractions = map(dict, bounds)
    # an int a count, a float a fraction (new_id_bounds made them so)
    bound = _placement.budgets(layout, slots.tab, {**fractions, **counts})
    rows, new_vocab[name], fresh[name] = _placement.admit(
      vocab[name], layout, slots.hi, slots.lo, slots.tab, slots.valid, bound
    )
    for f, r in slots.rebuild(rows).items():  # each in its own form
      jagged = forms[f].lengths is not None
      out[f] = Jagged(r, forms[f].lengths, forms[f].weights) if jagged else r
  return out, new_vocab, fresh


def new_id_bounds(plan: StackPlan, max_new: Any, fraction: Any) -> Bounds:
  """``admit``'s bounds of new ids, checked: ``(counts, fractions)``,
  each ``((table, bound), ...)`` (hashable: a program's key), a table
  in neither at the default fraction. A float ``max_new`` (or a dict's
  float) is a fraction, deprecated."""
  hashed = [t for layout in plan.maps.values() for t in layout.tables]
  where = "gradtx.TableStack.admit"

  def per_table(v: Any, arg: str) -> dict[str, Any]:
    if v is None:
      return {}
    if not isinstance(v, Mapping):
      return dict.fromkeys(hashed, v)
    unknown = [t for t in v if t not in hashed]
    if unknown:
      raise ValueError(
        f"{where} `{arg}` names {unknown}, which are not hashed tables; "
        f"the hashed tables are {hashed}."
      )
    return dict(v)

  counts = per_table(max_new, "max_new")
  fractions = per_table(fraction, "max_new_fraction")
  # the deprecated spelling: a float max_new is a fraction
  old = {t: counts.pop(t) for t in list(counts) if isinstance(counts[t], float)}
  bad = {
    t: v
    for t, v in {**old, **fractions}.items()
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1
  }
  if bad:
    raise ValueError(
      f"{where} `max_new_fraction` must be a float in (0, 1] (a fraction "
      "of the table's id slots), or a dict table name -> float; got "
      f"{bad!r}."
    )
  bad = {t: v for t, v in counts.items() if not (is_int(v) and v >= 1)}
  if bad:
    raise ValueError(
      f"{where} `max_new` must be an int >= 1 (a count of new ids), or a "
      f"dict table name -> int; got {bad!r}. For a fraction of the "
      "table's id slots pass `max_new_fraction`."
    )
  both = [t for t in hashed if t in fractions and (t in counts or t in old)]
  if both:
    raise ValueError(
      f"{where}: tables {both} are bounded by both `max_new` and "
      "`max_new_fraction`; give each table one bound."
    )
  if old:
    new = old if isinstance(max_new, Mapping) else max_new
    warnings.warn(
      f"{where} `max_new={max_new!r}` (a float: a fraction of the id "
      f"slots) is deprecated: pass `max_new_fraction={new!r}`; `max_new` "
      "takes an int count.",
      DeprecationWarning,
      stacklevel=3,
    )
  fractions.update(old)
  return (
    tuple((t, int(counts[t])) for t in hashed if t in counts),
    tuple((t, float(fractions[t])) for t in hashed if t in fractions),
  )
