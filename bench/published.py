"""Published trainings beside the planner: their layouts pinned, predicted vs published step time.

Profiles Llama 3 8B, 70B and 405B in fake mode on the hardware each run used (times from its
achievable rates; mixed precision, AdamW), then solves each published layout of
docs/hf-models.md pinned (degrees and micro-batch; ZeRO stage, checkpointing and stage
boundaries still solved) and the free layout for the same GPUs and tokens per step.
NeMo's runs used 8192-token sequences; each is evaluated at the same tokens per step in
4096-token samples (docs/hf-models.md says why and what that changes), and again in 8192-token
samples, as published (context parallelism, which the planner does not lay out, replaced by as
much data parallelism: the same tokens and attention work per GPU). torchtitan's runs, eager
PyTorch with FSDP2 as this project's runtime, are evaluated as published, on their own GPUs:
A100s, and H100s with HBM2e at a 500 W limit whose peak lies between two datasheets' (both ends
are evaluated).

    python bench/published.py          # writes bench/results/published.md
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from planner.hardware import Hardware, get_hardware, load_cluster_file  # noqa: E402
from planner.search import SolveOptions, search  # noqa: E402
from solve_real import llama  # noqa: E402


@dataclass
class Run:
    name: str
    model: str
    gpus: int
    global_batch: int          # 4096-token samples per step
    published_s: float         # seconds per step as published
    published_mfu: str
    pins: dict = field(default_factory=dict)
    extra_pins: dict = field(default_factory=dict)   # more of the published layout, tried as its own row
    seq: int = 4096            # tokens a sample
    hardware: tuple[str, ...] = ("h100-sxm-80g",)   # what it ran on (HARDWARE), each evaluated


# torchtitan's H100s (Meta's Grand Teton hosts; torchtitan benchmarks/llama3_h100_202412_torchtitan.md
# and docs/performance.md of 2024-12): 96 GB of HBM2e at 2.4 TB/s, under a 500 W power limit,
# whose peak "is between SXM and NVL, and we don't know its exact value" (its footnote). Both ends
# are evaluated: the SXM's 989.4 TFLOPS (the h100-sxm-80g preset's) and the NVL's 835.5 (NVIDIA's
# H100 datasheet, H100 NVL column: BF16 1,671 TFLOPS with sparsity). Every other figure is the
# SXM preset's; none is fitted to these runs. Each is a cluster file on that preset, as a user
# describes such GPUs (docs/hf-models.md).
TITAN_H100 = {
    "h100-hbm2e-500w-sxm-peak": "",
    "h100-hbm2e-500w-nvl-peak": 'bf16_flops = "835.5 TFLOPS"\n',
}


def hardware(name: str, workdir: Path) -> Hardware:
    """A preset, or one of TITAN_H100: the SXM preset with torchtitan's stated memory and bandwidth."""
    if name not in TITAN_H100:
        return get_hardware(name)
    path = workdir / f"{name}.toml"
    path.write_text(f'[hardware]\nbase = "h100-sxm-80g"\nname = "{name}"\nmemory_bytes = "96 GB"\n'
                    f'hbm_bandwidth = "2.4 TB/s"\n{TITAN_H100[name]}')
    return load_cluster_file(path)


RUNS = [
    Run("NeMo 24.09, Llama 3.1 8B", "llama-3-8b", 8, 256, 12.91, "59.4%", {"dp": 8, "tp": 1, "pp": 1, "micro_batch": 1}),
    Run("torchtitan FSDP, Llama 3.1 8B", "llama-3-8b", 8, 32, 2.84, "33-39%", {"dp": 8, "tp": 1, "pp": 1, "micro_batch": 4, "zero": 3},
        hardware=tuple(TITAN_H100)),
    # NeMo's 70B recipe: TP 4 with sequence parallelism, PP 4 with 5 virtual stages a rank.
    Run("NeMo 24.09, Llama 3.1 70B", "llama-3-70b", 64, 256, 14.72, "54.1%",
        {"dp": 4, "tp": 4, "pp": 4, "micro_batch": 1, "sequence_parallel": "on"}, {"virtual_stages": 5}),
    Run("NeMo 24.09, Llama 3.1 70B, weak-scaled", "llama-3-70b", 512, 2048, 14.89, "53.5%",
        {"dp": 32, "tp": 4, "pp": 4, "micro_batch": 1, "sequence_parallel": "on"}, {"virtual_stages": 5}),
    # As published, in 8192-token samples: NeMo's 8B runs CP 2 x DP 4, here DP 8.
    Run("NeMo 24.09, Llama 3.1 8B", "llama-3-8b", 8, 128, 12.91, "59.4%", {"dp": 8, "tp": 1, "pp": 1, "micro_batch": 1}, seq=8192),
    Run("NeMo 24.09, Llama 3.1 70B", "llama-3-70b", 64, 128, 14.72, "54.1%",
        {"dp": 4, "tp": 4, "pp": 4, "micro_batch": 1, "sequence_parallel": "on"}, seq=8192),
    Run("NeMo 24.09, Llama 3.1 70B, weak-scaled", "llama-3-70b", 512, 1024, 14.89, "53.5%",
        {"dp": 32, "tp": 4, "pp": 4, "micro_batch": 1, "sequence_parallel": "on"}, seq=8192),
    # torchtitan, eager FSDP2 (this project's runtime's kind), as published: 8192-token samples,
    # the published activation checkpointing pinned too, and ZeRO 3 (its fully_shard reshards after
    # forward). Step = tokens a step / (tokens/s/GPU x GPUs).
    # 2024-12, Table 1: 8 H100s, local batch 2, selective AC, 5,762 tokens/s/GPU.
    Run("torchtitan FSDP, Llama 3.1 8B", "llama-3-8b", 8, 16, 2.84, "33-39%",
        {"dp": 8, "tp": 1, "pp": 1, "micro_batch": 2, "checkpoint": "selective", "zero": 3}, seq=8192, hardware=tuple(TITAN_H100)),
    # Table 3: the same on 128 H100s (16 hosts, 400 Gb/s a GPU between them), 5,605 tokens/s/GPU.
    Run("torchtitan FSDP, Llama 3.1 8B", "llama-3-8b", 128, 256, 2 * 8192 / 5605, "33-39%",
        {"dp": 128, "tp": 1, "pp": 1, "micro_batch": 2, "checkpoint": "selective", "zero": 3}, seq=8192, hardware=tuple(TITAN_H100)),
    # docs/performance.md of 2024-04 to 2024-12: 64 A100s (80 GB), FSDP, local batch 1; the 8B with
    # selective op AC at 2,973 tokens/s/GPU (58.2% MFU), the 70B with full AC at 331 (51.7%).
    Run("torchtitan FSDP, Llama 3 8B", "llama-3-8b", 64, 64, 8192 / 2973, "58.2%",
        {"dp": 64, "tp": 1, "pp": 1, "micro_batch": 1, "checkpoint": "selective", "zero": 3}, seq=8192, hardware=("a100-80g",)),
    Run("torchtitan FSDP, Llama 3 70B", "llama-3-70b", 64, 64, 8192 / 331, "51.7%",
        {"dp": 64, "tp": 1, "pp": 1, "micro_batch": 1, "checkpoint": "all", "zero": 3}, seq=8192, hardware=("a100-80g",)),
    # The same page: Llama 3.1 405B on 128 H100s (HBM2e, lower TDP), FSDP 16 x TP 8, local batch 2,
    # full AC, no Float8 or async TP: 109 tokens/s/GPU (29.0% MFU of the SXM peak). torchtitan's TP
    # runs its norms sequence-parallel.
    Run("torchtitan FSDP + TP, Llama 3.1 405B", "llama-3-405b", 128, 32, 32 * 8192 / (109 * 128), "29.0%",
        {"dp": 16, "tp": 8, "pp": 1, "micro_batch": 2, "checkpoint": "all", "sequence_parallel": "on", "zero": 3}, seq=8192,
        hardware=tuple(TITAN_H100)),
]


# Models without a built-in config: written out here (the shape of Meta's Llama 3.1 405B config.json).
CONFIGS = {"llama-3-405b": llama(126, 16384, 128, 8, 53248, 128256, 8192)}


def profile(name: str, seq: int, hw: Hardware, workdir: Path):
    from profiles.hf import load_hf_spec
    from profiles.measure import ProfileOptions, profile_model
    source = name
    if name in CONFIGS:
        source = workdir / f"{name}.json"
        source.write_text(json.dumps(CONFIGS[name]))
    return profile_model(load_hf_spec(str(source), seq), ProfileOptions(fake=True, hardware=hw.name, precision="mixed"),
                         op_seconds=lambda kind, flops, io, mnk: hw.op_seconds("mixed", kind, flops, io, mnk))


def mfu_of_published_peak(mfu: float, hw: Hardware) -> float:
    """MFU as the run's authors counted it: torchtitan's H100s against the SXM's peak."""
    return mfu * hw.bf16_flops / get_hardware("h100-sxm-80g").bf16_flops if hw.name in TITAN_H100 else mfu


def main() -> None:
    profiles = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in RUNS:
            for hw_name in run.hardware:
                hw = hardware(hw_name, Path(tmp))
                key = (run.model, run.seq, hw.name)
                if key not in profiles:
                    profiles[key] = profile(run.model, run.seq, hw, Path(tmp))
                rows += solve_run(run, hw, profiles[key])
    md = ["# Published trainings beside the planner", "",
          f"`python bench/published.py`, {time.strftime('%Y-%m-%d')}: fake profiles on the hardware each run used "
          "(its preset's achievable rates; torchtitan's H100s: the SXM preset with their stated 2.4 TB/s of HBM2e, "
          "at the SXM's peak and at the NVL's, the two ends of theirs), at the published tokens per step; NeMo's "
          "in 4096-token samples and, as published, in 8192-token samples (context parallelism replaced by as "
          "much data parallelism). MFU is of the peak the authors counted against (torchtitan's H100s: the SXM's).", "",
          "| run | hardware | tokens a sample | layout | plan | checkpointed layers | predicted s/step | published s/step | error | predicted MFU | published MFU |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for run, hw, label, desc, ck, step, mfu in rows:
        if step is None:
            md.append(f"| {run.name}, {run.gpus} GPUs | {hw.name} | {run.seq} | {label} | {desc} |  |  | {run.published_s:.2f} |  |  | {run.published_mfu} |")
            continue
        err = f"{100 * (step - run.published_s) / run.published_s:+.0f}%" if label.startswith("pinned") else ""
        md.append(f"| {run.name}, {run.gpus} GPUs | {hw.name} | {run.seq} | {label} | {desc} | {ck} | {step:.2f} | "
                  f"{run.published_s:.2f} | {err} | {100 * mfu:.1f}% | {run.published_mfu} |")
    out = ROOT / "bench" / "results" / "published.md"
    out.write_text("\n".join(md) + "\n")
    print(f"wrote {out}")


def solve_run(run: Run, hw: Hardware, prof) -> list[tuple]:
    """The run's pinned layout (and with its extra pins), and the free layout, solved on `hw`."""
    rows = []
    tries = [("pinned", run.pins)] + ([("pinned + VP", {**run.pins, **run.extra_pins})] if run.extra_pins else [])
    for label, pins in tries + [("free", {})]:
        t = time.perf_counter()
        result = search(prof, SolveOptions(gpus=run.gpus, hardware=hw, global_batch=run.global_batch, **pins))
        if not result.solutions:
            need = result.closest.peak_bytes / 2**30 if result.closest else float("nan")
            rows.append((run, hw, label, f"{result.closest.candidate.describe()}: does not fit, the frugal layout "
                         f"peaks at {need:.1f} GiB", "", None, None))
            print(f"{run.name:40s} {hw.name:26s} {label:6s} does not fit ({need:.1f} GiB)", flush=True)
            continue
        sol = result.solutions[0]
        p = sol.prediction
        full = sum(c == "full" for st in sol.stages for _, c, _ in st)
        sel = sum(c == "selective" for st in sol.stages for _, c, _ in st)
        ck = f"{full}" + (f" + {sel} selective" if sel else "")
        mfu = mfu_of_published_peak(p.mfu, hw)
        rows.append((run, hw, label, sol.candidate.describe(), ck, p.step_s, mfu))
        print(f"{run.name:40s} {hw.name:26s} {run.seq:5d} {label:6s} {sol.candidate.describe():38s} ckpt {ck:>14s}  "
              f"predicted {p.step_s:7.3f} s (published {run.published_s:.2f} s, "
              f"{100 * (p.step_s - run.published_s) / run.published_s:+.0f}%), MFU {100 * mfu:.1f}%  "
              f"[{time.perf_counter() - t:.0f} s]", flush=True)
    return rows


if __name__ == "__main__":
    main()
