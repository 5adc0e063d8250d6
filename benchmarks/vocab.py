"""Open vocabularies: what the id map of hashed tables costs inside the whole
training step, and what it buys over the hashing trick.

* ``cost``: the 26-feature Criteo model of ``benchmarks/stacks.py`` (one id
  per example and feature, batch ``--batch``, ``--dim`` wide, a logit per
  feature), raw ids Zipf over 10^9 values (``numpy`` Zipf ranks of exponent
  ``--zipf``, scrambled by a hash so the hot ids are spread), a stack of
  hashed tables whose capacities are 10%, 50% and 100% of the distinct ids
  a table sees over the ``--batches`` batches the steps cycle through. The
  map's step (``admit`` + ``reset_rows`` + loss, gradient and update, params,
  state and map donated) against the same step on the same tables with ids
  already in range (the raw id modulo the rows, mapped in numpy before the
  step). The map's steps are timed after ``--fill`` untimed steps, so a
  small table is evicting rows when it is timed.
* ``quality``: a synthetic CTR task with a long tail: ``--q-features``
  features whose raw ids are Zipf over 10^9 values, each id with a fixed
  random effect, labels drawn from the logistic model of the effects.
  Embeddings of width 8 and a linear head, trained online (fresh examples
  every step) with ``gtx.adagrad``, then the held-out log loss on fresh
  examples. At a capacity of ``--q-capacity`` of the distinct ids the
  training stream holds: the id map (LRU; LRU admitting ids at their second
  read), the modulo hashing trick with the same rows and with the same bytes
  (the map's 24 bytes a row given to the table as rows), and an unbounded
  table (a row for every distinct id). Ids never seen in training read zeros
  in the map and the unbounded table, and a colliding row with the modulo.

* ``parts`` (``--only parts``): where the id map's time goes, on the
  100%-capacity stack of ``cost``: the jitted pieces of the hashed step
  timed alone, interleaved with the in-range step and the whole hashed
  step: ``stack.admit`` alone, ``admit`` + ``gtx.reset_rows``.

Writes ``benchmarks/results/vocab.{md,json}``, ``vocab_quality.{md,json}``
and ``vocab_parts.{md,json}``.

  python -m benchmarks.vocab [--quick] [--only cost|quality|parts]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks._common import parse, parser
from benchmarks._results import write_results
from benchmarks._timing import Schedule
from benchmarks.models import (
  bce,
  criteo_raw,
  hashed_criteo,
  hashed_step,
  zipf_raw,
)

SEED = 0


# ----------------------------------------------------------------------------
# cost inside the whole step


OPTIMIZERS = (
  ("rowwise_adagrad", lambda: gtx.rowwise_adagrad(1e-2)),
  ("lazy_adam", lambda: gtx.lazy_adam(1e-3)),
)


def cost(args):
  names, raw, labels, distinct = criteo_raw(
    args.batch, args.batches, args.zipf, SEED
  )
  rows_out, extra = [], {"distinct": distinct}
  for frac in args.fractions:
    rows = {n: max(64, int(np.ceil(frac * distinct[n]))) for n in names}
    for opt_name, make in OPTIMIZERS:
      times = _cost_pair(args, names, rows, raw, labels, make)
      ratio = times["map"] / times["in range"]
      rows_out.append([
        f"{int(frac * 100)}%",
        opt_name,
        sum(rows.values()),
        times["in range"] * 1e3,
        times["map"] * 1e3,
        ratio,
      ])  # fmt: skip
      extra.setdefault("runs", []).append({
        "fraction": frac, "optimizer": opt_name, **times
      })  # fmt: skip
  write_results(
    "vocab",
    "Hashed tables: the id map inside the whole step (26 Criteo features, "
    f"batch {args.batch}, dim {args.dim}, Zipf({args.zipf}) raw ids over "
    "10^9 values)",
    [
      "capacity / distinct ids",
      "optimizer",
      "rows (all tables)",
      "ids in range ms",
      "id map ms",
      "map / in range",
    ],
    rows_out,
    notes=(
      "Median of interleaved rounds, the loss returned, params, state and "
      "map donated. `ids in range`: the same stack without hashing, the "
      "raw id modulo the rows computed in numpy before the step (the "
      "hashing trick, free of the map's work). `id map`: "
      "`stack.admit` + `gtx.reset_rows` + the same loss, gradient and "
      f"update, timed after {args.fill} untimed steps. Distinct ids per "
      f"table over the {args.batches} batches the steps cycle through: "
      f"{min(distinct.values()):,}..{max(distinct.values()):,}."
    ),
    extra=extra,
  )


def _cost_pair(args, names, rows, raw, labels, make_tx, parts=False):
  """Runners of the in-range and the hashed step (with ``parts``, of the
  hashed step's pieces too), timed interleaved: system -> seconds."""
  fns = {}
  for system in ("in range", "map"):
    hashed = system == "map"
    tx = make_tx()
    stack, params, jitted = hashed_criteo(names, rows, args.dim, tx, hashed)
    box = [params, tx.init(params)]
    if hashed:
      box.append(stack.init_vocab(jax.random.key(1)))
      batches = [{n: jnp.asarray(b[n]) for n in names} for b in raw]
    else:
      batches = [{n: jnp.asarray(b[n] % rows[n]) for n in names} for b in raw]
    ys = [jnp.asarray(y) for y in labels]

    def run(box=box, jitted=jitted, batches=batches, ys=ys, i=[0]):  # noqa: B006
      k = i[0] % len(batches)
      i[0] += 1
      *new, v = jitted(*box, batches[k], ys[k])
      box[:] = new
      jax.block_until_ready(v)

    for _ in range(args.fill if hashed else 2):
      run()
    fns[system] = run
    if hashed and parts:
      fns.update(_pieces(stack, tx, box, batches))
  return Schedule.from_args(args).time(fns, warmup=1)


def _pieces(stack, tx, box, batches):
  """Runners of ``stack.admit`` alone and of ``admit`` + ``reset_rows``,
  each on its own copy of the filled state (map and params donated)."""

  def admit(vocab, ids):  # the fresh rows' values are an output too
    _, vocab, fresh = stack.admit(vocab, ids)
    return (vocab,), fresh

  def admit_reset(params, state, vocab, ids):
    ids, vocab, fresh = stack.admit(vocab, ids)
    params, state = gtx.reset_rows(tx, state, params, {"emb": fresh})
    return (params, state, vocab), None

  pieces = {
    "admit alone": (jax.jit(admit, donate_argnums=(0,)), [box[2]]),
    "admit + reset_rows": (
      jax.jit(admit_reset, donate_argnums=(0, 1, 2)),
      list(box),
    ),
  }
  out = {}
  for name, (jitted, state) in pieces.items():
    state[:] = jax.tree.map(jnp.copy, state)

    def run(jitted=jitted, state=state, i=[0]):  # noqa: B006
      new, out = jitted(*state, batches[i[0] % len(batches)])
      i[0] += 1
      state[:] = new
      jax.block_until_ready((new, out))

    run()
    out[name] = run
  return out


def parts(args):
  names, raw, labels, distinct = criteo_raw(
    args.batch, args.batches, args.zipf, SEED
  )
  rows = {n: max(64, distinct[n]) for n in names}
  rows_out, extra = [], {"runs": []}
  for opt_name, make in OPTIMIZERS:
    times = _cost_pair(args, names, rows, raw, labels, make, parts=True)
    base = times["in range"]
    for part in ("in range", "admit alone", "admit + reset_rows", "map"):
      rows_out.append([opt_name, part, times[part] * 1e3, times[part] / base])
    extra["runs"].append({"optimizer": opt_name, **times})
  write_results(
    "vocab_parts",
    "Where the id map's time goes in the hashed step (26 hashed Criteo "
    f"features, batch {args.batch}, dim {args.dim}, Zipf({args.zipf}) raw "
    "ids, capacity 100% of the distinct ids)",
    ["optimizer", "part", "ms", "/ in-range step"],
    rows_out,
    notes=(
      "Interleaved rounds, one process. `in range`: the step on ids mapped "
      "in numpy; `map`: the whole hashed step (`stack.admit` + "
      "`gtx.reset_rows` + loss, gradient and update). The pieces run "
      "jitted alone on copies of the filled map, params and state."
    ),
    extra=extra,
  )


# ----------------------------------------------------------------------------
# quality against the hashing trick


def quality(args):
  nf, dim, batch = args.q_features, 8, args.q_batch
  names = [f"f{t}" for t in range(nf)]
  rng = np.random.default_rng(SEED + 7)

  def effect(raw, t):  # a fixed N(0, 1) effect per raw id: Box-Muller
    x = raw.astype(np.uint64) * np.uint64(0x9E3779B1) + np.uint64(t)
    u1 = ((x % np.uint64(2**31)).astype(np.float64) + 0.5) / 2**31
    u2 = ((x // np.uint64(2**31)) % np.uint64(2**20)).astype(np.float64) / 2**20
    return np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)

  def sample(n):
    ids = {
      f: zipf_raw(rng, n, args.q_zipf, 1000 + t) for t, f in enumerate(names)
    }
    logit = sum(effect(ids[f], t) for t, f in enumerate(names)) - 1.5
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return ids, y, logit

  train = [sample(batch) for _ in range(args.q_steps)]
  test_ids, test_y, test_logit = sample(args.q_test)
  distinct = {
    f: np.unique(np.concatenate([b[0][f] for b in train])) for f in names
  }
  cap = {f: max(16, int(args.q_capacity * len(distinct[f]))) for f in names}
  row_bytes = dim * 4 * 2  # the row and Adagrad's accumulator
  same_bytes = {f: int(cap[f] * (row_bytes + 24) / row_bytes) for f in names}
  bayes = float(np.mean(np.logaddexp(0, test_logit) - test_y * test_logit))
  results = []
  systems = {
    "id map, LRU": ("map", cap, gtx.Hashed()),
    "id map, LRU, admit at 2nd read": ("map", cap, gtx.Hashed(min_count=2)),
    "modulo, same rows": ("mod", cap, None),
    "modulo, same bytes": ("mod", same_bytes, None),
    "unbounded table": ("exact", {f: len(distinct[f]) for f in names}, None),
  }
  for label, (kind, rows, hashed) in systems.items():
    loss_v = _train_eval(
      kind, rows, hashed, names, dim, train, test_ids, test_y, distinct
    )
    results.append([
      label,
      sum(rows.values()),
      loss_v,
      loss_v - bayes,
    ])  # fmt: skip
    print(label, loss_v, flush=True)
  write_results(
    "vocab_quality",
    f"Hashed tables: held-out log loss on a long-tail CTR task "
    f"({nf} features, Zipf({args.q_zipf}) ids over 10^9 values, "
    f"{args.q_steps} steps of {batch})",
    ["system", "rows (all tables)", "held-out log loss", "above Bayes"],
    results,
    notes=(
      f"Capacity {args.q_capacity:.0%} of the distinct ids of the training "
      f"stream per table ({sum(len(v) for v in distinct.values()):,} "
      "distinct ids in all); `same bytes`: the map's 24 bytes a row given "
      f"to the modulo table as rows of {row_bytes} bytes (row + Adagrad "
      f"state). Bayes: the log loss of the true probabilities, {bayes:.4f}. "
      f"{args.q_test:,} held-out examples; gtx.adagrad(0.05)."
    ),
  )


def _train_eval(kind, rows, hashed, names, dim, train, test_ids, test_y, seen):
  specs = {f: gtx.TableSpec(rows[f], dim, hashed=hashed) for f in names}
  stack = gtx.TableStack(specs)
  tx = gtx.adagrad(0.05)

  def logits(p, ids, vocab=None):
    x = stack.lookup(p["emb"], ids, output="concat", vocab=vocab)
    x = x.reshape(x.shape[0], len(names), dim)
    w = p["w"][np.array([names.index(f) for f in stack.concat_order(ids)])]
    return jnp.sum(x * w, axis=(1, 2)) + p["b"]

  def loss(p, ids, y):
    return bce(logits(p, ids), y)

  params = {
    "emb": stack.init(jax.random.key(0)),
    "w": jnp.full((len(names), dim), 0.1, jnp.float32),
    "b": jnp.zeros((), jnp.float32),
  }
  state = tx.init(params)

  def to_rows(ids):
    if kind == "mod":
      return {f: ids[f] % rows[f] for f in names}
    if kind == "exact":
      out = {}
      for f in names:
        at = np.minimum(np.searchsorted(seen[f], ids[f]), len(seen[f]) - 1)
        out[f] = np.where(seen[f][at] == ids[f], at, -1).astype(np.int32)
      return out
    return ids

  whole = hashed_step(stack, tx, loss, kind == "map")
  step = jax.jit(lambda *a: whole(*a)[:-1])  # the loss unused: not computed
  if kind == "map":
    vocab = stack.init_vocab(jax.random.key(1))
    for ids, y, _ in train:
      params, state, vocab = step(params, state, vocab, ids, y)
    test = jax.jit(lambda p, v, ids: logits(p, ids, vocab=v))
    z = test(params, vocab, test_ids)
  else:
    for ids, y, _ in train:
      params, state = step(params, state, to_rows(ids), y)
    z = jax.jit(logits)(params, to_rows(test_ids))
  z = np.asarray(z, np.float64)
  return float(np.mean(np.logaddexp(0, z) - test_y * z))


def main(argv=None):
  p = parser(__doc__.split("\n")[0], schedule=Schedule(8, 3, 1))
  p.add_argument("--batch", type=int, default=2048)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--zipf", type=float, default=1.2)
  p.add_argument("--batches", type=int, default=16)
  p.add_argument("--fill", type=int, default=20)
  p.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.5, 1.0])
  p.add_argument("--q-features", type=int, default=4)
  p.add_argument("--q-batch", type=int, default=1024)
  p.add_argument("--q-steps", type=int, default=400)
  p.add_argument("--q-test", type=int, default=50_000)
  p.add_argument("--q-zipf", type=float, default=1.3)
  p.add_argument("--q-capacity", type=float, default=0.25)
  p.add_argument("--only", choices=["cost", "quality", "parts"], default=None)
  quick = dict(batch=256, batches=4, fill=3, rounds=2, fractions=[0.5])
  args = parse(p, argv, quick=dict(quick, q_steps=20, q_test=2000))
  if args.only in (None, "cost"):
    cost(args)
  if args.only in (None, "quality"):
    quality(args)
  if args.only in (None, "parts"):
    parts(args)


if __name__ == "__main__":
  main()
