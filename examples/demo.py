"""A short run of what gradtx has so far: sparse gradients + sparse SGD."""

import time

import jax
import jax.numpy as jnp
import numpy as np

import gradtx as gtx


def main() -> None:
  rng = np.random.RandomState(0)
  num_rows, dim, batch = 10_000, 16, 256
  target = jnp.asarray(rng.normal(size=(num_rows, dim)), jnp.float32)
  params = {"emb": jnp.zeros((num_rows, dim)), "scale": jnp.ones([])}
  tx = gtx.scale_by_learning_rate(0.5)
  state = tx.init(params)

  def loss(p, ids):
    pred = gtx.lookup(p["emb"], ids) * p["scale"]
    return jnp.mean(jnp.sum((pred - target[ids]) ** 2, axis=-1))

  @jax.jit
  def step(p, s, ids):
    value, grads = gtx.sparse_value_and_grad(loss)(p, ids)
    updates, s = tx.update(grads, s, p)
    return gtx.apply_updates(p, updates), s, value

  t0 = time.perf_counter()
  for i in range(300):
    ids = jnp.asarray(rng.randint(0, 1000, size=batch))
    params, state, value = step(params, state, ids)
    if i % 100 == 0:
      print(f"step {i:4d} loss {float(value):.4f}")
  print(f"final loss {float(value):.4f} in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
  main()
