"""The solve-scaling grid solved by this checkout and by another one: time and top 5 per cell.

Each checkout runs the grid of bench/solve_scaling.py (same profile, depths, GPU counts, global
batches, top 5) in a child process of its own, one after the other, so both are timed on the
machine as it is now; then the cells are set side by side: seconds before and after, and
whether the five layouts and their step times are the same.

    git worktree add /tmp/old <commit>
    python bench/solve_compare.py /tmp/old       # writes bench/results/solve_compare.md
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

GRID = """
import json, sys, time
sys.path.insert(0, {root!r})
from planner.hardware import get_hardware
from planner.search import SolveOptions, search
# The grid from the solved checkout's own solve_scaling (the same depths, GPU counts and batches
# since it was written), so that its profile is made by its own profiler, in its own schema.
sys.path.append({bench!r})
from solve_scaling import DEPTHS, GPUS, base_profile, global_batch, with_depth
prof, hw, out = base_profile(), get_hardware("h100-sxm-80g"), {{}}
for depth in DEPTHS:
    p = with_depth(prof, depth - 2)
    for g in GPUS:
        t = time.perf_counter()
        r = search(p, SolveOptions(gpus=g, hardware=hw, global_batch=global_batch(g), top_k=5))
        out[f"{{depth}} x {{g}}"] = {{"s": time.perf_counter() - t,
                                   "top": [[s.candidate.describe(), round(s.prediction.step_s, 9)] for s in r.solutions]}}
        print(f"{{depth}} x {{g}}: {{out[f'{{depth}} x {{g}}']['s']:.2f}} s", file=sys.stderr, flush=True)
json.dump(out, open({dest!r}, "w"))
"""


def solve_grid(root: Path, dest: Path) -> dict:
    """The grid solved by the checkout at `root`, in a child process that imports only from it."""
    # solve_scaling's profile, cached in the temp folder: made (once) by that checkout's profiler.
    subprocess.run([sys.executable, "-c", "import solve_scaling; solve_scaling.base_profile()"], cwd=root / "bench", check=True)
    code = GRID.format(root=str(root), bench=str(root / "bench"), dest=str(dest))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tempfile.gettempdir())
    return json.loads(dest.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("other", type=Path, help="another checkout of the project (e.g. a git worktree of an earlier commit)")
    args = ap.parse_args()
    if not (args.other / "planner" / "search.py").exists():
        sys.exit(f"{args.other} is not a checkout of this project; give a folder with planner/search.py in it.")
    with tempfile.TemporaryDirectory() as tmp:
        before = solve_grid(args.other.resolve(), Path(tmp) / "before.json")
        after = solve_grid(ROOT, Path(tmp) / "after.json")
    rows = []
    for cell in after:
        b, a = before[cell], after[cell]
        same = "same" if a["top"] == b["top"] else ("same best" if a["top"][:1] == b["top"][:1] else "differs")
        best = f"{b['top'][0][1]:.4g} / {a['top'][0][1]:.4g}" if a["top"] and b["top"] else "-"
        rows.append(f"| {cell} | {b['s']:.2f} | {a['s']:.2f} | {same} | {best} |")
    worst = max(v["s"] for v in after.values())
    text = (f"# Solve time, two checkouts\n\n`python bench/solve_compare.py {args.other}` on {os.cpu_count()} CPU cores, "
            f"{time.strftime('%Y-%m-%d %H:%M')}: the solve-scaling grid (layers x GPUs), wall seconds of `search` "
            f"before (that checkout) and after (this one), run one after the other; top 5 compared. Slowest cell after: "
            f"{worst:.2f} s.\n\n| cell | before s | after s | top 5 | best step s, before / after |\n|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    out = ROOT / "bench" / "results" / "solve_compare.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
