#!/usr/bin/env bash
# The one-GPU check of parts (docs/gpu.md): every stage under a timeout, all within 8 minutes.
#   bash benchmarks/gpu_check.sh                 # results in $OUT if set, else ./gpu_check_out
#   bash benchmarks/gpu_check.sh --only w1,pair  # some stages; any flag of gpu_check.py
#   bash benchmarks/gpu_check.sh --mode cpu      # the CPU stand-in (or PARTS_GPU_CHECK_CPU=1)
# Where no CUDA GPU is usable and the CPU was not asked for, it exits 2 naming the cause.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCH_FR_BUFFER_SIZE=0 TORCH_NCCL_ASYNC_ERROR_HANDLING=1 NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# the native ops are CPU kernels built on first use; the check measures the device paths
export PARTS_CSRC_FALLBACK="${PARTS_CSRC_FALLBACK:-1}"
exec timeout -k 15 470 "${PYTHON:-python3}" "$ROOT/benchmarks/gpu_check.py" --out "${OUT:-gpu_check_out}" "$@"
