"""How much each kind of work slows when more single-thread CPU processes than cores share them.

The cost model slows a rank's compute by busy ranks / `host_cores` (planner/cost.py,
contention_scale), and `plan calibrate` measures `host_cores` on two small MLPs' forward and
backward (profiles/calibrate.py, effective_cores; 256^3 matmuls until stop 49). This times
other work the same way, alone and then in N processes at once, to see whether one figure
serves them all: tiny ops (dispatch-bound), the example models' blocks at micro-batch 4, and
what FSDP2's `replicate` adds to a block (over a 1-rank group, so no collective is waited on).

    python bench/contention.py [--processes 4] [--rounds 3]   # writes bench/results/contention.md
"""

from __future__ import annotations

import argparse
import os
import runpy
import statistics
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "contention.md"
SECONDS = 1.0        # each workload timed for about this long, per round


def workloads(world: int) -> dict:
    """name -> a callable running one unit of that work in this process."""
    import torch
    import torch.nn as nn
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh

    a, b, small = torch.randn(256, 256), torch.randn(256, 256), torch.randn(64)

    def matmul():                                    # what plan calibrate's host_cores timed until stop 49
        for _ in range(8):
            torch.mm(a, b)

    def tiny_ops():
        x = small
        for _ in range(200):
            x = x + 1.0

    def fwd_bwd(module, x):
        def run():
            module(x).sum().backward()
            for p in module.parameters():
                p.grad = None
        return run

    from profiles.calibrate import LAYER_ROWS, LAYER_WIDTH, layer_like_work
    w = LAYER_WIDTH
    out = {"matmul 256^3 x 8": matmul,
           f"two {w}-{4 * w}-{w} MLPs on {LAYER_ROWS} rows (what host_cores times)": fwd_bwd(*layer_like_work()),
           "200 adds on 64 values": tiny_ops}
    for name in ("mlp", "gpt"):
        ns = runpy.run_path(str(ROOT / "examples" / f"{name}.py"))
        torch.manual_seed(0)
        x = torch.randn(4, ns["WIDTH"]) if name == "mlp" else torch.randn(4, ns["SEQ_LEN"], ns["D_MODEL"])
        out[f"examples/{name}.py block, micro-batch 4"] = fwd_bwd(ns["Block"](), x)
    # A 1-rank mesh in every process: replicate's hooks and copies, its all-reduce over one rank.
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("all", "one"))["one"]
    x = torch.randn(4, 16, 256)

    def block() -> nn.Module:
        return nn.Sequential(nn.LayerNorm(256), nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))

    bare, wrapped = block(), block()
    replicate(wrapped, mesh=mesh)
    out["LayerNorm-MLP block, 4 x 16 x 256"] = fwd_bwd(bare, x)
    out["the same under replicate"] = fwd_bwd(wrapped, x)
    return out


def _worker(rank: int, world: int, port: int, rounds: int, queue) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from profiles.allocator import keep_freed_memory

    torch.set_num_threads(1)                          # as the runtime runs a rank
    keep_freed_memory()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    work = workloads(world)
    seconds: dict[str, list[float]] = {name: [] for name in work}
    for _ in range(rounds):
        for name, run in work.items():
            for _ in range(3):
                run()
            dist.barrier()                            # every process starts each workload at once
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < SECONDS:
                run()
                n += 1
            seconds[name].append((time.perf_counter() - t0) / n)
    t = torch.tensor([statistics.median(v) for v in seconds.values()], dtype=torch.float64)
    dist.all_reduce(t)                                # the mean over processes
    if rank == 0:
        queue.put(dict(zip(seconds, (t / world).tolist())))
    dist.destroy_process_group()


def measure(world: int, rounds: int) -> dict[str, float]:
    """Seconds per unit of each workload with `world` processes running it at once."""
    import torch.multiprocessing as mp

    sys.path.insert(0, str(ROOT))
    from profiles.calibrate import _free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_worker, args=(world, _free_port(), rounds, queue), nprocs=world, join=True)
    return queue.get()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--launches", type=int, default=2, help="alone / together pairs, in turns")
    args = ap.parse_args()
    alone: dict[str, list[float]] = {}
    together: dict[str, list[float]] = {}
    for k in range(args.launches):
        for into, world in ((alone, 1), (together, args.processes)):
            for name, s in measure(world, args.rounds).items():
                into.setdefault(name, []).append(s)
        print(f"launch {k + 1} of {args.launches} done", flush=True)
    slowdowns = {name: [t / a for a, t in zip(alone[name], together[name])] for name in alone}
    hooks = [(rt - bt) / (ra - ba) for ra, ba, rt, bt in zip(alone["the same under replicate"],
                                                              alone["LayerNorm-MLP block, 4 x 16 x 256"],
                                                              together["the same under replicate"],
                                                              together["LayerNorm-MLP block, 4 x 16 x 256"])]
    lines = ["# Work on shared cores", "",
             f"`python bench/contention.py --processes {args.processes} --rounds {args.rounds} --launches "
             f"{args.launches}` on {os.cpu_count()} CPU cores, {date.today()}: each workload timed for {SECONDS:g} s "
             f"in one process alone and in {args.processes} single-thread processes at once (the median of "
             f"{args.rounds} rounds, the mean over processes); slowdown = together / alone, per launch. The cost "
             "model slows all compute by busy ranks / host_cores, host_cores from the MLPs' row (from the matmul's "
             "until stop 49).", "",
             "| work | alone ms | together ms | slowdown |", "|---|---|---|---|"]
    for name in alone:
        lo, hi = min(slowdowns[name]), max(slowdowns[name])
        lines.append(f"| {name} | {statistics.median(alone[name]) * 1e3:.3f} | "
                     f"{statistics.median(together[name]) * 1e3:.3f} | x{lo:.2f}-{hi:.2f} |")
    lines.append(f"| what replicate adds (the difference of the last two) | | | x{min(hooks):.2f}-{max(hooks):.2f} |")
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten: {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
