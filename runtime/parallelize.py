"""Apply a plan's per-layer choices to one pipeline stage: TP, then checkpointing, then DP.

The order matters: parallelize_module must see the layer's own Linear submodules (a
checkpoint wrapper or FSDP2 first would hide or already own them), and FSDP2 / replicate
must see the TP DTensors so that they compose (dp x tp) instead of sharding the plain weights.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from planner.plan import LayerChoice, Plan
from profiles import checkpointing, tensor_parallel
from profiles.model_file import tp_plan_matches


def apply_tp(layer: nn.Module, tp_mesh: DeviceMesh, tp_plan: dict[str, str], sequence: tuple[bool, bool, bool] | None) -> None:
    """Shard the layer's submodules that the model file's tp_plan names (the rest stay
    replicated), with the profiler's own split so that both measure the same layer; `sequence`:
    its sequence-parallel edges (model_file.sequence_parallel_edges), None without it."""
    tensor_parallel.apply_tp(layer, tp_plan_matches(layer, tp_plan), tp_mesh, sequence)


def apply_ac(layer: nn.Module, mode: str) -> nn.Module:
    """Wrap the layer in non-reentrant torch.utils.checkpoint, whole ("full") or with the
    profiler's selective policy ("selective"): profiles/checkpointing.py."""
    return checkpointing.wrap_checkpoint(layer, mode)


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """bf16 compute, fp32 gradient reduction (and fp32 sharded parameters) under "mixed"; else none."""
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "mixed" else MixedPrecisionPolicy()


def apply_fsdp(module: nn.Module, dp_mesh: DeviceMesh, lc: LayerChoice, precision: str, device_type: str) -> None:
    """Make the layer `module` the DP unit plan.json names (planner.plan.UNITS) on the dp mesh.

    shard -> fully_shard (params resharded after forward; on the host when offloaded);
    shard_keep -> fully_shard keeping the unsharded params until backward; replicate ->
    FSDP-based replicate (ZeRO-1's optimizer sharding is in ShardedOptimizer); plain -> none.
    """
    mp = mixed_precision(precision)
    if lc.unit == "shard":
        offload = CPUOffloadPolicy(pin_memory=device_type == "cuda") if lc.offload else None
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=True, mp_policy=mp,
                    **({"offload_policy": offload} if offload else {}))
    elif lc.unit == "shard_keep":
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
    elif lc.unit == "replicate":
        replicate(module, mesh=dp_mesh, mp_policy=mp)


def parallelize_stage(stage: nn.Sequential, layers: list[LayerChoice], tp_plan: dict[str, str], mesh: DeviceMesh, plan: Plan,
                      edges: list[tuple[bool, bool, bool]] | None = None) -> nn.Sequential:
    """Apply TP, checkpointing and DP to each layer of the stage (children named by layer index),
    then make the stage the root DP unit; `edges`: every layer's sequence-parallel edges, or None."""
    for lc in layers:
        name = str(lc.index)
        layer = stage.get_submodule(name)
        if plan.tp > 1:
            apply_tp(layer, mesh["tp"], tp_plan, edges[lc.index] if edges else None)
        if lc.recomputes:
            layer = apply_ac(layer, lc.checkpoint)
            stage.register_module(name, layer)
        apply_fsdp(layer, mesh["dp"], lc, plan.precision, plan.device_type)
    if plan.wrapped:
        # The root owns no parameters (each belongs to a layer), so it is fully_shard whatever
        # the ZeRO stage: a replicate root's lazy init collects replicate units only, which
        # would leave offloaded (fully_shard) layers as roots of their own, outside the
        # stage's backward bookkeeping (pipelining then never reduces their gradients).
        fully_shard(stage, mesh=mesh["dp"], mp_policy=mixed_precision(plan.precision))
    return stage
