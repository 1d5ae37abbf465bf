"""Single-process reference training: the oracle every parallel plan must reproduce.

The same model (seed, init, dtype), the same global batches (every dp rank's rows, in rank
order), the same learning rates, clipping and fused optimizer as the runtime, but one process,
the whole global batch at once and no micro-batching. Under precision "mixed" the reference
trains in fp32 (it has no mixed-precision policy to mirror).
"""

from __future__ import annotations

import torch

from planner.plan import Plan
from profiles.model_file import ModelSpec

from .config import TrainConfig
from .data import batch_source
from .sharded_optimizer import build_optimizer
from .train import build_model


def train_reference(spec: ModelSpec, plan: Plan, steps: int, config: TrainConfig | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses per step and the final state dict (CPU tensors)."""
    config = config or TrainConfig()
    plan = config.apply_to(plan)
    model = build_model(spec, plan)
    optimizer = build_optimizer(list(model.parameters()), plan.optimizer)
    source = batch_source(spec, plan)
    losses = []
    for step in range(steps):
        torch.manual_seed(plan.seed + 1 + step)
        rows = [source.batch(step, r) for r in range(plan.dp)]
        inputs, targets = torch.cat([x for x, _ in rows]), torch.cat([y for _, y in rows])
        loss = spec.loss_fn(model(inputs), targets)
        loss.backward()
        if config.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad_norm)
        for group in optimizer.param_groups:
            group["lr"] = config.lr_at(step, plan.optimizer.lr, steps)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
