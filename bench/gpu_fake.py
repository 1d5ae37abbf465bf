"""Fake-mode times against the same layers measured on a GPU.

A fake profile (`plan profile --fake`) times each op at a hardware preset's achievable rates;
that is all the planner knows of a GPU it has not run on (every published run of
docs/hf-models.md is costed so). Here the same models were profiled on one H200
(bench/gpu_check.sh, 2026-12-04): a ~1B GPT at 1024 tokens and 4 of Llama 3 8B's layers at
4096 tokens, mixed precision. This profiles them again in fake mode with the H200 preset
(matmuls at MAMF's best-shape 80.1%, attention at FlashAttention-2's 35%, memory at the 85% of
HBM the check measured, and no layer faster than the host issues its ops at 18.7 us each), with
the ops' device time alone (no host floor) and with the attention rate the check measured (0.8),
and compares each kind of layer's forward + backward time, and the step the planner predicts for
the plain layout the check ran, with what was measured. Its last section is where the preset's
host time an op comes from: launch-bound layers' measured time over the ops they dispatch.

    python bench/gpu_fake.py           # writes bench/results/gpu_fake.md (about a minute, CPU only)
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.hardware import PRESETS  # noqa: E402
from planner.run_report import load_run  # noqa: E402
from planner.search import SolveOptions, search  # noqa: E402
from profiles.hf import load_hf_spec  # noqa: E402
from profiles.measure import ProfileOptions, profile_model  # noqa: E402
from profiles.model_file import load_model_file  # noqa: E402
from profiles.schema import load_profile  # noqa: E402

GPU = ROOT / "bench" / "results" / "gpu"


def result(name: str) -> Path:
    """A file bench/gpu_check.sh wrote: in bench/results/gpu/ (a rerun's), else from the lease
    of 2026-12-04 that first profiled the Llama's layers (bench/results/gpu/lease2/)."""
    return GPU / name if (GPU / name).exists() else GPU / "lease2" / name

NOW = PRESETS["h200-141g"]
# The preset with the attention rate the check measured (0.8, the median of its sweep), which
# the preset holds back (its sources say why).
MEASURED = dataclasses.replace(NOW, attention_efficiency=0.8)
# The preset without the host's time to issue ops: the ops' device time alone, as fake profiles
# were before op_launch_s.
DEVICE_ONLY = dataclasses.replace(NOW, op_launch_s=0.0)
# A layer is launch-bound where its ops' device time is under this share of what it measured.
LAUNCH_BOUND = 0.5
# The preset's figure comes from launch-bound layers of at least this many ops. A layer of a few
# dozen ops (an embedding, the loss) times the measuring harness's fixed cost per call and the
# one or two kernels the rates miss (an embedding's backward sorts its indices), not issuing.
MIN_OPS = 100

# (name, spec, measured profile, sizes, the plain layout's run: global batch, micro-batch, run.json)
CASES = (
    ("GPT ~1B, 1024 tokens", lambda: load_model_file(ROOT / "bench" / "models" / "gpt1b.py"), GPU / "profile.json",
     (1, 2, 4, 8), (8, 8, GPU / "run-plain.json")),
    ("Llama 3 8B, 4 layers, 4096 tokens", lambda: load_hf_spec(str(GPU / "llama-3-8b-4-layers"), 4096),
     result("llama8b4-profile.json"), (1, 2), (4, 2, result("run-llama8b4.json"))),
)


def fake_profile(spec, sizes, hw):
    opts = ProfileOptions(batch_sizes=sizes, precision="mixed", fake=True, hardware=hw.name, op_launch_s=hw.op_launch_s)
    return profile_model(spec, opts, op_seconds=lambda kind, flops, io, mnk: hw.op_seconds("mixed", kind, flops, io, mnk))


def op_counts(spec, sizes):
    """The ops each layer dispatches, forward and backward, as a fake profile whose ops take no
    device time and 1 us each to issue: its times are the counts, in us."""
    opts = ProfileOptions(batch_sizes=sizes, precision="mixed", fake=True, op_launch_s=1e-6)
    return profile_model(spec, opts, op_seconds=lambda kind, flops, io, mnk: 0.0)


def host_per_op(measured, device, counts, sizes) -> list[tuple[str, int, float, int, float]]:
    """(kind, micro-batch, measured ms, ops, us an op) of each launch-bound kind of layer: where
    the ops' device time is under LAUNCH_BOUND of the measured time, the host's issuing them
    is what was timed."""
    rows = []
    for b in sizes:
        m, d, n = layer_ms(measured, b), layer_ms(device, b), layer_ms(counts, b)
        for kind in m:
            if d[kind] < LAUNCH_BOUND * m[kind]:
                ops = round(1e3 * n[kind])
                rows.append((kind, b, m[kind], ops, 1e3 * m[kind] / ops))
    return rows


def layer_ms(prof, b: int) -> dict[str, float]:
    """Forward + backward ms per kind of layer (the median over layers of a kind), and the loss."""
    kinds: dict[str, list[float]] = {}
    for layer in prof.layers:
        s = layer.at(b)
        kinds.setdefault(layer.kind, []).append(1e3 * (s.fwd_s + s.bwd_s))
    out = {k: statistics.median(v) for k, v in kinds.items()}
    loss = prof.loss.at(b)
    out["loss"] = 1e3 * (loss.fwd_s + loss.bwd_s)
    return out


def plain_step(prof, hw, batch: int, micro: int) -> float:
    result = search(prof, SolveOptions(gpus=1, hardware=hw, global_batch=batch, micro_batch=micro, checkpoint="none",
                                       offload="none", zero=0, workers=1))
    return result.solutions[0].prediction.step_s


def pct(a: float, b: float) -> str:
    return f"{100 * (a - b) / b:+.0f}%"


def main() -> None:
    lines = ["# Fake-mode times vs the same layers measured on one H200", "",
             "`python bench/gpu_fake.py`. Measured: `bench/gpu_check.sh` on one H200 (torch 2.11, 2026-12-04); "
             "fake: `plan profile --fake` with the H200 preset "
             f"(matmul {100 * NOW.matmul_efficiency:.1f}% of peak, knee {NOW.matmul_knee}, attention "
             f"{100 * NOW.attention_efficiency:.0f}%, memory {100 * NOW.memory_efficiency:.0f}%, "
             f"{1e6 * NOW.op_launch_s:.1f} us of host time an op), the same without the host's time (the ops' "
             f"device time alone, as fake profiles were before op_launch_s), and with the attention rate the check "
             f"measured ({100 * MEASURED.attention_efficiency:.0f}%). "
             "Forward + backward ms per kind of layer (the median over its layers), and the plain layout's "
             "step (no checkpointing, no offload) as `plan solve` predicts it from each profile, beside the "
             "step the H200 measured for that plan.", "",
             f"The preset's host time an op is the median of the last section's figures: each launch-bound "
             f"layer's measured time over the ops it dispatches (those whose ops' device time is under "
             f"{100 * LAUNCH_BOUND:.0f}% of their measured time, of at least {MIN_OPS} ops). Those layers' rows are therefore fitted, not "
             "predicted; the other rows, and the Llama's, are not.", ""]
    launch_rows = []
    for name, make_spec, measured_path, sizes, (batch, micro, run_path) in CASES:
        spec = make_spec()
        measured = load_profile(measured_path)
        now, device, faster = (fake_profile(spec, sizes, hw) for hw in (NOW, DEVICE_ONLY, MEASURED))
        launch_rows += [(name, *r) for r in host_per_op(measured, device, op_counts(spec, sizes), sizes)]
        lines += [f"## {name}", "", "| layer | micro-batch | measured ms | fake, preset | error | device time alone | error "
                  "| fake, attention 0.8 | error |", "|---|---|---|---|---|---|---|---|---|"]
        for b in sizes:
            m, f0, fd, f1 = layer_ms(measured, b), layer_ms(now, b), layer_ms(device, b), layer_ms(faster, b)
            for kind in m:
                lines.append(f"| {kind} | {b} | {m[kind]:.2f} | {f0[kind]:.2f} | {pct(f0[kind], m[kind])} "
                             f"| {fd[kind]:.2f} | {pct(fd[kind], m[kind])} | {f1[kind]:.2f} | {pct(f1[kind], m[kind])} |")
        step = load_run(run_path).step_s
        got = {label: plain_step(p, hw, batch, micro)
               for label, p, hw in (("measured profile", measured, NOW), ("fake profile", now, NOW),
                                    ("fake profile's device time alone", device, NOW),
                                    ("fake profile with attention at 0.8", faster, MEASURED))}
        lines += ["", f"Plain layout, micro-batch {micro} x {batch // micro}: measured step {step:.4f} s "
                      f"({run_path.relative_to(ROOT)}); predicted "
                  + ", ".join(f"from the {k} {v:.4f} s ({pct(v, step)})" for k, v in got.items()) + ".", ""]
        print(f"{name}: step {step:.4f} s; " + ", ".join(f"{k} {v:.4f} ({pct(v, step)})" for k, v in got.items()),
              flush=True)
    lines += ["## The host's time an op", "",
              f"Launch-bound layers (their ops' device time under {100 * LAUNCH_BOUND:.0f}% of their measured time): "
              "measured forward + backward over the ops they dispatch (views included).", "",
              "| model | layer | micro-batch | measured ms | ops | us an op |", "|---|---|---|---|---|---|"]
    lines += [f"| {model} | {kind} | {b} | {ms:.2f} | {ops} | {us:.1f} |" for model, kind, b, ms, ops, us in launch_rows]
    many = [r[-1] for r in launch_rows if r[-2] >= MIN_OPS]
    lines += ["", f"Median over the layers of at least {MIN_OPS} ops: {statistics.median(many):.1f} us an op "
                  f"(the preset: {1e6 * NOW.op_launch_s:.1f}). Fewer ops time the harness's fixed cost per timed "
                  "call and kernels the rates miss more than issuing: those rows are shown, not used."]
    out = ROOT / "bench" / "results" / "gpu_fake.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
