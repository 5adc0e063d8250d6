"""The two models of ``benchmarks.convergence``, on real data.

The Python standard library's source, tokenized as ``examples/demo.py``
does it, split by file (:func:`load_corpus`), and the tasks trained on it:
:func:`skipgram_task` (word2vec with negative sampling, two tables) and
:func:`lm_task` (a next-token model over the 4 previous tokens' rows).
"""

from __future__ import annotations

import io
import sysconfig
import tokenize
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from examples.demo import build_vocab

DIM = 64
SEED = 0
HELD_OUT_EVERY = 10  # every 10th file (sorted order) is held out


def stdlib_files(max_tokens: int) -> list[list[str]]:
  """The standard library's tokens as ``examples.demo.stdlib_tokens`` has
  them (strings as ``<str>``), one list per file in sorted order, up to
  ``max_tokens`` in all."""
  root = Path(sysconfig.get_paths()["stdlib"])
  keep = {tokenize.NAME, tokenize.OP, tokenize.NUMBER}
  out: list[list[str]] = []
  total = 0
  for path in sorted(root.rglob("*.py")):
    if "site-packages" in path.relative_to(root).parts:
      continue
    toks: list[str] = []
    try:
      src = path.read_text(encoding="utf-8")
      for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type in keep:
          toks.append(tok.string)
        elif tok.type == tokenize.STRING:
          toks.append("<str>")
    except (SyntaxError, UnicodeDecodeError, tokenize.TokenError):
      continue
    if toks:
      out.append(toks[: max_tokens - total])
      total += len(out[-1])
    if total >= max_tokens:
      break
  return out


class Corpus(NamedTuple):
  train: list[str]  # tokens of the training files, concatenated
  held_out: list[str]  # tokens of the held-out files, concatenated
  files: int


def load_corpus(max_tokens: int) -> Corpus:
  files = stdlib_files(max_tokens)
  train, held = [], []
  for i, toks in enumerate(files):
    (held if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).extend(toks)
  return Corpus(train, held, len(files))


def encoded(corpus: Corpus, vocab: int) -> tuple[int, list, Any, Any]:
  """The training files' vocabulary (at most ``vocab`` words): its size,
  the words' counts, and the training and held-out streams as ids."""
  words, index, freq = build_vocab(corpus.train, vocab)

  def encode(tokens: list[str]) -> np.ndarray:
    return np.asarray([index.get(t, 0) for t in tokens], np.int32)

  return len(words), freq, encode(corpus.train), encode(corpus.held_out)


class Task(NamedTuple):
  name: str
  params: dict[str, np.ndarray]  # float32 init
  tables: tuple[str, ...]  # the embedding tables (bf16 in bf16 configs)
  loss: Callable[[Any, Any], jax.Array]
  sample: Callable[[np.random.RandomState], dict[str, np.ndarray]]
  eval_batches: list[dict[str, np.ndarray]]
  vocab: int
  batch: int
  tokens: tuple[int, int]  # training, held-out tokens


def _task(name, tables, params, loss, sample, streams, batch) -> Task:
  """A :class:`Task`, its params as float32; ``streams``: the vocabulary's
  size, the token streams, and the seed, examples and batch size of the
  held-out batches."""
  vocab, train, held, seed, examples, size = streams
  params = {k: v.astype(np.float32) for k, v in params.items()}
  rng = np.random.RandomState(seed)
  evals = [sample(rng, held, size) for _ in range(max(1, examples // size))]
  tokens = len(train), len(held)
  return Task(name, params, tables, loss, sample, evals, vocab, batch, tokens)


def skipgram_task(corpus: Corpus, vocab: int, batch: int, eval_pairs: int):
  negatives, window = 5, 4
  vocab, freq, train, held = encoded(corpus, vocab)
  noise = np.cumsum(np.asarray(freq, np.float64) ** 0.75)
  noise /= noise[-1]  # unigram^0.75 CDF of the training files
  offsets = np.concatenate([np.arange(-window, 0), np.arange(1, window + 1)])

  def sample(rng, stream=train, n=batch):
    pos = rng.randint(window, len(stream) - window, n)
    ctx = stream[pos + rng.choice(offsets, n)]
    negs = np.searchsorted(noise, rng.random_sample((n, negatives)))
    negs = np.minimum(negs, vocab - 1)
    others = np.concatenate([ctx[:, None], negs], axis=1)
    return {"center": stream[pos], "others": others.astype(np.int32)}

  def loss(p, b):
    center = p["center"][b["center"]].astype(jnp.float32)  # [b, d]
    others = p["context"][b["others"]].astype(jnp.float32)  # [b, 1+neg, d]
    logits = jnp.einsum("bd,bkd->bk", center, others)
    sign = jnp.concatenate([jnp.ones((1,)), -jnp.ones((negatives,))])
    return -jnp.mean(jnp.sum(jax.nn.log_sigmoid(sign * logits), axis=-1))

  init = np.random.RandomState(SEED)
  params = {
    "center": init.uniform(-0.5, 0.5, (vocab, DIM)) / DIM,
    "context": np.zeros((vocab, DIM)),
  }
  streams = vocab, train, held, SEED + 1, eval_pairs, 4096
  tables = ("center", "context")
  return _task("skip-gram", tables, params, loss, sample, streams, batch)


def lm_task(corpus: Corpus, vocab: int, batch: int, eval_positions: int):
  context, hidden = 4, 64
  vocab, _, train, held = encoded(corpus, vocab)
  window = np.arange(-context, 0)

  def sample(rng, stream=train, n=batch):
    pos = rng.randint(context, len(stream), n)
    return {"context": stream[pos[:, None] + window], "target": stream[pos]}

  def loss(p, b):
    x = p["emb"][b["context"]].astype(jnp.float32)  # [b, context, d]
    h = jnp.tanh(x.reshape(x.shape[0], -1) @ p["w"] + p["b"])
    logits = h @ p["w_out"] + p["b_out"]  # [b, vocab]
    target = jnp.take_along_axis(logits, b["target"][:, None], axis=1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(logits, axis=1) - target)

  init = np.random.RandomState(SEED)
  params = {
    "emb": init.normal(0, 0.1, (vocab, DIM)),
    "w": init.normal(0, 1, (context * DIM, hidden)) / np.sqrt(context * DIM),
    "b": np.zeros(hidden),
    "w_out": init.normal(0, 1, (hidden, vocab)) * 0.01,
    "b_out": np.zeros(vocab),
  }
  streams = vocab, train, held, SEED + 2, eval_positions, 2048
  return _task("next-token LM", ("emb",), params, loss, sample, streams, batch)
