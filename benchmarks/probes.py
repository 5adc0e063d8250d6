"""The design probes, each a measurement behind one choice in gradtx, as
data (:data:`PROBES`) run by one runner into ``results/<NAME>``; jax is
imported as a probe runs (``fbgemm_anchor`` runs without it).

  python -m benchmarks.probes NAME [--quick] [flags]   (NAME --help: its own)
"""

from __future__ import annotations

import functools
import gc
import itertools
import json
import os
import subprocess
import sys
from typing import Any, NamedTuple

from benchmarks import _common as bench
from benchmarks._results import columns, write_results
from benchmarks._timing import Clock, Counter, Schedule, once, step_runner
from benchmarks._timing import warm_copy_bandwidth as copy_bandwidth


class Probe(NamedTuple):
  """``measure(args, sched, facts)`` times the systems, returns the rows
  (None: skipped); the texts are formatted with the args and the ``facts``
  it adds (``extra``: json). No flags: ``measure()``: table_variants' cases."""

  doc: str  # --help: what it measures; what it decides
  measure: Any
  title: str
  columns: str
  notes: str = ""
  flags: dict[str, Any] | None = None  # --flag: default, or add_argument's
  quick: dict[str, Any] | None = None  # --quick's sizes
  schedule: Schedule | None = None  # --rounds, --burst, --settle


def run(name: str, argv: list[str] | None = None) -> None:
  """Runs ``PROBES[name]`` on the command line ``argv``."""
  p = PROBES[name]
  if p.flags is None:
    head, cases = columns(p.columns), p.measure()
    return bench.table_variants(p.doc, argv, name, p.title, head, cases)
  parser = bench.parser(p.doc, schedule=p.schedule)
  for flag, v in p.flags.items():
    kw = v if isinstance(v, dict) else dict(type=type(v), default=v)
    if isinstance(v, list):
      kw = dict(type=type(v[0]), nargs="+", default=v)
    parser.add_argument("--" + flag.replace("_", "-"), **kw)
  args = bench.parse(parser, argv, quick=p.quick)
  get = functools.partial(getattr, args)
  sched = Schedule(get("rounds", 0), get("burst", 1), get("settle", 0))
  facts: dict[str, Any] = {"schedule": sched.describe()}
  rows = p.measure(args, sched, facts)
  if rows is not None:  # None: skipped
    fmt = {**vars(args), **facts}
    title, head, notes = (s.format(**fmt) for s in p[2:5])
    extra = facts.get("extra")
    write_results(name, title, columns(head), rows, notes=notes, extra=extra)


def main(argv: list[str] | None = None) -> None:
  argv = sys.argv[1:] if argv is None else list(argv)
  if not argv or argv[0] not in PROBES:
    usage = "usage: python -m benchmarks.probes NAME [--quick] [flags]; NAME: "
    raise SystemExit(usage + ", ".join(PROBES))
  run(argv[0], argv[1:])


def _jax() -> tuple:
  """jax, jax.numpy, numpy and gradtx, imported as a probe runs."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  return jax, jnp, np, __import__("gradtx")


def whole_step(tx: Any, loss: Any, reader: Any = None, **opts: Any) -> Any:
  """``sparse_value_and_grad(loss, **opts)``, ``tx``, apply: jitted and
  donated; ``reader``: the row engine's ``gather_rows`` while it traces."""
  jax, _, _, gtx = _jax()
  from gradtx import _rowio

  one = _rowio.gather_rows

  def step(p, s, ids):
    _rowio.gather_rows = reader or one  # read at trace time
    try:
      value, g = gtx.sparse_value_and_grad(loss, **opts)(p, ids)
      u, s = tx.update(g, s, p)
      return gtx.apply_updates(p, u), s, value
    finally:
      _rowio.gather_rows = one

  return jax.jit(step, donate_argnums=(0, 1))


def _loss(p: Any, ids: Any) -> Any:
  jnp, w = _jax()[1], p["w"] if "w" in p else 0.01
  return jnp.sum(jnp.tanh(p["emb"][ids]) * w)


def _lr_pass() -> dict:
  gtx = _jax()[3]
  pairs = {
    "lazy_adam": (gtx.lazy_adam(1e-3), gtx.scale_by_lazy_adam()),
    "rowwise_adagrad": (gtx.rowwise_adagrad(1e-2), gtx.scale_by_rowwise_rss()),
    "adagrad": (gtx.adagrad(1e-2), gtx.scale_by_rss()),
  }
  return {
    name: {
      "chain (rule + lr pass)": lambda c=chain: (c, bench.table_step(gtx, c)),
      "rule alone": lambda r=rule: (r, bench.table_step(gtx, r)),
    }
    for name, (chain, rule) in pairs.items()
  }


def _row_reader() -> dict:
  def fill(table, ids, *, unique=False, what=""):  # the engine's reader before
    return table.at[ids].get(mode="fill", fill_value=0, unique_indices=unique)

  def variant(opt, lr, reader):
    tx = getattr(_jax()[3], opt)(lr)
    return tx, whole_step(tx, _loss, reader)

  readers = {"fill gather": fill, "clamp + select (one reader)": None}
  return {
    o: {k: functools.partial(variant, o, lr, r) for k, r in readers.items()}
    for o, lr in (("lazy_adam", 1e-3), ("rowwise_adagrad", 1e-2))
  }


def _dense_threshold(args, sched, facts):
  _, jnp, np, gtx = _jax()
  rng, rows = np.random.RandomState(0), []
  for ratio in (0.05, 0.1, 0.25, 0.35, 0.5, 1.0, 2.0, 4.0, 8.0, 64.0, 2048.0):
    v, n, fns = max(1, int(round(args.reads / ratio))), args.reads, {}
    batches = [jnp.asarray(rng.randint(0, v, n), jnp.int32) for _ in range(8)]
    for kind, opt in (("sparse", "require_sparse"), ("dense", "dense")):
      emb = jnp.asarray(rng.normal(size=(v, args.dim)), jnp.float32)
      p = {"emb": emb, "w": jnp.ones(args.dim, jnp.float32)}
      tx = gtx.lazy_adam(1e-3)
      step = whole_step(tx, _loss, **{opt: "['emb']"})
      run = step_runner(step, [p, tx.init(p)], lambda k, b=batches: (b[k % 8],))
      fns[kind] = Counter(run)
    t = sched.time(fns, label=f"reads / V {ratio:g}")
    ms = [f"{t[k] * 1e3:.3f}" for k in ("sparse", "dense")]
    ms.append(f"{t['sparse'] / t['dense']:.2f}")
    picks = "dense" if ratio >= gtx._autodiff.DENSE_READS_PER_ROW else "sparse"
    rows.append([f"{v:,}", f"{ratio:g}", *ms, picks])
  return rows


def _low_precision(args, sched, facts):
  _, jnp, _, gtx = _jax()
  from benchmarks.models import one_table, one_table_step
  from benchmarks.twins import torch_table

  int8 = dict(mu_dtype="int8", nu_dtype="int8")
  f32 = dict(mu_dtype=jnp.float32, nu_dtype=jnp.float32)
  variants = {  # name -> (table dtype, state dtypes, stochastic rounding)
    "float32": (jnp.float32, {}, False),
    "bf16 nearest": (jnp.bfloat16, f32, False),
    "bf16 stochastic": (jnp.bfloat16, f32, True),
    "int8 m/v": (jnp.float32, int8, False),
    "bf16 stochastic + int8 m/v": (jnp.bfloat16, int8, True),
  }
  bandwidth = copy_bandwidth()
  facts["gbs"] = bandwidth / 1e9
  torch, rows = not args.no_torch and bench.available("torch"), []
  for dist in ("uniform", "zipf"):
    data = one_table(args.rows, args.dim, args.ids, dist, sched.steps)
    fns, per_row = {}, {}
    for name, (dt, kw, sr) in variants.items():
      tx = gtx.lazy_adam(1e-3, **kw)
      step = functools.partial(one_table_step, tx, data, lookup=True)
      run, box, _ = step(dtype=dt, stochastic=sr)
      gtx.use_huge_pages(box)
      fns[name] = Counter(run, 0)
      per_row[name] = gtx.bytes_per_row(tx, box[0])["['emb']"]
    if torch:
      fns["torch SparseAdam"] = Counter(torch_table("SparseAdam", data)[0])
      per_row["torch SparseAdam"] = 3 * args.dim * 4
    gc.collect()
    t = sched.time(fns, label=dist)
    touched = data.unique() * 2 / bandwidth * 1e3
    for k, s in t.items():
      rows.append([dist, k, f"{per_row[k]:.0f}", f"{s * 1e3:.2f}"])
      rows[-1] += [f"{s / t['float32']:.3f}", f"{touched * per_row[k]:.2f}"]
    del fns, data
    gc.collect()
  return rows


def _row_gather(args, sched, facts):
  jax, jnp, np, gtx = _jax()  # gradtx's host memory settings, as in a step

  def systems(table_np: Any) -> dict:  # name -> a read of the next batch
    table, shape = jax.device_put(table_np), (n, table_np.shape[1])
    ct = jax.device_put(np.ones(shape, np.float32))
    out = np.empty(shape, table_np.dtype)
    read = jax.jit(gtx.lookup)
    loss = jax.jit(lambda t, i: jnp.sum(gtx.lookup(t, i) * ct))
    np.take(table_np, ids_np[0], axis=0, out=out)  # fault the pages in
    calls = {
      "gtx.lookup": lambda k: read(table, ids[k]).block_until_ready(),
      "gtx.lookup in a loss": lambda k: loss(table, ids[k]).block_until_ready(),
      "numpy take": lambda k: np.take(table_np, ids_np[k], axis=0, out=out),
    }
    return {k: Counter(lambda i, f=f: f(i % 16), 0) for k, f in calls.items()}

  bandwidth = copy_bandwidth()
  per_call = facts["schedule"].replace("steps", "calls")
  facts.update(gbs=bandwidth / 1e9, schedule=per_call)
  rng, rows, n = np.random.default_rng(0), [], args.ids
  ids_np = [rng.integers(0, args.rows, n).astype(np.int32) for _ in range(16)]
  ids = [jax.device_put(i) for i in ids_np]
  for dim in args.dims:
    table = rng.standard_normal((args.rows, dim)).astype(np.float32)
    t = sched.time(systems(table), label=f"dim {dim}")
    floor = 2 * n * dim * 4 / bandwidth
    for k, s in t.items():
      rows.append([dim, k, f"{s * 1e3:.3f}", f"{s / t['numpy take']:.2f}x"])
      rows[-1].append(f"{s / floor:.2f}x")
    del table
  return rows


def programs(trips: int, chunk: int) -> dict:
  """name -> f(a, b, ia, ib) returning (a, b), a and b (m, v, p) triples."""
  import jax.numpy as jnp
  from jax import lax

  def trip(k, carry, ids):  # one chunk of an Adam-like row update
    m, v, p = carry
    i = lax.dynamic_slice(ids, (k * chunk,), (chunk,))
    g = jnp.sin(i.astype(jnp.float32))[:, None] * jnp.ones((1, m.shape[1]))
    mr, vr = m[i] * 0.9 + g, v[i] * 0.99 + g * g
    u, kw = -mr / (jnp.sqrt(vr) + 1e-8), dict(unique_indices=True)
    return m.at[i].set(mr, **kw), v.at[i].set(vr, **kw), p.at[i].add(u, **kw)

  def loop(c, ids):
    return lax.fori_loop(0, trips, lambda k, c: trip(k, c, ids), c)

  def unrolled(c, ids):
    for k in range(trips):
      c = trip(k, c, ids)
    return c

  def one_loop(a, b, ia, ib):
    def both(k, c):
      return trip(k, c[0], ia), trip(k, c[1], ib)

    return lax.fori_loop(0, trips, both, (a, b))

  def two(f):
    return lambda a, b, ia, ib: (f(a, ia), f(b, ib))

  return {
    "one table": lambda a, b, ia, ib: (loop(a, ia), b),
    "two tables, two loops": two(loop),
    "two tables, one loop": one_loop,
    "one table, unrolled": lambda a, b, ia, ib: (unrolled(a, ia), b),
    "two tables, unrolled": two(unrolled),
  }


def _cpu_overlap(args, sched, facts):
  import jax
  import jax.numpy as jnp
  import numpy as np

  facts["cores"] = len(os.sched_getaffinity(0))
  rng, fns, rows = np.random.default_rng(0), {}, []
  shape = (args.rows, args.dim)
  ia, ib = (rng.permutation(args.rows)[: args.ids] for _ in range(2))
  ia, ib = (jax.device_put(i.astype(np.int32)) for i in (ia, ib))
  for name, f in programs(args.ids // args.chunk, args.chunk).items():
    box = [tuple(jnp.zeros(shape) for _ in range(3)) for _ in range(2)]
    step = jax.jit(f, donate_argnums=(0, 1))
    fns[name] = Counter(step_runner(step, box, lambda k: (ia, ib)))
  t = sched.time(fns, label="overlap")
  for name, s in t.items():
    clock = Clock()  # cores busy: CPU time over the wall time of 20 calls
    for _ in range(20):
      fns[name]()
    busy = clock.cpu() / clock.wall()
    ref = t["one table, unrolled" if "unrolled" in name else "one table"]
    rows.append([name, f"{s * 1e3:.2f}", f"{s / ref:.2f}x", f"{busy:.2f}"])
  return rows


def _fbgemm_anchor(args, sched, facts):
  if not bench.fbgemm():
    print(
      "fbgemm_anchor: skipped (fbgemm_gpu or torch does not import). Install "
      "fbgemm-gpu-cpu with its matching torch in a separate environment "
      "(see `python -m benchmarks.probes fbgemm_anchor --help`); "
      "docs/benchmarks.md quotes earlier measured figures, labelled as such."
    )
    return None
  import numpy as np

  torch = bench.import_torch()
  rows, dim, n, steps = args.rows, args.dim, args.ids, args.rounds + 2
  rng, fns = np.random.default_rng(0), {}
  ids = [rng.integers(0, rows, n).astype(np.int64) for _ in range(steps)]
  ids = [torch.from_numpy(i) for i in ids]
  ct = torch.from_numpy(rng.standard_normal((n, dim)).astype(np.float32))
  for optim in ("EXACT_ADAGRAD", "EXACT_SGD", "EXACT_ROWWISE_ADAGRAD", "ADAM"):
    pool = "NONE" if optim in ("EXACT_ROWWISE_ADAGRAD", "ADAM") else "SUM"
    bags = "SUM bags of 1" if pool == "SUM" else "pooling NONE"
    name = f"FBGEMM {optim} ({bags})"
    try:
      run, *_ = bench.tbe_step(rows, dim, optim, pool, 1e-3, ids, ct)
      fns[name] = Counter(run, 0)
    except Exception as e:  # an optimizer this build refuses on CPU
      print(f"{name}: not available ({type(e).__name__}: {e})")
  emb = torch.nn.Embedding(rows, dim, sparse=True)
  opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-3)

  def torch_step(i):
    opt.zero_grad(set_to_none=True)
    loss = (torch.tanh(emb(ids[i % steps])) * ct).sum()
    loss.backward()
    opt.step()
    loss.item()

  ref = "torch nn.Embedding(sparse=True) + SparseAdam"
  fns[ref] = Counter(torch_step, 0)
  ms = {k: s * 1e3 for k, s in sched.time(fns).items()}
  facts.update(torch=bench.version("torch"), fbgemm=bench.version("fbgemm_gpu"))
  facts["extra"] = {"ms": ms, "table": {"rows": rows, "dim": dim, "ids": n}}
  return [[k, v, v / ms[ref]] for k, v in ms.items()]


def _eager_calls(args, sched, facts):
  jax, _, np, gtx = _jax()
  from gradtx._admission import _admit, new_id_bounds
  from gradtx._plan import feature_combiners
  from gradtx._pooled import _read

  forms = ("int32 jax", "int64 numpy")
  ways = ("outside jit", "op by op", "user's jax.jit")

  def systems(form: str) -> dict:  # (method, way) -> a call on ids as form
    pl, combiners = stack.plan, feature_combiners(stack.plan, None)
    wide = form == forms[1]
    jit_admit = jax.jit(stack.admit)
    jit_lookup = jax.jit(lambda p, i, v: stack.lookup(p, i, vocab=v))
    jit_stats = jax.jit(stack.vocab_stats)

    def words(i):  # a jitted step takes 64-bit ids as gtx.Words
      return {f: gtx.Words.of(x) for f, x in i.items()} if wide else i

    calls = {  # method -> its ways (op by op: its private body)
      "admit": (
        lambda i: stack.admit(vocab, i),
        lambda i: _admit(pl, vocab, i, None, new_id_bounds(pl, None, None)),
        lambda i: jit_admit(vocab, words(i)),
      ),
      "lookup": (
        lambda i: stack.lookup(params, i, vocab=vocab),
        lambda i: _read(pl, params, i, None, combiners, "dict", vocab, False),
        lambda i: jit_lookup(params, words(i), vocab),
      ),
      "vocab_stats": (  # takes no ids
        lambda i: stack.vocab_stats(vocab),
        lambda i: stack._vocab_stats(vocab),
        lambda i: jit_stats(vocab),
      ),
    }
    if wide:
      del calls["vocab_stats"]
    return {(m, w): f[j] for m, f in calls.items() for j, w in enumerate(ways)}

  names, rng = [f"f{t}" for t in range(args.features)], np.random.default_rng(0)
  specs = {n: gtx.TableSpec(args.rows, 16, hashed=gtx.Hashed()) for n in names}
  stack = gtx.TableStack(specs)
  vocab = stack.init_vocab(jax.random.key(1))
  params = stack.init(jax.random.key(0))
  draws = [
    {n: rng.integers(0, 10**6, args.batch) for n in names}
    for _ in range(args.rounds + 4)
  ]
  batches = {
    forms[0]: [
      {n: jax.device_put(x.astype(np.int32)) for n, x in d.items()}
      for d in draws
    ],
    forms[1]: [{n: x * 3_000_000_019 for n, x in d.items()} for d in draws],
  }
  first, fns, rows, ready = {}, {}, [], jax.block_until_ready
  for form, b in batches.items():
    for (method, way), fn in systems(form).items():
      key = f"{method}, {form}, {way}"
      first[key] = once(lambda fn=fn, b=b: ready(fn(b[0])))
      fns[key] = Counter(lambda k, fn=fn, b=b: ready(fn(b[k % len(b)])))
  t = sched.time(fns, warmup=1, label="eager calls")
  methods = ("admit", "lookup", "vocab_stats")
  for method, form, way in itertools.product(methods, forms, ways):
    if (key := f"{method}, {form}, {way}") in t:
      ours = t[f"{method}, {form}, {ways[0]}"]
      ids = "-" if method == "vocab_stats" else form
      rows.append([method, ids, way, f"{first[key]:.2f}"])
      rows[-1] += [f"{t[key] * 1e3:.2f}", f"{t[key] / ours:.2f}x"]
  return rows


def _bounds_check(args, sched, facts):
  jax, jnp, np, gtx = _jax()
  names, rng = [f"f{t}" for t in range(args.features)], np.random.default_rng(0)
  stack = gtx.TableStack({n: gtx.TableSpec(args.rows, 16) for n in names})
  tx, shape = gtx.lazy_adam(1e-3), (args.batch, args.bag)
  b = [
    {n: jnp.asarray(rng.integers(0, args.rows, shape)) for n in names}
    for _ in range(4)
  ]

  def runner(checked: bool) -> Counter:
    def loss(p, ids):
      emb = stack.lookup(p["emb"], ids, output="concat", bounds_check=checked)
      return jnp.mean((emb @ p["w"]) ** 2)

    emb = stack.init(jax.random.key(0))
    p = {"emb": emb, "w": jnp.ones((16 * args.features,), jnp.float32)}
    step, box = whole_step(tx, loss), [p, tx.init(p)]
    return Counter(step_runner(step, box, lambda k: (b[k % 4],)), 0)

  fns = {"off (default)": runner(False), "bounds_check=True": runner(True)}
  t = sched.time(fns, label="bounds check")
  base = t["off (default)"]
  return [[k, f"{v * 1e3:.2f}", f"{v / base:.2f}x"] for k, v in t.items()]


def _stack_init(args, sched, facts):
  git = ["git", "rev-parse", "--short", "HEAD"]
  now = subprocess.check_output(git, cwd=bench.ROOT, text=True).strip()
  facts.update(now=f"this checkout ({now}+)", then=f"before ({args.before})")
  rows, child = [], "from benchmarks.probes import first_init; first_init{!r}"
  cap_dim = (args.cap, args.dim)
  for kind, n in itertools.product(("criteo", "distinct"), args.tables):
    got = []
    for rev in ("HEAD+", args.before):
      cmd = [sys.executable, "-c", child.format((rev, kind, n, *cap_dim))]
      out = subprocess.check_output(cmd, cwd=bench.ROOT, text=True)
      got.append(json.loads(out.strip().splitlines()[-1]))
    a, b = (g["init"] for g in got)
    rows.append([kind, n, f"{got[-1]['rows']:,}", f"{a:.2f}", f"{b:.2f}"])
    rows[-1].append(f"{b / a:.1f}x")
    print(rows[-1], flush=True)
  return rows


def first_init(rev: str, kind: str, n: int, cap: int, dim: int) -> None:
  """A fresh process's first stack.init, gradtx at rev (HEAD+: this), JSON."""
  import jax

  from benchmarks.models import table_rows

  jax.config.update("jax_enable_compilation_cache", False)
  gtx = __import__("gradtx") if rev == "HEAD+" else bench.load_version(rev)
  distinct = [1000 + 7 * i for i in range(n)]
  sizes = table_rows(n, cap) if kind == "criteo" else distinct
  specs = {f"t{i}": gtx.TableSpec(r, dim) for i, r in enumerate(sizes)}
  stack, key = gtx.TableStack(specs), jax.random.key(0)
  jax.block_until_ready(jax.random.fold_in(key, 1))  # the backend up
  seconds = once(lambda: jax.block_until_ready(stack.init(key)))
  print(json.dumps({"init": seconds, "rows": sum(sizes)}))


WHOLE_STEP = ", whole step: {rows:,} x {dim} table, {ids:,} fresh uniform ids "
LOOPS = Schedule(rounds=10, burst=10, settle=2)

PROBES: dict[str, Probe] = {
  "lr_pass": Probe(
    "Is the learning rate's separate pass worth folding into the row rule?",
    _lr_pass,
    "The learning rate's pass" + WHOLE_STEP + "per step",
    "optimizer | variant | step ms | vs chain",
  ),
  "row_reader": Probe(
    "A/B of gradtx's one row reader (_rowio.gather_rows) on the whole step.",
    _row_reader,
    "One row reader" + WHOLE_STEP + "per step",
    "optimizer | engine reads | step ms | vs fill",
  ),
  "dense_threshold": Probe(
    "Where dense beats sparse: reads / V there sets DENSE_READS_PER_ROW.",
    _dense_threshold,
    "Sparse vs dense gradient, whole lazy_adam step, {reads:,} reads per "
    "step, {dim} wide",
    "rows V | reads / V | sparse ms | dense ms | sparse / dense | gtx picks",
    "{schedule}; both in one process, fresh uniform ids.",
    dict(reads=4096, dim=64),
    dict(reads=256, rounds=2, burst=2, settle=1),
    Schedule(),
  ),
  "low_precision": Probe(
    "Low-precision tables and 8-bit optimizer state: the whole step's time.",
    _low_precision,
    "Low precision, whole lazy-Adam step: {rows:,} x {dim} table, {ids:,} "
    "fresh ids per step",
    "ids | variant | B/row | step ms | vs float32 | floor ms",
    "{schedule}; all variants in one process; floor: touched rows x B/row, "
    "read and written, at {gbs:.1f} GB/s (copy into a touched buffer).",
    dict(rows=1_000_000, dim=64, ids=8192, no_torch=dict(action="store_true")),
    bench.QUICK_TABLE,
    Schedule(),
  ),
  "row_gather": Probe(
    "A row read alone: what the backend's gather costs against numpy's take.",
    _row_gather,
    "A row read alone: {rows:,} rows x D float32, {ids:,} fresh uniform ids "
    "a call",
    "D | read | ms | vs numpy take | vs floor",
    "{schedule}; all in one process. floor: the rows' bytes read and written "
    "at the warm copy bandwidth ({gbs:.1f} GB/s). numpy take: one thread, "
    "into a buffer written once before. `gtx.lookup in a loss`: `jnp.sum("
    "gtx.lookup(t, ids) * ct)` jitted, the forward of the single-table step.",
    dict(rows=1_000_000, ids=8192, dims=[16, 32, 64, 128]),
    dict(rows=5_000, ids=256, dims=[16], rounds=2),
    LOOPS,
  ),
  "cpu_overlap": Probe(
    "Does XLA:CPU run independent row updates side by side?\nA stack's "
    "lanes; pinned (taskset -c 0, GRADTX_BENCH_SUFFIX=_one_core): one core.",
    _cpu_overlap,
    "Independent row updates in one program: {ids:,} unique rows of a "
    "{rows:,} x {dim} table, {chunk:,} a trip",
    "program | ms | vs one table | cores busy",
    "{schedule}; all in one process, params and state donated. `vs one table`"
    ": against the one-table program of the same form (loop or unrolled); "
    "2.00x: the two tables' chains ran one after the other. `cores busy`: "
    "the process's CPU time over the wall time of 20 more calls (threads "
    "that wait by spinning count too). Cores this process may run on: {cores}.",
    dict(rows=400_000, dim=64, ids=16_384, chunk=2048),
    dict(rows=4_000, ids=256, chunk=64, rounds=2),
    LOOPS,
  ),
  "fbgemm_anchor": Probe(
    "FBGEMM anchor: TorchRec's fused embedding kernels on CPU, beside torch."
    "\nIts own venv: pip install fbgemm-gpu-cpu==1.9.0 torch==2.14.1 numpy",
    _fbgemm_anchor,
    "FBGEMM anchor: fused CPU embedding step vs torch SparseAdam",
    "system | ms/step | / torch SparseAdam",
    "{rows:,} x {dim} table, {ids:,} fresh uniform ids a step, loss `sum(tanh("
    "E[ids]) * ct)` returned; median of {rounds} round-robin steps. FBGEMM "
    "has no Adam on CPU. torch {torch}, fbgemm_gpu {fbgemm}, 2 threads.",
    dict(rows=1_000_000, dim=64, ids=8192, rounds=15),
    dict(rows=20_000, ids=512, rounds=3),
  ),
  "eager_calls": Probe(
    "A table stack's methods called outside jax.jit, as in a notebook.",
    _eager_calls,
    "A table stack's methods called outside jax.jit",
    "method | ids | called | first call s | later calls ms | vs outside jit",
    "{features} hashed tables of {rows:,} rows, 16 wide, {batch} raw ids a "
    "feature, new ids every call; `int64 numpy`: numpy's default integers, ids"
    " past 32 bits (x64 off), `gtx.Words` under the user's jax.jit. First "
    "call: its compiling included; later calls: median of {rounds} interleaved"
    " rounds. `op by op`: the method's body called eagerly, what the methods "
    "did before they compiled themselves outside jit (and, for numpy int64 "
    "ids, before they made them fit on the host).",
    dict(features=8, rows=10_000, batch=256, rounds=8),
    dict(features=2, rows=500, batch=32, rounds=2),
  ),
  "bounds_check": Probe(
    "What TableStack.lookup(..., bounds_check=True) costs a training step.",
    _bounds_check,
    "TableStack.lookup's bounds check in a training step",
    "lookup | step ms | vs off",
    "{features} plain tables of {rows:,} rows, 16 wide, [{batch}, {bag}] bags "
    "a feature, a jitted and donated step (lookup, linear head, sparse_value_"
    "and_grad, lazy_adam); median of {rounds} interleaved rounds. The check "
    "is a host callback over every id read, before the gather.",
    dict(features=8, rows=10_000, batch=1024, bag=4, rounds=15),
    dict(features=2, rows=500, batch=64, rounds=2),
  ),
  "stack_init": Probe(
    "TableStack.init's first call, by number of tables: now vs --before REV.",
    _stack_init,
    "TableStack.init, first call in a fresh process ({dim} wide), wall s "
    "including compiles",
    "tables' sizes | tables | rows | {now} | {then} | speed-up",
    "criteo: Criteo's 26 cardinalities capped at {cap:,} rows, repeated past "
    "26 (26 distinct shapes); distinct: 1000 + 7i rows, every table its own "
    "shape.",
    dict(before=dict(required=True), tables=[26, 104, 500], cap=20_000, dim=32),
    dict(tables=[4, 8], cap=2000),
  ),
}


if __name__ == "__main__":
  main()
