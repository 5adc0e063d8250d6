"""Word embeddings of Python's own source code, trained with gradtx.

The corpus is the Python standard library on this machine, tokenized with
the ``tokenize`` module; the model is skip-gram with negative sampling
(word2vec). Every step uses gradtx end to end:

* ``gtx.sparse_value_and_grad``: the model reads its two embedding tables
  as plain ``table[ids]`` (no change for gradtx), and both get
  ``SparseRows`` gradients, never a dense ``[vocab, dim]`` buffer
  (``require_sparse`` makes that a guarantee, ``gtx.sparsity_report``
  prints it);
* ``gtx.Mirrored``: the step runs on every (fake CPU) device with
  replicated params, ``gtx.all_reduce`` all-gathers the sparse gradients;
* ``gtx.accumulate``: the optimizer is applied once every ``--accumulate``
  micro-steps, with sparse buffers;
* ``gtx.lazy_adam``: only the touched rows are updated (``--catch-up``
  switches on the exact catch-up mode).

Run ``make demo`` (or ``python -m examples.demo --help``).
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import sys
import sysconfig
import time
import tokenize
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=1000, help="micro-steps")
  p.add_argument(
    "--batch",
    type=int,
    default=1024,
    help="center words per micro-step (all devices)",
  )
  p.add_argument("--dim", type=int, default=64, help="embedding size")
  p.add_argument(
    "--devices", type=int, default=8, help="fake CPU devices to mirror over"
  )
  p.add_argument(
    "--accumulate", type=int, default=2, help="micro-steps per optimizer update"
  )
  p.add_argument("--negatives", type=int, default=5)
  p.add_argument("--window", type=int, default=4)
  p.add_argument("--vocab", type=int, default=50_000)
  p.add_argument(
    "--max-tokens",
    type=int,
    default=2_000_000,
    help="stop reading the stdlib after this many tokens",
  )
  p.add_argument("--lr", type=float, default=0.02)
  p.add_argument(
    "--catch-up", action="store_true", help="lazy_adam(catch_up=True)"
  )
  p.add_argument("--out", default="demo_out", help="folder for the plot")
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args(argv)


# ----------------------------------------------------------------------------
# corpus


def stdlib_tokens(max_tokens: int) -> list[str]:
  """Tokens of the standard library's .py files, in a fixed file order.

  Names, operators, keywords and numbers are kept as they are; string
  literals become ``<str>``; comments and layout tokens are dropped.
  """
  root = Path(sysconfig.get_paths()["stdlib"])
  skip = {"site-packages"}
  files = sorted(
    p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts)
  )
  keep = {tokenize.NAME, tokenize.OP, tokenize.NUMBER}
  out: list[str] = []
  for path in files:
    try:
      src = path.read_text(encoding="utf-8")
      toks = tokenize.generate_tokens(io.StringIO(src).readline)
      for tok in toks:
        if tok.type in keep:
          out.append(tok.string)
        elif tok.type == tokenize.STRING:
          out.append("<str>")
    except (SyntaxError, UnicodeDecodeError, tokenize.TokenError):
      continue
    if len(out) >= max_tokens:
      break
  return out[:max_tokens]


def build_vocab(tokens: list[str], size: int):
  counts = collections.Counter(tokens)
  words = ["<unk>"] + [w for w, _ in counts.most_common(size - 1)]
  index = {w: i for i, w in enumerate(words)}
  freq = [0] * len(words)
  for w, c in counts.items():
    freq[index.get(w, 0)] += c
  return words, index, freq


# ----------------------------------------------------------------------------
# training


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + f" --xla_force_host_platform_device_count={args.devices}"
  )
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from tqdm import tqdm

  import gradtx as gtx

  t0 = time.perf_counter()
  tokens = stdlib_tokens(args.max_tokens)
  words, index, freq = build_vocab(tokens, args.vocab)
  stream = np.asarray([index.get(t, 0) for t in tokens], np.int32)
  vocab = len(words)
  print(
    f"corpus: {len(tokens):,} tokens of the Python {sys.version.split()[0]} "
    f"standard library, vocabulary {vocab:,} (rest -> <unk>), "
    f"read in {time.perf_counter() - t0:.1f}s"
  )

  mirrored = gtx.Mirrored(jax.devices()[: args.devices])
  replicas = mirrored.num_replicas
  if args.batch % replicas:
    raise SystemExit(f"--batch {args.batch} must divide by {replicas} devices")
  per_replica = args.batch // replicas
  neg = args.negatives
  rng = np.random.RandomState(args.seed)
  params = {
    "center": jnp.asarray(
      rng.uniform(-0.5, 0.5, (vocab, args.dim)) / args.dim, jnp.float32
    ),
    "context": jnp.zeros((vocab, args.dim), jnp.float32),
  }
  # After the all-gather one gradient carries every replica's rows.
  rows = {
    "center": replicas * per_replica,
    "context": replicas * per_replica * (1 + neg),
  }
  tx = optax.chain(
    gtx.all_reduce(mirrored.axis_name),
    gtx.accumulate(
      gtx.lazy_adam(args.lr, catch_up=args.catch_up),
      args.accumulate,
      rows_per_step=rows,
    ),
  )
  opt_state = tx.init(params)

  def loss_fn(p, batch):
    center = p["center"][batch["center"]]  # [b, d]
    others = p["context"][batch["others"]]  # [b, 1 + neg, d]
    logits = jnp.einsum("bd,bkd->bk", center, others)
    sign = jnp.concatenate([jnp.ones((1,)), -jnp.ones((neg,))])[None, :]
    return -jnp.mean(jnp.sum(jax.nn.log_sigmoid(sign * logits), axis=-1))

  # Raise, rather than fall back to a dense gradient, if a table is not
  # read as whole rows only.
  grad_fn = gtx.sparse_value_and_grad(
    loss_fn, require_sparse=("['center']", "['context']")
  )

  def train_step(p, s, batch):
    loss, grads = grad_fn(p, batch)
    updates, s = tx.update(grads, s, p)
    return (
      gtx.apply_updates(p, updates),
      s,
      mirrored.reduce_in_step(loss, "mean"),
    )

  step = mirrored.step(train_step, donate_argnums=(0, 1))
  params = mirrored.replicate(params)
  opt_state = mirrored.replicate(opt_state)

  noise = np.cumsum(np.asarray(freq, np.float64) ** 0.75)
  noise /= noise[-1]  # unigram^0.75 CDF, sampled by inversion
  offsets = np.concatenate(
    [np.arange(-args.window, 0), np.arange(1, args.window + 1)]
  )

  def sample_batch():
    pos = rng.randint(args.window, len(stream) - args.window, args.batch)
    ctx = stream[pos + rng.choice(offsets, args.batch)]
    negs = np.searchsorted(noise, rng.random_sample((args.batch, neg)))
    negs = np.minimum(negs, vocab - 1)
    return {
      "center": stream[pos],
      "others": np.concatenate([ctx[:, None], negs], axis=1).astype(np.int32),
    }

  print("\ngradients (gtx.sparsity_report):")
  ids = {
    "center": np.zeros(args.batch, np.int32),
    "others": np.zeros((args.batch, 1 + neg), np.int32),
  }
  print(gtx.sparsity_report(loss_fn)(params, ids))  # traces, runs nothing
  losses = []
  bar = tqdm(range(args.steps), desc="skip-gram", unit="step")
  start = time.perf_counter()
  for i in bar:
    batch = mirrored.shard_batch(sample_batch())
    params, opt_state, loss = step(params, opt_state, batch)
    if i % 20 == 0 or i == args.steps - 1:
      losses.append((i, float(loss)))
      rate = (i + 1) * args.batch / (time.perf_counter() - start)
      bar.set_postfix(loss=f"{losses[-1][1]:.3f}", tokens_s=f"{rate:,.0f}")
  elapsed = time.perf_counter() - start

  acc = opt_state[1]
  summary = [
    ("loss at start", f"{losses[0][1]:.4f}"),
    ("loss at end", f"{losses[-1][1]:.4f}"),
    ("micro-steps", f"{args.steps}"),
    ("optimizer updates", f"{int(acc.num_updates)}"),
    ("micro-gradients accumulated", f"{int(acc.num_micro_steps)}"),
    ("devices (mirrored)", f"{replicas}"),
    ("center tokens/s", f"{args.steps * args.batch / elapsed:,.0f}"),
    ("lazy_adam catch_up", f"{args.catch_up}"),
    ("wall time", f"{elapsed:.1f}s"),
  ]
  print("\n| metric | value |\n|---|---|")
  for k, v in summary:
    print(f"| {k} | {v} |")

  emb = np.asarray(params["center"])
  emb = emb / (np.linalg.norm(emb, axis=1, keepdims=True) + 1e-9)
  print("\nnearest neighbours by cosine similarity:")
  for word in ["append", "self", "True", "None", "return", "len"]:
    if word not in index:
      continue
    sims = emb @ emb[index[word]]
    best = [words[j] for j in np.argsort(-sims)[1:9]]
    print(f"  {word:>8}: {' '.join(best)}")

  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.plot(*zip(*losses, strict=True))
  ax.set_xlabel("micro-step")
  ax.set_ylabel("skip-gram loss")
  ax.set_title(
    f"gradtx demo: {replicas} devices, lazy_adam, k={args.accumulate}"
  )
  fig.tight_layout()
  fig.savefig(out / "loss.png", dpi=120)
  print(f"\nloss curve written to {out / 'loss.png'}")


if __name__ == "__main__":
  main()
