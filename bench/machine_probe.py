"""How fast this machine runs a fixed piece of work now: a probe for drift within a bench.

`probe(processes)` starts that many processes of one thread, which begin together (each
after importing torch) and run 256 x 256 fp32 matmuls for a second; it returns the median
process's GFLOP/s. One process is how the profiler times layers; four are how a step of
bench/time_fidelity.py runs. This VM's speed moved by 10% between a bench's profiles and its
runs (stop 47: one thread's matmul 110-112 GFLOP/s one hour, 102 another), which a fixed
probe before and after each round of runs shows instead of leaving it to be inferred.

    python bench/machine_probe.py [--processes 1,4]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

SIZE = 256
SECONDS = 1.0
START_AFTER_S = 4.0      # every process has imported torch by then (about 1.5 s each on 2 busy cores)


def matmul_gflops(start_at: float, seconds: float = SECONDS) -> float:
    """Wait until `start_at` (time.time()), then run matmuls for `seconds`: GFLOP/s."""
    import torch
    torch.set_num_threads(1)
    a, b = torch.randn(SIZE, SIZE), torch.randn(SIZE, SIZE)
    a @ b                                           # warm-up, before the common start
    while time.time() < start_at:
        time.sleep(0.001)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return 2 * SIZE ** 3 * n / (time.perf_counter() - t0) / 1e9


def probe(processes: int) -> float:
    """The median GFLOP/s of `processes` one-thread processes running the matmul at once."""
    start_at = time.time() + START_AFTER_S
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", repr(start_at)], stdout=subprocess.PIPE, text=True)
             for _ in range(processes)]
    rates = [float(p.communicate()[0]) for p in procs]
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--processes", default="1,4")
    ap.add_argument("--worker", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(matmul_gflops(args.worker))
        return
    for n in map(int, args.processes.split(",")):
        print(f"{n} process(es): {probe(n):.1f} GFLOP/s each (median)")


if __name__ == "__main__":
    main()
