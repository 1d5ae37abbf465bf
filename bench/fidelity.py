"""Predicted vs measured: every knob, run for real.

For examples/gpt.py, examples/mlp.py and the tiny Hugging Face Llama (examples/hf-llama-tiny,
embedding and head split by vocabulary under TP), profiles the model on this CPU, builds a matrix of
plans with the cost model (one process at micro-batch 1, 2 and 4; checkpointing some and all
layers; selective checkpointing alone, beside full, under ZeRO 3, tp2 and pp2; offload; ZeRO 0-3;
dp2; tp2; pp2 with 1F1B, GPipe, interleaved 1F1B and looped BFS (two stages a rank); dp2 x tp2;
pp2 x dp2, also interleaved and looped BFS; sequence parallelism; mixed precision), runs each with the runtime under torchrun (CPU processes, gloo), and prints per
stage the predicted and measured peak memory and the error, plus predicted and measured step
time (only indicative on CPU processes sharing two cores).

    python bench/fidelity.py [--models gpt,mlp,llama] [--only NAME]   # writes bench/results/fidelity.{csv,md}
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.build import build_plan  # noqa: E402
from planner.cost import Candidate, CostModel  # noqa: E402
from planner.hardware import get_hardware  # noqa: E402
from planner.partition import even_stage_sizes  # noqa: E402
from planner.plan import Placed, load_plan, wraps_layers  # noqa: E402
from planner.search import Solution, SolveOptions  # noqa: E402
from planner.run_report import load_run  # noqa: E402
from planner.verify import compare  # noqa: E402


@dataclass
class Case:
    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1
    b: int = 2
    m: int = 1
    zero: int = 0
    schedule: str = "1f1b"
    v: int = 1                    # stages per pp rank (interleaved)
    checkpoint: str = "none"      # none | some | all | selective (every layer) | mixed (selective, every other full)
    offload: str = "none"         # none | some
    precision: str = "fp32"
    sp: bool = False              # sequence parallelism (models whose tp_plan offers it)


CASES = [
    Case("1 process b1", b=1),
    Case("1 process b2", b=2),
    Case("1 process b4", b=4),
    Case("checkpoint some", checkpoint="some"),
    Case("checkpoint all", checkpoint="all"),
    Case("selective all", checkpoint="selective"),
    Case("selective + full", checkpoint="mixed", m=2),
    Case("selective zero3 dp2", dp=2, zero=3, checkpoint="selective"),
    Case("selective tp2", tp=2, checkpoint="selective"),
    Case("selective pp2 1f1b", pp=2, m=4, checkpoint="selective"),
    Case("accumulate 4", m=4),
    Case("offload some", offload="some", zero=3),
    Case("zero0 dp2", dp=2, zero=0),
    Case("zero1 dp2", dp=2, zero=1),
    Case("zero2 dp2", dp=2, zero=2),
    Case("zero3 dp2", dp=2, zero=3),
    Case("zero3 dp2 accumulate 4", dp=2, zero=3, m=4),
    Case("tp2", tp=2),
    Case("pp2 1f1b", pp=2, m=4),
    Case("pp2 gpipe", pp=2, m=4, schedule="gpipe"),
    Case("pp2 interleaved v2", pp=2, v=2, m=4, schedule="interleaved"),
    Case("pp2 x dp2 interleaved v2", pp=2, dp=2, v=2, m=4, zero=3, schedule="interleaved"),
    Case("selective pp2 interleaved v2", pp=2, v=2, m=4, schedule="interleaved", checkpoint="selective"),
    Case("pp2 looped bfs v2", pp=2, v=2, m=4, schedule="looped_bfs"),
    Case("pp2 x dp2 looped bfs v2", pp=2, dp=2, v=2, m=2, zero=3, schedule="looped_bfs", checkpoint="some"),
    Case("dp2 x tp2", dp=2, tp=2, zero=3),
    Case("tp2 sp", tp=2, sp=True),
    Case("selective tp2 sp", tp=2, checkpoint="selective", sp=True),
    Case("dp2 x tp2 sp", dp=2, tp=2, zero=3, sp=True),
    Case("pp2 x tp2 sp", pp=2, tp=2, m=4, sp=True),
    Case("pp2 x dp2", pp=2, dp=2, m=4, zero=3),
    Case("mixed zero3 dp2", dp=2, zero=3, precision="mixed"),
]


def stages_for(n: int, case: Case) -> list[list[Placed]]:
    """Contiguous stages split as the planner splits a pipeline of several stages a rank
    (partition.even_stage_sizes: the remainder to the end stages, which also hold the embedding
    and the head); 'some' = every other layer from the second."""
    out, i = [], 0
    for count in even_stage_sizes(n, case.pp * case.v):
        st = []
        for _ in range(count):
            ck = {"all": "full", "selective": "selective", "mixed": "full" if i % 2 else "selective",
                  "some": "full" if i % 2 else "none"}.get(case.checkpoint, "none")
            off = case.offload == "some" and i % 2 == 1
            st.append(Placed(i, ck, off))
            i += 1
        out.append(st)
    return out


MODELS = {"gpt": "examples/gpt.py", "mlp": "examples/mlp.py", "llama": "examples/hf-llama-tiny"}


def example_spec(model: str):
    """The ModelSpec of one of MODELS: a model file, or a Hugging Face config folder."""
    from profiles.hf import load_hf_spec
    from profiles.model_file import load_model_file
    source = ROOT / MODELS[model]
    return load_hf_spec(str(source)) if source.is_dir() else load_model_file(source)


def profile(model: str, precision: str, cache: dict):
    key = (model, precision)
    if key not in cache:
        from profiles.measure import ProfileOptions, profile_model
        path = tempfile.mktemp(suffix=".json")
        spec = example_spec(model)
        prof = profile_model(spec, ProfileOptions(precision=precision, repeats=3))
        prof.save(path)
        cache[key] = (prof, path)
    return cache[key]


def run_case(model: str, case: Case, cache: dict, workdir: Path) -> list[dict]:
    prof, prof_path = profile(model, case.precision, cache)
    hw = get_hardware("cpu")
    offload = case.offload != "none"
    fsdp = wraps_layers(case.dp, case.precision, offload)
    cand = Candidate(case.dp, case.tp, case.pp, case.b, case.m, case.zero, case.schedule, fsdp, offload, case.v, case.sp)
    model_cost = CostModel(prof, hw, 8, hw.usable_memory_bytes())
    stages = stages_for(prof.n_layers, case)
    pred = model_cost.evaluate(cand, stages)
    opts = SolveOptions(gpus=cand.world_size, hardware=hw)
    plan_path = workdir / f"{model}-{case.name.replace(' ', '_')}.json"
    plan = build_plan(Solution(cand, stages, pred), [], prof, prof_path, hw, opts, hw.usable_memory_bytes(), str(plan_path))
    plan.save(plan_path)
    run_path = plan_path.with_suffix(".run.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cand.world_size}",
                           "--standalone", "-m", "runtime", str(plan_path), "--steps", "4", "--out", str(run_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        raise SystemExit(f"{model} / {case.name}: the run failed")
    rows, (pred_step, meas_step) = compare(load_plan(plan_path), plan_path, load_run(run_path))
    return [{"model": model, "plan": case.name, "stage": r.stage, "predicted_bytes": r.predicted,
             "measured_bytes": r.measured, "error_pct": round(r.error_pct, 3),
             "peak_phase": pred.stages[r.stage].memory.phase,
             "predicted_step_s": round(pred_step, 4), "measured_step_s": round(meas_step, 4)} for r in rows]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt,mlp,llama")
    ap.add_argument("--only", default=None, help="run only the cases with these names (comma-separated)")
    args = ap.parse_args()
    cache: dict = {}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            for case in CASES:
                if args.only and case.name not in args.only.split(","):
                    continue
                if case.sp and not profile(model, case.precision, cache)[0].sequence_parallel:
                    continue           # its tp_plan names no "sequence" modules
                t = time.perf_counter()
                case_rows = run_case(model, case, cache, Path(tmp))
                rows += case_rows
                print(f"{model:4s} {case.name:24s} {time.perf_counter() - t:5.1f}s  worst error "
                      f"{max(abs(r['error_pct']) for r in case_rows):.2f}%", flush=True)
    df = pd.DataFrame(rows)
    table = Table(title="predicted vs measured peak memory per stage (CPU processes, gloo)")
    for col in ("model", "plan", "stage", "predicted MiB", "measured MiB", "error", "peak during", "step s pred/meas"):
        table.add_column(col, justify="left" if col in ("model", "plan", "peak during") else "right")
    for r in rows:
        colour = "green" if abs(r["error_pct"]) <= 1 else ("yellow" if abs(r["error_pct"]) <= 3 else "red")
        table.add_row(r["model"], r["plan"], str(r["stage"]), f"{r['predicted_bytes'] / 2**20:.3f}",
                      f"{r['measured_bytes'] / 2**20:.3f}", f"[{colour}]{r['error_pct']:+.2f}%[/]", r["peak_phase"],
                      f"{r['predicted_step_s']:.3f} / {r['measured_step_s']:.3f}")
    Console().print(table)
    within1 = (df["error_pct"].abs() <= 1).mean() * 100
    within3 = (df["error_pct"].abs() <= 3).mean() * 100
    print(f"{len(df)} rows: {within1:.0f}% within 1%, {within3:.0f}% within 3%, worst {df['error_pct'].abs().max():.2f}%")
    if args.only is None:
        out = ROOT / "bench" / "results"
        out.mkdir(parents=True, exist_ok=True)
        df.to_csv(out / "fidelity.csv", index=False)
        md = ["| model | plan | stage | predicted MiB | measured MiB | error | peak during | step s pred / meas |",
              "|---|---|---|---|---|---|---|---|"]
        md += [f"| {r['model']} | {r['plan']} | {r['stage']} | {r['predicted_bytes'] / 2**20:.3f} | "
               f"{r['measured_bytes'] / 2**20:.3f} | {r['error_pct']:+.2f}% | {r['peak_phase']} | "
               f"{r['predicted_step_s']:.3f} / {r['measured_step_s']:.3f} |" for r in rows]
        (out / "fidelity.md").write_text(
            f"# Fidelity\n\n`python bench/fidelity.py` on {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}. "
            f"{len(df)} rows: {within1:.0f}% within 1%, {within3:.0f}% within 3%, worst "
            f"{df['error_pct'].abs().max():.2f}%.\n\n" + "\n".join(md) + "\n")
        print(f"wrote {out / 'fidelity.md'} and {out / 'fidelity.csv'}")


if __name__ == "__main__":
    main()
