"""Checkpoints with torch.distributed.checkpoint (DCP): written under one plan, read under any
plan of the same model.

    DIR/step-00000003/            one checkpoint: DCP's files and checkpoint.json

What is saved is ParallelModel.state_dict(): the parameters and the optimizer's states by the
full model's parameter names, sharded tensors as DTensors of the full shape. DCP writes each
shard once (replicas are deduplicated) and, on load, reads whatever pieces the loading plan's
shards need, so dp / tp / pp / ZeRO may all differ. The learning rate and the data position
are functions of the step (runtime/config.py, runtime/data.py), and so is the random state
(the runtime seeds each step with seed + 1 + step): the step is all a resume needs beside the
tensors.

A save writes into DIR/step-00000003.partial/ (every rank its shards, rank 0 DCP's metadata),
then rank 0 writes checkpoint.json there and renames the folder. Only a folder named
step-N with a checkpoint.json is complete: a crash at any moment before the rename leaves a
.partial folder, which loading never reads and the next save of that step replaces.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from profiles.schema import write_json_atomic

from .api import ParallelModel, clean_name

CHECKPOINT_SCHEMA = 1
INFO = "checkpoint.json"
PARTIAL = ".partial"


class CheckpointError(Exception):
    """A checkpoint folder that cannot be used; the message is one sentence with the fix."""


@dataclass
class CheckpointInfo:
    """What checkpoint.json records beside DCP's files."""

    step: int                          # steps trained when it was written
    model: str                         # the model's name (its file's stem or config's name)
    params: dict[str, list[int]]       # every parameter's full shape, by name: what must match to resume
    optimizer: str                     # whose states it holds (planner.plan.OptimizerConfig.name)
    layout: dict                       # {"dp", "tp", "pp", "zero"} of the plan that wrote it (for messages)
    config: dict = field(default_factory=dict)   # the TrainConfig it trained with
    total_steps: int = 0               # the run's --steps (the cosine's default horizon)
    kind: str = "checkpoint"
    schema: int = CHECKPOINT_SCHEMA

    @classmethod
    def of_run(cls, model: str, plan, shapes: dict[str, list[int]], config=None, total_steps: int = 0,
               step: int = 0) -> "CheckpointInfo":
        """What a run of `plan` records (config: its TrainConfig, if any)."""
        return cls(step=step, model=model, params=shapes, optimizer=plan.optimizer.name,
                   layout={"dp": plan.dp, "tp": plan.tp, "pp": plan.pp, "zero": plan.zero},
                   config=config.to_json() if config is not None else {}, total_steps=total_steps)


def model_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Every parameter's shape by its name in the full model (works on the meta device)."""
    return {clean_name(n): list(p.shape) for n, p in model.named_parameters()}


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step-{step:08d}"


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """The complete checkpoints in the folder, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [p for p in d.glob("step-*") if p.is_dir() and not p.name.endswith(PARTIAL) and (p / INFO).is_file()]
    return sorted(found, key=lambda p: p.name)


def read_info(path: Path) -> CheckpointInfo:
    try:
        d = json.loads((path / INFO).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / INFO} cannot be read ({type(e).__name__}); the checkpoint is damaged, resume from an older one or start afresh.") from None
    if not isinstance(d, dict) or d.get("kind") != "checkpoint":
        raise CheckpointError(f"{path} is not a checkpoint written by plan; pass the folder `plan run --checkpoint-dir` wrote.")
    if d.get("schema") != CHECKPOINT_SCHEMA:
        raise CheckpointError(f"{path} has checkpoint schema {d.get('schema')!r}, this plan reads {CHECKPOINT_SCHEMA}; resume it with the version of plan that wrote it.")
    try:
        return CheckpointInfo(**{f.name: d[f.name] for f in fields(CheckpointInfo) if f.name in d})
    except TypeError as e:
        raise CheckpointError(f"{path / INFO} is damaged or hand-edited ({e}); resume from an older checkpoint or start afresh.") from None


def find_resume(directory: str | Path, shapes: dict[str, list[int]], optimizer: str) -> tuple[Path, CheckpointInfo]:
    """The latest complete checkpoint in the folder, checked against this model and optimizer."""
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"--resume: checkpoint folder {directory} does not exist; pass the --checkpoint-dir of an earlier run, or drop --resume to start afresh.")
    found = complete_checkpoints(d)
    if not found:
        partial = any(p.name.endswith(PARTIAL) for p in d.glob("step-*"))
        why = "only checkpoints whose writing was cut short" if partial else "no checkpoint written by plan"
        raise CheckpointError(f"--resume: {directory} holds {why}; pass the --checkpoint-dir of an earlier run, or drop --resume to start afresh.")
    path = found[-1]
    info = read_info(path)
    if info.params != shapes:
        names = sorted(set(info.params) ^ set(shapes)) or [n for n in shapes if info.params[n] != shapes[n]]
        raise CheckpointError(f"{path} is a checkpoint of another model ({info.model}: its parameters differ, first at {names[0]}); "
                              "resume it with the model that wrote it, or choose another --checkpoint-dir.")
    if info.optimizer != optimizer:
        raise CheckpointError(f"{path} holds {info.optimizer} optimizer states but the plan trains with {optimizer}; "
                              f"solve with --optimizer {info.optimizer}, or start afresh in another --checkpoint-dir.")
    return path, info


def check_fresh(directory: str | Path) -> None:
    """A run that does not resume must not write over (or beside) another run's checkpoints."""
    found = complete_checkpoints(directory)
    if found:
        raise CheckpointError(f"{directory} already holds checkpoints (the latest after step {read_info(found[-1]).step}); "
                              "pass --resume to continue from it, or choose another --checkpoint-dir.")
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise CheckpointError(f"--checkpoint-dir {directory} is a file; pass a folder.")


def save(parallel: ParallelModel, directory: str | Path, info: CheckpointInfo) -> Path:
    """Write a checkpoint of every rank's state after `info.step` steps (a collective: every rank calls it)."""
    final = step_dir(directory, info.step)
    partial = final.with_name(final.name + PARTIAL)
    if dist.get_rank() == 0:
        Path(directory).mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)      # a save of this step cut short earlier
    dist.barrier()
    dcp.save(parallel.state_dict(), checkpoint_id=str(partial))
    dist.barrier()                                        # every rank's shards are written
    if dist.get_rank() == 0:
        write_json_atomic(partial / INFO, asdict(info))
        os.replace(partial, final)
    dist.barrier()
    return final


def load(parallel: ParallelModel, path: str | Path) -> None:
    """Read a checkpoint into this rank's stages and optimizer, resharded to this plan (a collective)."""
    state = parallel.empty_state_dict()
    dcp.load(state, checkpoint_id=str(path))
    parallel.load_state_dict(state)
