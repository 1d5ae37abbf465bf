"""The training loop of `plan run`: a short user of runtime.api that trains, logs,
checkpoints and measures.

Each step t seeds torch's RNG with seed + 1 + t, takes this dp rank's rows (runtime/data.py),
sets the learning rate of step t (runtime/config.py) and runs ParallelModel.train_step; every
`checkpoint_every` steps, and after the last, it writes a checkpoint (runtime/checkpoint.py);
with checkpoints on, SIGINT / SIGTERM stops it at the end of a step with a checkpoint (Stopped).

Measurements count from the launch's first step (a resumed run measures its own steps). Step 1 warms up. Memory is measured on step 2: on CUDA the allocator's peak from step 2 on;
on CPU a `LiveMemory` entered for step 2 only, told at the step's start about everything
alive that the step uses. Every step starts on all ranks at once (_start_together); a rank's step
time is the median wall time of its timed steps (from step 3), the run's the median of their slowest rank's
(RunReport.step_s); with S >= 4 the last step (the last 3 with S >= 12) runs under
torch.profiler and gives the step's time by component (breakdown.py; of several, the one of
median wall time), so they are left out of the median.
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.fsdp import FSDPModule
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

from planner.plan import Plan
from planner.run_report import RankReport, step_roles
from profiles.live_memory import LiveMemory
from profiles.model_file import ModelSpec, build_checked_model

from . import checkpoint
from .api import ParallelModel
from .breakdown import profile_step
from .config import TrainConfig
from .data import DatasetBatches, SyntheticBatches
from .pipeline import p2p_buffers
from .sharded_optimizer import local


def build_model(spec: ModelSpec, plan: Plan, on_meta: bool = False) -> nn.Sequential:
    """The whole model on CPU, initialised exactly as one process would; or, `on_meta`, its
    shapes only (a run whose weights are loaded: each rank then allocates its own shards)."""
    torch.manual_seed(plan.seed)
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        model = build_checked_model(spec)
    return model.to(torch.bfloat16) if plan.precision == "bf16" else model


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



@dataclass
class StepLog:
    """What one step did, for the log line."""

    step: int                  # steps done (1-based)
    steps: int                 # the run's last step
    loss: float | None         # this rank's mean loss (None off the last stage)
    seconds: float             # the step's time: its slowest rank's (the log line's rank may be done early)
    lr: float
    grad_norm: float | None    # before clipping; computed when clipping or logging


@dataclass
class Checkpointing:
    directory: Path
    every: int                         # also after every N steps (0: after the last only)
    info: checkpoint.CheckpointInfo    # what each checkpoint.json records (its step set at each save)

    def due(self, done: int, steps: int) -> bool:
        return done == steps or (self.every > 0 and done % self.every == 0)


class Stopped(Exception):
    """Training stopped on a signal after `step` steps, with a checkpoint of them at `saved`."""

    def __init__(self, step: int, signal_name: str, saved: Path):
        super().__init__(f"stopped by {signal_name} after step {step}")
        self.step, self.signal_name, self.saved = step, signal_name, saved


class StopRequests:
    """SIGINT / SIGTERM (Ctrl-C, or torchrun stopping its ranks) asks the run to stop at the end
    of a step. The ranks agree on that step with one all-reduce per step (each may see the
    signal during a different step), so they all write the same checkpoint, then stop."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def agreed(self, device: torch.device) -> bool:
        flag = torch.tensor([1 if self.signal_name else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not self.signal_name:
            self.signal_name = "SIGTERM"          # another rank's signal
        return bool(flag.item())


class Trainer:
    """Trains a ParallelModel on a batch source and measures the run."""

    def __init__(self, parallel: ParallelModel, source: SyntheticBatches | DatasetBatches,
                 config: TrainConfig | None = None, checkpoints: Checkpointing | None = None):
        self.parallel, self.source = parallel, source
        self.config = config or TrainConfig()
        self.checkpoints = checkpoints
        self.saved: Path | None = None          # the latest checkpoint this run wrote
        self.tokens_per_sample = 0              # token ids per input row (integer inputs), from the first batch
        # With checkpoints on, a signal stops the run at a step's end with a checkpoint.
        self.stops = StopRequests() if checkpoints else None

    def log_due(self, done: int, start: int, steps: int) -> bool:
        every = self.config.log_every or max(1, (steps - start) // 20)
        return done % every == 0 or done == steps

    def train(self, steps: int, start: int = 0, on_step=None, on_start=None) -> tuple[list[float], RankReport]:
        """Run steps start..steps-1; this rank's mean loss per step (0.0 off the last stage) and
        its report. `on_start(step)` is called once a step's batch is ready, `on_step(StepLog)`
        after the steps that log (both outside the step's timing)."""
        p, plan = self.parallel, self.parallel.plan
        n = steps - start
        measured, profiled, timed_steps = step_roles(n)
        losses, times, cpu_times, peak, breakdowns = [], [], [], 0, []
        for k, step in enumerate(range(start, steps)):
            torch.manual_seed(plan.seed + 1 + step)
            inputs, targets = (t.to(p.device) for t in self.source.batch(step, p.dp_rank))
            if k == 0 and not (inputs.dtype.is_floating_point or inputs.dtype.is_complex):
                self.tokens_per_sample = int(inputs[0].numel())
            lr = self.config.lr_at(step, plan.optimizer.lr, steps)
            logs = self.log_due(step + 1, start, steps)
            # The log line's norm: this rank's share inside the step (no communication; clipping
            # computes the whole norm anyway), added up after its timing; never on the step whose
            # memory is measured.
            args = dict(lr=lr, clip_grad_norm=self.config.clip_grad_norm, grad_norm=logs and k != measured)
            if on_start:
                on_start(step)
            self._start_together()
            cpu0 = time.process_time()
            if k in profiled:
                out: list = []
                parts, wall = profile_step(lambda: out.append(p.train_step(inputs, targets, **args)), self._synchronize,
                                           on_gpu=p.device.type == "cuda")
                breakdowns.append((wall, parts))
                times.append(wall)
                loss = out[0]
            else:
                with self._measure_memory(inputs, targets) if k == measured else contextlib.nullcontext() as memory:
                    self._synchronize()
                    t0 = time.perf_counter()
                    loss = p.train_step(inputs, targets, **args)
                    self._synchronize()
                    times.append(time.perf_counter() - t0)
                if memory is not None:
                    peak = memory.peak
            cpu_times.append(time.process_time() - cpu0)      # this process's threads, gloo's included
            losses.append(float(loss) if loss is not None else 0.0)
            norm = p.global_grad_norm()          # every rank: a collective when the step logs without clipping
            if logs:
                seconds = self._slowest(times[-1])   # every rank: the log line's rank may be done early
                if on_step:
                    on_step(StepLog(step + 1, steps, losses[-1] if loss is not None else None, seconds, lr, norm))
            stop = bool(self.stops) and step + 1 < steps and self.stops.agreed(p.device)
            if self.checkpoints and (stop or self.checkpoints.due(step + 1, steps)):
                self.saved = checkpoint.save(p, self.checkpoints.directory, replace(self.checkpoints.info, step=step + 1))
            if stop:
                raise Stopped(step + 1, self.stops.signal_name, self.saved)
        reserved = 0
        if p.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(p.device)
            reserved = torch.cuda.max_memory_reserved(p.device)   # since the process began: the cache fragmentation leaves
        timed = [times[i] for i in timed_steps]
        # The profiled step of median wall time (the lower middle of an even count) gives the breakdown.
        wall, breakdown = sorted(breakdowns, key=lambda b: b[0])[(len(breakdowns) - 1) // 2] if breakdowns else (0.0, None)
        report = RankReport(rank=dist.get_rank(), pp_rank=p.pp_rank, dp_rank=p.dp_rank, tp_rank=p.tp_rank,
                            stages=p.stage_indices, peak_bytes=int(peak), step_times_s=times,
                            median_step_s=statistics.median(timed), threads=torch.get_num_threads(),
                            breakdown_s=breakdown, breakdown_step_s=wall,
                            reserved_bytes=int(reserved), cpu_times_s=cpu_times)
        return losses, report

    @contextlib.contextmanager
    def _measure_memory(self, inputs: torch.Tensor, targets: torch.Tensor):
        """CUDA: start the allocator's peak here (read after the last step). CPU: a DeviceMemory
        for this step, told what is alive at its start, leaving out what offload keeps on the host."""
        p = self.parallel
        if p.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(p.device)
            yield None
            return
        with DeviceMemory() as memory:
            memory.track(*p.modules, *fsdp_gather_buffers(p.modules), p.optimizer.state,
                         *p2p_buffers(p.pipeline_stages), inputs, targets)
            memory.exclude(p.offloaded, p.optimizer.state_of(p.offloaded))
            memory.reset_peak()
            # FSDP2 hands an offloaded parameter its new (host) gradient, then calls these hooks.
            hooks = [q.register_post_accumulate_grad_hook(lambda q: memory.exclude(q.grad)) for q in p.offloaded]
            try:
                yield memory
            finally:
                for h in hooks:
                    h.remove()

    def _start_together(self) -> None:
        """Every rank leaves here at once (an all-reduce of one number, outside the step's timing),
        so that each rank times a step from the same start and the step lasts as long as its
        slowest rank (RunReport.step_s). Without it the ranks a pipeline frees early would wait
        for the next step inside their timers, or outside them where a collective between steps
        (the log line's norm) holds them, and their times would mean different things."""
        if dist.get_world_size() > 1:
            dist.all_reduce(torch.zeros(1, device=self.parallel.device))
        self._synchronize()

    def _slowest(self, seconds: float) -> float:
        """The slowest rank's `seconds` (a collective: every rank calls it on the same steps)."""
        if dist.get_world_size() == 1:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64, device=self.parallel.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def _synchronize(self) -> None:
        if self.parallel.device.type == "cuda":
            torch.cuda.synchronize(self.parallel.device)


def reduce_losses(losses: list[float], has_last_stage: bool, plan: Plan, device: torch.device) -> list[float]:
    """The global batch's mean loss per step, the same on every rank: the dp x tp ranks that
    hold the last stage each contribute their rows' mean (equal row counts, so the mean of
    means is the global mean); the others contribute 0."""
    t = torch.tensor(losses if has_last_stage else [0.0] * len(losses), dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t / (plan.dp * plan.tp)).tolist()
