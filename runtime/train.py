"""The training loop: build this rank's part of the model, train it, measure it.

Step 1 warms up. Memory is measured on step 2: on CUDA the allocator's peak from step 2 on;
on CPU a `LiveMemory` entered for step 2 only, told at the step's start about everything
alive that the step uses. Step time is the median wall time of steps 3..S-1; with S >= 4 the
last step runs under torch.profiler and gives the step's time by component (breakdown.py),
so it is left out of the median.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from planner.plan import Plan, Stage
from planner.run_report import RankReport
from profiles.live_memory import LiveMemory
from profiles.model_file import ModelSpec, build_checked_model, call_make_batch

from .breakdown import optimizer_region, profile_step
from .parallel_dims import MESH_DIMS
from .parallelize import parallelize_stage
from .pipeline import build_pipeline_schedule, p2p_buffers
from .sharded_optimizer import ShardedOptimizer, local


def build_model(spec: ModelSpec, plan: Plan) -> nn.Sequential:
    """The whole model on CPU, initialised exactly as one process would."""
    torch.manual_seed(plan.seed)
    model = build_checked_model(spec)
    return model.to(torch.bfloat16) if plan.precision == "bf16" else model


def global_batch(spec: ModelSpec, plan: Plan, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s whole global batch, on CPU; every rank draws the same one."""
    torch.manual_seed(plan.seed + 1 + step)
    return call_make_batch(spec, plan.global_batch)


def build_stage(model: nn.Sequential, stage: Stage) -> nn.Sequential:
    """The stage's layers in order, named by their index in the model (so names match the full model's)."""
    return nn.Sequential(OrderedDict((str(lc.index), model[lc.index]) for lc in stage.layers))


class DeviceMemory(LiveMemory):
    """LiveMemory that leaves out storages a real device would not hold (offloaded to the host)."""

    def __init__(self) -> None:
        super().__init__()
        self._excluded = WeakIdKeyDictionary()

    def exclude(self, *objs) -> None:
        """Stop counting the storages of these tensors (or of the tensors inside these containers)."""
        tree_map_only(torch.Tensor, self._exclude_tensor, objs)

    def _exclude_tensor(self, t: torch.Tensor) -> None:
        for st in get_untyped_storages(local(t)):
            cell = self._cells.setdefault(st, [0])
            self.live -= cell[0]
            cell[0] = 0
            self._excluded[st] = True

    def _resized(self, st: torch.UntypedStorage) -> None:
        if st not in self._excluded:
            super()._resized(st)


def fsdp_gather_buffers(modules: list[nn.Module]) -> list[torch.Tensor]:
    """FSDP2's unsharded-parameter buffers: kept between steps at size 0 and resized (not
    allocated) when gathered, so LiveMemory counts them only if they are tracked."""
    out = []
    for module in modules:
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                for group in unit._get_fsdp_state()._fsdp_param_groups:
                    for fp in group.fsdp_params:
                        out += [*fp.all_gather_outputs, *getattr(fp, "_unsharded_inner_tensors", ())]
    return out



class Trainer:
    """This rank's stages of the model, parallelized as the plan says, with their optimizer."""

    def __init__(self, plan: Plan, spec: ModelSpec, model: nn.Sequential, mesh: DeviceMesh):
        self.plan, self.spec = plan, spec
        self.device = torch.device("cuda", torch.cuda.current_device()) if plan.device_type == "cuda" else torch.device("cpu")
        self.pp_rank, self.dp_rank, self.tp_rank = (mesh.get_local_rank(d) for d in MESH_DIMS)
        stages = plan.stages_of_rank(self.pp_rank)
        self.stage_indices = [s.index for s in stages]
        self.modules = [parallelize_stage(build_stage(model, s).to(self.device), s.layers, spec, mesh, plan) for s in stages]
        self.has_first_stage = 0 in self.stage_indices
        self.has_last_stage = len(plan.stages) - 1 in self.stage_indices

        self.offloaded = [p for s, m in zip(stages, self.modules) for lc in s.layers if lc.offload
                          for p in m.get_submodule(str(lc.index)).parameters()]
        params = [p for m in self.modules for p in m.parameters()]
        zero1 = plan.wrapped and plan.zero == 1 and plan.dp > 1
        offloaded_ids = {id(p) for p in self.offloaded}
        self.optimizer = ShardedOptimizer(params, plan.optimizer, mesh["dp"].get_group() if zero1 else None,
                                          replicated=[p for p in params if id(p) not in offloaded_ids])
        # Accumulation: replicate units (zero 0/1) all-reduce only after the last micro-batch;
        # fully_shard units (zero 2/3, offloaded layers) reduce-scatter after every one.
        self.sync_units = [u for m in self.modules for u in m.modules() if isinstance(u, ReplicateModule)]

        self.schedule, self.pipeline_stages = None, []
        if plan.pp > 1:
            self.schedule, self.pipeline_stages = build_pipeline_schedule(
                list(zip(self.stage_indices, self.modules)), len(plan.stages), self.device,
                mesh["pp"].get_group(), plan.schedule, plan.num_micro_batches, spec.loss_fn)

    # -- one step ----------------------------------------------------------------------
    def local_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This dp rank's rows of the global batch, copied so the rest can be freed."""
        inputs, targets = global_batch(self.spec, self.plan, step)
        rows = self.plan.micro_batch_size * self.plan.num_micro_batches
        lo, hi = self.dp_rank * rows, (self.dp_rank + 1) * rows
        return inputs[lo:hi].to(self.device, copy=True), targets[lo:hi].to(self.device, copy=True)

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward, backward and optimizer step; the mean loss of this rank's rows (None off the last stage)."""
        loss = self._pipeline_step(inputs, targets) if self.schedule is not None else self._accumulation_step(inputs, targets)
        with optimizer_region():
            self.optimizer.step()
            self.optimizer.zero_grad()
        return loss

    def _accumulation_step(self, inputs, targets) -> torch.Tensor:
        m, b = self.plan.num_micro_batches, self.plan.micro_batch_size
        model = self.modules[0]
        losses = []
        for k in range(m):
            for unit in self.sync_units:
                unit.set_requires_gradient_sync(k == m - 1, recurse=False)
            rows = slice(k * b, (k + 1) * b)
            loss = self.spec.loss_fn(model(inputs[rows]), targets[rows])
            (loss / m).backward()
            losses.append(loss.detach())
        return torch.stack(losses).mean()

    def _pipeline_step(self, inputs, targets) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first_stage else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last_stage else {}
        # return_outputs=False: the last stage would otherwise keep and concatenate every micro-batch's output.
        self.schedule.step(*args, return_outputs=False, **kwargs)
        return torch.stack([loss.detach() for loss in losses]).mean() if self.has_last_stage else None

    # -- the run -----------------------------------------------------------------------
    def train(self, steps: int, on_step=None, on_start=None) -> tuple[list[float], RankReport]:
        """Run `steps` steps; this rank's mean loss per step (0.0 off the last stage) and its
        report. `on_start(step)` is called once a step's batch is ready, `on_step(step, loss or
        None, seconds)` after the step (both outside its timing)."""
        measured = min(1, steps - 1)  # step 2, or the only step
        profiled = steps - 1 if steps >= 4 else None
        losses, times, peak, breakdown = [], [], 0, None
        for step in range(steps):
            inputs, targets = self.local_batch(step)
            if on_start:
                on_start(step)
            if step == profiled:
                out: list = []
                breakdown, wall = profile_step(lambda: out.append(self.train_step(inputs, targets)), self._synchronize)
                times.append(wall)
                loss = out[0]
            else:
                with self._measure_memory(inputs, targets) if step == measured else contextlib.nullcontext() as memory:
                    self._synchronize()
                    t0 = time.perf_counter()
                    loss = self.train_step(inputs, targets)
                    self._synchronize()
                    times.append(time.perf_counter() - t0)
                if memory is not None:
                    peak = memory.peak
            losses.append(float(loss) if loss is not None else 0.0)
            if on_step:
                on_step(step, losses[-1] if loss is not None else None, times[-1])
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        timed = (times[2:profiled] if profiled else times[2:]) or times[1:] or times
        report = RankReport(rank=dist.get_rank(), pp_rank=self.pp_rank, dp_rank=self.dp_rank, tp_rank=self.tp_rank,
                            stages=self.stage_indices, peak_bytes=int(peak), step_times_s=times,
                            median_step_s=statistics.median(timed), threads=torch.get_num_threads(),
                            breakdown_s=breakdown, breakdown_step_s=times[profiled] if profiled else 0.0)
        return losses, report

    @contextlib.contextmanager
    def _measure_memory(self, inputs: torch.Tensor, targets: torch.Tensor):
        """CUDA: start the allocator's peak here (read after the last step). CPU: a DeviceMemory
        for this step, told what is alive at its start, leaving out what offload keeps on the host."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            yield None
            return
        with DeviceMemory() as memory:
            memory.track(*self.modules, *fsdp_gather_buffers(self.modules), self.optimizer.state,
                         *p2p_buffers(self.pipeline_stages), inputs, targets)
            memory.exclude(self.offloaded, self.optimizer.state_of(self.offloaded))
            memory.reset_peak()
            # FSDP2 hands an offloaded parameter its new (host) gradient, then calls these hooks.
            hooks = [p.register_post_accumulate_grad_hook(lambda p: memory.exclude(p.grad)) for p in self.offloaded]
            try:
                yield memory
            finally:
                for h in hooks:
                    h.remove()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def reduce_losses(losses: list[float], has_last_stage: bool, plan: Plan, device: torch.device) -> list[float]:
    """The global batch's mean loss per step, the same on every rank: the dp x tp ranks that
    hold the last stage each contribute their rows' mean (equal row counts, so the mean of
    means is the global mean); the others contribute 0."""
    t = torch.tensor(losses if has_last_stage else [0.0] * len(losses), dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / (plan.dp * plan.tp)).tolist()
