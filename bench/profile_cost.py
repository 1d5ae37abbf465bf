"""How long profiling takes, and how much memory it needs.

Profiles examples/gpt.py and examples/mlp.py on this CPU (measured), and the 7B-class GPT of
bench/models/gpt7b.py in fake mode (FakeTensorMode, times from the H100 roofline), each in
a fresh process through the CLI, recording wall time and the process's peak resident memory.
Goals: under 30 s for examples/gpt.py; under 60 s and 2 GiB for the fake 7B.

    python bench/profile_cost.py            # prints the table, writes bench/results/profile_cost.md
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
CASES = [
    ("examples/gpt.py", [], 30, None),
    ("examples/mlp.py", [], 30, None),
    ("bench/models/gpt7b.py", ["--fake", "--hardware", "h100-sxm-80g"], 60, 2.0),
    ("bench/models/gpt7b.py", ["--fake", "--hardware", "h100-sxm-80g", "--precision", "mixed"], 60, 2.0),
]

RUNNER = """
import resource, sys, time
from typer.main import get_command
from cli import app
t = time.perf_counter()
try:
    get_command(app).main(args=sys.argv[1:], standalone_mode=False)
finally:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"@@ {time.perf_counter() - t:.3f} {rss}", file=sys.stderr)
"""


def main() -> None:
    table = Table(title="plan profile: cost of profiling (fresh process each)")
    for col in ("model", "mode", "layers", "wall s", "peak RSS GiB", "goal"):
        table.add_column(col, justify="left" if col in ("model", "mode", "goal") else "right")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, flags, goal_s, goal_gib in CASES:
            out = Path(tmp) / "p.json"
            proc = subprocess.run([sys.executable, "-c", RUNNER, "profile", model, "-o", str(out), *flags],
                                  cwd=ROOT, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
            marker = [line for line in proc.stderr.splitlines() if line.startswith("@@ ")]
            if proc.returncode or not marker:
                print(proc.stdout, proc.stderr)
                raise SystemExit(f"profiling {model} failed")
            wall, rss = marker[-1].split()[1:]
            import json
            layers = len(json.loads(out.read_text())["layers"])
            mode = "fake " + " ".join(f for f in flags if not f.startswith("--") and f != "h100-sxm-80g") if flags else "measured (cpu)"
            goal = f"< {goal_s} s" + (f", < {goal_gib} GiB" if goal_gib else "")
            ok = float(wall) < goal_s and (goal_gib is None or int(rss) / 2**30 < goal_gib)
            row = (model, mode.strip(), str(layers), f"{float(wall):.1f}", f"{int(rss) / 2**30:.2f}",
                   goal + (" ok" if ok else " MISSED"))
            rows.append(row)
            table.add_row(*row)
    Console().print(table)
    results = ROOT / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    lines = ["| model | mode | layers | wall s | peak RSS GiB | goal |", "|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    (results / "profile_cost.md").write_text(
        f"# Profiling cost\n\n`python bench/profile_cost.py` on {os.cpu_count()} CPU cores, "
        f"{time.strftime('%Y-%m-%d')}.\n\n" + "\n".join(lines) + "\n")
    print(f"wrote {results / 'profile_cost.md'}")


if __name__ == "__main__":
    main()
