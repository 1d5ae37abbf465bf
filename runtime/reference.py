"""Single-process reference training: the oracle every parallel plan must reproduce.

The same model (seed, init, dtype), the same global batches and the same fused optimizer as
the runtime, but one process, the whole global batch at once and no micro-batching. Under
precision "mixed" the reference trains in fp32 (it has no mixed-precision policy to mirror).
"""

from __future__ import annotations

import torch

from planner.plan import Plan
from profiles.model_file import ModelSpec

from .sharded_optimizer import build_optimizer
from .train import build_model, global_batch


def train_reference(spec: ModelSpec, plan: Plan, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses per step and the final state dict (CPU tensors)."""
    model = build_model(spec, plan)
    optimizer = build_optimizer(list(model.parameters()), plan.optimizer)
    losses = []
    for step in range(steps):
        inputs, targets = global_batch(spec, plan, step)
        loss = spec.loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
