"""Train, checkpoint and resume several plans in one torchrun launch (tests/test_training.py).

    torchrun --nproc-per-node N tests/resume_driver.py JOBS.json

JOBS.json is a list of {"name", "plan", "steps", "checkpoint_dir", "resume", "config"}, run in
order in one process group with the runtime's own pieces, as `python -m runtime` runs them:
the model built on the meta device when resuming, checkpoint.find_resume / load, the Trainer
with a checkpoint after the last step. Rank 0 writes DIR/<name>.result.json: the global losses,
the first step and the checkpoint written. One launch instead of one per run: a launch costs
seconds here, a run a fraction of that.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from planner.plan import load_plan
from profiles.model_file import load_spec
from runtime import checkpoint
from runtime.api import apply_plan, leave
from runtime.config import TrainConfig
from runtime.data import batch_source
from runtime.parallel_dims import ParallelDims
from runtime.train import Checkpointing, Trainer, build_model, reduce_losses


def main(jobs_path: str) -> None:
    dist.init_process_group("gloo")
    meshes = {}
    for job in json.loads(Path(jobs_path).read_text()):
        plan = load_plan(job["plan"])
        spec = load_spec(plan.model)
        dims = ParallelDims.from_plan(plan)
        if dims not in meshes:
            meshes[dims] = dims.build_mesh("cpu")
        config = TrainConfig(**job["config"])
        model = build_model(spec, plan, on_meta=job["resume"])
        shapes = checkpoint.model_shapes(model)
        parallel = apply_plan(model, plan, spec.loss_fn, spec.tp_plan, mesh=meshes[dims])
        start = 0
        if job["resume"]:
            path, info = checkpoint.find_resume(job["checkpoint_dir"], shapes, plan.optimizer.name)
            checkpoint.load(parallel, path)
            start = info.step
        info = checkpoint.CheckpointInfo.of_run(spec.name, plan, shapes, config, total_steps=job["steps"])
        trainer = Trainer(parallel, batch_source(spec, plan), config, Checkpointing(Path(job["checkpoint_dir"]), 0, info))
        local_losses, _ = trainer.train(job["steps"], start)
        losses = reduce_losses(local_losses, parallel.has_last_stage, plan, parallel.device)
        if dist.get_rank() == 0:
            result = {"losses": losses, "first_step": start, "steps": job["steps"] - start, "checkpoint": str(trainer.saved)}
            (Path(jobs_path).parent / f"{job['name']}.result.json").write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    leave()                      # as the runtime does (runtime.api.leave says why)
