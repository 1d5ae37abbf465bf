#!/usr/bin/env bash
# The GPU check: calibrate the GPU (matmul sweep, attention, copies; NCCL collectives where
# there are 2+ GPUs), profile a ~1B-parameter GPT on CUDA, and run one plan of each kind on one
# GPU (the free choice, plain, accumulation, full and selective checkpointing, and checkpointing
# with offload under a memory limit), printing memory and time fidelity for each; profile and
# run 4 of Llama 3 8B's layers at 4096 tokens; then resume the offload plan from a CUDA
# checkpoint and load a tiny Llama's safetensors (--init-from).
# Designed to finish in about 8 minutes on one H200; exits 0 with a note where there is no CUDA.
#
#   bash bench/gpu_check.sh            # results under $OUT (default bench/results/gpu)
#   TRAINING=0 bash bench/gpu_check.sh # without the resume and --init-from checks
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
# The rates table (matmul sweep, attention, copies, the host's AdamW); collectives with 2+ GPUs.
time plan calibrate --device cuda --processes "$NGPU" --base h200-141g -o "$OUT/cluster.toml" | tee "$OUT/calibrate.txt"
time plan profile bench/models/gpt1b.py --device cuda --precision mixed --batch-sizes 1,2,4,8 -o "$OUT/profile.json" --repeats 3

# One row of the single-GPU time-fidelity table: solve with these pins, run 8 steps, verify.
row() {
  local name=$1 profile=$2 batch=$3; shift 3
  plan solve "$profile" --gpus 1 --hardware h200-141g --global-batch "$batch" "$@" -o "$OUT/plan-$name.json"
  plan run "$OUT/plan-$name.json" --steps 8 --out "$OUT/run-$name.json"
  plan verify "$OUT/plan-$name.json" "$OUT/run-$name.json" --tolerance 5 | tee "$OUT/verify-$name.txt"
}
row plain "$OUT/profile.json" 8 --checkpoint none --offload none --micro-batch 8
row accumulation "$OUT/profile.json" 8 --checkpoint none --offload none --micro-batch 2
row checkpointing "$OUT/profile.json" 8 --checkpoint all --offload none --micro-batch 8
row offload "$OUT/profile.json" 8 --memory-limit "$LIMIT"   # the solver's checkpointing and offload under the limit

# Llama 3 8B's layers (4 of them) at 4096 tokens, measured: what the fake-mode roofline's
# per-layer times are held to (bench/gpu_fake.py, on any machine, from these files).
python - "$OUT" <<'PY'
import json, pathlib, sys
from profiles.hf import read_config
_, d = read_config("llama-3-8b"); d["num_hidden_layers"] = 4
folder = pathlib.Path(sys.argv[1]) / "llama-3-8b-4-layers"; folder.mkdir(exist_ok=True)
(folder / "config.json").write_text(json.dumps(d, indent=1))
PY
time plan profile "$OUT/llama-3-8b-4-layers" --device cuda --precision mixed --seq-len 4096 --batch-sizes 1,2 --repeats 3 -o "$OUT/llama8b4-profile.json"
row llama8b4 "$OUT/llama8b4-profile.json" 4 --checkpoint none --offload none --micro-batch 2
row free "$OUT/profile.json" 8
row selective "$OUT/profile.json" 8 --checkpoint selective --offload none --micro-batch 8

[ "${TRAINING:-1}" = 1 ] || exit 0
# Training on CUDA (issue 13): 4 steps with a checkpoint, then a resume to step 8, held to the
# uninterrupted run above (its losses 5..8); then a tiny Llama's safetensors in (--init-from),
# its first loss against transformers' own from_pretrained on the same batch.
plan run "$OUT/plan-offload.json" --steps 4 --checkpoint-dir "$OUT/ck" --out "$OUT/run-first.json"
plan run "$OUT/plan-offload.json" --steps 8 --checkpoint-dir "$OUT/ck" --resume --out "$OUT/run-resumed.json"
python - "$OUT" <<'PY' | tee "$OUT/resume.txt"
import json, sys
out = sys.argv[1]
whole = json.load(open(f"{out}/run-offload.json"))["losses"]
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
