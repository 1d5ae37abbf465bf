"""Apply a plan's per-layer choices to one pipeline stage: TP, then checkpointing, then DP.

The order matters: parallelize_module must see the layer's own Linear submodules (a
checkpoint wrapper or FSDP2 first would hide or already own them), and FSDP2 / replicate
must see the TP DTensors so that they compose (dp x tp) instead of sharding the plain weights.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from planner.plan import LayerChoice, Plan
from profiles import tensor_parallel
from profiles.model_file import ModelSpec, tp_plan_matches


def uses_fsdp(plan: Plan) -> bool:
    """False for the plain path: dp 1, nothing offloaded, no mixed precision -> no DP wrapper at all."""
    offloads = any(lc.offload for stage in plan.stages for lc in stage.layers)
    return plan.dp > 1 or offloads or plan.precision == "mixed"


def apply_tp(layer: nn.Module, tp_mesh: DeviceMesh, tp_plan: dict[str, str]) -> None:
    """Shard the layer's submodules that the model file's tp_plan names (the rest stay
    replicated), with the profiler's own split so that both measure the same layer."""
    tensor_parallel.apply_tp(layer, tp_plan_matches(layer, tp_plan), tp_mesh)


def apply_ac(layer: nn.Module) -> nn.Module:
    """Wrap the whole layer in non-reentrant torch.utils.checkpoint: it keeps only its input."""
    return checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """bf16 compute, fp32 gradient reduction (and fp32 sharded parameters) under "mixed"; else none."""
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "mixed" else MixedPrecisionPolicy()


def apply_fsdp(module: nn.Module, dp_mesh: DeviceMesh, zero: int, offload: bool, precision: str, device_type: str) -> None:
    """Make the layer `module` one DP unit on the dp mesh.

    zero 3 -> fully_shard (params resharded after forward); zero 2 -> fully_shard keeping the
    unsharded params until backward; zero 0/1 -> FSDP-based replicate (ZeRO-1's optimizer
    sharding is in ShardedOptimizer). An offloaded unit is always fully sharded on the host.
    """
    mp = mixed_precision(precision)
    if offload:
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=True, mp_policy=mp,
                    offload_policy=CPUOffloadPolicy(pin_memory=device_type == "cuda"))
    elif zero >= 2:
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=zero == 3, mp_policy=mp)
    else:
        replicate(module, mesh=dp_mesh, mp_policy=mp)


def parallelize_stage(stage: nn.Sequential, layers: list[LayerChoice], spec: ModelSpec, mesh: DeviceMesh, plan: Plan) -> nn.Sequential:
    """Apply TP, checkpointing and DP to each layer of the stage (children named by layer index), then make the stage the root DP unit."""
    fsdp = uses_fsdp(plan)
    for lc in layers:
        name = str(lc.index)
        layer = stage.get_submodule(name)
        if plan.tp > 1:
            apply_tp(layer, mesh["tp"], spec.tp_plan)
        if lc.checkpoint:
            layer = apply_ac(layer)
            stage.register_module(name, layer)
        if fsdp:
            apply_fsdp(layer, mesh["dp"], plan.zero, lc.offload, plan.precision, plan.device_type)
    if fsdp:
        # The root owns no parameters (each belongs to a layer), so it is fully_shard whatever
        # the ZeRO stage: a replicate root's lazy init collects replicate units only, which
        # would leave offloaded (fully_shard) layers as roots of their own, outside the
        # stage's backward bookkeeping (pipelining then never reduces their gradients).
        fully_shard(stage, mesh=mesh["dp"], mp_policy=mixed_precision(plan.precision))
    return stage
