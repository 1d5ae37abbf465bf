"""Measure every layer of a model: memory, time and FLOPs at each micro-batch size.

Each layer is measured on its own, fed the output the previous layers produce for a batch
from `make_batch`, in the dtype and on the device it will train on:

  1. forward under `saved_tensors_hooks` and `LiveMemory`: what autograd saves (each storage
     once, parameters excluded, the layer's own input and output told apart), the output, and
     the transient peak above what stays;
  2. backward twice (gradients new, then gradients accumulating) from a root that hands the
     layer a ready output gradient and holds no other reference to the output, as in a real
     step: the peak above what was live when the backward started;
  3. the same under non-reentrant activation checkpointing;
  4. FLOPs and memory traffic (`OpCost`) and, unless fake, times: median of repeats after
     warm-up, with CUDA events on a GPU; on a CPU each repeat on the next of several copies of
     the layer, so that it finds its weights in memory as in a step (time_layer).

In fake mode (FakeTensorMode) nothing is allocated; memory and FLOPs are exact and times come
from a hardware preset's achievable rates, op by op (`Hardware.op_seconds`), and no faster than
the host issues the ops (`Hardware.op_launch_s`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import statistics
import time
import warnings
import dataclasses
import functools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from . import model_file as mf
from .allocator import keep_freed_memory
from .checkpointing import checkpointed_call
from .flops import OpCost
from .live_memory import LiveMemory
from .schema import TP_MEASURED, TP_TIMED, LayerProfile, LayerSample, LossProfile, ParamInfo, Profile, splits_evenly
from .tensor_parallel import apply_tp, fake_tp_mesh, loss_context

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class ProfileOptions:
    batch_sizes: tuple[int, ...] = (1, 2, 4)
    optimizer: str = "adamw"        # sgd | momentum | adam | adamw
    precision: str = "fp32"         # fp32 | bf16 | mixed
    device: str = "cpu"             # cpu | cuda
    fake: bool = False              # FakeTensorMode: no allocation, roofline times
    hardware: str | None = None     # preset for fake-mode times
    op_launch_s: float = 0.0        # fake mode: the host's time to issue one op (that preset's op_launch_s)
    warmup: int = 2
    repeats: int = 5
    threads: int = 1                # intra-op threads to time with: the runtime runs one per process on CPU


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype layers compute in: bf16 for bf16 and mixed precision."""
    return torch.float32 if precision == "fp32" else torch.bfloat16


def storage_dtype(precision: str) -> torch.dtype:
    """The dtype of the stored parameters, gradients and optimizer states."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def optimizer_state_bytes(optimizer: str, param_numels: list[int], itemsize: int) -> int:
    """Bytes of the states torch.optim keeps (fused implementation) for these parameters.

    SGD keeps none; momentum one buffer per parameter; Adam/AdamW two (exp_avg, exp_avg_sq)
    plus a float32 `step` scalar per parameter tensor.
    """
    n = sum(param_numels)
    if optimizer == "sgd":
        return 0
    if optimizer == "momentum":
        return n * itemsize
    return 2 * n * itemsize + 4 * len(param_numels)


# --------------------------------------------------------------------------------------
# One layer
# --------------------------------------------------------------------------------------

class _Root(torch.autograd.Function):
    """A backward root that hands `grad` to `out` and keeps no reference to `out`.

    In a real step the layer's output is alive during its backward only if autograd saved it,
    and its gradient arrives ready-made from the next layer; this root reproduces that.
    """

    @staticmethod
    def forward(ctx, out, grad):
        ctx.grad = grad
        return out.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        grad, ctx.grad = ctx.grad, None
        return grad, None


def _storages(t) -> list:
    from torch.distributed._tools.common_utils import get_untyped_storages
    return list(get_untyped_storages(t)) if isinstance(t, torch.Tensor) else []


def _nbytes(t) -> int:
    return sum(st.nbytes() for st in _storages(t))


def _needs_grad(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _fresh_input(x: torch.Tensor) -> torch.Tensor:
    """A leaf copy of x that asks for a gradient when x does (every layer's input but the batch)."""
    return x.detach().requires_grad_(x.requires_grad)


def _clear_grads(module: nn.Module, x: torch.Tensor | None = None) -> None:
    for p in module.parameters():
        p.grad = None
    if x is not None:
        x.grad = None


def measure_memory(fn: Callable, module: nn.Module, x: torch.Tensor, extra=()) -> dict:
    """Memory figures of `fn(x)` (a layer, or the layer under checkpointing).

    `extra` are tensors that exist anyway (the loss's targets): counted as live, never as saved.
    """
    param_storages = {id(st) for t in list(module.parameters()) + list(module.buffers()) + list(extra)
                      for st in _storages(t)}
    x_in = _fresh_input(x)
    fig = {}
    for phase in ("first", "accum"):
        tracker = LiveMemory()
        tracker.track(module, x_in, *extra)
        saved: dict[int, int] = {}          # id(storage) -> bytes, for storages saved this forward

        def pack(t):
            for st in _storages(t):
                if id(st) not in param_storages:
                    saved[id(st)] = st.nbytes()
            return t

        with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            tracker.reset_peak()
            live_before_fwd = tracker.live
            out = fn(x_in)
            live_after_fwd = tracker.live
            fwd_peak = tracker.peak
            in_ids = {id(st) for st in _storages(x_in)}
            out_ids = {id(st) for st in _storages(out)}
            if phase == "first":
                fig["input_bytes"] = _nbytes(x_in)
                fig["output_bytes"] = _nbytes(out)
                fig["saved_bytes"] = sum(saved.values())
                fig["saved_input_bytes"] = sum(v for k, v in saved.items() if k in in_ids)
                fig["saved_output_bytes"] = sum(v for k, v in saved.items() if k in out_ids and k not in in_ids)
                fig["fwd_transient_bytes"] = fwd_peak - live_after_fwd
            # What the forward left alive besides its output (checkpointing: RNG state, ...).
            out_new = 0 if out_ids <= in_ids else _nbytes(out)
            if phase == "first":
                fig["retained_bytes"] = live_after_fwd - live_before_fwd - out_new
            saved.clear()
            if out.requires_grad:
                grad = torch.ones_like(out)   # (DTensor's random ops warn on a CPU mesh)
                root = _Root.apply(out, grad)
                before_del = tracker.live
                del out, grad
                if phase == "first":
                    # What of the output outlives the caller's reference (selective checkpointing
                    # can keep it, as the output of a kept op).
                    fig["output_kept_bytes"] = 0 if not out_new else max(0, out_new - (before_del - tracker.live))
                tracker.reset_peak()
                before = tracker.live
                root.backward()
                fig[f"bwd_{phase}"] = tracker.peak - before
                del root
            else:
                del out
                fig[f"bwd_{phase}"] = 0
                fig.setdefault("output_kept_bytes", 0)
        # The input gradient flows on to the previous layer; it is not accumulated. (Where a
        # collective made it, sequence parallelism's gather, it is waited for first: an
        # unwaited collective stays registered and torch warns of it when the process ends.)
        if isinstance(x_in.grad, AsyncCollectiveTensor):
            x_in.grad.wait()
        x_in.grad = None
    _clear_grads(module, x_in)
    return fig


def measure_cost(fn: Callable, x: torch.Tensor, op_seconds=None, launch_s: float = 0.0) -> tuple[OpCost, OpCost]:
    """FLOPs, memory traffic and all-reduce traffic of fn's forward and of its backward (and
    their achievable times, given `op_seconds` and the host's `launch_s` an op: OpCost)."""
    x_in = _fresh_input(x)
    with OpCost(op_seconds, launch_s) as fwd:
        out = fn(x_in)
    bwd = OpCost(op_seconds, launch_s)
    if out.requires_grad:
        grad = torch.ones_like(out)
        with bwd:
            out.backward(grad)
    return fwd, bwd


def measure_time(turns: list[tuple[Callable, nn.Module]], x: torch.Tensor, opts: ProfileOptions) -> tuple[float, float]:
    """Median forward and backward seconds after warm-up (CUDA events on a GPU) of `fn(x)`,
    for (fn, module) pairs that take the repeats in turn (one pair, or time_layer's copies);
    each repeat clears its module's gradients."""
    cuda = opts.device == "cuda"
    x_in = _fresh_input(x)
    fwd_times, bwd_times = [], []
    for rep in range(opts.warmup + opts.repeats):
        fn, module = turns[rep % len(turns)]
        t_f = _Timer(cuda)
        with t_f:
            out = fn(x_in)
        if out.requires_grad:
            grad = torch.ones_like(out)
            t_b = _Timer(cuda)
            with t_b:
                out.backward(grad)
        else:
            t_b = None
        _clear_grads(module, x_in)
        del out
        if rep >= opts.warmup:
            fwd_times.append(t_f.seconds())
            bwd_times.append(t_b.seconds() if t_b else 0.0)
    return statistics.median(fwd_times), statistics.median(bwd_times)


# A layer's weights, timed: in a step the other layers run between two uses of a layer's
# weights, so a layer whose weights do not stay in the cache finds them in memory; timed back
# to back on the same weights it finds them in cache. examples/mlp.py's step took 1.32-1.99x its
# layers timed so in two runs (its blocks hold 2 MiB of weights and do little with them), the
# GPT's and the Llama's 1.00-1.08x; timed on copies in turn, every model's layers summed to
# within 0-9% of its step (bench/results/layers_in_model.md, 2026-12-06). On a CPU each repeat
# therefore runs on the next of several copies of the layer, whose parameters add up to twice
# the last-level cache: by its turn, the other copies have pushed its weights out.
COPIES_MAX = 32


@functools.cache
def last_level_cache_bytes() -> int:
    """The largest CPU cache this host reports (Linux sysfs), else 32 MiB."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        try:
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1], 0))
        except ValueError:
            continue
    return max(sizes, default=32 << 20)


def weight_copies(layer: nn.Module, opts: ProfileOptions) -> list[nn.Module]:
    """The layer and, on CPU, copies of it up to twice the last-level cache of parameters (at
    most COPIES_MAX in all); just the layer on a GPU, for one larger than that, or for one
    deepcopy cannot copy."""
    nbytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    if opts.device != "cpu" or nbytes == 0:
        return [layer]
    count = min(COPIES_MAX, -(-2 * last_level_cache_bytes() // nbytes))
    try:
        return [layer] + [copy.deepcopy(layer) for _ in range(count - 1)]
    except Exception:  # noqa: BLE001 - a layer holding something deepcopy refuses: timed on itself
        return [layer]


def time_layer(layer: nn.Module, x: torch.Tensor, opts: ProfileOptions,
               wrap: Callable[[nn.Module], Callable] | None = None) -> tuple[float, float]:
    """Forward and backward seconds of `layer` (or of `wrap(layer)`: under checkpointing) with
    its weights where a step finds them: each repeat on the next of its weight_copies."""
    turns = [(wrap(c) if wrap else c, c) for c in weight_copies(layer, opts)]
    return measure_time(turns, x, opts)


class _Timer:
    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __enter__(self):
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
        else:
            self.t = time.perf_counter() - self.t0

    def seconds(self) -> float:
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return self.t


def time_split(layer: nn.Module, match, mesh, x: torch.Tensor, opts: ProfileOptions) -> tuple[float, float]:
    """Forward and backward seconds of a copy of `layer` split over `mesh` by its tp_plan."""
    split = apply_tp(copy_layer(layer), match, mesh)
    return time_layer(split, x, opts)


def measure_layer(layer: nn.Module, x: torch.Tensor, opts: ProfileOptions, op_seconds, timed: bool = True) -> LayerSample:
    """All size-dependent figures of one layer at the micro-batch size of x."""
    ckpt, sac = checkpointed_call(layer, "full"), checkpointed_call(layer, "selective")
    # Each memory figure is taken from the second of two identical runs: first calls allocate
    # caches (DTensor's sharding propagation, kernels) that would look like activations.
    plain = [measure_memory(layer, layer, x) for _ in range(2)][-1]
    ck = [measure_memory(ckpt, layer, x) for _ in range(2)][-1]
    sel = [measure_memory(sac, layer, x) for _ in range(2)][-1]
    fwd, bwd = measure_cost(layer, x, op_seconds, opts.op_launch_s)
    sync_count, sync_bytes = gradients_to_settle(layer)
    _, sac_bwd = measure_cost(sac, x, op_seconds, opts.op_launch_s)
    if opts.fake or not timed:
        fwd_s, bwd_s = fwd.seconds, bwd.seconds
        sac_bwd_s = sac_bwd.seconds
    else:
        fwd_s, bwd_s = time_layer(layer, x, opts)
        sac_bwd_s = time_layer(layer, x, opts, wrap=lambda m: checkpointed_call(m, "selective"))[1]
    return LayerSample(
        input_bytes=plain["input_bytes"], output_bytes=plain["output_bytes"],
        saved_bytes=plain["saved_bytes"], saved_input_bytes=plain["saved_input_bytes"],
        saved_output_bytes=plain["saved_output_bytes"], fwd_transient_bytes=plain["fwd_transient_bytes"],
        bwd_peak_bytes=plain["bwd_first"], bwd_accum_peak_bytes=plain["bwd_accum"],
        ckpt_saved_bytes=max(0, ck["retained_bytes"]), ckpt_fwd_transient_bytes=ck["fwd_transient_bytes"],
        ckpt_bwd_peak_bytes=ck["bwd_first"], ckpt_bwd_accum_peak_bytes=ck["bwd_accum"],
        sac_saved_bytes=max(0, sel["retained_bytes"]), sac_saved_output_bytes=sel["output_kept_bytes"],
        sac_fwd_transient_bytes=sel["fwd_transient_bytes"], sac_bwd_peak_bytes=sel["bwd_first"],
        sac_bwd_accum_peak_bytes=sel["bwd_accum"], sac_recompute_s=max(0.0, sac_bwd_s - bwd_s),
        sac_tp_bwd_comm_bytes=sac_bwd.all_reduce_bytes, sac_tp_bwd_comm_count=sac_bwd.all_reduce_count,
        sac_sp_bwd_comm_bytes=sac_bwd.gather_scatter_bytes, sac_sp_bwd_comm_count=sac_bwd.gather_scatter_count,
        fwd_s=fwd_s, bwd_s=bwd_s, fwd_flops=fwd.flops, bwd_flops=bwd.flops,
        fwd_io_bytes=fwd.io_bytes, bwd_io_bytes=bwd.io_bytes, fwd_ops=fwd.ops, bwd_ops=bwd.ops,
        tp_fwd_comm_bytes=fwd.all_reduce_bytes, tp_bwd_comm_bytes=bwd.all_reduce_bytes,
        tp_fwd_comm_count=fwd.all_reduce_count, tp_bwd_comm_count=bwd.all_reduce_count,
        sp_fwd_comm_bytes=fwd.gather_scatter_bytes, sp_bwd_comm_bytes=bwd.gather_scatter_bytes,
        sp_fwd_comm_count=fwd.gather_scatter_count, sp_bwd_comm_count=bwd.gather_scatter_count,
        tp_grad_sync_count=sync_count, tp_grad_sync_bytes=sync_bytes,
    )


def gradients_to_settle(layer: nn.Module) -> tuple[int, int]:
    """(count, local bytes) of the layer's gradients, after a backward, whose layout is not their
    parameter's: under sequence parallelism a norm's weight gradient is a partial sum over this
    rank's slice of the sequence, which one all-reduce over the TP group settles a step (the
    runtime's Trainer._settle_grads, or FSDP2's reduction). Counted here, outside the backward
    whose collectives measure_cost counts: the runtime's dp2 x tp2 GPT under sequence
    parallelism issued 16 such all-reduces a step beside its 34 gathers and scatters, and was
    predicted 33% short without them (2026-12-06, docs/fidelity.md)."""
    count = nbytes = 0
    for p in layer.parameters():
        g = p.grad
        if isinstance(p, DTensor) and isinstance(g, DTensor) and g.placements != p.placements:
            count += 1
            nbytes += g.to_local().numel() * g.element_size()
    return count, nbytes


def measure_loss(loss_fn: Callable, output: torch.Tensor, targets: torch.Tensor, opts, op_seconds) -> LayerSample:
    """The loss as one more layer without parameters; its input is the model's output."""
    empty = nn.Module()

    def fn(out):
        return loss_fn(out, targets)

    m = [measure_memory(fn, empty, output, extra=(targets,)) for _ in range(2)][-1]
    fwd, bwd = measure_cost(fn, output, op_seconds, opts.op_launch_s)
    if opts.fake:
        fwd_s, bwd_s = fwd.seconds, bwd.seconds
    else:
        fwd_s, bwd_s = measure_time([(fn, empty)], output, opts)
    return LayerSample(
        input_bytes=m["input_bytes"], output_bytes=m["output_bytes"], saved_bytes=m["saved_bytes"],
        saved_input_bytes=m["saved_input_bytes"], saved_output_bytes=m["saved_output_bytes"],
        fwd_transient_bytes=m["fwd_transient_bytes"], bwd_peak_bytes=m["bwd_first"],
        bwd_accum_peak_bytes=m["bwd_accum"], fwd_s=fwd_s, bwd_s=bwd_s, fwd_flops=fwd.flops,
        bwd_flops=bwd.flops, fwd_io_bytes=fwd.io_bytes, bwd_io_bytes=bwd.io_bytes,
        fwd_ops=fwd.ops, bwd_ops=bwd.ops,
        tp_fwd_comm_bytes=fwd.all_reduce_bytes, tp_bwd_comm_bytes=bwd.all_reduce_bytes,
        tp_fwd_comm_count=fwd.all_reduce_count, tp_bwd_comm_count=bwd.all_reduce_count,
    )


# --------------------------------------------------------------------------------------
# Static figures of a layer
# --------------------------------------------------------------------------------------

TP_DIMS = {  # (style, module kind) -> {param name: dim the style shards}
    ("colwise", "Linear"): {"weight": 0, "bias": 0},
    ("vocab", "Linear"): {"weight": 0, "bias": 0},
    ("rowwise", "Linear"): {"weight": 1},
    ("colwise", "Embedding"): {"weight": 1},
    ("rowwise", "Embedding"): {"weight": 0},
}


def copy_layer(layer: nn.Module) -> nn.Module:
    """A deep copy of the layer whose fake tensors (FakeTensorMode) share the original's mode.
    A plain deepcopy copies the mode too, with its table of constants' storage weak references
    (DTensor's vocabulary-split embedding makes such constants); both copies of a reference
    are freed when they die, and torch 2.13 then crashes with a segmentation fault."""
    modes = {id(t.fake_mode): t.fake_mode for t in list(layer.parameters()) + list(layer.buffers())
             if getattr(t, "fake_mode", None) is not None}
    return copy.deepcopy(layer, memo=dict(modes))


def static_figures(layer: nn.Module, index: int, name: str, tp_matches: dict[str, str], opts: ProfileOptions) -> LayerProfile:
    sdt, cdt = storage_dtype(opts.precision), compute_dtype(opts.precision)
    s_size = torch.empty((), dtype=sdt).element_size() if not opts.fake else (2 if sdt == torch.bfloat16 else 4)
    c_size = 2 if cdt == torch.bfloat16 else 4
    params = []
    for pname, p in layer.named_parameters():
        owner, _, leaf = pname.rpartition(".")
        style = tp_matches.get(owner)
        kind = "Embedding" if isinstance(layer.get_submodule(owner) if owner else layer, nn.Embedding) else "Linear"
        tp_dim = TP_DIMS.get((style, kind), {}).get(leaf) if style else None
        params.append(ParamInfo(name=pname, shape=list(p.shape), tp_dim=tp_dim))
    numels = [p.numel() for p in layer.parameters()]
    count = sum(numels)
    tp_count = sum(p.numel() for p, info in zip(layer.parameters(), params) if info.tp_dim is not None)
    return LayerProfile(
        index=index, name=name, kind=type(layer).__name__,
        param_count=count, param_bytes=count * s_size, compute_param_bytes=count * c_size,
        buffer_bytes=sum(b.numel() * b.element_size() for b in layer.buffers()),
        grad_bytes=count * s_size,
        optimizer_state_bytes=optimizer_state_bytes(opts.optimizer, numels, s_size),
        tp_param_bytes=tp_count * s_size, params=params, vocab_head="vocab" in tp_matches.values(),
    )


def check_no_shared_params(model: nn.Sequential, spec: mf.ModelSpec) -> None:
    owner: dict[int, int] = {}
    for i, layer in enumerate(model):
        for pname, p in layer.named_parameters():
            j = owner.setdefault(id(p), i)
            if j != i:
                raise mf.ModelFileError(f"{mf.layer_name(model, j)} and {mf.layer_name(model, i)} in {spec.path} share the parameter {pname}; give each layer its own parameters (untie them) so layers can live on different pipeline stages.")


def structure_key(layer: nn.Module, x: torch.Tensor, tp_matches: dict[str, str], edges=(False, False, False)) -> str:
    """Layers with equal keys run the same ops on the same shapes: their memory and FLOPs are
    measured once. The key is the module's repr (types and hyper-parameters), its parameter
    and buffer shapes and dtypes, the input's, and the TP split (with its sequence-parallel edges)."""
    tensors = [(n, tuple(t.shape), str(t.dtype)) for n, t in list(layer.named_parameters()) + list(layer.named_buffers())]
    return json.dumps([repr(layer), tensors, tuple(x.shape), str(x.dtype), sorted(tp_matches.items()), list(edges)])


def sequence_slice(x: torch.Tensor, degree: int) -> torch.Tensor:
    """One rank's slice of the sequence (dim 1) of a layer input, as sequence parallelism hands it on."""
    part = x.detach().chunk(degree, dim=1)[0].clone(memory_format=torch.contiguous_format)   # its own storage
    return part.requires_grad_(x.requires_grad)


def signature(layer: LayerProfile) -> str:
    """Equal for layers identical in structure and every measured memory and FLOP figure."""
    keep = [{b: {k: v for k, v in asdict(s).items() if not k.endswith("_s")} for b, s in samples.items()}
            for samples in (layer.samples, layer.tp_samples, layer.sp_samples)]
    blob = json.dumps([layer.kind, [asdict(p) for p in layer.params], layer.buffer_bytes, keep], sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def share_times_of_identical_layers(layers: list[LayerProfile]) -> None:
    """Identical layers take the same time; give each the median of the group's measurements."""
    groups: dict[str, list[LayerProfile]] = {}
    for layer in layers:
        groups.setdefault(layer.signature, []).append(layer)
    for group in groups.values():
        for mode in group[0].fsdp_overhead_s:
            med = statistics.median(g.fsdp_overhead_s.get(mode, 0.0) for g in group)
            for g in group:
                g.fsdp_overhead_s[mode] = med
        step = statistics.median(g.optimizer_step_s for g in group)
        for g in group:
            g.optimizer_step_s = step
        for attr in ("samples", "tp_samples"):
            for b in getattr(group[0], attr):
                for name in ("fwd_s", "bwd_s"):
                    med = statistics.median(getattr(getattr(g, attr)[b], name) for g in group)
                    for g in group:
                        setattr(getattr(g, attr)[b], name, med)
        for b in group[0].tp_times:
            med = [statistics.median(g.tp_times[b][k] for g in group) for k in (0, 1)]
            for g in group:
                g.tp_times[b] = list(med)


# --------------------------------------------------------------------------------------
# The whole model
# --------------------------------------------------------------------------------------

@contextlib.contextmanager
def _build_context(opts: ProfileOptions):
    """Default dtype and device for building (and, in fake mode, FakeTensorMode)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(compute_dtype(opts.precision))
    try:
        with torch.device(opts.device):
            if opts.fake:
                from torch._subclasses.fake_tensor import FakeTensorMode
                with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
                    # DTensor asks fake tensors for data pointers; harmless, and not the user's concern.
                    warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
                    yield
            else:
                yield
    finally:
        torch.set_default_dtype(old)


def measure_optimizer_step(layer: nn.Module, opts: ProfileOptions) -> float:
    """Median seconds of the runtime's fused optimizer step over a copy of the layer's
    parameters with gradients set (states exist: every step after the first)."""
    from planner.plan import OptimizerConfig
    from runtime.sharded_optimizer import build_optimizer
    params = [nn.Parameter(p.detach().clone()) for p in layer.parameters()]
    if not params:
        return 0.0
    for p in params:
        p.grad = torch.randn_like(p)
    opt = build_optimizer(params, OptimizerConfig(name=opts.optimizer))
    times = []
    for rep in range(opts.warmup + opts.repeats):
        t = _Timer(opts.device == "cuda")
        with t:
            opt.step()
        if rep >= opts.warmup:
            times.append(t.seconds())
    return statistics.median(times)


FSDP_MODES = ("replicate", "shard", "shard_keep")   # the runtime's DP units (planner.cost names them so)
# replicate all-reduces only after a step's last micro-batch: its overhead per micro-batch is
# measured without that reduction, and "replicate_sync" is what the reduction's copies add once.


def measure_fsdp_overhead(layer: nn.Module, x: torch.Tensor, mesh, opts: ProfileOptions) -> dict[str, float]:
    """What wrapping the layer as each kind of FSDP2 unit adds to its forward + backward per
    micro-batch: the hooks, the copies into and out of the collectives' flat buffers, the
    bookkeeping (measured on a fake 2-rank mesh, so the collectives themselves cost nothing;
    the planner costs those from the hardware's calibrated fits)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    units = {}
    for mode in FSDP_MODES + ("replicate_sync",):
        unit = copy.deepcopy(layer)
        if mode.startswith("replicate"):
            replicate(unit, mesh=mesh)
            unit.set_requires_gradient_sync(mode == "replicate_sync", recurse=False)
        else:
            fully_shard(unit, mesh=mesh, reshard_after_forward=mode == "shard")
        units[mode] = unit
    # Interleaved, so that a slow patch of the machine hits every variant alike; the median of
    # each variant's paired differences from the bare layer.
    diffs: dict[str, list[float]] = {mode: [] for mode in units}
    quick = dataclasses.replace(opts, warmup=1, repeats=1)
    for rep in range(2 + 2 * opts.repeats):
        bare = sum(measure_time([(layer, layer)], x, quick))
        for mode, unit in units.items():
            wrapped = sum(measure_time([(unit, unit)], x, quick))
            if rep >= 2:
                diffs[mode].append(wrapped - bare)
    out = {mode: max(0.0, statistics.median(d)) for mode, d in diffs.items()}
    out["replicate_sync"] = max(0.0, out["replicate_sync"] - out["replicate"])
    return out


def set_fsdp_overheads(layers: list[LayerProfile], overheads: dict[int, list[dict[str, float]]],
                       same_as: dict[int, int]) -> None:
    """Each measured layer's FSDP2 overheads: per unit kind, the median over the micro-batch
    sizes it was measured at; identical layers take it. The hooks and buffer copies do not grow
    with the micro-batch, and a difference of two timings is noisiest where the layer is
    longest: a GPT block's replicate hooks measured 0.66-0.98 ms at micro-batch 1, 0.95-1.15 at 4
    and 0.54-0.71 at 16 but for one 2.7 ms (examples/gpt.py, 4 tries each, 2026-12-05); timed at
    the largest size alone, as before, one profile gave every block 1.86 ms
    (bench/results/time_fidelity_runs/gpt.profile.json)."""
    for i, measured in overheads.items():
        layers[i].fsdp_overhead_s = {mode: statistics.median(m[mode] for m in measured) for mode in measured[0]}
    for i, j in same_as.items():
        layers[i].fsdp_overhead_s = dict(layers[j].fsdp_overhead_s)


@contextlib.contextmanager
def _threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def profile_model(spec: mf.ModelSpec, opts: ProfileOptions, on_progress: Callable[[str, int], None] | None = None,
                  op_seconds: Callable | None = None) -> Profile:
    """Measure every layer of `spec`'s model at each of `opts.batch_sizes`, timing with
    `opts.threads` intra-op threads (what each rank of the runtime uses).

    `on_progress(message, total)` is called before each of `total` units of work. In fake
    mode the times are `op_seconds(kind, flops, io_bytes, (m, n, k) | None)` summed over the
    ops (`Hardware.op_seconds`: achievable rates, not peaks), or `opts.op_launch_s` an op
    where the host's issuing them takes longer (OpCost).
    """
    if not opts.fake:
        keep_freed_memory()              # the host allocator the runtime's ranks run with
    with _threads(opts.threads):
        return _profile_model(spec, opts, on_progress, op_seconds)


def _profile_model(spec, opts, on_progress, op_seconds) -> Profile:
    if opts.device == "cuda" and not opts.fake and not torch.cuda.is_available():
        raise mf.ModelFileError("--device cuda was asked for but torch sees no CUDA device; use --device cpu or --fake.")
    on_progress = on_progress or (lambda _msg, _total: None)
    op_seconds = op_seconds or (lambda kind, flops, io, mnk: 0.0)
    torch.manual_seed(0)
    with _tp_context(spec, opts) as (tp_mesh, tp_timed_mesh), _build_context(opts):  # the mesh must be real, built first
        model = mf.build_checked_model(spec)
        check_no_shared_params(model, spec)
        tp_matches = mf.check_tp_plan(model, spec)
        edges = mf.sequence_parallel_edges(tp_matches)
        layers = [static_figures(layer, i, name, tp_matches[i], opts)
                  for i, (name, layer) in enumerate(model.named_children())]
        loss = LossProfile()
        batch = {"input_bytes": {}, "target_bytes": {}}
        total = (len(model) + 1) * len(opts.batch_sizes)
        # FSDP2 units' own work, measured at every micro-batch size of each first layer of a kind
        # (same_as: the identical layers that take its figures): see set_fsdp_overheads.
        overheads: dict[int, list[dict[str, float]]] = {}
        same_as: dict[int, int] = {}
        for b in opts.batch_sizes:
            inputs, targets = mf.call_make_batch(spec, b)
            inputs, targets = inputs.to(opts.device), targets.to(opts.device)
            batch["input_bytes"][b], batch["target_bytes"][b] = _nbytes(inputs), _nbytes(targets)
            x = inputs
            seen: dict[str, int] = {}        # structure -> first layer measured with it at this b
            for i, layer in enumerate(model):
                on_progress(f"micro-batch {b}: {mf.layer_name(model, i)}", total)
                with torch.no_grad():
                    nxt = mf.run_layer_checked(model, i, x, spec)   # also checks the chain
                nxt.requires_grad_(_needs_grad(nxt))   # later layers' inputs carry gradients; the batch does not
                key = structure_key(layer, x, tp_matches[i], edges[i])
                if key in seen:
                    # Same structure, same input shape: the same memory and FLOPs; only time it.
                    j = seen[key]
                    same_as[i] = j
                    layers[i].samples[b] = copy.copy(layers[j].samples[b])
                    if layers[j].tp_samples:
                        layers[i].tp_samples[b] = copy.copy(layers[j].tp_samples[b])
                    if layers[j].sp_samples:
                        layers[i].sp_samples[b] = copy.copy(layers[j].sp_samples[b])
                    if b in layers[j].tp_times:
                        layers[i].tp_times[b] = list(layers[j].tp_times[b])
                    if not opts.fake:
                        layers[i].samples[b].fwd_s, layers[i].samples[b].bwd_s = time_layer(layer, x, opts)
                        # Split ones too: share_times_of_identical_layers then takes the median of
                        # as many TP timings as plain ones. (Timed on the first layer only, the
                        # tiny Llama's summed TP times moved 24-30% between four profiles where
                        # its plain times moved 12-16%, 2026-12-04.)
                        if b in layers[i].tp_samples:
                            sample = layers[i].tp_samples[b]
                            sample.fwd_s, sample.bwd_s = time_split(layer, tp_matches[i], tp_mesh, x, opts)
                        if b in layers[i].tp_times:
                            layers[i].tp_times[b] = list(time_split(layer, tp_matches[i], tp_timed_mesh, x, opts))
                else:
                    seen[key] = i
                    layers[i].samples[b] = measure_layer(layer, x, opts, op_seconds)
                    if tp_mesh is not None and not opts.fake and any(True for _ in layer.parameters()):
                        overheads.setdefault(i, []).append(measure_fsdp_overhead(layer, x, tp_mesh, opts))
                    # (A layer whose split dims 2 does not divide admits no TP degree: the
                    # planner then offers none, and DTensor could not run it unevenly anyway.)
                    if tp_mesh is not None and tp_matches[i] and splits_evenly(layers[i].params, list(spec.tp_divides), 2):
                        split = apply_tp(copy_layer(layer), tp_matches[i], tp_mesh)
                        layers[i].tp_samples[b] = measure_layer(split, x, opts, op_seconds)
                        del split
                        if not opts.fake and splits_evenly(layers[i].params, list(spec.tp_divides), TP_TIMED):
                            layers[i].tp_times[b] = list(time_split(layer, tp_matches[i], tp_timed_mesh, x, opts))
                    if tp_mesh is not None and (edges[i][0] or edges[i][1]) and splits_evenly(layers[i].params, list(spec.tp_divides), 2):
                        # Under sequence parallelism: the layers that run it, and those that
                        # receive a slice of the sequence (memory and collectives; no timing).
                        split = apply_tp(copy_layer(layer), tp_matches[i], tp_mesh, edges[i])
                        part = sequence_slice(x, TP_MEASURED) if edges[i][1] else x
                        layers[i].sp_samples[b] = measure_layer(split, part, opts, op_seconds, timed=False)
                        del split, part
                last_input, x = x, nxt
            on_progress(f"micro-batch {b}: loss", total)
            with torch.no_grad():
                mf.run_loss_checked(spec, x, targets)
            loss.samples[b] = measure_loss(spec.loss_fn, x, targets, opts, op_seconds)
            if layers[-1].vocab_head and b in layers[-1].tp_samples:
                # The loss on the logits a "vocab" head leaves split, under loss_parallel, at
                # two degrees (schema.LossProfile says why not through t = 1).
                for mesh in (tp_mesh, tp_timed_mesh):
                    split = apply_tp(copy_layer(model[-1]), tp_matches[-1], mesh)
                    with torch.no_grad():
                        logits = split(last_input).requires_grad_(True)
                    try:
                        with loss_context(spec.tp_plan, mesh.size()):
                            loss.split_samples.setdefault(mesh.size(), {})[b] = measure_loss(spec.loss_fn, logits, targets, opts, op_seconds)
                    except Exception as e:  # noqa: BLE001
                        raise mf.ModelFileError(
                            f"the loss in {spec.path} cannot take the logits of its \"vocab\" head split by vocabulary under "
                            f"torch's loss_parallel ({type(e).__name__}: {mf.first_line(e)}); compute it with F.cross_entropy "
                            "on the logits, or take the head out of the tp_plan.") from None
                    del split, logits
        set_fsdp_overheads(layers, overheads, same_as)
        if not opts.fake:
            steps: dict[str, float] = {}     # the optimizer step depends on the parameter shapes only
            for i, layer in enumerate(model):
                key = json.dumps([list(p.shape) for p in layer.parameters()])
                if key not in steps:
                    steps[key] = measure_optimizer_step(layer, opts)
                layers[i].optimizer_step_s = steps[key]
    for layer in layers:
        layer.signature = signature(layer)
    share_times_of_identical_layers(layers)
    for layer in layers:
        layer.refit()
    loss.refit()
    bs = list(opts.batch_sizes)
    per_sample = {k: max(v[b] / b for b in bs) for k, v in batch.items()}
    if opts.device == "cuda" and not opts.fake:
        device_name = torch.cuda.get_device_name()
    else:
        device_name = opts.device
    return Profile(
        model={"path": spec.path, "sha256": spec.sha256, "source": spec.source, "name": spec.name,
               **({"seq_len": spec.seq_len} if spec.seq_len is not None else {})},
        torch_version=torch.__version__.split("+")[0], device=device_name, device_type=opts.device,
        method="fake" if opts.fake else "measured", hardware=opts.hardware, precision=opts.precision,
        optimizer=opts.optimizer, batch_sizes=bs, layers=layers, loss=loss,
        batch={"input_bytes_per_sample": per_sample["input_bytes"], "target_bytes_per_sample": per_sample["target_bytes"]},
        seq_len=spec.seq_len, tp_divides=list(spec.tp_divides), threads=opts.threads,
    )


@contextlib.contextmanager
def _tp_context(spec: mf.ModelSpec, opts: ProfileOptions):
    """(a fake mesh of TP_MEASURED ranks, one of TP_TIMED ranks or None). The first when the
    model has a tp_plan (TP is measured on it) or its layers are timed (FSDP2's hooks are
    measured on it), else None; the second when it has a tp_plan (its layers are timed at
    TP_TIMED ranks too, tp_times, and a "vocab" head's loss is measured there)."""
    if not spec.tp_plan and opts.fake:
        yield None, None
        return
    if not spec.tp_plan:
        with fake_tp_mesh(opts.device, TP_MEASURED) as mesh:
            yield mesh, None
        return
    with fake_tp_mesh(opts.device, TP_TIMED) as world:
        # TP_MEASURED ranks of the TP_TIMED: a sub-mesh of the same fake world.
        sub = init_device_mesh(opts.device, (TP_TIMED // TP_MEASURED, TP_MEASURED), mesh_dim_names=("rest", "tp"))
        yield sub["tp"], world
