"""Where an FSDP2 step's dp_comm goes: collective waits, and FSDP2's own hooks and copies.

The runtime's breakdown (runtime/breakdown.py) gives everything inside FSDP2's `FSDP::`
regions to dp_comm: the waits on its all-gathers, reduce-scatters and all-reduces, and the
hooks, the copies into and out of the flat buffers and the collectives' issue. The cost model
prices those apart: the collectives from the calibrated fits, the hooks and copies from the
profile (`fsdp_overhead_s`). This bench runs layouts kept by `bench/time_fidelity.py --keep`
again under torchrun (4 CPU processes), its breakdown step split finer: the self time of the
`FSDP::all_gather` and `FSDP::post_backward_reduce` regions (no op of this thread runs there:
the rank waits on the collective, which gloo runs on its own threads) against the rest.

    python bench/time_fidelity.py --keep DIR ...        # first, once
    python bench/dp_comm_split.py [--kept DIR] [--runs 2]  # writes bench/results/dp_comm_split.md

Each figure is the median over the 4 ranks and the runs of one profiled step; predictions are
today's cost model's, from the kept profile.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "dp_comm_split.md"
LAYOUTS = ["dp4_zero0", "dp4_zero2", "dp4_zero3"]
MODELS = ["mlp", "gpt", "llama"]
WAITS = ("FSDP::all_gather", "FSDP::post_backward_reduce")    # regions whose own time is a collective's wait


def split_events(events) -> dict[str, float]:
    """Seconds of the busiest thread's FSDP:: regions: waits (WAITS' self time) and the rest."""
    from runtime import breakdown
    per_thread = Counter()
    for e in events:
        if e.cpu_parent is None:
            per_thread[e.thread] += e.cpu_time_total
    main = per_thread.most_common(1)[0][0]
    out = Counter()
    for e in events:
        if e.thread != main:
            continue
        up = e
        while up is not None and breakdown.component_of(up.name) is None:
            up = up.cpu_parent
        if up is None or not up.name.startswith("FSDP::"):
            continue
        wait = up is e and re.sub(r" \(\d+\)$", "", e.name) in WAITS
        out["waits" if wait else "hooks"] += e.self_cpu_time_total / 1e6
    return dict(out)


def as_runtime(argv: list[str]) -> None:
    """Run `python -m runtime argv` with the breakdown step's events also split (split_events),
    each rank's split written to $SPLIT_DIR/rank{RANK}.json."""
    from runtime import breakdown
    attribute = breakdown.attribute

    def attribute_and_split(events):
        Path(os.environ["SPLIT_DIR"], f"rank{os.environ['RANK']}.json").write_text(json.dumps(split_events(events)))
        return attribute(events)
    breakdown.attribute = attribute_and_split
    sys.argv = ["runtime", *argv]
    runpy.run_module("runtime", run_name="__main__")


def measure(plan_path: Path, tmp: Path) -> list[dict[str, float]]:
    """One launch of the plan: each rank's split (seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "SPLIT_DIR": str(tmp)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone",
                           __file__, "--as-runtime", str(plan_path), "--steps", "8", "--out", str(tmp / "run.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stdout[-2000:], proc.stderr[-3000:])
        raise SystemExit(f"{plan_path.name}: the run failed")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(4)]


def predicted(kept: Path, model: str, layout: str) -> tuple[float, float]:
    """Today's cost model on the kept layout: (collectives, hooks and copies) in seconds a step."""
    from planner.build import layout_of
    from planner.cost import CostModel
    from planner.hardware import get_hardware
    from planner.plan import load_plan
    from profiles.schema import load_profile
    hw = get_hardware("cpu")
    cost = CostModel(load_profile(kept / f"{model}.profile.json"), hw, 8, hw.usable_memory_bytes())
    cand, stages = layout_of(load_plan(kept / f"{model}-{layout}.json"))
    layers, _ = cost.stage_costs(cand, 0, stages[0])
    m = cand.num_micro_batches
    collectives = m * sum(c.comm_s - c.tp_comm_s for c in layers) + cost.stage_terms(cand, 0, stages[0]).exposed_sync
    hooks = sum(m * c.fsdp_hooks_s + c.fsdp_sync_copies_s for c in layers)
    return collectives, hooks


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--as-runtime":
        as_runtime(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kept", type=Path, default=ROOT / "bench" / "results" / "time_fidelity_runs")
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    rows = []
    for model in MODELS:
        for layout in LAYOUTS:
            plan = args.kept / f"{model}-{layout}.json"
            if not plan.exists():
                raise SystemExit(f"{plan} is missing; keep a run with `python bench/time_fidelity.py --keep {args.kept}` first.")
            splits = []
            for _ in range(args.runs):
                with tempfile.TemporaryDirectory() as tmp:
                    splits += measure(plan, Path(tmp))
            waits = statistics.median(s.get("waits", 0.0) for s in splits)
            hooks = statistics.median(s.get("hooks", 0.0) for s in splits)
            pred_waits, pred_hooks = predicted(args.kept, model, layout)
            rows.append((model, layout.replace("_", " ").replace("zero", "ZeRO "), pred_waits, waits, pred_hooks, hooks))
            print(f"{model} {layout}: collectives {pred_waits * 1e3:.1f} / {waits * 1e3:.1f} ms, "
                  f"hooks and copies {pred_hooks * 1e3:.1f} / {hooks * 1e3:.1f} ms (predicted / measured)", flush=True)
    lines = ["# Where FSDP2's dp_comm goes", "",
             f"`python bench/dp_comm_split.py --runs {args.runs}` on 2 CPU cores, {date.today()}: the layouts kept in "
             f"{args.kept.relative_to(ROOT) if args.kept.is_relative_to(ROOT) else args.kept} run again on 4 processes; "
             "each figure the median over ranks and runs of one profiled step (ms); predicted by today's cost model "
             "from the kept profile. Collectives: the waits inside FSDP2's all-gather and reduce-backward regions "
             "(predicted: the calibrated collectives, exposed). Hooks and copies: the rest of its FSDP:: regions "
             "(predicted: the profile's fsdp_overhead_s, times the contention scale).", "",
             "| model | layout | collectives pred | collectives meas | ratio | hooks and copies pred | hooks and copies meas | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for model, layout, pw, w, ph, h in rows:
        lines.append(f"| {model} | {layout} | {pw * 1e3:.1f} | {w * 1e3:.1f} | {pw / w if w else float('nan'):.2f} "
                     f"| {ph * 1e3:.1f} | {h * 1e3:.1f} | {ph / h if h else float('nan'):.2f} |")
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
