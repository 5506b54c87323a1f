#!/usr/bin/env bash
# DiLoCo against data-parallel at a real-ish size, on one CUDA card (issue 24): a Llama of
# 27.8M parameters (8 x 512, 8 heads sharing 4 key/value heads, context 128) on
# tinyshakespeare with a BPE of 4,096 tokens, K = 4 workers simulated one after the other
# on the card, 500 inner steps of 8 sequences per worker; single, ddp and DiLoCo int8 at
# H = 10, 25 and 50 with the platform's defaults, seeds 0 and 1 (bench/convergence.py).
# About 5 minutes of an H100. It writes the "on a GPU" section of docs/benchmarks.md
# (its own: the CPU sections are untouched), a plot, and every run's JSON under OUT_DIR.
# Usage: bash bench/gpu_convergence.sh [OUT_DIR] [convergence.py options, which win]
#   e.g. bash bench/gpu_convergence.sh out/gpu --seeds 0 1 2
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench/out/convergence-llama-gpu}
shift || true
PYTHON=${PYTHON:-python3}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1 || true
"$PYTHON" bench/convergence.py --arch llama --device cuda --jobs 1 \
    --n-layer 8 --n-embd 512 --n-head 8 --n-kv-head 4 --block-size 128 --batch-size 8 \
    --steps 500 --vocab 4096 --workers 4 --hs 10 25 50 --seeds 0 1 \
    --work-dir "$out" "$@" 2>&1 | tee "$out/convergence.log"
