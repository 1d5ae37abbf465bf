"""Pipelines whose ranks share the cores: predicted against measured as micro-batches are added.

On 4 CPU processes over 2 cores a pipeline's slots grow with the ranks busy at once, not with
the work alone: the cost model slows each slot's compute and the schedule's overhead per action
by the busy ranks over `host_cores` (planner/cost.py, compute_scale). This runs examples/mlp.py
(whose stages compute 1-2 ms a micro-batch, so the overhead shows most) as pp 4 with 1, 2, 4
and 8 micro-batches of 4 samples (GPipe; 1F1B for 4 and 8) and one micro-batch of 16, each
`--runs` times, interleaved, and prints the measured step beside the cost model's prediction.
Like bench/time_fidelity.py it calibrates this machine first, unless `--hardware` names a
preset or cluster file. `--model gpt` (or llama) runs that model of bench/time_fidelity.py
instead, whose actions are longer (the GPT's stages about 5 ms a micro-batch of 4).

    python bench/pipeline_contention.py [--runs 3] [--hardware FILE]   # writes bench/results/pipeline_contention.md
    python bench/pipeline_contention.py --model gpt                    # ... pipeline_contention_gpt.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from fidelity import MODELS, Case  # noqa: E402
from time_fidelity import calibrate_here, profile, run, write_case_plan  # noqa: E402
from planner.cost import CostModel  # noqa: E402
from planner.hardware import get_hardware  # noqa: E402

GRID = [Case(f"pp4 b4x{m} gpipe", pp=4, b=4, m=m, schedule="gpipe") for m in (1, 2, 4, 8)] \
    + [Case(f"pp4 b4x{m} 1f1b", pp=4, b=4, m=m) for m in (4, 8)] \
    + [Case("pp4 b16x1 gpipe", pp=4, b=16, m=1, schedule="gpipe")]       # (1F1B needs m >= pp)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--hardware", default=None, help="preset or cluster file (default: calibrate this machine first)")
    ap.add_argument("--model", default="mlp", choices=sorted(MODELS), help="which of bench/time_fidelity.py's models")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        hw = get_hardware(args.hardware or str(calibrate_here(work)))
        prof, prof_path = profile(args.model, work)
        model = CostModel(prof, hw, 8, hw.usable_memory_bytes())
        plans = []
        for case in GRID:
            path = work / f"{case.name.replace(' ', '_')}.json"
            _, _, pred = write_case_plan(case, prof, prof_path, model, path)
            plans.append((case, path, pred.step_s))
        measured = {case.name: [] for case, *_ in plans}
        for k in range(args.runs):
            for case, path, *_ in plans:
                measured[case.name].append(run(path, k).step_s)
                print(f"{case.name:18s} run {k}: {1e3 * measured[case.name][-1]:.1f} ms", flush=True)
    rows = ["| layout | measured ms (runs) | predicted ms | error |", "|---|---|---|---|"]
    for case, _, pred in plans:
        runs = measured[case.name]
        med = statistics.median(runs)
        rows.append(f"| {case.name} | {1e3 * med:.1f} ({', '.join(f'{1e3 * t:.1f}' for t in runs)}) | {1e3 * pred:.1f} | "
                    f"{100 * (pred / med - 1):+.1f}% |")
    how = args.hardware or "a `plan calibrate` of this machine run first"
    text = (f"# Pipelines on shared cores\n\n`python bench/pipeline_contention.py --runs {args.runs}"
            f"{' --hardware ' + args.hardware if args.hardware else ''}"
            f"{' --model ' + args.model if args.model != 'mlp' else ''}` on {os.cpu_count()} CPU cores, "
            f"{time.strftime('%Y-%m-%d')}: {MODELS[args.model]} as pp 4 on 4 processes, predicted with {how} "
            f"(pipeline_overhead_s {1e3 * hw.pipeline_overhead_s:.2f} ms, host_cores {hw.host_cores:.2f}); measured = the median over runs "
            "of each run's step (RunReport.step_s: over its 7 timed steps, the median of the slowest rank's time).\n\n" + "\n".join(rows) + "\n")
    out = ROOT / "bench" / "results" / ("pipeline_contention.md" if args.model == "mlp" else f"pipeline_contention_{args.model}.md")
    out.write_text(text)
    print(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
