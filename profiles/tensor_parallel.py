"""Tensor parallelism of one layer, as the model file's tp_plan asks for it.

Used by the profiler (under a fake process group, to measure a layer at tp = 2 in one
process) and by the runtime (under the real one), so both apply exactly the same split.

Sequence parallelism (Megatron-style, Korthikanti et al. 2022): in a layer whose tp_plan names
"sequence" modules (its norms), and when the plan turns it on, the activations outside the
column/row-parallel regions are split along the sequence (dim 1): the norms run on 1/tp of the
tokens (SequenceParallel), each colwise linear all-gathers its input instead of taking a
replicated one, and each rowwise linear reduce-scatters its output instead of all-reducing it.
Such a layer takes and returns this rank's slice of the sequence, (B, T/tp, C); where its
neighbour is not sequence-parallel the slice is cut from (input) or gathered into (output)
the full tensor at the layer's edge.

A "vocab" head (the last layer's output linear) is column-parallel over the vocabulary and its
logits leave the layer as a DTensor split along the last dim, (B, T, V/tp) on each rank: the
loss takes them so, under `loss_parallel()` (forward and backward), which computes the
cross-entropy with three small all-reduces (the max, the sum of exponentials, the target's
logit) instead of gathering (B, T, V).
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, loss_parallel,
                                               parallelize_module)

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
SEQUENCE = Shard(1)          # (B, T, C): the sequence dimension


class GatheringColwise(ColwiseParallel):
    """A column-parallel linear in a sequence-parallel layer: a sequence slice (a local tensor)
    is gathered; a DTensor (a norm's output, gathered once already) is taken as it is. Its
    gradient then stays partial, so the gradients of q, k and v add up before the one
    reduce-scatter back to the slice, where a redistribution per linear would all-reduce each
    (measured under the fake process group: three all-reduces per attention)."""

    def __init__(self):
        super().__init__(input_layouts=SEQUENCE)

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        if isinstance(inputs[0], DTensor):
            return inputs[0]
        return ColwiseParallel._prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh)


def apply_tp(layer: nn.Module, matches: dict[str, str], tp_mesh: DeviceMesh,
             sequence: tuple[bool, bool, bool] | None = None) -> nn.Module:
    """Split the matched submodules of `layer` over `tp_mesh`; outputs stay local tensors
    (SDPA on DTensors fails on CPU, and the model's view(b, t, -1, hd) finds the local heads).

    sequence: None without sequence parallelism ("sequence" entries are then ignored: the norms
    stay replicated); with it, the layer's model_file.sequence_parallel_edges entry (it runs
    sequence-parallel, its input arrives split, its output must be whole).
    """
    sp, input_split, output_whole = sequence or (False, False, False)
    styles, gathered, waited = {}, [], []
    for name, style in matches.items():
        linear = isinstance(layer.get_submodule(name), nn.Linear)
        if style == "sequence":
            if sp:
                styles[name] = SequenceParallel()
                gathered.append(name)
        elif style == "vocab":
            # Fed a slice of the sequence (sequence parallelism), it gathers it like any colwise linear.
            styles[name] = ColwiseParallel(input_layouts=SEQUENCE if sp else Replicate(), output_layouts=Shard(-1),
                                           use_local_output=False)
        elif sp and style == "colwise" and linear:
            styles[name] = GatheringColwise()                               # all-gather the tokens in
        elif sp and style == "rowwise" and linear:
            styles[name] = RowwiseParallel(output_layouts=SEQUENCE)         # reduce-scatter them out
        elif style == "rowwise" and not linear:
            # An embedding split by rows (the vocabulary): it takes the token ids whole (torch's
            # default input layout, the last dim split, is a linear's and would gather the ids).
            styles[name] = RowwiseParallel(input_layouts=Replicate())
            waited.append(name)
        elif style == "colwise" and not linear:
            # An embedding split by columns (its width): its output gathered whole, as the
            # layers after it take it (torch's default leaves it split along the width).
            styles[name] = ColwiseParallel(output_layouts=Replicate())
        else:
            styles[name] = STYLES[style]()
    if styles:
        parallelize_module(layer, tp_mesh, styles)
    for name in waited:
        # Its all-reduced output is waited for at once: recomputed under checkpointing, where
        # nothing reads it, the collective would stay registered, unwaited, one more each step.
        layer.get_submodule(name).register_forward_hook(_wait_output)
    for name in gathered:
        # A norm's output is gathered once, as a replicated DTensor that the column-parallel
        # linears after it take as it is (q, k and v share one all-gather, and its backward is
        # one reduce-scatter of their summed gradients, as in torchtitan's plan); a colwise
        # linear fed the slice itself gathers it on its own.
        parallelize_module(layer.get_submodule(name), tp_mesh,
                           PrepareModuleOutput(output_layouts=(SEQUENCE,), desired_output_layouts=(Replicate(),),
                                               use_local_output=False))
    if sp:
        # What the layer's forward sees of the sequence is 1/tp of it: a layer that computes
        # positions or masks from its input's length reads this (profiles/hf.py's adapter).
        layer.sequence_split = tp_mesh.size()
    # The layer's edges: cut the slice this rank works on, or gather the whole sequence back.
    def edge(frm, to):
        return dict(input_layouts=(frm,), desired_input_layouts=(to,), use_local_output=True)
    if sp and not input_split:
        parallelize_module(layer, tp_mesh, PrepareModuleInput(**edge(Replicate(), SEQUENCE)))
    if not sp and input_split:
        parallelize_module(layer, tp_mesh, PrepareModuleInput(**edge(SEQUENCE, Replicate())))
    if output_whole and "vocab" not in matches.values():
        parallelize_module(layer, tp_mesh, PrepareModuleOutput(output_layouts=(SEQUENCE,), desired_output_layouts=(Replicate(),),
                                                               use_local_output=True))
    return layer


def _wait_output(module, inputs, output) -> None:
    if isinstance(output, AsyncCollectiveTensor):
        output.wait()


def loss_context(tp_plan: dict[str, str], tp: int):
    """What the loss's forward and backward run under: loss_parallel when a "vocab" head hands
    it split logits (tp > 1), else nothing."""
    if tp > 1 and "vocab" in tp_plan.values():
        return loss_parallel()
    return contextlib.nullcontext()


@contextlib.contextmanager
def fake_tp_mesh(device_type: str, degree: int):
    """A one-process mesh of `degree` ranks whose collectives do nothing: shapes and memory
    are those of real tensor parallelism, the numbers are not."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_tp_mesh needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=degree)
    try:
        yield init_device_mesh(device_type, (degree,))
    finally:
        dist.destroy_process_group()
