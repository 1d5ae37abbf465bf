#!/usr/bin/env bash
# The GPU check: calibrate the GPU (matmul sweep, copy bandwidth; NCCL collectives where there
# are 2+ GPUs), profile a ~1B-parameter GPT on CUDA, solve for one GPU with a memory limit that
# forces checkpointing and offload, run the plan (and one with every layer selectively
# checkpointed), and print memory and time fidelity; then
# resume that plan from a CUDA checkpoint and load a tiny Llama's safetensors (--init-from).
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
# Selective checkpointing on CUDA (its masks and kernels differ from the CPU's): every layer selective.
plan solve "$OUT/profile.json" --gpus 1 --hardware h200-141g --global-batch 8 --checkpoint selective -o "$OUT/plan-selective.json"
plan run "$OUT/plan-selective.json" --steps 8 --out "$OUT/run-selective.json"
plan verify "$OUT/plan-selective.json" "$OUT/run-selective.json" --tolerance 5 | tee "$OUT/verify-selective.txt"

# Training on CUDA (issue 13): 4 steps with a checkpoint, then a resume to step 8, held to the
# uninterrupted run above (its losses 5..8); then a tiny Llama's safetensors in (--init-from),
# its first loss against transformers' own from_pretrained on the same batch.
plan run "$OUT/plan.json" --steps 4 --checkpoint-dir "$OUT/ck" --out "$OUT/run-first.json"
plan run "$OUT/plan.json" --steps 8 --checkpoint-dir "$OUT/ck" --resume --out "$OUT/run-resumed.json"
python - "$OUT" <<'PY' | tee "$OUT/resume.txt"
import json, sys
out = sys.argv[1]
whole = json.load(open(f"{out}/run.json"))["losses"]
resumed = json.load(open(f"{out}/run-resumed.json"))["losses"]
print("uninterrupted steps 5-8:", whole[4:]); print("resumed steps 5-8:     ", resumed)
print("max relative difference:", max(abs(a - b) / abs(a) for a, b in zip(whole[4:], resumed)))
PY
python - "$OUT" <<'PY'
import sys, torch, transformers
from profiles.hf import make_config, read_config
_, d = read_config("examples/hf-llama-tiny")
torch.manual_seed(7)
transformers.AutoModelForCausalLM.from_config(make_config(d), attn_implementation="sdpa").save_pretrained(f"{sys.argv[1]}/tiny-llama")
PY
plan profile "$OUT/tiny-llama" --device cuda --seq-len 64 --batch-sizes 1,2 --repeats 1 -o "$OUT/llama-profile.json"
plan solve "$OUT/llama-profile.json" --gpus 1 --hardware h200-141g --global-batch 4 -o "$OUT/llama-plan.json"
plan run "$OUT/llama-plan.json" --steps 2 --init-from "$OUT/tiny-llama" --out "$OUT/llama-run.json"
python - "$OUT" <<'PY' | tee "$OUT/init-from.txt"
import json, sys, torch, transformers
from planner.plan import load_plan
from profiles.model_file import load_spec
from runtime.data import global_batch
out = sys.argv[1]
plan = load_plan(f"{out}/llama-plan.json"); spec = load_spec(plan.model)
inputs, targets = global_batch(spec, plan, 0)
ref = transformers.AutoModelForCausalLM.from_pretrained(f"{out}/tiny-llama", attn_implementation="sdpa")
with torch.no_grad():
    want = spec.loss_fn(ref(inputs).logits, targets).item()
got = json.load(open(f"{out}/llama-run.json"))["losses"][0]
print(f"first loss {got:.6f} vs from_pretrained {want:.6f} (relative {abs(got - want) / want:.2e})")
PY
