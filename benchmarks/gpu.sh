#!/usr/bin/env bash
# The GPU figures in one command, on a lent GPU machine's python3 (PY), with
# gradtx from this working tree, in at most 9 minutes; results also copied to
# $OUT when it is set:
#
#   bash benchmarks/gpu.sh            # benchmarks/results/gpu.md, gpu_model.md
#   bash benchmarks/gpu.sh --dry-run  # every part at toy sizes on the CPU
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = "--dry-run" ]; then
  export JAX_PLATFORMS=cpu
  out=${GPU_DRY_RUN_OUT:-$(mktemp -d)}
  timeout 120 $PY -m benchmarks.gpu --dry-run --out "$out"
  echo "dry run: $out/gpu.md"
  exit 0
fi
unset XLA_FLAGS JAX_PLATFORMS
export XLA_PYTHON_CLIENT_PREALLOCATE=false # torch runs in the same process
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
$PY -c "import jax; print(jax.__version__, jax.devices()); \
assert jax.default_backend() == 'gpu'"
timeout 480 $PY -m benchmarks.gpu
timeout 60 $PY -m benchmarks.gpu_model
if [ -n "${OUT:-}" ]; then
  cp benchmarks/results/gpu.{md,json} benchmarks/results/gpu_model.md "$OUT"/
fi
