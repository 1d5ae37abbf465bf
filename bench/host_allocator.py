"""What keeping freed host memory (profiles/allocator.py) does to the runtime's steps on CPU.

Runs layouts kept by `bench/time_fidelity.py --keep` under torchrun (4 CPU processes), in
turns with glibc's default thresholds (PLAN_KEEP_FREED_MEMORY=0) and with freed memory kept
(the runtime's default): the step (RunReport.step_s, the median over its timed steps of the
slowest rank) and how many cores the ranks kept busy (RunReport.cores_busy: their CPU time,
the kernel's included, over the step).

    python bench/time_fidelity.py --keep DIR ...             # first, once
    python bench/host_allocator.py [--kept DIR] [--runs 3]   # writes bench/results/host_allocator.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from datetime import date
from pathlib import Path

from time_fidelity import ROOT, STEPS, launch

RESULTS = ROOT / "bench" / "results" / "host_allocator.md"
LAYOUTS = ["mlp-dp4_zero0", "mlp-dp4_zero3", "mlp-pp4_1f1b", "gpt-dp4_zero0", "gpt-dp4_zero3", "gpt-pp4_1f1b",
           "llama-dp4_zero0", "llama-dp2_x_tp2"]
MODES = {"glibc defaults": "0", "kept": "1"}     # PLAN_KEEP_FREED_MEMORY


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kept", type=Path, default=ROOT / "bench" / "results" / "time_fidelity_runs")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="kept plans, by file name without .json")
    args = ap.parse_args()
    layouts = args.layouts.split(",")
    for name in layouts:
        if not (args.kept / f"{name}.json").exists():
            raise SystemExit(f"{args.kept / name}.json is missing; keep a run with "
                             f"`python bench/time_fidelity.py --keep {args.kept}` first.")
    got: dict[tuple[str, str], list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.runs):                     # in turns, so that a slow patch hits both alike
            for name in layouts:
                for mode, keep in MODES.items():
                    doc = launch(args.kept / f"{name}.json", Path(tmp) / "run.json", {"PLAN_KEEP_FREED_MEMORY": keep})
                    got.setdefault((name, mode), []).append((doc.step_s, doc.cores_busy))
                    print(f"{name:22} {mode:15} run {k}: {doc.step_s * 1e3:7.1f} ms, "
                          f"{doc.cores_busy or float('nan'):.2f} cores busy", flush=True)

    def summary(name, mode):
        steps = [s for s, _ in got[(name, mode)]]
        busy = [b for _, b in got[(name, mode)] if b is not None]
        med = statistics.median(steps)
        return med, (max(steps) - min(steps)) / med, statistics.median(busy) if busy else float("nan")

    kept_dir = args.kept.relative_to(ROOT) if args.kept.is_relative_to(ROOT) else args.kept
    lines = ["# Keeping freed host memory", "",
             f"`python bench/host_allocator.py --runs {args.runs}` on {os.cpu_count()} CPU cores, {date.today()}: "
             f"layouts kept in {kept_dir}, 4 processes of one thread, {STEPS} steps a run, each layout run "
             f"{args.runs} times with glibc's default thresholds (PLAN_KEEP_FREED_MEMORY=0) and as many with freed "
             "memory kept (profiles/allocator.py), in turns. Step: the median over runs of RunReport.step_s; "
             "spread: (max - min) / median over the runs; cores busy: the ranks' CPU time (the kernel's "
             "included) over the step, the median over runs.", "",
             "| layout | glibc defaults ms | spread | cores busy | kept ms | spread | cores busy | kept / defaults |",
             "|---|---|---|---|---|---|---|---|"]
    for name in layouts:
        d, ds, db = summary(name, "glibc defaults")
        kp, ks, kb = summary(name, "kept")
        lines.append(f"| {name.replace('_', ' ')} | {d * 1e3:.1f} | {ds:.0%} | {db:.2f} | {kp * 1e3:.1f} | {ks:.0%} "
                     f"| {kb:.2f} | {kp / d:.2f} |")
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten: {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
