#!/usr/bin/env bash
# The GPU check: calibrate the GPU (matmul sweep, copy bandwidth; NCCL collectives where there
# are 2+ GPUs), profile a ~1B-parameter GPT on CUDA, solve for one GPU with a memory limit that
# forces checkpointing and offload, run the plan, and print memory and time fidelity.
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
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 2 ]; then
  time plan calibrate --device cuda --processes "$NGPU" --base h200-141g -o "$OUT/cluster.toml" | tee "$OUT/calibrate.txt"
else
  # One GPU: the matmul table and copy bandwidth only (collectives need two).
  time python -c "from profiles.calibrate import fit_matmul, matmul_flops, copy_bandwidth; import torch
pts = [(d, d, d, matmul_flops(torch.bfloat16, d, d, d, device='cuda', repeats=20)) for d in (256, 512, 1024, 2048, 4096, 8192)]
pts += [(m, n, k, matmul_flops(torch.bfloat16, m, n, k, device='cuda', repeats=20)) for m, n, k in ((16384, 4096, 4096), (4096, 14336, 4096), (8192, 1024, 8192))]
print('matmul TFLOP/s', [(m, n, k, round(r / 1e12)) for m, n, k, r in pts])
print('fit (efficiency, knee, residual) vs 989.4 TFLOPS:', fit_matmul(pts, 989.4e12))
print('copy GB/s', copy_bandwidth(1 << 30, device='cuda') / 1e9)" | tee "$OUT/calibrate.txt"
fi
time plan profile bench/models/gpt1b.py --device cuda --precision mixed --batch-sizes 1,2,4 -o "$OUT/profile.json" --repeats 3
time plan solve "$OUT/profile.json" --gpus 1 --hardware h200-141g --memory-limit "$LIMIT" --global-batch 8 -o "$OUT/plan.json"
plan run "$OUT/plan.json" --steps 8 --out "$OUT/run.json"
plan verify "$OUT/plan.json" "$OUT/run.json" --tolerance 5 | tee "$OUT/verify.txt"
