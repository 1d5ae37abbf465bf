"""Runtime overhead: the step time of `python -m runtime` against a hand-written FSDP2 loop.

Both under torchrun with 2 processes (CPU, gloo), the same model (bench/models/gpt_overhead.py),
seed, batches and fused AdamW, dp 2 with ZeRO-3: fully_shard on every layer and on the root.
The hand-written loop is the few lines a person would write for that; the runtime adds plan
loading, the mesh, the optimizer on local shards and its measurements. Launches alternate
(runtime, loop, runtime, loop, ...) so that drift in the machine's speed hits both; each
launch gives rank 0's median step time over steps 3..S, and the table shows every launch and
the median over launches. Goal: the runtime within 3% of the loop.

    python bench/runtime_overhead.py [--rounds 3] [--steps 12]

Writes bench/results/runtime_overhead.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "bench" / "models" / "gpt_overhead.py"
RESULTS = ROOT / "bench" / "results" / "runtime_overhead.md"
N_LAYERS = 6  # embedding, 4 blocks, head


def bench_plan(micro_batch: int = 8):
    from planner.plan import LayerChoice, OptimizerConfig, Plan, Stage
    from profiles.model_file import file_sha256
    return Plan(profile={"path": "", "sha256": ""}, model={"path": str(MODEL), "sha256": file_sha256(MODEL), "source": "file", "name": MODEL.stem},
                hardware={"name": "cpu"}, device_type="cpu", world_size=2, gpus_per_node=2, dp=2, tp=1, pp=1, zero=3,
                schedule="1f1b", micro_batch_size=micro_batch, num_micro_batches=1, global_batch=2 * micro_batch,
                precision="fp32", optimizer=OptimizerConfig(), stages=[Stage(0, [LayerChoice(i) for i in range(N_LAYERS)])])


def hand_loop(plan_path: str, out: str, steps: int) -> None:
    """The hand-written FSDP2 loop (runs under torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from planner.plan import load_plan
    from profiles.model_file import load_spec

    plan = load_plan(plan_path)
    spec = load_spec(plan.model)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (plan.dp,))
    torch.manual_seed(plan.seed)
    model = spec.build_model()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    o = plan.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=True)
    rank, rows = dist.get_rank(), plan.global_batch // plan.dp
    times = []
    for step in range(steps):
        torch.manual_seed(plan.seed + 1 + step)
        x, y = spec.make_batch(plan.global_batch)
        x, y = x[rank * rows:(rank + 1) * rows].clone(), y[rank * rows:(rank + 1) * rows].clone()
        t0 = time.perf_counter()
        loss = spec.loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        float(loss)
    if rank == 0:
        Path(out).write_text(json.dumps({"median_step_s": statistics.median(times[2:])}))
    dist.destroy_process_group()


def launch(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def measure(rounds: int, steps: int) -> dict[str, list[float]]:
    from runtime.launch import build_command

    plan = bench_plan()
    medians = {"runtime": [], "loop": []}
    with tempfile.TemporaryDirectory() as tmp:
        plan_path, run_out, loop_out = Path(tmp, "plan.json"), Path(tmp, "run.json"), Path(tmp, "loop.json")
        plan.save(plan_path)
        for _ in range(rounds):
            launch(build_command(plan_path, plan, steps=steps, out=run_out))
            medians["runtime"].append(json.loads(run_out.read_text())["ranks"][0]["median_step_s"])
            launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    __file__, "--hand-loop", str(plan_path), str(loop_out), str(steps)])
            medians["loop"].append(json.loads(loop_out.read_text())["median_step_s"])
    return medians


def report(medians: dict[str, list[float]], steps: int) -> str:
    import torch
    from rich.console import Console
    from rich.table import Table

    rt, loop = statistics.median(medians["runtime"]), statistics.median(medians["loop"])
    overhead = rt / loop - 1
    rows = [("python -m runtime", medians["runtime"], rt), ("hand-written FSDP2 loop", medians["loop"], loop)]
    table = Table("", "per launch (ms)", "median (ms)", title=f"step time, dp 2 ZeRO-3, {MODEL.name}, overhead {overhead:+.1%}")
    for name, per, med in rows:
        table.add_row(name, "  ".join(f"{x * 1e3:.1f}" for x in per), f"{med * 1e3:.1f}")
    Console().print(table)
    lines = [f"# Runtime overhead ({date.today()}, torch {torch.__version__}, CPU gloo, 2 processes)", "",
             f"Model `bench/models/{MODEL.name}`, dp 2, ZeRO-3, micro-batch 8, fused AdamW; {len(medians['runtime'])} alternating "
             f"launches of {steps} steps each, rank 0's median step time over steps 3..{steps} per launch.", "",
             "| | per launch (ms) | median (ms) |", "|---|---|---|"]
    lines += [f"| {name} | {' '.join(f'{x * 1e3:.1f}' for x in per)} | {med * 1e3:.1f} |" for name, per, med in rows]
    lines += ["", f"Runtime overhead: **{overhead:+.1%}** (goal: within 3%).", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--hand-loop", nargs=3, metavar=("PLAN", "OUT", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.hand_loop:
        hand_loop(args.hand_loop[0], args.hand_loop[1], int(args.hand_loop[2]))
        return
    medians = measure(args.rounds, args.steps)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(report(medians, args.steps))


if __name__ == "__main__":
    main()
