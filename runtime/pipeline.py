"""Pipeline parallelism: manual PipelineStages and the schedule the plan names."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleLoopedBFS)
from torch.distributed.pipelining.schedules import _PipelineSchedule

from planner.memory import interleaved_rounds
from planner.plan import MULTI_STAGE_SCHEDULES

# torch's class for each of planner.plan.SCHEDULES; MULTI_STAGE_SCHEDULES take a rank's stages, the rest its one.
SCHEDULE_CLASSES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved": ScheduleInterleaved1F1B,
                    "looped_bfs": ScheduleLoopedBFS}


def schedule_problem(schedule: str, n_stages: int, pp: int, n_microbatches: int) -> str | None:
    """Why torch's schedule would refuse this layout (checked before any collective), or None."""
    if schedule not in MULTI_STAGE_SCHEDULES and n_stages != pp:
        return f"the {schedule} schedule runs one stage per pp rank but the plan has {n_stages} stages for pp {pp}"
    if schedule == "interleaved":
        rounds = interleaved_rounds(pp, n_microbatches)
        if n_microbatches % rounds:
            return f"the interleaved schedule needs the {n_microbatches} micro-batches to be a multiple of {rounds} rounds"
    return None


def build_pipeline_schedule(stage_modules: list[tuple[int, nn.Module]], n_stages: int, device: torch.device,
                            pp_group: dist.ProcessGroup, schedule: str, n_microbatches: int,
                            loss_fn: Callable) -> tuple[_PipelineSchedule, list[PipelineStage]]:
    """One PipelineStage per (stage index, module) of this rank and the schedule that runs them.

    The schedule splits the batch it is given into n_microbatches along dim 0, applies loss_fn
    (a mean) on the last stage and divides the gradients by n_microbatches after backward.
    """
    stages = [PipelineStage(module, index, n_stages, device, group=pp_group) for index, module in stage_modules]
    runs = stages if schedule in MULTI_STAGE_SCHEDULES else stages[0]
    return SCHEDULE_CLASSES[schedule](runs, n_microbatches, loss_fn=loss_fn), stages


def p2p_buffers(stages: list[PipelineStage]) -> list[torch.Tensor]:
    """The receive buffers (activations and their gradients, one per micro-batch) that stages keep between steps."""
    infos = [info for stage in stages for table in (stage.args_recv_info, stage.grad_recv_info)
             for per_mb in table.values() for info in per_mb]
    return [info.buffer for info in infos if getattr(info, "buffer", None) is not None]
