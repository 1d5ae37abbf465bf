"""How much two runs of bench/time_fidelity.py differ, layout by layout.

Each run of the bench is one reading of a noisy machine: new runs, a new calibration, new
profiles. Set beside an earlier run of the same grid, this says how far a layout's measured
step, its prediction and their error moved between the two, and which layouts were off the
same way in both (the model's steady misses, as against one run's noise).

    python bench/fidelity_drift.py OLD.csv [NEW.csv]   # NEW: bench/results/time_fidelity.csv
                                                       # writes bench/results/time_fidelity_drift.md

An earlier table is in the repository's history: `git show COMMIT:bench/results/time_fidelity.csv > old.csv`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "time_fidelity_drift.md"
STEADY_PCT = 10.0      # a layout off by more than this, the same way in both runs, is a steady miss


def per_layout(csv: Path) -> pd.DataFrame:
    """One row per (model, layout): the median over runs of predicted and measured step, and the error in %."""
    runs = pd.read_csv(csv)
    out = runs.groupby(["model", "layout"], sort=False).agg(predicted=("predicted_s", "median"),
                                                           measured=("measured_s", "median")).reset_index()
    out["error"] = 100 * (out.predicted / out.measured - 1)
    return out


def drift(old: pd.DataFrame, new: pd.DataFrame) -> pd.DataFrame:
    """The layouts of both runs, with how far each figure moved (percent, error in points)."""
    both = old.merge(new, on=["model", "layout"], suffixes=("_old", "_new"), sort=False)
    both["measured_moved"] = 100 * (both.measured_new / both.measured_old - 1)
    both["predicted_moved"] = 100 * (both.predicted_new / both.predicted_old - 1)
    both["error_moved"] = both.error_new - both.error_old
    both["steady_miss"] = ((both.error_old.abs() > STEADY_PCT) & (both.error_new.abs() > STEADY_PCT)
                           & ((both.error_old > 0) == (both.error_new > 0)))
    return both


def summary(both: pd.DataFrame) -> list[str]:
    lines = ["| figure | median | 90th percentile | most |", "|---|---|---|---|"]
    for col, name, unit in (("measured_moved", "measured step moved", "%"),
                            ("predicted_moved", "prediction moved", "%"),
                            ("error_moved", "error moved", " points")):
        x = both[col].abs()
        lines.append(f"| {name} | {x.median():.1f}{unit} | {x.quantile(0.9):.1f}{unit} | {x.max():.1f}{unit} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path, nargs="?", default=ROOT / "bench" / "results" / "time_fidelity.csv")
    args = ap.parse_args()
    for path in (args.old, args.new):
        if not path.exists():
            raise SystemExit(f"{path} does not exist; give the .csv a run of bench/time_fidelity.py wrote.")
    both = drift(per_layout(args.old), per_layout(args.new))
    if both.empty:
        raise SystemExit(f"{args.old} and {args.new} share no layout; give two runs of the same grid.")
    lines = ["# Time fidelity: two runs side by side", "",
             f"`python bench/fidelity_drift.py {args.old.name} {args.new.name}`: {len(both)} layouts in both; "
             "per layout the median over its runs; moved = new against old (measured and predicted in %, the "
             f"error in points); a steady miss is off by more than {STEADY_PCT:g}% the same way in both.", ""]
    lines += summary(both) + ["", "| model | layout | error old | error new | prediction moved | measured moved | steady miss |",
                              "|---|---|---|---|---|---|---|"]
    for r in both.itertuples():
        lines.append(f"| {r.model} | {r.layout} | {r.error_old:+.1f}% | {r.error_new:+.1f}% | {r.predicted_moved:+.1f}% "
                     f"| {r.measured_moved:+.1f}% | {'yes' if r.steady_miss else ''} |")
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten: {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
