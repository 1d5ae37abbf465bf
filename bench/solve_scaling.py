"""How long `plan solve` takes as the model deepens and the cluster grows.

Builds profiles of LLaMA-7B-sized GPTs with 12 to 96 identical blocks from one fake-mode
profile of bench/models/gpt7b.py (so no layer is measured twice), and solves each for 1 to
8192 H100s (8 per node) with every knob free, global batch min(2048, max(8, 2 x GPUs)): up to
256 micro-batches per replica on 8 GPUs. Goal on a 2-core machine: every cell under 2 s.

    python bench/solve_scaling.py      # prints the table, writes bench/results/solve_scaling.md
"""

import copy
import os
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.hardware import get_hardware  # noqa: E402
from planner.search import SolveOptions, search  # noqa: E402
from profiles.schema import SCHEMA_VERSION, Profile, load_profile  # noqa: E402

DEPTHS = [12, 24, 32, 48, 64, 80, 96]
GPUS = [1, 8, 64, 512, 1024, 8192]


def global_batch(gpus: int) -> int:
    return min(2048, max(8, 2 * gpus))


def base_profile() -> Profile:
    # Named by the profile schema, so that checkouts of different schemas (solve_compare.py) keep their own.
    path = Path(tempfile.gettempdir()) / f"plan_bench_gpt7b_profile.s{SCHEMA_VERSION}.json"
    if not path.exists():
        from typer.main import get_command

        from cli import app
        get_command(app).main(args=["profile", str(ROOT / "bench/models/gpt7b.py"), "--fake", "--hardware",
                                    "h100-sxm-80g", "--precision", "mixed", "-o", str(path)], standalone_mode=False)
    return load_profile(path)


def with_depth(prof: Profile, blocks: int) -> Profile:
    """The same model with `blocks` transformer blocks (embedding and head kept). The first
    block is its own kind under sequence parallelism (it takes the whole sequence from the
    embedding and hands on a slice: its own signature), so the copies are of the second.
    (Copying the first for all of them made a model whose every block took the whole sequence
    but received a slice: the MILP, which reads a boundary as the next layer's input, and the
    cost model, which reads it as the last layer's output, then disagreed by 8%, 80 x 8192.)"""
    p = copy.deepcopy(prof)
    layers = [p.layers[0], p.layers[1]] + [copy.deepcopy(p.layers[2]) for _ in range(blocks - 1)] + [p.layers[-1]]
    for i, layer in enumerate(layers):
        layer.index, layer.name = i, str(i)
    p.layers = layers
    return p


def main() -> None:
    prof = base_profile()
    hw = get_hardware("h100-sxm-80g")
    table = Table(title="plan solve: wall seconds (candidates / memory-free MILPs / solved with memory / memory MILPs), 7B-width GPT, H100 x N, 8 per node")
    table.add_column("layers", justify="right")
    for g in GPUS:
        table.add_column(f"{g} GPUs", justify="right")
    rows, per_milp = [], []
    for depth in DEPTHS:
        p = with_depth(prof, depth - 2)
        cells, per = [], []
        for g in GPUS:
            opts = SolveOptions(gpus=g, hardware=hw, global_batch=global_batch(g), top_k=5)
            t = time.perf_counter()
            result = search(p, opts)
            dt = time.perf_counter() - t
            fit = "" if result.solutions else " none fits"
            cells.append(f"{dt:.2f} ({result.candidates}/{result.free_solved}/{result.solved}/{result.milps}){fit}")
            per.append(f"{dt / max(result.milps + result.free_solved, 1):.2f}")
        rows.append((str(depth), *cells))
        per_milp.append((str(depth), *per))
        table.add_row(*rows[-1])
        Console().print(f"{depth} layers done", style="dim")
    Console().print(table)
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    header = "| layers | " + " | ".join(f"{g} GPUs" for g in GPUS) + " |"
    rule = "|" + "---|" * (len(GPUS) + 1)
    lines = [header, rule] + ["| " + " | ".join(r) + " |" for r in rows]
    per_lines = [header, rule] + ["| " + " | ".join(r) + " |" for r in per_milp]
    (out / "solve_scaling.md").write_text(
        f"# Solve time\n\n`python bench/solve_scaling.py` on {os.cpu_count()} CPU cores, {time.strftime('%Y-%m-%d')}: "
        "wall seconds of `search` (candidates enumerated / memory-free MILPs / candidates solved within the memory "
        "limit / MILPs with memory rows: a pipeline of one stage a rank is solved by its stage sizes, with a MILP only "
        "where a stage's layouts are too many to list), "
        "global batch min(2048, max(8, 2 x GPUs)), "
        "7B-width GPT blocks, mixed precision, AdamW, H100 SXM 80G presets.\n\n" + "\n".join(lines) + "\n\n"
        "Seconds per MILP (the wall time above over both kinds of MILPs): how the size of one layout "
        "problem grows with depth. Totals also grow with how many candidates the bounds cannot prune.\n\n"
        + "\n".join(per_lines) + "\n")
    print(f"wrote {out / 'solve_scaling.md'}")


if __name__ == "__main__":
    main()
