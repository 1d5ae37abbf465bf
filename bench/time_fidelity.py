"""Predicted vs measured step time: a grid of layouts on 4 CPU processes, run for real.

For examples/gpt.py, examples/mlp.py and the tiny Hugging Face Llama, profiles the model on
this CPU (one thread, as every rank runs), then runs each layout of a grid of 4-process
layouts (dp with ZeRO 0-3, accumulation, checkpointing (full and selective), offload, tp, pp with 1F1B and GPipe,
dp x tp, pp x dp (also interleaved and looped BFS, two stages a rank), pp x tp) plus the layout the free `plan solve` chooses, each `--runs` times
under torchrun. Prints, per layout, the predicted step time, the measured median of the runs
(each run's figure: over its 7 timed steps, the median of the slowest rank's time) and their spread
(the noise band), the error, and the measured time by component of the slowest rank's
profiled step beside the prediction; per model, the median and worst error,
the rank correlation of predicted and measured times, and the free choice's measured time
over the fastest layout's. A fixed probe (bench/machine_probe.py: one process's matmul rate,
and four processes' at once) is taken before calibrating, before each model's profile and
after each round of its runs, so the table says how far the machine moved between a
model's profile and its runs.

    python bench/time_fidelity.py [--models gpt,mlp,llama] [--runs 3] [--out NAME] [--keep DIR]  # writes bench/results/NAME.{md,csv} (time_fidelity)
    python bench/time_fidelity.py --again DIR --out NAME   # today's cost model against the runs kept in DIR, nothing run

Before anything runs, `plan calibrate --runs 3` measures this machine's collectives, core sharing and
pipeline overhead, and the layouts are predicted with that cluster file, as a user plans after
calibrating: this shared VM's collectives move by half between days (all-gather over 4
processes: 5.4 ms of latency on 2026-12-01, 3.5-3.9 ms on 2026-12-03), and a preset from another
day measures the drift, not the model. `--hardware cpu` predicts with the built-in preset
instead. `--again` predicts every layout kept in DIR (by `--keep`) again from its kept profile
(and kept cluster file, where there is one) and compares it with the same measured runs: a
change to the cost model is judged without the noise of new runs and new profiles (these
shared cores move both by 10-25% between runs). A model whose runs were kept from a launch of their
own is predicted with that launch's cluster file, kept as MODEL.cluster.toml.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from fidelity import MODELS, Case, example_spec, stages_for  # noqa: E402
from machine_probe import probe  # noqa: E402
from planner.build import build_plan, layout_of  # noqa: E402
from planner.cost import Candidate, CostModel, tp_divides  # noqa: E402
from planner.hardware import get_hardware  # noqa: E402
from planner.search import Solution, SolveOptions, search  # noqa: E402
from planner.run_report import load_run  # noqa: E402
from planner.verify import MEASURED_COMPONENTS, compare, compare_time  # noqa: E402
from planner.plan import load_plan  # noqa: E402
from profiles.model_file import ModelFileError  # noqa: E402
from profiles.schema import load_profile  # noqa: E402

GLOBAL_BATCH = 16
# Every micro-batch size a layout of 4 processes can take at this global batch: the profile
# measures them all, as `plan solve` advises when its choice lies beyond the measured sizes.
# Extended along a line from 1, 2 and 4 instead (the profiler's default), the MLP's blocks at
# 16 came out at twice what they measure (7 ms a step's layers, against 14-15 ms from the
# fit; 2026-12-04), and its two rows at 16 measured 73% and 87% off.
PROFILED_SIZES = (1, 2, 4, 8, 16)
STEPS = 12            # 1 warm-up, 1 memory, 7 timed, 3 under the profiler (the breakdown: their median; 1 until stop 52)
GRID = [
    Case("dp4 zero0", dp=4, b=4),
    Case("dp4 zero0 accumulate 4", dp=4, b=1, m=4),
    Case("dp4 zero0 checkpoint some", dp=4, b=4, checkpoint="some"),
    Case("dp4 zero1", dp=4, b=4, zero=1),
    Case("dp4 zero2", dp=4, b=4, zero=2),
    Case("dp4 zero3", dp=4, b=4, zero=3),
    Case("dp4 zero3 checkpoint all", dp=4, b=4, zero=3, checkpoint="all"),
    Case("dp4 zero3 selective all", dp=4, b=4, zero=3, checkpoint="selective"),
    Case("dp4 zero3 offload some", dp=4, b=4, zero=3, offload="some"),
    Case("dp2 x tp2", dp=2, tp=2, b=8),
    Case("dp2 x tp2 sp", dp=2, tp=2, b=8, sp=True),
    Case("tp4", tp=4, b=16),
    Case("pp2 x dp2 1f1b", pp=2, dp=2, b=2, m=4),
    Case("pp2 x dp2 interleaved v2", pp=2, dp=2, b=2, m=4, v=2, schedule="interleaved"),
    Case("pp2 x dp2 looped bfs v2", pp=2, dp=2, b=2, m=4, v=2, schedule="looped_bfs"),
    Case("pp4 1f1b", pp=4, b=4, m=4),
    Case("pp4 gpipe", pp=4, b=4, m=4, schedule="gpipe"),
    Case("pp2 x tp2 1f1b", pp=2, tp=2, b=4, m=4),
]


def profile(model: str, workdir: Path):
    from profiles.measure import ProfileOptions, profile_model
    prof = profile_model(example_spec(model), ProfileOptions(batch_sizes=PROFILED_SIZES, repeats=5))
    path = workdir / f"{model}.profile.json"
    prof.save(path)
    return prof, path


CALIBRATIONS = 3   # plan calibrate --runs: each figure the median of three, as the cpu preset was built


def calibrate_here(workdir: Path) -> Path:
    """`plan calibrate --device cpu --processes 2,4 --runs 3 -o workdir/cluster.toml`: this machine now."""
    path = workdir / "cluster.toml"
    proc = subprocess.run([sys.executable, str(ROOT / "cli.py"), "calibrate", "--device", "cpu", "--processes", "2,4",
                           "--runs", str(CALIBRATIONS), "-o", str(path)], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stdout[-2000:], proc.stderr[-3000:])
        raise SystemExit("plan calibrate failed")
    print(f"calibrated: {path}", flush=True)
    return path


def write_case_plan(case: Case, prof, prof_path: Path, cost: CostModel, path: Path):
    """The plan of a pinned layout of 4 processes, written to `path`: (candidate, stages, prediction)."""
    offload = case.offload != "none"
    fsdp = case.dp > 1 or offload or case.precision == "mixed"
    cand = Candidate(case.dp, case.tp, case.pp, case.b, case.m, case.zero, case.schedule, fsdp, offload, case.v, case.sp)
    stages = stages_for(prof.n_layers, case)
    pred = cost.evaluate(cand, stages)
    hw = cost.hw
    opts = SolveOptions(gpus=4, hardware=hw, global_batch=cand.global_batch)
    build_plan(Solution(cand, stages, pred), [], prof, str(prof_path), hw, opts, hw.usable_memory_bytes(), str(path)).save(path)
    return cand, stages, pred


def plans_for(model: str, prof, prof_path: Path, workdir: Path, hw) -> list[tuple[str, Path, float]]:
    """(layout name, plan path, predicted step seconds) for the grid and the free choice."""
    cost = CostModel(prof, hw, 8, hw.usable_memory_bytes())
    out = []
    for case in GRID:
        if case.tp > 1 and not tp_divides(prof, case.tp) or case.pp * case.v > prof.n_layers \
                or case.sp and not prof.sequence_parallel:
            continue
        path = workdir / f"{model}-{case.name.replace(' ', '_')}.json"
        _, _, pred = write_case_plan(case, prof, prof_path, cost, path)
        out.append((case.name, path, pred.step_s))
    opts = SolveOptions(gpus=4, hardware=hw, global_batch=GLOBAL_BATCH)
    result = search(prof, opts)
    best = result.solutions[0]
    path = workdir / f"{model}-free.json"
    build_plan(best, result.solutions[1:], prof, str(prof_path), hw, opts, hw.usable_memory_bytes(), str(path)).save(path)
    out.append((f"free choice: {best.candidate.describe()}", path, best.prediction.step_s))
    return out


def run(plan_path: Path, k: int) -> dict:
    return launch(plan_path, plan_path.with_suffix(f".run{k}.json"))


def launch(plan_path: Path, out: Path, env: dict[str, str] | None = None):
    """One run of the plan under torchrun on 4 CPU processes of one thread (STEPS steps, more
    environment from `env`); its run.json written to `out` and loaded."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--standalone",
                           "-m", "runtime", str(plan_path), "--steps", str(STEPS), "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stdout[-2000:], proc.stderr[-3000:])
        raise SystemExit(f"{plan_path.name}: the run failed")
    return load_run(out)


def row(model: str, name: str, k: int, plan, doc) -> dict:
    """One run of one layout: predicted (the plan's) and measured step, and both by component."""
    comps, _ = compare_time(plan, doc)
    return {"model": model, "layout": name, "run": k, "predicted_s": plan.predicted.step_time_s, "measured_s": doc.step_s,
            **{f"pred_{c.component}_s": c.predicted for c in comps},
            **{f"meas_{c.component}_s": c.measured for c in comps}}


def probe_now(model: str, when: str) -> dict:
    """bench/machine_probe.py's matmul rate now, alone and with 4 processes at once."""
    out = {"model": model, "when": when, "time": time.strftime("%H:%M"), "one_gflops": probe(1), "four_gflops": probe(4)}
    print(f"probe {model} {when}: one process {out['one_gflops']:.1f}, four {out['four_gflops']:.1f} GFLOP/s each", flush=True)
    return out


def check_models(models: list[str]) -> None:
    """Every model named can be built, before anything is measured: a missing package (the Llama
    needs transformers) stopped a run of stop 52 after the other two models' 25 minutes, before
    its table was written (their kept runs gave it back with --again)."""
    for model in models:
        if model not in MODELS:
            raise SystemExit(f"no model {model!r} in this bench; pass --models from {', '.join(MODELS)}.")
        try:
            example_spec(model)
        except ModelFileError as e:
            raise SystemExit(f"{model}: {e}") from None


def run_grid(models: list[str], runs: int, keep: Path | None, hardware: str | None) -> tuple[list[dict], list[dict]]:
    """(one row per run of each layout, the machine probes taken along the way)."""
    rows, probes = [], []
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = keep or Path(tmp)
        if not hardware:
            probes.append(probe_now("-", "calibration"))
        hw = get_hardware(hardware or str(calibrate_here(workdir)))
        for model in models:
            probes.append(probe_now(model, "profile"))
            prof, prof_path = profile(model, workdir)
            plans = plans_for(model, prof, prof_path, workdir, hw)
            for k in range(runs):          # runs interleaved, so slow drift hits every layout alike
                for name, path, _ in plans:
                    t = time.perf_counter()
                    doc, plan = run(path, k), load_plan(path)
                    compare(plan, path, doc)     # the run is this plan's (its hash), or one sentence
                    rows.append(row(model, name, k, plan, doc))
                    print(f"{model:5s} {name:40s} run {k}: predicted {rows[-1]['predicted_s']:.4f} s, "
                          f"measured {rows[-1]['measured_s']:.4f} s ({time.perf_counter() - t:.0f} s)", flush=True)
                probes.append(probe_now(model, f"after run {k}"))
        if keep:
            pd.DataFrame(probes).to_csv(keep / "probes.csv", index=False)
    return rows, probes


def probe_table(probes: pd.DataFrame) -> list[str]:
    """The probes as markdown, and per model how far the machine moved between its profile
    and its runs."""
    md = ["", "Machine probe (`bench/machine_probe.py`: 256 x 256 fp32 matmuls for a second, one thread per "
          "process; GFLOP/s of the median process), taken before calibrating, before each model's profile "
          "and after each round of its runs:", "",
          "| model | when | time | 1 process | 4 processes at once |", "|---|---|---|---|---|"]
    md += [f"| {p.model} | {p.when} | {p.time} | {p.one_gflops:.1f} | {p.four_gflops:.1f} |" for p in probes.itertuples()]
    for model, g in probes[probes["model"] != "-"].groupby("model", sort=False):
        at_profile, runs = g.iloc[0], g.iloc[1:]
        if runs.empty:
            continue
        md.append(f"- {model}: one process {100 * (runs.one_gflops.median() / at_profile.one_gflops - 1):+.0f}% "
                  f"and four at once {100 * (runs.four_gflops.median() / at_profile.four_gflops - 1):+.0f}% "
                  "during its runs (median of the rounds) against its profile's time.")
    return md


def evaluate_again(models: list[str], kept: Path, hardware: str | None) -> list[dict]:
    """The layouts kept in `kept` predicted by today's cost model from their kept profiles
    (with the kept cluster file, the model's own where it has one, or `hardware`), beside their
    kept runs."""
    rows = []
    for model in models:
        cluster = next((c for c in (kept / f"{model}.cluster.toml", kept / "cluster.toml") if c.exists()), None)
        hw = get_hardware(hardware or (str(cluster) if cluster else "cpu"))
        prof_path = kept / f"{model}.profile.json"
        if not prof_path.exists():
            raise SystemExit(f"{prof_path} is missing; keep a run with `--keep {kept}` first.")
        prof = load_profile(prof_path)
        cost = CostModel(prof, hw, 8, hw.usable_memory_bytes())
        opts = SolveOptions(gpus=4, hardware=hw, global_batch=GLOBAL_BATCH)
        named = [(case.name, f"{model}-{case.name.replace(' ', '_')}") for case in GRID]
        free_cand, free_stages = layout_of(load_plan(kept / f"{model}-free.json"))
        named.append((f"free choice: {free_cand.describe()}", f"{model}-free"))
        best = search(prof, opts).solutions[0]
        if (best.candidate.describe(), best.stages) != (free_cand.describe(), free_stages):
            print(f"{model}: today's model would choose {best.candidate.describe()}, not the kept free choice")
        for name, stem in named:
            plan_path = kept / f"{stem}.json"
            if not plan_path.exists():
                continue                     # a grid layout this model does not admit
            cand, stages = layout_of(load_plan(plan_path))
            sol = Solution(cand, stages, cost.evaluate(cand, stages))
            again = build_plan(sol, [], prof, str(prof_path), hw, opts, hw.usable_memory_bytes(), str(plan_path))
            for run_path in sorted(kept.glob(f"{stem}.run*.json")):
                rows.append(row(model, name, int(run_path.suffixes[-2][4:]), again, load_run(run_path)))
    return sorted(rows, key=lambda r: (models.index(r["model"]), r["run"]))     # as run_grid orders them


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt,mlp,llama")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="time_fidelity", help="name of the table in bench/results/ (.md and .csv)")
    ap.add_argument("--keep", type=Path, default=None,
                    help="keep the profiles, plans and run.json files in this folder (to evaluate the cost model again on them)")
    ap.add_argument("--again", type=Path, default=None,
                    help="run nothing: predict the layouts kept in this folder again and compare with their kept runs")
    ap.add_argument("--hardware", default=None,
                    help="predict with this preset or cluster file (default: calibrate this machine first; "
                         "with --again, the kept cluster.toml, else the cpu preset)")
    args = ap.parse_args()
    models = args.models.split(",")
    if args.again:
        rows = evaluate_again(models, args.again, args.hardware)
        kept_probes = args.again / "probes.csv"
        probes = pd.read_csv(kept_probes).to_dict("records") if kept_probes.exists() else []
        args.runs = max(r["run"] for r in rows) + 1
    else:
        check_models(models)
        rows, probes = run_grid(models, args.runs, args.keep, args.hardware)
    raw = pd.DataFrame(rows)
    comp_cols = [c for c in raw.columns if c.startswith(("pred_", "meas_"))]
    agg = raw.groupby(["model", "layout"], sort=False).agg(
        predicted_s=("predicted_s", "first"), measured_s=("measured_s", "median"),
        low_s=("measured_s", "min"), high_s=("measured_s", "max"), **{c: (c, "median") for c in comp_cols}).reset_index()
    agg["error_pct"] = 100 * (agg["predicted_s"] - agg["measured_s"]) / agg["measured_s"]
    agg["noise_pct"] = 100 * (agg["high_s"] - agg["low_s"]) / agg["measured_s"]
    summary = []
    for model, g in agg.groupby("model", sort=False):
        free = g[g["layout"].str.startswith("free choice")].iloc[0]
        fastest = g.loc[g["measured_s"].idxmin()]
        # within noise: the free choice's fastest run no slower than the fastest layout's slowest
        within = "yes" if free["low_s"] <= fastest["high_s"] else "no"
        summary.append({
            "model": model, "layouts": len(g), "median_abs_error_pct": g["error_pct"].abs().median(),
            "worst_abs_error_pct": g["error_pct"].abs().max(),
            "rank_correlation": g["predicted_s"].rank().corr(g["measured_s"].rank()),
            "free_over_fastest": free["measured_s"] / g["measured_s"].min(),
            "free_within_noise": ("it is the fastest" if fastest["layout"] == free["layout"]
                                  else f"{within} (fastest: {fastest['layout']})"),
            "median_noise_pct": g["noise_pct"].median(),
        })
    summ = pd.DataFrame(summary)

    table = Table(title=f"predicted vs measured step time, 4 CPU processes (gloo), median of {args.runs} runs")
    for col in ("model", "layout", "pred ms", "meas ms", "spread", "error"):
        table.add_column(col, justify="left" if col in ("model", "layout") else "right")
    for _, r in agg.iterrows():
        table.add_row(r["model"], r["layout"], f"{1e3 * r['predicted_s']:.1f}", f"{1e3 * r['measured_s']:.1f}",
                      f"{r['noise_pct']:.0f}%", f"{r['error_pct']:+.0f}%")
    Console().print(table)
    print(summ.to_string(index=False, float_format=lambda v: f"{v:.2f}"))

    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    raw.to_csv(out / f"{args.out}.csv", index=False)
    comps = MEASURED_COMPONENTS
    flag = f" --hardware {args.hardware}" if args.hardware else ""
    how = (f"--models {args.models} --again {args.again}{flag}` on {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}: "
           f"the runs kept in {args.again} (nothing run again), predicted by today's cost model from their kept profiles "
           f"with {args.hardware or 'their kept cluster file (the cpu preset where none was kept)'}; "
           if args.again else
           f"--models {args.models} --runs {args.runs}{flag}` on {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}: "
           f"predicted with {args.hardware or '`plan calibrate --runs 3` of this machine run first (each figure the median of three)'}; ")
    md = [f"# Time fidelity\n\n`python bench/time_fidelity.py {how}every layout of 4 processes, global batch {GLOBAL_BATCH}, each run "
          f"{args.runs} times (interleaved); measured = the median over runs of each run's step (RunReport.step_s: "
          "the median over its 7 timed steps of the slowest rank's time, every rank starting each step at once); "
          "spread = (max - min) / median over the runs; the free choice is within noise of the fastest layout when "
          "its fastest run took no longer than that layout's slowest.\n",
          "| model | layouts | median error | worst error | rank correlation | free choice / fastest | "
          "free choice within noise of the fastest | median spread |",
          "|---|---|---|---|---|---|---|---|"]
    md += [f"| {s['model']} | {s['layouts']} | {s['median_abs_error_pct']:.1f}% | {s['worst_abs_error_pct']:.1f}% | "
           f"{s['rank_correlation']:.2f} | {s['free_over_fastest']:.2f} | "
           f"{s['free_within_noise']} | "
           f"{s['median_noise_pct']:.0f}% |" for s in summary]
    md += ["", "| model | layout | predicted ms | measured ms | spread | error | " +
           " | ".join(f"{c} pred / meas" for c in comps) + " |", "|---" * (6 + len(comps)) + "|"]
    for _, r in agg.iterrows():
        parts = " | ".join(f"{1e3 * r.get(f'pred_{c}_s', 0):.0f} / {1e3 * r.get(f'meas_{c}_s', 0):.0f}" for c in comps)
        md.append(f"| {r['model']} | {r['layout']} | {1e3 * r['predicted_s']:.1f} | {1e3 * r['measured_s']:.1f} | "
                  f"{r['noise_pct']:.0f}% | {r['error_pct']:+.1f}% | {parts} |")
    if probes:
        md += probe_table(pd.DataFrame(probes))
    (out / f"{args.out}.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out / (args.out + '.md')} and {out / (args.out + '.csv')}")


if __name__ == "__main__":
    main()
