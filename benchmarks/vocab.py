"""Open vocabularies: what the id map of hashed tables costs inside the whole
training step (``cost``, at ``--fractions`` of the distinct ids, and
``parts``, its pieces timed alone), and what it buys over the hashing trick
(``quality``: held-out log loss on a long-tail CTR task). The results'
notes say what each measures.

  python -m benchmarks.vocab [--quick] [--only cost|quality|parts]
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx
from benchmarks import models
from benchmarks._common import parse, parser
from benchmarks._results import columns, write_results
from benchmarks._timing import Schedule

SEED = 0
OPTIMIZERS = {
  "rowwise_adagrad": lambda: gtx.rowwise_adagrad(1e-2),
  "lazy_adam": lambda: gtx.lazy_adam(1e-3),
}


def _loop(jitted, box, feeds, nested=False):
  """A call without arguments: ``jitted(*box, *feed)`` on the next feed,
  the carried state it returns (donated) kept in ``box``: every output but
  the last, or (``nested``) the first of two."""
  count = itertools.count()

  def run():
    out = jitted(*box, *feeds[next(count) % len(feeds)])
    box[:], last = out if nested else (out[:-1], out[-1])
    jax.block_until_ready((box, last))

  return run


def _pieces(stack, tx):
  """The hashed step's pieces, jitted, the state they carry donated:
  ``stack.admit`` alone (the fresh rows' values an output too) and
  ``admit`` + ``gtx.reset_rows``; each ``(fn, which of params, state and
  map it carries)``."""

  def admit(vocab, ids):
    _, vocab, fresh = stack.admit(vocab, ids)
    return (vocab,), fresh

  def admit_reset(params, state, vocab, ids):
    ids, vocab, fresh = stack.admit(vocab, ids)
    params, state = gtx.reset_rows(tx, state, params, {"emb": fresh})
    return (params, state, vocab), None

  return {
    "admit alone": (jax.jit(admit, donate_argnums=(0,)), slice(2, 3)),
    "admit + reset_rows": (
      jax.jit(admit_reset, donate_argnums=(0, 1, 2)),
      slice(0, 3),
    ),
  }


def _time(args, data, rows, make_tx, parts=False):
  """The in-range and the hashed step (with ``parts``, the hashed step's
  pieces too), timed interleaved: system -> seconds."""
  names, raw, labels, _ = data
  ys = [jnp.asarray(y) for y in labels]
  fns = {}
  for system in ("in range", "map"):
    hashed = system == "map"
    tx = make_tx()
    stack, params, jitted = models.hashed_criteo(
      names, rows, args.dim, tx, hashed
    )
    box = [params, tx.init(params)]
    if hashed:
      box.append(stack.init_vocab(jax.random.key(1)))
    ids = [
      {n: jnp.asarray(b[n] if hashed else b[n] % rows[n]) for n in names}
      for b in raw
    ]
    fns[system] = _loop(jitted, box, list(zip(ids, ys, strict=True)))
    for _ in range(args.fill if hashed else 2):
      fns[system]()
    pieces = _pieces(stack, tx) if hashed and parts else {}
    for name, (fn, carried) in pieces.items():
      # each on its own copy of the filled state
      state = jax.tree.map(jnp.copy, box[carried])
      fns[name] = _loop(fn, state, [(i,) for i in ids], nested=True)
      fns[name]()
  return Schedule.from_args(args).time(fns, warmup=1)


PARTS = ("in range", "admit alone", "admit + reset_rows", "map")


def timed(args, data, parts=False):
  """``cost`` (at each of ``--fractions``) or ``parts`` (at capacity 100%):
  the steps of each capacity and optimizer timed interleaved, written."""
  names, _, _, distinct = data
  table, runs = [], []
  for frac in [1.0] if parts else args.fractions:
    rows = {n: max(64, int(np.ceil(frac * distinct[n]))) for n in names}
    for opt_name, make in OPTIMIZERS.items():
      t = _time(args, data, rows, make, parts)
      if parts:
        table += [
          [opt_name, k, t[k] * 1e3, t[k] / t["in range"]] for k in PARTS
        ]
        runs.append({"optimizer": opt_name, **t})
        continue
      cells = [t["in range"] * 1e3, t["map"] * 1e3, t["map"] / t["in range"]]
      table.append(
        [f"{int(frac * 100)}%", opt_name, sum(rows.values()), *cells]
      )
      runs.append({"fraction": frac, "optimizer": opt_name, **t})
  what = f"batch {args.batch}, dim {args.dim}, Zipf({args.zipf}) raw ids"
  if parts:
    write_results(
      "vocab_parts",
      "Where the id map's time goes in the hashed step (26 hashed Criteo "
      f"features, {what}, capacity 100% of the distinct ids)",
      columns("optimizer | part | ms | / in-range step"),
      table,
      notes=(
        "Interleaved rounds, one process. `in range`: the step on ids "
        "mapped in numpy; `map`: the whole hashed step (`stack.admit` + "
        "`gtx.reset_rows` + loss, gradient and update). The pieces run "
        "jitted alone on copies of the filled map, params and state."
      ),
      extra={"runs": runs},
    )
    return
  write_results(
    "vocab",
    "Hashed tables: the id map inside the whole step (26 Criteo features, "
    f"{what} over 10^9 values)",
    columns(
      "capacity / distinct ids | optimizer | rows (all tables) | ids in "
      "range ms | id map ms | map / in range"
    ),
    table,
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
    extra={"distinct": distinct, "runs": runs},
  )


# ----------------------------------------------------------------------------
# quality against the hashing trick


def _effect(raw, t):
  """A fixed N(0, 1) effect per raw id (Box-Muller on a hash of it)."""
  x = raw.astype(np.uint64) * np.uint64(0x9E3779B1) + np.uint64(t)
  u1 = ((x % np.uint64(2**31)).astype(np.float64) + 0.5) / 2**31
  u2 = ((x // np.uint64(2**31)) % np.uint64(2**20)).astype(np.float64) / 2**20
  return np.sqrt(-2 * np.log(u1)) * np.cos(2 * np.pi * u2)


def quality(args):
  nf, dim, batch = args.q_features, 8, args.q_batch
  names = [f"f{t}" for t in range(nf)]
  rng = np.random.default_rng(SEED + 7)

  def sample(n):
    ids = {
      f: models.zipf_raw(rng, n, args.q_zipf, 1000 + t)
      for t, f in enumerate(names)
    }
    logit = sum(_effect(ids[f], t) for t, f in enumerate(names)) - 1.5
    y = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return ids, y, logit

  train = [sample(batch) for _ in range(args.q_steps)]
  test_ids, test_y, test_logit = sample(args.q_test)
  seen = {f: np.unique(np.concatenate([b[0][f] for b in train])) for f in names}
  cap = {f: max(16, int(args.q_capacity * len(seen[f]))) for f in names}
  row_bytes = dim * 4 * 2  # the row and Adagrad's accumulator
  same_bytes = {f: int(cap[f] * (row_bytes + 24) / row_bytes) for f in names}
  bayes = float(np.mean(np.logaddexp(0, test_logit) - test_y * test_logit))
  results = []
  systems = {
    "id map, LRU": ("map", cap, gtx.Hashed()),
    "id map, LRU, admit at 2nd read": ("map", cap, gtx.Hashed(min_count=2)),
    "modulo, same rows": ("mod", cap, None),
    "modulo, same bytes": ("mod", same_bytes, None),
    "unbounded table": ("exact", {f: len(seen[f]) for f in names}, None),
  }
  for label, (kind, rows, hashed) in systems.items():
    loss_v = _train_eval(kind, rows, hashed, dim, train, test_ids, test_y, seen)
    results.append([label, sum(rows.values()), loss_v, loss_v - bayes])
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
      f"stream per table ({sum(len(v) for v in seen.values()):,} "
      "distinct ids in all); `same bytes`: the map's 24 bytes a row given "
      f"to the modulo table as rows of {row_bytes} bytes (row + Adagrad "
      f"state). Bayes: the log loss of the true probabilities, {bayes:.4f}. "
      f"{args.q_test:,} held-out examples; gtx.adagrad(0.05)."
    ),
  )


def _train_eval(kind, rows, hashed, dim, train, test_ids, test_y, seen):
  """Held-out log loss after training on ``train``: ``kind`` ``map`` (the
  id map), ``mod`` (raw id modulo the rows) or ``exact`` (a row for every
  id ``seen``, -1 for the others)."""
  names = list(seen)
  stack = gtx.TableStack(
    {f: gtx.TableSpec(rows[f], dim, hashed=hashed) for f in names}
  )
  tx = gtx.adagrad(0.05)

  def logits(p, ids, vocab=None):
    x = stack.lookup(p["emb"], ids, output="concat", vocab=vocab)
    x = x.reshape(x.shape[0], len(names), dim)
    w = p["w"][np.array([names.index(f) for f in stack.concat_order(ids)])]
    return jnp.sum(x * w, axis=(1, 2)) + p["b"]

  def to_rows(ids):
    if kind == "mod":
      return {f: ids[f] % rows[f] for f in names}
    if kind == "map":
      return ids
    at = {
      f: np.minimum(np.searchsorted(seen[f], ids[f]), len(seen[f]) - 1)
      for f in names
    }
    return {
      f: np.where(seen[f][at[f]] == ids[f], at[f], -1).astype(np.int32)
      for f in names
    }

  params = {
    "emb": stack.init(jax.random.key(0)),
    "w": jnp.full((len(names), dim), 0.1, jnp.float32),
    "b": jnp.zeros((), jnp.float32),
  }
  box = [params, tx.init(params)]
  hashed = kind == "map"
  whole = models.hashed_step(
    stack, tx, lambda p, i, y: models.bce(logits(p, i), y), hashed
  )
  step = jax.jit(lambda *a: whole(*a)[:-1])  # the loss unused: not computed
  if hashed:
    box.append(stack.init_vocab(jax.random.key(1)))
  for ids, y, _ in train:
    box[:] = step(*box, to_rows(ids), y)
  test = jax.jit(lambda p, *v, ids: logits(p, ids, *v))
  z = np.asarray(test(box[0], *box[2:], ids=to_rows(test_ids)), np.float64)
  return float(np.mean(np.logaddexp(0, z) - test_y * z))


def main(argv=None):
  p = parser(__doc__.split("\n")[0], schedule=Schedule(8, 3, 1))
  for flag, kind, default in [
    ("--batch", int, 2048),
    ("--dim", int, 64),
    ("--zipf", float, 1.2),
    ("--batches", int, 16),
    ("--fill", int, 20),
    ("--q-features", int, 4),
    ("--q-batch", int, 1024),
    ("--q-steps", int, 400),
    ("--q-test", int, 50_000),
    ("--q-zipf", float, 1.3),
    ("--q-capacity", float, 0.25),
  ]:
    p.add_argument(flag, type=kind, default=default)
  p.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.5, 1.0])
  p.add_argument("--only", choices=["cost", "quality", "parts"], default=None)
  quick = dict(batch=256, batches=4, fill=3, rounds=2, fractions=[0.5])
  args = parse(p, argv, quick=dict(quick, q_steps=20, q_test=2000))
  if args.only in (None, "cost", "parts"):
    data = models.criteo_raw(args.batch, args.batches, args.zipf, SEED)
  if args.only in (None, "cost"):
    timed(args, data)
  if args.only in (None, "quality"):
    quality(args)
  if args.only in (None, "parts"):
    timed(args, data, parts=True)


if __name__ == "__main__":
  main()
