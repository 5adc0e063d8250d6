#!/usr/bin/env bash
# The GPU figures in one command, for a lent GPU machine as it is: its
# python3 (CUDA jax, CUDA torch, flax, optax, orbax; nothing installed),
# gradtx from this working tree. At most 9 minutes on one GPU:
#
#   bash benchmarks/gpu.sh            # writes benchmarks/results/gpu.md
#   bash benchmarks/gpu.sh --dry-run  # every part at toy sizes on the CPU
#
# The one harness is benchmarks/gpu.py (gtx and torch, FBGEMM where it
# imports, on the same card; the cost model's prediction beside each gtx
# figure); then the model's table of the full-size programs
# (benchmarks/gpu_model.py, tested in tests/test_platforms.py). Results are
# also copied to $OUT when it is set. PY picks the python (default
# python3).
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
# JAX must not take most of the card: torch runs in the same process.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
$PY -c "import jax; print(jax.__version__, jax.devices()); \
assert jax.default_backend() == 'gpu'"
timeout 480 $PY -m benchmarks.gpu
timeout 60 $PY -m benchmarks.gpu_model
if [ -n "${OUT:-}" ]; then
  cp benchmarks/results/gpu.md benchmarks/results/gpu.json \
    benchmarks/results/gpu_model.md "$OUT"/
fi
