"""FLOPs and memory traffic of the ops a layer runs.

`OpCost` is a dispatch mode that adds up, for every op, its FLOPs (PyTorch's own
`FlopCounterMode` formulas) or, for ops without a formula (elementwise, norms, softmax,
copies), the bytes they read and write. Given `op_seconds` (a hardware's achievable rates,
`Hardware.op_seconds`), it also adds up each op's time on its own: a matmul's FLOPs at the
rate its (m, n, k) shape reaches, attention's at the fused kernels' rate, the other ops'
bytes at the achievable memory bandwidth; and a layer's ops take at least the host's time to
issue them (`Hardware.op_launch_s` each). That is how fake-mode profiles get times; the planner
moves times measured on one device to another with the totals.

PyTorch's counter has no formula for the CPU flash-attention kernels; they are registered
here with the same formulas it uses for the CUDA ones.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None
from torch.utils.flop_counter import (
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

from .live_memory import CountingMode, ShapePropagation

aten = torch.ops.aten

# Ops that move no data of their own: views and metadata changes.
_FREE_OPS = {
    aten.view, aten._unsafe_view, aten.reshape, aten.expand, aten.permute, aten.transpose, aten.t,
    aten.unsqueeze, aten.squeeze, aten.slice, aten.select, aten.as_strided, aten.alias, aten.detach,
    aten.split, aten.split_with_sizes, aten.unbind, aten.chunk, aten.empty, aten.empty_like,
    aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.lift_fresh,
}


def _register_cpu_attention_formulas() -> None:
    fwd = aten._scaled_dot_product_flash_attention_for_cpu
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward
    if fwd not in flop_registry:
        @register_flop_formula(fwd)
        def _cpu_flash_fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return sdpa_flop_count(query_shape, key_shape, value_shape)
    if bwd not in flop_registry:
        @register_flop_formula(bwd)
        def _cpu_flash_bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_register_cpu_attention_formulas()


def attention_flops(packet, args, kwargs, out) -> int:
    """A fused attention op's FLOPs by PyTorch's formula. Under grouped-query attention K and V
    hold fewer heads than Q (Llama 3: 8 and 32), which the formula refuses ("query/key/value
    shapes are incompatible", a CUDA profile of Llama 3 on an H200, 2026-12-04); every Q head
    still attends over its group's K and V, so they count as repeated to Q's heads. Only the
    SDPA kernels and the flash / efficient ones under them are so treated: their arguments
    are (grad_out,) q, k, v, ... (flex_attention's backward takes grad_out later)."""
    name = packet.__name__
    if not name.startswith(("_scaled_dot_product", "_flash_attention", "_efficient_attention")):
        return int(flop_registry[packet](*args, **kwargs, out_val=out))
    q_at = 1 if "backward" in name else 0                     # their backward ops take grad_out first
    heads = 1 if name.startswith("_scaled_dot_product") else 2   # (B, H, S, D), else (B, S, H, D)
    args = list(args)
    q = args[q_at]
    for i in (q_at + 1, q_at + 2):
        kv = args[i]
        if isinstance(kv, torch.Tensor) and kv.dim() == 4 and kv.shape[heads] != q.shape[heads]:
            shape = list(kv.shape)
            shape[heads] = q.shape[heads]
            args[i] = torch.empty(shape, dtype=kv.dtype, device="meta")   # the formula reads shapes only
    return int(flop_registry[packet](*args, **kwargs, out_val=out))


def _tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


_ALL_REDUCE = {torch.ops._c10d_functional.all_reduce, torch.ops._c10d_functional.all_reduce_}
# Sequence parallelism's collectives: each moves half an all-reduce's bytes (ring algorithms).
_GATHER_SCATTER = {torch.ops._c10d_functional.all_gather_into_tensor, torch.ops._c10d_functional.reduce_scatter_tensor}


_MATMULS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}


def matmul_shape(packet, args) -> tuple[int, int, int] | None:
    """(m, n, k) of a matmul op's arguments, batches folded into m."""
    try:
        if packet in (aten.mm, aten.bmm):
            a, b = args[0], args[1]
        else:                                   # addmm / baddbmm: (input, a, b)
            a, b = args[1], args[2]
        m = a.numel() // a.shape[-1]
        return int(m), int(b.shape[-1]), int(a.shape[-1])
    except (AttributeError, IndexError, TypeError):
        return None


class OpCost(CountingMode):
    """Sum FLOPs of matmul-like ops, bytes moved by the other ops, and TP collectives' traffic; with
    `op_seconds(kind, flops, io_bytes, mnk)`, also the ops' achievable time (`seconds`).

    That time is the larger of the ops' device time (each op's own, added up) and the host's
    time to issue them, `launch_s` for every op dispatched (views too: each is a Python and
    dispatcher call; not metadata queries, which a fake tensor dispatches and a real one does
    not: counted, they made a fake GPT block's count 3.4x a real one's). Eager PyTorch queues kernels while the host runs ahead, so a run of ops
    takes whichever is longer; adding the two instead would double-count. On one H200
    (bench/results/gpu_fake.md) a ~1B GPT block at micro-batch 4 measured 2.46 ms forward and
    backward, its ops 2.35 ms at the preset's rates and 133 dispatched ops at 18.7 us 2.49 ms:
    their sum would be 4.8. At micro-batch 1 the block measured 2.49 ms, its ops 0.63."""

    def __init__(self, op_seconds=None, launch_s: float = 0.0) -> None:
        super().__init__()
        self.flops = 0
        self.io_bytes = 0
        self.all_reduce_bytes = 0
        self.all_reduce_count = 0
        self.gather_scatter_bytes = 0    # all-gathers (bytes of the whole output) and reduce-scatters (of the whole input)
        self.gather_scatter_count = 0
        self.op_seconds = op_seconds
        self.launch_s = launch_s
        self.device_seconds = 0.0        # the ops' own times, added up
        self.ops = 0                     # ops dispatched (what the host issues)

    @property
    def seconds(self) -> float:
        """The ops' achievable time: their device time, or the host's time to issue them if longer."""
        return max(self.device_seconds, self.ops * self.launch_s)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Let DTensor lower itself first, so that the local (sharded) ops are what is counted.
        if DTensor is not None and any(t is DTensor for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if ShapePropagation.depth:
            return out
        outs, _ = tree_flatten(out)
        if func.namespace == "prim" or not any(isinstance(t, torch.Tensor) for t in outs):
            return out         # metadata queries (a fake tensor's prim.device, sizes) issue and move nothing
        self.ops += 1
        packet = func.overloadpacket
        if packet in _ALL_REDUCE:
            self.all_reduce_bytes += _tensor_bytes([args[0]])
            self.all_reduce_count += 1
        elif packet in _GATHER_SCATTER:
            whole = out if packet == torch.ops._c10d_functional.all_gather_into_tensor else args[0]
            self.gather_scatter_bytes += _tensor_bytes([whole])
            self.gather_scatter_count += 1
        elif packet in flop_registry:
            kind = "attention" if "attention" in packet.__name__ else "matmul"
            flops = attention_flops(packet, args, kwargs, out) if kind == "attention" else \
                int(flop_registry[packet](*args, **kwargs, out_val=out))
            self.flops += flops
            if self.op_seconds is not None:
                self.device_seconds += self.op_seconds(kind, flops, 0, matmul_shape(packet, args) if packet in _MATMULS else None)
        elif packet not in _FREE_OPS and not func.is_view:
            ins, _ = tree_flatten((args, kwargs))
            io = _tensor_bytes(ins) + _tensor_bytes(outs)
            self.io_bytes += io
            if self.op_seconds is not None:
                self.device_seconds += self.op_seconds("memory", 0, io, None)
        return out
