"""Run several plans in one torchrun launch and save what the runtime tests compare.

    torchrun --nproc-per-node N tests/runtime_driver.py DIR STEPS

Trains every DIR/*.plan.json (each for N processes) for STEPS steps with the runtime's own
Trainer (with the training settings of DIR/<name>.config.json where there is one) and, on rank 0, writes DIR/<name>.result.pt: the global losses, the full final
parameters (DTensors gathered with full_tensor, other pipeline stages' layers from their
ranks) and every rank's report. One launch, one process group, many plans: a launch costs
seconds here, a plan a fraction of that.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from planner.plan import load_plan
from profiles.model_file import load_spec
from runtime.api import ParallelModel, apply_plan, leave
from runtime.config import TrainConfig
from runtime.data import batch_source
from runtime.parallel_dims import ParallelDims
from runtime.train import Trainer, build_model, reduce_losses


def full_state(parallel: ParallelModel) -> dict[str, torch.Tensor]:
    """The whole model's state on every rank: each (pp) stage's tensors from its dp 0 / tp 0 rank."""
    state = {}
    for module in parallel.modules:
        for name, t in module.state_dict().items():  # names as in the full model ("3.attn.q.weight")
            state[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
    mine = state if parallel.dp_rank == 0 and parallel.tp_rank == 0 else {}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {k: v for part in gathered for k, v in part.items()}


def main(directory: str, steps: int) -> None:
    dist.init_process_group("gloo")
    meshes = {}
    for plan_path in sorted(Path(directory).glob("*.plan.json")):
        plan = load_plan(plan_path)
        spec = load_spec(plan.model)
        dims = ParallelDims.from_plan(plan)
        if dims not in meshes:
            meshes[dims] = dims.build_mesh("cpu")
        parallel = apply_plan(build_model(spec, plan), plan, spec.loss_fn, spec.tp_plan, mesh=meshes[dims])
        name = plan_path.name.removesuffix(".plan.json")
        settings = Path(directory) / f"{name}.config.json"
        config = TrainConfig.from_json(json.loads(settings.read_text())) if settings.exists() else None
        local_losses, report = Trainer(parallel, batch_source(spec, plan), config).train(steps)
        losses = reduce_losses(local_losses, parallel.has_last_stage, plan, parallel.device)
        state = full_state(parallel)
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, asdict(report))
        if dist.get_rank() == 0:
            torch.save({"losses": losses, "state": state, "reports": reports}, Path(directory) / f"{name}.result.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    leave()                      # as the runtime does (runtime.api.leave says why)
