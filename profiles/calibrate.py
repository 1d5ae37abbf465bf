"""`plan calibrate`: measure this machine's collectives and rates, write a cluster file.

The planner's step time is only as good as the figures of the hardware it costs. A preset's
figures are a datasheet's; this measures them where the plan will run, the way a rank sees
them:

- collectives (all-reduce, all-gather, reduce-scatter, broadcast, send/receive) against
  message size, for every group size that divides the process count, with every process
  busy at once (groups side by side, as under a plan), each timed as in a step: what it adds
  to a slice of compute before it, never less than it takes alone (broadcasts, which ZeRO-1
  issues back to back after the optimizer step from each rank in turn, packing and unpacking
  a layer's chunks as it does, and the pipeline's asynchronous sends: alone), by the slowest
  rank;
  each kind and group size is fitted as latency + bytes / bandwidth, with its worst residual;
- on CPU processes: one thread's matmul, copy and fused-AdamW rates, and how many processes
  the cores run at full speed at once (`host_cores`, from layer-like work run alone and in
  every process together), and a pipeline schedule's overhead per action;
- on a GPU: bf16 / fp32 matmul FLOP/s over a sweep of shapes, fitted as the best share of the
  peak and a per-dimension knee (`Hardware.matmul_flops`), and the achievable copy bandwidth.

The result is a `Hardware` (a preset as base, the measured fields replaced, each with its
source) written as a TOML cluster file that `plan solve --cluster` reads.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import platform
import socket
import statistics
import time
from datetime import date
from pathlib import Path
from typing import Callable

from planner.hardware import PRESETS, CollectiveFit, Hardware

from .allocator import keep_freed_memory

SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 23)   # bytes of the whole tensor
# Collectives timed back to back run in chains of this many. In chains of 4 a 4-rank gloo
# broadcast's fitted latency was 1.1 ms in one run and 0.33 and 0.85 ms in two others on the
# 2-core machine (worst misses of the fit 35-83%), in chains of 32 0.78 and 0.67 ms (19%), where
# the ZeRO-1 steps of bench/time_fidelity.py measured 0.6-0.8 ms a broadcast (2026-12-03).
BACK_TO_BACK = 32
# The compute before each collective timed in a step: 256^3 fp32 matmuls, 8 of them about 2.6
# ms of one core alone on the 2-core VM. What a collective adds is also timed after slices of
# SLICES matmuls (2026-12-07, 4 processes: a 64 KiB all-reduce over 4 added 5.2 ms after 1,
# 6.9 after 8 and 11.7 after 64; over 2 of them 2.6, 3.4 and 6.5 ms).
SLICE_MATMULS = 8
SLICES = (1, SLICE_MATMULS, 32)
SLICE_PROBE_BYTES = 1 << 16
# Timed back to back, not after a slice of compute (see _collectives_worker).
TIMED_ALONE = ("broadcast", "send_recv")
# A broadcast is timed on a tensor in this many parts, packed and unpacked as ZeRO-1 packs a
# layer's parameters' chunks (the examples' layers hold 2-16 parameters).
BROADCAST_PARTS = 8


# ---------------------------------------------------------------------------------------------
# Fits
# ---------------------------------------------------------------------------------------------

def fit_latency_bandwidth(sizes: list[float], seconds: list[float]) -> tuple[float, float, float]:
    """(latency, bandwidth, worst relative residual) of t = latency + size / bandwidth.

    Least squares on the relative error (weights 1/t^2), so that the small messages that fix
    the latency count as much as the large ones that fix the bandwidth; the latency is kept
    non-negative and the bandwidth positive.
    """
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError("a fit needs at least two (size, time) points")
    w = [1.0 / max(t, 1e-12) ** 2 for t in seconds]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, sizes))
    sy = sum(wi * y for wi, y in zip(w, seconds))
    sxx = sum(wi * x * x for wi, x in zip(w, sizes))
    sxy = sum(wi * x * y for wi, x, y in zip(w, sizes, seconds))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det if det > 0 else 0.0
    latency = (sy - slope * sx) / sw
    if latency < 0:                       # through the origin instead
        latency, slope = 0.0, sxy / sxx
    slope = max(slope, 1e-18)
    residual = max(abs(latency + x * slope - y) / y for x, y in zip(sizes, seconds))
    return latency, 1.0 / slope, residual


def fit_matmul(points: list[tuple[int, int, int, float]], peak: float,
               least_s: float = 50e-6) -> tuple[float, int, float]:
    """(efficiency, knee, worst relative residual) of FLOP/s(m, n, k) = peak * efficiency *
    prod(d / (d + knee)) over measured (m, n, k, FLOP/s) points; the knee by a search over
    powers of two and halves between, the efficiency then by least squares.

    Points whose matmul takes under `least_s` are left out: back to back, those time how fast
    the host launches kernels, not the GPU (an H200's 256^3 to 1024^3 ran at 11-28 us a call on
    two hosts, 2x apart, 2026-12-04), and no knee fits both."""
    timed = [p for p in points if 2.0 * p[0] * p[1] * p[2] / p[3] >= least_s]
    points = timed if len(timed) >= 2 else points
    best = None
    for knee in sorted({1} | {int(2 ** (e / 2)) for e in range(2, 25)}):
        shape = [math.prod(d / (d + knee) for d in (m, n, k)) if knee > 1 else 1.0 for m, n, k, _ in points]
        rates = [r for *_, r in points]
        eff = sum(s * r for s, r in zip(shape, rates)) / (peak * sum(s * s for s in shape))
        res = max(abs(peak * eff * s - r) / r for s, r in zip(shape, rates))
        if best is None or res < best[2]:
            best = (min(eff, 1.0), knee, res)
    return best


# ---------------------------------------------------------------------------------------------
# Collectives, in N processes
# ---------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rounds_s(op: Callable[[], None] | None, compute: Callable[[], None], world_barrier: Callable[[], None],
              rounds: int) -> float:
    """Seconds a round of (a slice of compute, then op) takes, over `rounds` of them, every rank
    starting at once."""
    world_barrier()
    t0 = time.perf_counter()
    for _ in range(rounds):
        compute()
        if op is not None:
            op()
    return (time.perf_counter() - t0) / rounds


def _time_in_step(op: Callable[[], None] | None, compute: Callable[[], None], world_barrier: Callable[[], None],
                  repeats: int, rounds: int = 4) -> float:
    """Median seconds of `rounds` x (a slice of compute, then op), per round, every rank at once:
    a collective costs inside a step what it adds to the compute around it (on CPU processes
    its threads contend with the ranks' own compute, and ranks arrive at it unevenly)."""
    _rounds_s(op, compute, world_barrier, rounds)
    return statistics.median(_rounds_s(op, compute, world_barrier, rounds) for _ in range(repeats))


def _added_in_step(op: Callable[[], None], compute: Callable[[], None], world_barrier: Callable[[], None],
                   repeats: int, rounds: int = 4) -> float:
    """Seconds `op` adds to the slice of compute before it, every rank at once: rounds of
    (compute, op) timed in turns with rounds of compute alone, the difference per pair, and the
    mean of the middle of those (trimmed_mean). A step pays a collective's mean, not its median:
    a 2-rank all-reduce of 1 KiB among 4 processes added 0.3-6.8 ms in 30 pairs, where the median
    of 7 ranged 2.3-3.6 ms from one set of 7 to the next and the mean of 30 2.7-2.9 ms over three
    launches (2-core VM, 2026-12-06)."""
    _rounds_s(op, compute, world_barrier, rounds)
    return trimmed_mean([_rounds_s(op, compute, world_barrier, rounds) - _rounds_s(None, compute, world_barrier, rounds)
                         for _ in range(repeats)])


def trimmed_mean(xs: list[float], cut: float = 0.1) -> float:
    """The mean of `xs` without its lowest and highest `cut` share (with a cut, at least one
    each from 5 values on)."""
    xs = sorted(xs)
    k = int(len(xs) * cut)
    if cut > 0 and len(xs) >= 5:
        k = max(k, 1)
    return statistics.fmean(xs[k:len(xs) - k])


def _collectives_worker(rank: int, world: int, port: int, device: str, sizes: tuple[int, ...], repeats: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from runtime.sharded_optimizer import broadcast_packed

    if device == "cpu":
        torch.set_num_threads(1)
        keep_freed_memory()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        dev = torch.device("cuda", rank)
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        dev = torch.device("cpu")

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def barrier():
        sync()
        dist.barrier()

    a = torch.randn(256, 256, device=dev)
    b = torch.randn(256, 256, device=dev)

    def compute(matmuls: int = SLICE_MATMULS if device == "cpu" else 200):   # a layer's slice
        for _ in range(matmuls):
            torch.mm(a, b)
        sync()

    def alone_s(matmuls: int) -> float:
        """One rank's slice of `matmuls` with the others waiting: the profile's kind of time."""
        t = torch.zeros(1, dtype=torch.float64)
        barrier()
        if rank == 0:
            t[0] = median_time(lambda: compute(matmuls), 5)
        dist.broadcast(t, 0)
        return t.item()

    # torch 2.13 renamed the tensor forms (the old names warn); older torch has only those.
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    rows = []
    for g in [d for d in range(2, world + 1) if world % d == 0]:
        groups = [dist.new_group(list(range(i, i + g))) for i in range(0, world, g)]
        mine = groups[rank // g]
        me = rank % g
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv"):
            if kind == "send_recv" and g != 2:
                continue
            for nbytes in sizes:
                n = nbytes // 4
                whole = torch.ones(n, device=dev)
                part = torch.ones(n // g, device=dev)
                if kind == "all_reduce":
                    fn = lambda: dist.all_reduce(whole, group=mine)                           # noqa: E731
                elif kind == "all_gather":
                    fn = lambda: all_gather(whole, part, group=mine)                           # noqa: E731
                elif kind == "reduce_scatter":
                    fn = lambda: reduce_scatter(part, whole, group=mine)                       # noqa: E731
                elif kind == "broadcast":
                    # From each rank in turn, as ZeRO-1 broadcasts a layer's packed chunks from their
                    # owners: 4 gloo processes on the 2-core VM took 0.85-1.0 ms a 1 KiB broadcast
                    # from one root and 0.3-0.75 ms from roots in turn (chains of 276, 2026-12-06).
                    # Packed and unpacked as the runtime does (broadcast_packed): the GPT's and the
                    # MLP's 24 and 40 broadcasts of a ZeRO-1 step took 0.93 and 1.10 ms each so, 0.69
                    # and 0.77 ms bare (the same sizes, 4 processes, 2026-12-07), and the bench's
                    # ZeRO-1 steps spent 2-3x their bare fit in them.
                    roots = itertools.cycle(range(g))
                    parts = list(whole.chunk(BROADCAST_PARTS))
                    fn = lambda: broadcast_packed(parts, next(roots), me, mine)               # noqa: E731
                elif me == 0:
                    fn = lambda: dist.send(whole, group=mine, group_dst=1)                     # noqa: E731
                else:
                    fn = lambda: dist.recv(whole, group=mine, group_src=0)                     # noqa: E731

                def op(fn=fn):
                    fn()
                    sync()

                # Back to back: what the collective alone costs, all that is timed for broadcasts
                # (ZeRO-1 issues them back to back after the optimizer step, one per parameter
                # chunk) and for a pipeline's asynchronous sends: in a chain of BACK_TO_BACK, so
                # that how unevenly ranks leave the barrier is spread as over ZeRO-1's hundreds.
                # The others run between slices of a layer's compute, where they cost what they
                # add to it, never less than alone (a chain of 4 for that floor).
                timed_alone = kind in TIMED_ALONE
                alone = _time_in_step(op, lambda: None, barrier, repeats, rounds=BACK_TO_BACK if timed_alone else 4)
                in_step = 0.0
                if not timed_alone:
                    in_step = _added_in_step(op, compute, barrier, 2 * repeats)
                t = torch.tensor([alone, in_step], dtype=torch.float64, device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)            # the slowest rank's view is the cost
                rows.append({"kind": kind, "group": g, "processes": world, "bytes": nbytes,
                             "seconds": max(t[0].item(), t[1].item())})
        if device == "cpu":
            # What a collective adds grows with the compute before it: ranks that take turns
            # on shared cores finish a longer slice further apart. A 64 KiB all-reduce after
            # slices of several lengths (CollectiveFit.per_slice_s; every kind of the group
            # takes it, as it is the ranks' arrival, not the collective, that it times).
            x = torch.ones(SLICE_PROBE_BYTES // 4, device=dev)
            for matmuls in SLICES:
                added = _added_in_step(lambda: dist.all_reduce(x, group=mine), lambda m=matmuls: compute(m),
                                       barrier, 2 * repeats)
                t = torch.tensor([added], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                rows.append({"kind": "slice", "group": g, "processes": world, "bytes": SLICE_PROBE_BYTES,
                             "slice_s": alone_s(matmuls), "seconds": t.item(), "timed_after": matmuls == SLICE_MATMULS})
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def measure_collectives(processes: int, device: str = "cpu", sizes: tuple[int, ...] = SIZES, repeats: int = 7) -> list[dict]:
    """One row per (kind, group size, message bytes): the slowest rank's median seconds."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_collectives_worker, args=(processes, _free_port(), device, sizes, repeats, queue), nprocs=processes, join=True)
    return queue.get()


def fit_collectives(rows: list[dict]) -> list[CollectiveFit]:
    """A fit per (kind, group, processes) of the size rows; with the "slice" rows of its group
    and processes, the slice its collectives were timed after and the slope of what one adds
    over the slice before it (least squares, never below 0; none for the kinds timed alone)."""
    sized = [r for r in rows if r["kind"] != "slice"]
    keys = sorted({(r["kind"], r["group"], r["processes"]) for r in sized})
    fits = []
    for kind, group, procs in keys:
        pts = sorted((r["bytes"], r["seconds"]) for r in sized if (r["kind"], r["group"], r["processes"]) == (kind, group, procs))
        lat, bw, res = fit_latency_bandwidth([p[0] for p in pts], [p[1] for p in pts])
        slices = [r for r in rows if r["kind"] == "slice" and (r["group"], r["processes"]) == (group, procs)]
        timed_after = [r["slice_s"] for r in slices if r["timed_after"]]
        slope = 0.0
        if len(slices) >= 2 and timed_after and kind not in TIMED_ALONE:
            xs, ys = [r["slice_s"] for r in slices], [r["seconds"] for r in slices]
            mx, my = statistics.fmean(xs), statistics.fmean(ys)
            spread = sum((x - mx) ** 2 for x in xs)
            slope = max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread) if spread > 0 else 0.0
        fits.append(CollectiveFit(kind, group, procs, lat, bw, res, slice_s=timed_after[0] if slope else 0.0,
                                  per_slice_s=slope))
    return fits


def _pipeline_worker(rank: int, world: int, port: int, micro_batches: int, repeats: int, queue) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    keep_freed_memory()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    schedule = Schedule1F1B(PipelineStage(nn.Linear(16, 16), rank, world, torch.device("cpu")), micro_batches,
                            loss_fn=lambda out, target: out.sum())
    x = torch.randn(micro_batches, 16)

    def step():
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=x, losses=[])
        else:
            schedule.step()
    t = torch.tensor([_time_in_step(step, lambda: None, dist.barrier, repeats, rounds=1)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put(t.item())
    dist.barrier()
    dist.destroy_process_group()


def measure_pipeline(processes: int, micro_batches: int = 8, repeats: int = 30) -> float:
    """A pipeline's overhead per micro-batch and action (a stage's forward or its backward)
    beside its compute and its transfers' bytes (pipeline_overhead_s): a 1F1B schedule over
    `processes` stages of a 16 x 16 linear layer, no compute to speak of and the cores free,
    whose step is m + pp - 1 slots of a forward and a backward, so step / (m + pp - 1) / 2.
    Where busy ranks fill the cores the cost model slows it as it slows compute."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_pipeline_worker, args=(processes, _free_port(), micro_batches, repeats, queue),
             nprocs=processes, join=True)
    return queue.get() / (micro_batches + processes - 1) / 2


# ---------------------------------------------------------------------------------------------
# Rates
# ---------------------------------------------------------------------------------------------

def median_time(fn: Callable[[], None], repeats: int, warmup: int = 2, sync: Callable[[], None] = lambda: None) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_flops(dtype, m: int, n: int, k: int, device: str = "cpu", repeats: int = 10, chain: int = 1) -> float:
    """FLOP/s of torch.mm, timed `chain` calls back to back per sample. On a GPU a chain is what a
    step issues: one call and a synchronize also times the launch and the wait, about 20 us on an
    H200 (2026-12-04: a lone 1024^3 bf16 matmul took 25 us, 85 TFLOP/s)."""
    import torch
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    out = torch.empty(m, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def calls() -> None:
        for _ in range(chain):
            torch.mm(a, b, out=out)
    return 2.0 * m * n * k * chain / median_time(calls, repeats, sync=sync)


# The GPU sweep: squares, then the shapes of transformer layers (tokens x width x width, the MLP's
# wide and narrow sides, a tensor-parallel slice, the vocabulary head).
MATMUL_SHAPES = tuple((d, d, d) for d in (256, 512, 1024, 2048, 4096, 8192)) + (
    (2048, 2048, 2048 * 3), (2048, 8192, 2048), (2048, 2048, 8192), (8192, 4096, 4096), (8192, 14336, 4096),
    (8192, 4096, 14336), (8192, 1024, 4096), (16384, 8192, 8192), (16384, 28672, 8192), (8192, 3584, 8192),
    (4096, 32000, 2048), (8192, 128256, 4096))
# Fused attention (B, heads, sequence, head size), causal, forward and backward: the 1B GPT of
# the GPU check, Llama 3 8B's at 2k-8k tokens, and 70B's head count.
ATTENTION_SHAPES = ((8, 16, 1024, 128), (4, 32, 2048, 128), (1, 32, 4096, 128), (1, 32, 8192, 128), (1, 64, 4096, 128))


def attention_rate(batch: int, heads: int, seq: int, head_dim: int, repeats: int = 10) -> float:
    """FLOP/s of causal bf16 scaled_dot_product_attention forward and backward on the GPU, the
    FLOPs as PyTorch's counter (and so the profile) counts them."""
    import torch
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
    with FlopCounterMode(display=False) as counter:
        step()
    flops = float(counter.get_total_flops())
    return flops / median_time(step, repeats, sync=torch.cuda.synchronize)


def host_to_device_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes / t of a pinned host tensor copied to the GPU (FSDP2's CPU offload pins its states)."""
    import torch
    src = torch.ones(nbytes // 4, dtype=torch.float32).pin_memory()
    dst = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    return nbytes / median_time(lambda: dst.copy_(src, non_blocking=True), repeats, sync=torch.cuda.synchronize)


def copy_bandwidth(nbytes: int = 256 * 2**20, device: str = "cpu", repeats: int = 10) -> float:
    """(bytes read + bytes written) / t of dst.copy_(src): what a roofline's memory term counts."""
    import torch
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return 2.0 * nbytes / median_time(lambda: dst.copy_(src), repeats, sync=sync)


def adamw_params_per_s(total: int = 16 * 2**20, tensors: int = 16, repeats: int = 5) -> float:
    import torch
    params = [torch.nn.Parameter(torch.randn(total // tensors)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    return total / median_time(opt.step, repeats)


def op_launch_seconds(device: str = "cpu", repeats: int = 50) -> float:
    """The host's time to issue one op in eager PyTorch: a forward and backward of a small
    block (norm, two linear layers, GELU, a residual) on 2 x 16 values, whose kernels take
    less than issuing them, over the ops it dispatches as a fake profile counts them (OpCost:
    views too)."""
    import torch
    from torch import nn

    from .flops import OpCost
    block = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)).to(device)
    x = torch.randn(2, 16, device=device, requires_grad=True)
    grad = torch.ones(2, 16, device=device)

    def step() -> None:
        for p in (x, *block.parameters()):
            p.grad = None
        (x + block(x)).backward(grad)
    step()                                 # grads exist from here on, as in every step
    with OpCost() as ops:
        step()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return median_time(step, repeats, sync=sync) / ops.ops


# Work like a layer's, for host_cores: two 256-1024-256 MLPs' forward and backward on 64 rows
# (matmuls and the elementwise ops between them, 4-5 ms on the 2-core VM). Four processes at
# once ran it at 1.69-1.85 processes' worth (six launches of three rounds, 2026-12-07) where
# 256^3 matmuls alone read 1.92-2.03, and timed call by call it slowed 2.42-2.53x with four at
# once, among the example models' blocks (2.35-2.88x), where those matmuls slowed 2.00-2.09x
# (bench/results/contention.md): the matmuls stay in a core's cache, a step's work does not.
LAYER_WIDTH, LAYER_ROWS = 256, 64


def layer_like_work():
    """The module and input host_cores is timed on: two LAYER_WIDTH-wide MLPs (4x hidden, GELU)
    on LAYER_ROWS rows."""
    import torch
    import torch.nn as nn
    w = LAYER_WIDTH
    layer = nn.Sequential(*[nn.Sequential(nn.Linear(w, 4 * w), nn.GELU(), nn.Linear(4 * w, w)) for _ in range(2)])
    return layer, torch.randn(LAYER_ROWS, w, requires_grad=True)


def _layer_work_rate(seconds: float) -> float:
    """Forward-and-backward passes a second of the layer-like work above, on this thread, over
    `seconds` of wall time."""
    layer, x = layer_like_work()
    for _ in range(2):
        layer(x).sum().backward()
    count, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        layer(x).sum().backward()
        count += 1
    return count / elapsed


def _layer_work_worker(rank: int, seconds: float, barrier, queue) -> None:
    import torch
    torch.set_num_threads(1)
    keep_freed_memory()
    barrier.wait()                     # every process computes over the same interval
    queue.put(_layer_work_rate(seconds))


def effective_cores(processes: int, seconds: float = 2.0, rounds: int = 3) -> tuple[float, float, float]:
    """How many single-thread processes run at full speed at once: processes x (the rate of
    layer-like work each gets while all run together) / (the rate one gets alone), the median
    of `rounds` (a shared VM moves it by tens of percent). Returns (cores, alone, together), the
    rates in passes a second."""
    runs = sorted((_effective_cores_once(processes, seconds) for _ in range(rounds)), key=lambda r: r[0])
    return runs[len(runs) // 2]


def _effective_cores_once(processes: int, seconds: float) -> tuple[float, float, float]:
    import torch
    import torch.multiprocessing as mp

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        alone = _layer_work_rate(seconds)
    finally:
        torch.set_num_threads(threads)
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.SimpleQueue(), ctx.Barrier(processes)
    mp.spawn(_layer_work_worker, args=(seconds, barrier, queue), nprocs=processes, join=True)
    together = statistics.mean(queue.get() for _ in range(processes))
    cores = min(float(os.cpu_count() or 1), processes * together / alone)
    return cores, alone, together


def host_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


# ---------------------------------------------------------------------------------------------
# The whole calibration
# ---------------------------------------------------------------------------------------------

_LAUNCH_HOW = ("a forward and backward of a LayerNorm-Linear-GELU-Linear block with a residual on 2 x 16 values "
               "(its kernels shorter than issuing them) / the ops it dispatches, views included, as a fake profile "
               "counts them")


@dataclasses.dataclass(frozen=True)
class Calibration:
    hardware: Hardware
    collective_rows: list       # the raw timings behind hardware.collectives
    notes: list                 # what was measured, one line each


def calibrate(device: str = "cpu", processes: tuple[int, ...] = (2, 4), base: str | None = None,
              on_progress: Callable[[str], None] = lambda _msg: None) -> Calibration:
    """Measure this machine and return the hardware it describes (see the module docstring)."""
    import torch

    base_name = base or ("cpu" if device == "cpu" else "h100-sxm-80g")
    hw = PRESETS[base_name]
    today = date.today().isoformat()
    counts = ",".join(map(str, processes))
    where = (f"measured by `plan calibrate --device {device} --processes {counts}` on {today} "
             f"({platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__.split('+')[0]}")
    fields: dict[str, object] = {}
    sources: dict[str, str] = {}
    notes: list[str] = []

    def put(name: str, value, how: str) -> None:
        fields[name] = value
        sources[name] = f"{where}): {how}"

    if device == "cpu":
        keep_freed_memory()             # the host allocator the runtime's ranks run with (profiles/allocator.py)
        on_progress("single-thread rates")
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            put("fp32_flops", matmul_flops(torch.float32, 1024, 1024, 1024), "1024^3 fp32 torch.mm, 1 thread, 2n^3/t")
            put("bf16_flops", matmul_flops(torch.bfloat16, 512, 512, 512, repeats=3), "512^3 bf16 torch.mm, 1 thread, 2n^3/t")
            adam = adamw_params_per_s()
            put("cpu_adam_params_per_s", adam, "fused torch.optim.AdamW step on 16M fp32 parameters in 16 tensors, 1 thread")
            # A step on the "device" and the same step "offloaded" to this same CPU cost the same.
            put("hbm_bandwidth", adam * 28, "the fused AdamW rate x the 28 bytes it moves per fp32 parameter")
            put("host_to_device_bandwidth", copy_bandwidth() / 2, "bytes moved / t of a 256 MiB copy_, 1 thread")
            put("op_launch_s", op_launch_seconds(), _LAUNCH_HOW)
        finally:
            torch.set_num_threads(threads)
        put("host_memory_bytes", host_memory_bytes(), "MemTotal in /proc/meminfo")
        most = max(processes)
        on_progress(f"layer-like work in {most} processes at once")
        cores, alone, together = effective_cores(most)
        put("host_cores", cores, f"{most} processes x their rate together ({together:.0f} forward-and-backward passes a second "
                                  f"each of two {LAYER_WIDTH}-{4 * LAYER_WIDTH}-{LAYER_WIDTH} MLPs on {LAYER_ROWS} rows) "
                                  f"/ one alone ({alone:.0f})")
        put("collective_overlap", 0.0, "gloo runs FSDP2's collectives on threads that the ranks' own cores must serve, "
                                       "and the step's time breakdown (run.json) shows FSDP2 waiting on each one")
        notes.append(f"{cores:.2f} processes at a time run at full speed ({most} together: {together / alone:.2f} of one alone)")
    else:
        on_progress("matmul sweep")
        points = [(m, n, k, matmul_flops(torch.bfloat16, m, n, k, device="cuda", repeats=7, chain=8))
                  for m, n, k in MATMUL_SHAPES]
        eff, knee, res = fit_matmul(points, hw.bf16_flops)
        shown = ", ".join(f"{m}x{n}x{k}: {r / 1e12:.0f}" for m, n, k, r in points)
        put("matmul_efficiency", eff, f"bf16 torch.mm sweep, 8 calls back to back a sample, TFLOP/s {shown}; "
                                      f"fitted with the knee below, worst miss {100 * res:.1f}%")
        put("matmul_knee", knee, "the same fit")
        on_progress("attention")
        shares = []
        for shape in ATTENTION_SHAPES:
            shares.append((shape, attention_rate(*shape) / hw.bf16_flops))
        shown = ", ".join(f"{'x'.join(map(str, sh))}: {100 * f:.0f}%" for sh, f in shares)
        # The counter counts a causal kernel's skipped half too, so the share could pass 1 on a fast kernel.
        put("attention_efficiency", min(1.0, statistics.median(f for _, f in shares)),
            f"causal bf16 scaled_dot_product_attention forward and backward, FLOPs as PyTorch's counter counts them "
            f"over t, as a share of the peak, median of (B x heads x sequence x head size) {shown}")
        on_progress("copies")
        put("memory_efficiency", min(1.0, copy_bandwidth(1 << 30, device="cuda") / hw.hbm_bandwidth),
            "(read + written bytes) / t of a 1 GiB copy_ over the base's hbm_bandwidth")
        put("host_to_device_bandwidth", host_to_device_bandwidth(), "bytes / t of a 1 GiB pinned host tensor copied to the GPU")
        put("cpu_adam_params_per_s", adamw_params_per_s(total=64 * 2**20, repeats=3),
            f"fused torch.optim.AdamW step on 64M fp32 parameters on the host, {torch.get_num_threads()} threads")
        put("op_launch_s", op_launch_seconds("cuda"), _LAUNCH_HOW)
        best = max(r for *_, r in points)
        notes.append(f"best matmul {best / 1e12:.0f} TFLOP/s bf16 ({100 * best / hw.bf16_flops:.0f}% of the datasheet's dense peak); "
                     f"fitted: {100 * eff:.1f}% of peak, knee {knee}, worst miss {100 * res:.0f}%")
        notes.append("matmul TFLOP/s (m x n x k): " + ", ".join(f"{m}x{n}x{k} {r / 1e12:.0f}" for m, n, k, r in points))
        notes.append("attention, share of peak (B x heads x sequence x head size): " + shown)
        if max(processes) < 2:
            notes.append(f"one GPU: no collectives measured; the file keeps {base_name}'s links")

    rows = []
    for count in (c for c in processes if c > 1):
        on_progress(f"collectives in {count} processes")
        rows += measure_collectives(count, device)
    if device == "cpu":
        most = max(processes)
        on_progress(f"pipelines of {most} stages")
        idle = measure_pipeline(most)
        put("pipeline_overhead_s", idle,
            f"a 1F1B schedule over {most} stages of a 16x16 linear layer, 8 micro-batches: "
            "step / (m + pp - 1) / 2 actions (a forward and a backward a slot)")
        notes.append(f"a pipeline action: {idle * 1e3:.2f} ms with the cores free")
    fits = fit_collectives(rows)
    for f in fits:
        notes.append(f"{fit_text(f)} (worst miss {100 * f.max_residual:.0f}%)")
    two = min((f for f in fits if f.kind == "all_reduce" and f.group == 2), key=lambda f: f.processes, default=None)
    if two is not None:
        # The link figures stay the fallback for groups that were not measured.
        put("intra_node_latency", two.latency_s / 2, "all_reduce over 2 ranks' fitted latency / its 2 ring steps")
        put("intra_node_bandwidth", two.bandwidth, "all_reduce over 2 ranks' fitted bandwidth (2(n-1)/n = 1)")
    values = {f.name: getattr(hw, f.name) for f in dataclasses.fields(hw)}
    values.update(fields)
    values["name"] = f"{base_name}-calibrated"
    values["collectives"] = tuple(fits)
    all_sources = {k: f"preset {base_name}: {v}" for k, v in hw.sources.items()}
    all_sources.update(sources)
    all_sources["name"] = f"{where}), from preset {base_name}"
    values["sources"] = all_sources
    return Calibration(Hardware(**values), rows, notes)


def fit_text(f: CollectiveFit) -> str:
    """One collective's fit as the calibration's notes print it."""
    text = f"{f.kind} over {f.group} of {f.processes}: {f.latency_s * 1e6:.0f} us + bytes / {f.bandwidth / 1e9:.2f} GB/s"
    if f.per_slice_s:
        text += f", +{f.per_slice_s * 1e3:.0f} us per ms of compute before it over {f.slice_s * 1e3:.1f}"
    return text


def median_calibration(cals: list[Calibration]) -> Calibration:
    """Several calibrations of one machine as one: each numeric figure the median of theirs (a
    source that says so, with every run's value, where they differ), each collective's latency
    and bandwidth the median of its fits, its worst miss the worst of theirs. On the 2-core VM
    three runs in a row gave latencies within 5-25% of one another, where single runs an hour
    apart had differed by up to 40% (2026-12-06; the `cpu` preset is such a median)."""
    if len(cals) == 1:
        return cals[0]
    first = cals[0].hardware
    values = {f.name: getattr(first, f.name) for f in dataclasses.fields(first)}
    sources = dict(first.sources)
    notes = [f"the median of {len(cals)} calibrations in a row"]
    for f in dataclasses.fields(first):
        seen = [getattr(c.hardware, f.name) for c in cals]
        if isinstance(seen[0], bool) or not isinstance(seen[0], (int, float)) or len(set(seen)) == 1:
            continue
        pick = statistics.median_low if isinstance(seen[0], int) else statistics.median
        values[f.name] = pick(seen)
        runs = ", ".join(f"{v:.4g}" for v in seen)
        sources[f.name] = f"{sources.get(f.name, '')}; the median of {len(cals)} runs ({runs})"
        notes.append(f"{f.name}: {values[f.name]:.4g} (runs: {runs})")
    fits = []
    keys = sorted({(c.kind, c.group, c.processes) for cal in cals for c in cal.hardware.collectives})
    for key in keys:
        mine = [c for cal in cals for c in cal.hardware.collectives if (c.kind, c.group, c.processes) == key]
        fit = CollectiveFit(*key, statistics.median(c.latency_s for c in mine), statistics.median(c.bandwidth for c in mine),
                            max(c.max_residual for c in mine), slice_s=statistics.median(c.slice_s for c in mine),
                            per_slice_s=statistics.median(c.per_slice_s for c in mine))
        fits.append(fit)
        notes.append(f"{fit_text(fit)} (runs' latencies: " + ", ".join(f"{c.latency_s * 1e6:.0f}" for c in mine) + " us)")
    values["collectives"] = tuple(fits)
    values["sources"] = sources
    return Calibration(Hardware(**values), [row for cal in cals for row in cal.collective_rows], notes)


def cluster_file_text(cal: Calibration, base: str) -> str:
    """The calibrated hardware as a TOML cluster file: the preset as base, each measured field
    with its source as a comment, the collectives as [[collectives]] tables."""
    hw = cal.hardware
    base_hw = PRESETS[base]
    lines = [f"# Written by `plan calibrate` on {date.today().isoformat()}; read by `plan solve --cluster FILE`.",
             "[hardware]", f'base = "{base}"', f'name = "{hw.name}"']
    for f in dataclasses.fields(hw):
        if f.name in ("name", "sources", "collectives", "device_type"):
            continue
        value = getattr(hw, f.name)
        if value != getattr(base_hw, f.name):
            lines.append(f"# {hw.sources.get(f.name, '')}")
            lines.append(f"{f.name} = {value!r}")
    for c in hw.collectives:
        lines += ["", "[[collectives]]"] + [f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"'
                                            for k, v in dataclasses.asdict(c).items()]
    return "\n".join(lines) + "\n"


def write_cluster_file(cal: Calibration, base: str, path: str | Path) -> None:
    from .schema import write_text_atomic
    write_text_atomic(path, cluster_file_text(cal, base))
