#!/usr/bin/env bash
# The GPU benchmark set, as one prepared script for a lent GPU machine.
# Needs a Python with gradtx's dependencies and a CUDA build of jaxlib
# (e.g. `pip install -e . "jax[cuda12]"`). Results go to
# benchmarks/results/*_gpu.{md,json} (and to $OUT when it is set).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
export GRADTX_BENCH_SUFFIX=_gpu
unset XLA_FLAGS JAX_PLATFORMS
$PY -c "import jax; print(jax.devices()); assert jax.default_backend() == 'gpu'"
nvidia-smi --query-gpu=name,memory.total --format=csv || true
# Lazy Adam at GPU scale (issue 3): 1e7 x 128 table, 65,536 ids per step.
timeout 300 $PY -m benchmarks.lazy_adam --rows 1000000 10000000 --dim 128 \
  --ids 65536
# The whole training step (issue 13) at the same scale: gtx lazy_adam and
# catch_up vs optax.adam (torch is CPU-only in the bench extra: skipped).
# jaxlib 0.10.2-0.11.0 emit a CAS loop for f32 scatter-add on GPUs
# (jax#38806, xla#46225): the dense baseline (duplicate ids, Zipf above all)
# pays it; gtx coalesces first and scatters unique rows.
timeout 420 $PY -m benchmarks.train_step --rows 10000000 --dim 128 \
  --ids 65536 --no-torch
# Sparse vs dense gradient at the same scale.
timeout 200 $PY -m benchmarks.sparse_grad --rows 1000000 10000000 --dim 128 \
  --ids 65536
# Row-sharded vs replicated tables over the GPUs (needs >= 2 GPUs; the
# module fakes 8 CPU devices only when JAX_PLATFORMS=cpu).
if [ "$($PY -c 'import jax; print(jax.device_count())')" -ge 2 ]; then
  timeout 300 $PY -m benchmarks.sharded --rows 1000000 8000000 --dim 128
fi
# Recommender scale (issue 29): 26 tables one leaf each vs stacked by hand,
# and the compiled step's ops (the kernels a GPU launches) at 26-104 tables.
timeout 500 $PY -m benchmarks.recsys --optimizers lazy_adam rowwise_adagrad \
  --heads linear --no-torch
# Table stacks (issue 39): per-table leaves vs gtx.TableStack on Criteo's
# one-hot features and on multi-hot bags, and the compiled step's ops at
# 26, 104 and 500 features (torch only where it imports).
timeout 600 $PY -m benchmarks.stacks --compile-features 26 104 500
if [ -n "${OUT:-}" ]; then cp benchmarks/results/*_gpu.* "$OUT"/; fi
