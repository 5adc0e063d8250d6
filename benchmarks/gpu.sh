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
# The four whole steps of the fast-by-default issue, each on the default
# path (no opt-in call), in well under 10 minutes together:
# 1. the single table: 1M x 64, 8,192 fresh ids a step, lazy_adam, donated
#    (torch is CPU-only in the bench extra: skipped).
timeout 120 $PY -m benchmarks.train_step --rows 1000000 --dim 64 \
  --ids 8192 --no-torch
# 2-3. the stack against per-table leaves: Criteo's 26 one-hot features and
#    8 tables of weighted bags (uniform and Zipf), and compile at 26 and 500.
timeout 300 $PY -m benchmarks.stacks --optimizers lazy_adam rowwise_adagrad \
  --heads linear --rounds 4 --compile-features 26 500
# 4. the id map: hashed features against ids in range (cost only).
timeout 120 $PY -m benchmarks.vocab --only cost --rounds 4
if [ -n "${OUT:-}" ]; then cp benchmarks/results/*_gpu.* "$OUT"/; fi
