"""Measure the figures behind the `cpu` hardware preset (planner/hardware.py) on this machine.

The `cpu` preset describes plans executed as CPU processes talking over gloo, as the tests and
a small dev machine run them. Each figure is measured the way a plan's rank sees it: one
process with ONE intra-op thread (several ranks share a 2-core machine), median of repeats
after warm-up.

    python bench/measure_cpu_preset.py               # prints the figures (median of 3 rounds)
    python bench/measure_cpu_preset.py --rounds 5    # more rounds on a noisy machine
    python bench/measure_cpu_preset.py --json        # also prints them as one JSON object

Figures:
  fp32_flops        2*n^3 / t of an n x n fp32 torch.mm (n = 1024), 1 thread
  bf16_flops        the same in bf16 (CPU bf16 matmul; what a "mixed" plan's matmuls run at)
  hbm_bandwidth     (read + write bytes) / t of dst.copy_(src) on a 256 MiB fp32 tensor, 1 thread
                    (the bytes a roofline counts: everything read plus everything written)
  host_to_device_bandwidth
                    bytes moved / t of the same copy (= hbm_bandwidth / 2): on CPU an "offload"
                    is a copy between two host buffers
  intra_node_*      gloo all_reduce (sum, fp32) between 2 local processes (torch.multiprocessing
                    spawn, TCP store on 127.0.0.1), each rank's median, slower rank taken:
                    latency = time of a 4-byte all-reduce divided by its 2(n-1) = 2 ring steps
                    (the preset's latency is per collective step); bandwidth = bytes / (t - t_4B)
                    of a 64 MiB all-reduce, which for 2 ranks is the ring model's
                    2(n-1)/n * bytes / bw with 2(n-1)/n = 1.
  cpu_adam_params_per_s
                    parameters / t of torch.optim.AdamW(fused=True).step() on 16M fp32
                    parameters in 16 tensors with gradients set, 1 thread
  host_memory_bytes MemTotal from /proc/meminfo
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _median_time(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_flops(dtype: torch.dtype, n: int = 1024, repeats: int = 10) -> float:
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    out = torch.empty(n, n, dtype=dtype)
    t = _median_time(lambda: torch.mm(a, b, out=out), repeats)
    return 2.0 * n**3 / t


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 10) -> float:
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    t = _median_time(lambda: dst.copy_(src), repeats)
    return 2.0 * nbytes / t  # read src + write dst


def adamw_params_per_s(total: int = 16 * 2**20, tensors: int = 16, repeats: int = 5) -> float:
    params = [torch.nn.Parameter(torch.randn(total // tensors)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    t = _median_time(opt.step, repeats)
    return total / t


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _allreduce_worker(rank: int, world: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    for nbytes, repeats in ((4, 200), (2**20, 30), (16 * 2**20, 10), (64 * 2**20, 8)):
        t = torch.ones(nbytes // 4)

        def step():
            dist.all_reduce(t)

        for _ in range(3):
            step()
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        # the slower rank's view is what a collective costs
        worst = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        results[nbytes] = worst.item()
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def gloo_allreduce(world: int = 2) -> dict[int, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_allreduce_worker, args=(world, _free_port(), queue), nprocs=world, join=True)
    return queue.get()


def host_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def measure_once(world: int = 2) -> dict[str, float]:
    figures: dict[str, float] = {}
    figures["fp32_flops"] = matmul_flops(torch.float32)
    figures["bf16_flops"] = matmul_flops(torch.bfloat16)
    figures["hbm_bandwidth"] = copy_bandwidth()
    figures["host_to_device_bandwidth"] = figures["hbm_bandwidth"] / 2
    figures["cpu_adam_params_per_s"] = adamw_params_per_s()
    ar = gloo_allreduce(world)
    big = 64 * 2**20
    figures["intra_node_latency"] = ar[4] / (2 * (world - 1))
    figures["intra_node_bandwidth"] = big / (ar[big] - ar[4])
    figures["host_memory_bytes"] = host_memory_bytes()
    for nbytes, t in sorted(ar.items()):
        figures[f"allreduce_{nbytes}B_s"] = t
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="measure this many times, report the median")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    rounds = [measure_once() for _ in range(max(1, args.rounds))]
    figures = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, 1 intra-op thread per process, "
          f"median of {len(rounds)} round(s)")
    units = {
        "fp32_flops": ("GFLOP/s", 1e9), "bf16_flops": ("GFLOP/s", 1e9),
        "hbm_bandwidth": ("GB/s", 1e9), "host_to_device_bandwidth": ("GB/s", 1e9),
        "cpu_adam_params_per_s": ("Mparam/s", 1e6),
        "intra_node_latency": ("us", 1e-6), "intra_node_bandwidth": ("GB/s", 1e9),
        "host_memory_bytes": ("GiB", 2**30),
    }
    for key, value in figures.items():
        unit, scale = units.get(key, ("ms", 1e-3))
        print(f"{key:26s} {value / scale:12.3f} {unit}")
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
