"""Runtime overhead: the step time of the runtime against a hand-written FSDP2 loop.

Both under torchrun with 2 processes (CPU, gloo), the same model (bench/models/gpt_overhead.py),
seed, batches and fused AdamW, dp 2 with ZeRO-3: fully_shard on every layer and on the root.
The hand-written loop is the few lines a person would write for that; the runtime adds plan
loading, the mesh, the optimizer on local shards and its measurements. Two measurements:

  paired       one launch holds both, built side by side, and runs their steps alternately
               (runtime then loop, loop then runtime, ...): the ratio of each pair's times
               is immune to the machine's speed drifting (other jobs on a small machine).
               Median of the per-pair ratios over steps 3..S.
  end to end   alternating launches of `python -m runtime` (its run.json's median step time,
               rank 0) and of the loop alone; the median over launches.

    python bench/runtime_overhead.py [--rounds 3] [--steps 12]

Prints a table and writes bench/results/runtime_overhead.md. Goal: the runtime within 3%.
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


def build_hand_model(plan, spec):
    """The hand-written FSDP2 setup: every layer and the root fully sharded over all ranks."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (plan.dp,))
    torch.manual_seed(plan.seed)
    model = spec.build_model()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    o = plan.optimizer
    return model, torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=True)


def hand_batch(plan, spec, step: int):
    import torch
    import torch.distributed as dist

    torch.manual_seed(plan.seed + 1 + step)
    x, y = spec.make_batch(plan.global_batch)
    rank, rows = dist.get_rank(), plan.global_batch // plan.dp
    return x[rank * rows:(rank + 1) * rows].clone(), y[rank * rows:(rank + 1) * rows].clone()


def hand_step(model, optimizer, spec, x, y) -> float:
    t0 = time.perf_counter()
    loss = spec.loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    elapsed = time.perf_counter() - t0
    float(loss)
    return elapsed


def worker(mode: str, plan_path: str, out: str, steps: int) -> None:
    """Under torchrun: `loop` runs the hand-written loop alone, `paired` it and the runtime's Trainer alternately."""
    import torch.distributed as dist

    from planner.plan import load_plan
    from profiles.model_file import load_spec
    from runtime.parallel_dims import ParallelDims
    from runtime.train import Trainer, build_model

    plan = load_plan(plan_path)
    spec = load_spec(plan.model)
    dist.init_process_group("gloo")
    model, optimizer = build_hand_model(plan, spec)
    trainer = Trainer(plan, spec, build_model(spec, plan), ParallelDims.from_plan(plan).build_mesh("cpu")) if mode == "paired" else None
    loop_times, runtime_times = [], []
    for step in range(steps):
        x, y = hand_batch(plan, spec, step)
        if trainer is None:
            loop_times.append(hand_step(model, optimizer, spec, x, y))
            continue
        inputs, targets = trainer.local_batch(step)
        for first_runtime in ((True, False) if step % 2 == 0 else (False, True)):
            if first_runtime:
                t0 = time.perf_counter()
                trainer.train_step(inputs, targets)
                runtime_times.append(time.perf_counter() - t0)
            else:
                loop_times.append(hand_step(model, optimizer, spec, x, y))
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"loop": loop_times[2:], "runtime": runtime_times[2:]}))
    dist.destroy_process_group()


def launch(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")


def measure(rounds: int, steps: int) -> dict[str, list[float]]:
    from runtime.launch import build_command

    plan = bench_plan()
    out = {"runtime": [], "loop": [], "ratios": [], "paired_runtime": [], "paired_loop": []}
    with tempfile.TemporaryDirectory() as tmp:
        plan_path, run_out, loop_out = Path(tmp, "plan.json"), Path(tmp, "run.json"), Path(tmp, "loop.json")
        plan.save(plan_path)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, "--worker"]
        launch(torchrun + ["paired", str(plan_path), str(loop_out), str(steps)])
        paired = json.loads(loop_out.read_text())
        out["paired_runtime"], out["paired_loop"] = paired["runtime"], paired["loop"]
        out["ratios"] = [r / l for r, l in zip(paired["runtime"], paired["loop"])]
        for _ in range(rounds):
            launch(build_command(plan_path, plan, steps=steps, out=run_out))
            out["runtime"].append(json.loads(run_out.read_text())["ranks"][0]["median_step_s"])
            launch(torchrun + ["loop", str(plan_path), str(loop_out), str(steps)])
            out["loop"].append(statistics.median(json.loads(loop_out.read_text())["loop"]))
    return out


def report(m: dict[str, list[float]], steps: int) -> str:
    import torch
    from rich.console import Console
    from rich.table import Table

    paired = statistics.median(m["ratios"]) - 1
    e2e = statistics.median(m["runtime"]) / statistics.median(m["loop"]) - 1
    ms = lambda xs: "  ".join(f"{x * 1e3:.0f}" for x in xs)  # noqa: E731
    rows = [
        ("paired, one launch", "runtime", ms(m["paired_runtime"]), statistics.median(m["paired_runtime"]), f"{paired:+.1%} (median of pair ratios)"),
        ("", "loop", ms(m["paired_loop"]), statistics.median(m["paired_loop"]), ""),
        ("end to end, per launch", "python -m runtime", ms(m["runtime"]), statistics.median(m["runtime"]), f"{e2e:+.1%} (ratio of medians)"),
        ("", "loop", ms(m["loop"]), statistics.median(m["loop"]), ""),
    ]
    table = Table("measurement", "", "step times (ms)", "median (ms)", "runtime overhead",
                  title=f"dp 2 ZeRO-3, {MODEL.name}, micro-batch 8, fused AdamW, CPU gloo")
    for how, who, per, med, over in rows:
        table.add_row(how, who, per, f"{med * 1e3:.1f}", over)
    Console().print(table)
    lines = [f"# Runtime overhead ({date.today()}, torch {torch.__version__}, CPU gloo, 2 processes)", "",
             f"Model `bench/models/{MODEL.name}`, dp 2, ZeRO-3, micro-batch 8, fused AdamW, steps 3..{steps}. "
             "Paired: the runtime's Trainer and the hand-written FSDP2 loop in one launch, steps alternating; "
             f"end to end: {len(m['runtime'])} alternating launches each, rank 0's median step time per launch.", "",
             "| measurement | | step times (ms) | median (ms) | runtime overhead |", "|---|---|---|---|---|"]
    lines += [f"| {how} | {who} | {per} | {med * 1e3:.1f} | {over} |" for how, who, per, med, over in rows]
    lines += ["", f"Runtime overhead: **{paired:+.1%}** paired, {e2e:+.1%} end to end (goal: within 3%).", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--worker", nargs=4, metavar=("MODE", "PLAN", "OUT", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker[0], args.worker[1], args.worker[2], int(args.worker[3]))
        return
    medians = measure(args.rounds, args.steps)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(report(medians, args.steps))


if __name__ == "__main__":
    main()
