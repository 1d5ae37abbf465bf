#!/usr/bin/env bash
# The GPU check: profile a ~1B-parameter GPT on CUDA, solve for one GPU with a memory limit
# that forces checkpointing and offload, run the plan, and print memory and time fidelity.
# Designed to finish in a few minutes on one H200; exits 0 with a note where there is no CUDA.
#
#   bash bench/gpu_check.sh            # results under $OUT (default bench/results/gpu)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device: the GPU check needs one; nothing to do"
  exit 0
fi
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
LIMIT=${LIMIT:-12GiB}   # mixed-precision AdamW keeps 16 B per parameter: ~17 GB for 1B, so 12 GiB forces offload
set -x
time plan profile bench/models/gpt1b.py --device cuda --precision mixed --batch-sizes 1,2,4 -o "$OUT/profile.json" --repeats 3
time plan solve "$OUT/profile.json" --gpus 1 --hardware h200-141g --memory-limit "$LIMIT" --global-batch 8 -o "$OUT/plan.json"
plan run "$OUT/plan.json" --steps 5 --out "$OUT/run.json"
plan verify "$OUT/plan.json" "$OUT/run.json" --tolerance 5 | tee "$OUT/verify.txt"
