"""Activation checkpointing of one layer, in each mode a plan can ask for (CHECKPOINT_MODES).

Used by the profiler (to measure a layer's memory and time under each mode) and by the
runtime (to run it), so both apply exactly the same policy.

  full       torch.utils.checkpoint, non-reentrant: the forward keeps only the layer's input
             and the backward runs the whole forward again.
  selective  the same with PyTorch's selective checkpoint API: the outputs of the ops in
             SAVED_OPS are kept, every other op (elementwise, norms, views) runs again in
             backward. Matmuls and attention are where a layer's time goes and its
             elementwise ops are where its activation bytes go (a GELU's input, a norm's
             output), so this keeps most of the time for part of the memory; torchtitan's
             per-op policy (its `_save_list`) keeps the same kinds of op. Collectives are kept
             too, so a tensor-parallel layer does not run its all-reduces again.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional


def _ops(*names: tuple) -> set:
    """The overloads that exist in this torch (attention kernels differ between versions)."""
    out = set()
    for namespace, name in names:
        packet = getattr(namespace, name, None)
        if packet is not None:
            out.update(getattr(packet, o) for o in packet.overloads())
    return out


SAVED_OPS = _ops(
    (_aten, "mm"), (_aten, "addmm"), (_aten, "bmm"), (_aten, "baddbmm"), (_aten, "linear"),
    (_aten, "_scaled_dot_product_flash_attention"), (_aten, "_scaled_dot_product_flash_attention_for_cpu"),
    (_aten, "_scaled_dot_product_efficient_attention"), (_aten, "_scaled_dot_product_cudnn_attention"),
    (_c10d, "all_reduce"), (_c10d, "all_gather_into_tensor"), (_c10d, "reduce_scatter_tensor"),
    (_c10d, "wait_tensor"),
)


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep the outputs of compute-heavy ops and collectives; recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(selective_policy)


def _mode_kwargs(layer: nn.Module, mode: str) -> dict:
    """What torch.utils.checkpoint takes besides the layer for a "full" or "selective" mode.

    A tensor-parallel layer's recompute runs its whole forward (early_stop=False): stopped as
    soon as the saved tensors are back, it can leave a collective it started unwaited (a
    vocabulary-split embedding's all-reduce, whose output only the next op waits for), and
    torch keeps every such work registered: one more each step, and a warning when the
    process ends. Other layers stop early, as torch's default, not recomputing past what
    backward needs."""
    split = any(isinstance(p, DTensor) for p in layer.parameters())
    return {**({"early_stop": False} if split else {}),
            **({"context_fn": _selective_contexts} if mode == "selective" else {})}


def checkpointed_call(layer: nn.Module, mode: str):
    """`layer` as a function of its input under `mode` (the profiler measures this)."""
    if mode == "none":
        return layer
    return functools.partial(checkpoint, layer, use_reentrant=False, **_mode_kwargs(layer, mode))


def wrap_checkpoint(layer: nn.Module, mode: str) -> nn.Module:
    """The layer wrapped to run under `mode` in a model (the runtime applies this)."""
    if mode == "none":
        return layer
    return checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **_mode_kwargs(layer, mode))
