"""How long `plan solve`s of published model shapes take, at the sizes they trained at.

Each model is profiled once in fake mode (mixed precision, AdamW, micro-batches 1, 2, 4) from a
Hugging Face config built here (nothing downloaded); each case then solves with every knob free
(or NeMo's 70B layout with its virtual stages pinned, the slowest solves of docs/hf-models.md),
in a child process with a time limit, as `plan solve` would. Prints per case the wall time,
the candidates, the memory-free MILPs, the candidates solved within the memory limit and the
MILPs with memory rows that took (a pipeline of one stage a rank is solved by its stage sizes,
planner/partition.py), and the layout chosen. What follows the table in the results file (the
tables before) is kept.

    python bench/solve_real.py [--limit 180]     # writes bench/results/solve_real.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def llama(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int, seq: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "vocab_size": vocab,
            "max_position_embeddings": seq, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "attention_bias": False}


MODELS = {
    # name: (config or built-in name, sequence length, hardware preset)
    "llama-3-8b": ("llama-3-8b", 4096, "h100-sxm-80g"),
    "llama-3-70b": ("llama-3-70b", 4096, "h100-sxm-80g"),
    # GPT-3 175B's shape (Brown et al. 2020; Narayanan et al. 2021, Table 1): 96 layers, hidden
    # 12288, 96 heads, 2048 tokens; a Llama block with an MLP of the same parameter count.
    "gpt3-175b-shaped": (llama(96, 12288, 96, 96, 32768, 51200, 2048), 2048, "a100-80g"),
    # Llama 3.1 405B (Meta's config): 126 layers, hidden 16384, 128 heads, 8 KV heads.
    "llama-405b-shaped": (llama(126, 16384, 128, 8, 53248, 128256, 8192), 8192, "h100-sxm-80g"),
}
NEMO_VP5 = dict(tp=4, pp=4, micro_batch=1, sequence_parallel="on", virtual_stages=5)   # docs/hf-models.md
CASES = [  # (model, GPUs, global batch, pinned knobs: SolveOptions fields)
    ("llama-3-8b", 8, 256, {}),
    ("llama-3-8b", 8, 32, {}),
    ("llama-3-70b", 64, 256, {}),
    ("llama-3-70b", 512, 2048, {}),
    ("gpt3-175b-shaped", 1536, 1536, {}),
    ("llama-405b-shaped", 8192, 2048, {}),
    # NeMo's 70B layouts with its virtual stages, pinned as docs/hf-models.md solves them
    ("llama-3-70b", 64, 256, dict(dp=4, **NEMO_VP5)),
    ("llama-3-70b", 512, 2048, dict(dp=32, **NEMO_VP5)),
]

SOLVE = """
import json, sys, time
sys.path.insert(0, {root!r})
from planner.hardware import get_hardware
from planner.search import SolveOptions, search
from profiles.schema import load_profile
prof = load_profile({profile!r})
opts = SolveOptions(gpus={gpus}, hardware=get_hardware({hw!r}), global_batch={batch}, top_k=5, **{pins!r})
t = time.perf_counter()
r = search(prof, opts)
best = r.solutions[0] if r.solutions else None
print(json.dumps({{"seconds": time.perf_counter() - t, "candidates": r.candidates, "solved": r.solved,
                  "free_solved": getattr(r, "free_solved", 0), "milps": getattr(r, "milps", r.solved),
                  "layout": best.candidate.describe() if best else "nothing fits",
                  "step_s": best.prediction.step_s if best else None}}))
"""


HISTORY = "<!-- earlier tables, kept by bench/solve_real.py -->"


def profile(name: str, workdir: Path) -> Path:
    source, seq, hw = MODELS[name]
    sys.path.insert(0, str(ROOT))
    from profiles.schema import SCHEMA_VERSION
    path = Path(tempfile.gettempdir()) / f"plan_bench_{name}_{seq}_v{SCHEMA_VERSION}.profile.json"
    if path.exists():
        return path
    if isinstance(source, dict):
        cfg = workdir / f"{name}.json"
        cfg.write_text(json.dumps(source))
        source = str(cfg)
    cmd = [sys.executable, "-c", "from cli import app; app()", "profile", source, "--fake", "--hardware", hw,
           "--seq-len", str(seq), "--precision", "mixed", "-o", str(path)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=float, default=180.0, help="seconds a solve may take before it is stopped")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, gpus, batch, pins in CASES:
            prof = profile(name, Path(tmp))
            code = SOLVE.format(root=str(ROOT), profile=str(prof), gpus=gpus, hw=MODELS[name][2], batch=batch, pins=pins)
            t = time.perf_counter()
            try:
                proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=args.limit)
                res = json.loads(proc.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                res = {"seconds": None, "candidates": "-", "solved": "-", "free_solved": "-", "milps": "-", "layout": "-",
                       "step_s": None}
            wall = f"{res['seconds']:.2f}" if res["seconds"] is not None else f"> {args.limit:.0f} (stopped)"
            step = f"{res['step_s']:.3f}" if res["step_s"] else "-"
            pinned = " ".join(f"{k}={v}" for k, v in pins.items()) or "free"
            rows.append((name, str(gpus), str(batch), pinned, wall, str(res["candidates"]), str(res["free_solved"]),
                         str(res["solved"]), str(res["milps"]), res["layout"], step))
            print(" | ".join(rows[-1]), f"({time.perf_counter() - t:.0f} s)", flush=True)
    head = ("| model | GPUs | global batch | knobs | solve s | candidates | memory-free MILPs | solved with memory "
            "| memory MILPs | layout | step s |")
    md = [head, "|" + "---|" * 11] + ["| " + " | ".join(r) + " |" for r in rows]
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / "solve_real.md"
    history = path.read_text().split(HISTORY, 1)[1] if path.exists() and HISTORY in path.read_text() else "\n"
    path.write_text(
        f"# Solves of published shapes\n\n`python bench/solve_real.py --limit {args.limit:.0f}` on "
        f"{os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}: fake profiles (mixed precision, AdamW), every "
        "knob free but those pinned (NeMo's virtual stages, as docs/hf-models.md solves them), top 5; wall "
        "seconds of `search`.\n\n" + "\n".join(md) + "\n\n" + HISTORY + history)
    print("\n".join(md))


if __name__ == "__main__":
    main()
