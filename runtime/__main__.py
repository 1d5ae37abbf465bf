"""`torchrun --nproc-per-node N -m runtime plan.json [--steps S] [--out run.json]`.

Every rank first checks, without touching the network, that the plan loads, fits this launch
and names an unchanged model file; if not, each prints the same one sentence and exits 2, so
no rank is left waiting in a collective. Then each builds its part, trains, and rank 0
writes run.json with every rank's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from rich.console import Console

from display import run_summary, run_table
from planner.plan import Plan, PlanError, load_plan
from planner.run_report import RankReport, RunReport, profiled_count
from profiles.allocator import keep_freed_memory
from profiles.model_file import ModelFileError, ModelSpec, load_spec

from . import checkpoint
from .api import agent_store, apply_plan, init_distributed, leave
from .checkpoint import CheckpointError, CheckpointInfo
from .config import ConfigError, TrainConfig, add_train_args, load_config
from .data import batch_source
from .launch import DEFAULT_STEPS, DEFAULT_TIMEOUT_S
from .pipeline import schedule_problem
from .train import Checkpointing, StepLog, Stopped, Trainer, build_model, reduce_losses
from .weights import WeightsError, load_weights, weight_sources


EXIT_TIMEOUT = 4
EXIT_PEER_LOST = 5
PEER_LOST_GRACE_S = 3.0


class RunError(Exception):
    """A plan this launch cannot run; the message is one sentence with the fix."""


RUN_ERRORS = (PlanError, RunError, ModelFileError, ConfigError, CheckpointError, WeightsError)   # each a sentence with the fix


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime", description="Run a plan (under torchrun).")
    p.add_argument("plan", help="plan.json written by `plan solve`")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps; step 1 warms up, step 2 measures memory, "
                   "the rest time, and the last (S >= 4; the last 3 with S >= 12) run under the profiler for the time breakdown")
    p.add_argument("--out", default="run.json", help="where rank 0 writes the run report")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds a collective may wait for the other ranks before the run stops")
    p.add_argument("--checkpoint-dir", help="write checkpoints (torch.distributed.checkpoint) into this folder")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also write one every N steps (0: after the last only)")
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint in --checkpoint-dir")
    p.add_argument("--init-from", help="start from a Hugging Face model's weights in this folder (safetensors)")
    p.add_argument("--tensorboard", help="also write the log lines' figures as TensorBoard scalars into this folder")
    add_train_args(p)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if not args.timeout > 0:
        p.error("--timeout must be a positive number of seconds")
    if args.checkpoint_every < 0:
        p.error("--checkpoint-every must be 0 or more steps")
    return args


def train_config(args: argparse.Namespace) -> TrainConfig:
    return load_config(args.config, **{name: getattr(args, name) for name in TrainConfig.__dataclass_fields__})


def check_run_settings(args: argparse.Namespace, plan: Plan, spec: ModelSpec, shapes: dict, check_data: bool = False):
    """The training settings, the batch source, the step to start from and the checkpoint to
    load; what `plan run` also checks before launching (there with the dataset's first sample)."""
    config = train_config(args)
    source = batch_source(spec, plan, check=check_data)
    start, resume_from = resume_point(args, plan, shapes)
    if args.init_from and args.resume:
        raise RunError("--init-from and --resume both say where the weights come from; pass one of them.")
    sources = weight_sources(spec, args.init_from, shapes) if args.init_from and resume_from is None else None
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:     # torch.utils.tensorboard needs it
        raise RunError("--tensorboard needs the tensorboard package; `pip install tensorboard`, or drop the flag.")
    return config, source, start, resume_from, sources


def restarted_with_checkpoint(args: argparse.Namespace) -> bool:
    """A torchrun restart (--max-restarts) with a complete checkpoint to resume from."""
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 and bool(args.checkpoint_dir)
            and bool(checkpoint.complete_checkpoints(args.checkpoint_dir)))


def loads_every_weight(args: argparse.Namespace) -> bool:
    """Whether every parameter will come from files (a checkpoint, or --init-from): then the
    model is built on the meta device and no rank holds more than its own shards."""
    return bool(args.init_from or args.resume or restarted_with_checkpoint(args))


def resume_point(args: argparse.Namespace, plan: Plan, shapes: dict) -> tuple[int, Path | None]:
    """The step to start from and the checkpoint to load (None: start afresh). A torchrun
    restart (--max-restarts) resumes from the latest complete checkpoint when there is one."""
    if not args.checkpoint_dir:
        if args.resume:
            raise RunError("--resume needs --checkpoint-dir, the folder of the checkpoints to continue from.")
        return 0, None
    if args.resume or restarted_with_checkpoint(args):
        path, info = checkpoint.find_resume(args.checkpoint_dir, shapes, plan.optimizer.name)
        if info.step >= args.steps:
            raise RunError(f"{path} was written after step {info.step}, so --steps {args.steps} leaves nothing to train; "
                           f"pass a --steps above {info.step}.")
        return info.step, path
    checkpoint.check_fresh(args.checkpoint_dir)
    return 0, None


def load_run_inputs(plan_path: str, config: TrainConfig, on_meta: bool = False) -> tuple[Plan, ModelSpec, torch.nn.Sequential]:
    """The plan (with the settings' optimizer hyper-parameters and seed), the model file and
    the built model (on the meta device when its weights will be loaded); raises PlanError,
    RunError or ModelFileError."""
    plan = config.apply_to(load_plan(plan_path))
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        raise RunError(f"the runtime runs under torchrun; use `torchrun --nproc-per-node {plan.world_size} -m runtime {plan_path}`.")
    if int(world) != plan.world_size:
        raise RunError(f"plan {plan_path} is for {plan.world_size} processes but this launch has {world}; "
                       f"start it with `torchrun --nproc-per-node {plan.world_size} -m runtime {plan_path}` or `plan run {plan_path}`.")
    if problem := schedule_problem(plan.schedule, len(plan.stages), plan.pp, plan.num_micro_batches):
        raise RunError(f"plan {plan_path} cannot run: {problem}; solve again with `plan solve`.")
    if plan.device_type == "cuda" and torch.cuda.device_count() < int(os.environ.get("LOCAL_WORLD_SIZE", "1")):
        raise RunError(f"plan {plan_path} needs {os.environ.get('LOCAL_WORLD_SIZE', 1)} CUDA devices on this node but torch sees {torch.cuda.device_count()}; run it where they are.")
    spec = load_spec(plan.model)
    if plan.sequence_parallel and "sequence" not in spec.tp_plan.values():
        raise RunError(f"plan {plan_path} is sequence-parallel but the tp_plan of {spec.path} names no \"sequence\" "
                       "modules; solve again with `plan solve`.")
    # Not tried on a GPU yet: FSDP2's to_empty with an offload policy (shards that must stay on the host).
    offloads_on_gpu = plan.device_type == "cuda" and any(lc.offload for s in plan.stages for lc in s.layers)
    model = build_model(spec, plan, on_meta and not offloads_on_gpu)
    if len(model) != plan.n_layers:
        raise RunError(f"plan {plan_path} has {plan.n_layers} layers but {spec.path} builds {len(model)}; profile and solve again.")
    return plan, spec, model


def refuse(message: str) -> NoReturn:
    """Print the one sentence and exit 2, the same on every rank.

    torchrun stops every worker as soon as one exits, so a rank that has refused waits (in
    torchrun's own store, not a process group) until all have, turns torchrun's SIGTERM into
    the same exit code, and leaves with os._exit: Python's teardown (long, with torch loaded)
    restores the default SIGTERM action and would be cut short by it.
    """
    print(message, file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        wait_for_all_ranks("runtime/refused")
    os._exit(2)


def wait_for_all_ranks(key: str, timeout_s: float = 15.0) -> None:
    store = agent_store(timeout_s)
    key = f"{key}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < int(os.environ["WORLD_SIZE"]) and time.monotonic() < deadline:
        time.sleep(0.05)


def is_peer_lost(e: BaseException) -> bool:
    """Whether a collective failed because another rank's process went away (gloo's "Connection
    reset by peer" / "Connection closed by peer", NCCL's remote errors)."""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("connection reset by peer" in text or "connection closed by peer" in text
                                            or "remote process exited" in text)


def is_timeout(e: BaseException) -> bool:
    """Whether a collective gave up waiting (gloo: "Timed out waiting ...", NCCL's watchdog: "Timeout")."""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("timed out" in text or "timeout" in text)


def device_name(plan: Plan) -> str:
    return torch.cuda.get_device_name() if plan.device_type == "cuda" else "cpu"


def print_summary(run: RunReport) -> None:
    console = Console()
    console.print(run_summary(run), highlight=False, markup=False)
    console.print(run_table(run))


def measured_mfu(plan: Plan, step_s: float) -> float:
    """The plan's predicted MFU scaled to the measured step: the same FLOPs over the same peak."""
    p = plan.predicted
    return p.mfu * p.step_time_s / step_s if p is not None and p.step_time_s > 0 and step_s > 0 else 0.0


class StepRecord:
    """Every rank's count of steps begun (batch in hand, compute started), kept in torchrun's
    store, so that a rank whose collective timed out can name the ranks that fell behind
    (outside torchrun: nothing kept)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.rank = int(os.environ.get("RANK", "0"))
        self.prefix = f"plan/steps/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.store = None
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            with contextlib.suppress(RuntimeError, KeyError, ValueError):   # no record is no worse than before
                self.store = agent_store(10.0)

    def begun(self, steps: int) -> None:
        if self.store is not None:
            self.store.set(f"{self.prefix}{self.rank}", str(steps))

    def behind(self) -> tuple[list[int], int] | None:
        """The ranks that have begun the fewest steps and that count, when not all are equal."""
        if self.store is None:
            return None
        try:
            done = {r: int(self.store.get(f"{self.prefix}{r}")) if self.store.check([f"{self.prefix}{r}"]) else 0
                    for r in range(self.world_size)}
        except (RuntimeError, ValueError):
            return None
        least = min(done.values())
        if least == max(done.values()):
            return None
        return sorted(r for r, n in done.items() if n == least), least


def timeout_sentence(rank, timeout_s: float, record: StepRecord | None) -> str:
    behind = record.behind() if record else None
    if behind:
        ranks, steps = behind
        who = (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} never began step {steps + 1}")
        return (f"rank {rank}: a collective waited more than {timeout_s:g} s; {who} (stopped, crashed or hung), so the "
                "run stops; if steps really take that long, pass a larger --timeout.")
    return (f"rank {rank}: a collective waited more than {timeout_s:g} s for the other ranks (one stopped, crashed or "
            "hangs), so the run stops; if steps really take that long, pass a larger --timeout.")


def progress_printer(trainer: Trainer, tensorboard: str | None = None):
    """A log line on the steps that log (runtime.train.Trainer.log_due), from the rank that
    holds the last stage for dp and tp rank 0: its loss is that replica's share of the batch.
    With `tensorboard` that rank also writes the line's figures there as scalars."""
    parallel, plan = trainer.parallel, trainer.parallel.plan
    if not (parallel.has_last_stage and parallel.dp_rank == 0 and parallel.tp_rank == 0):
        return None
    console = Console(highlight=False)
    writer = None
    if tensorboard:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(tensorboard)

    def on_step(log: StepLog) -> None:
        tokens_per_sample = trainer.tokens_per_sample
        rate = plan.global_batch * (tokens_per_sample or 1) / log.seconds
        parts = [f"step {log.step}/{log.steps}", f"loss {log.loss:.4f} (dp rank 0's samples)", f"lr {log.lr:.3g}"]
        if log.grad_norm is not None:
            parts.append(f"grad norm {log.grad_norm:.3g}")
        parts += [f"{log.seconds:.3f} s", f"{rate:,.0f} {'tokens' if tokens_per_sample else 'samples'}/s"]
        if parallel.device.type == "cuda":
            parts.append(f"MFU {100 * measured_mfu(plan, log.seconds):.1f}%")
            parts.append(f"peak {torch.cuda.max_memory_allocated(parallel.device) / 2**30:.2f} GiB")
        if writer is not None:
            for name, v in (("loss", log.loss), ("lr", log.lr), ("grad_norm", log.grad_norm), ("step_s", log.seconds),
                            ("tokens_per_s" if tokens_per_sample else "samples_per_s", rate)):
                if v is not None:
                    writer.add_scalar(f"train/{name}", v, log.step)
            writer.flush()
        console.print(", ".join(parts), markup=False, soft_wrap=True)
    return on_step


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    keep_freed_memory()                  # as the profiler timed the layers (profiles/allocator.py)
    try:
        plan, spec, model = load_run_inputs(args.plan, train_config(args), on_meta=loads_every_weight(args))
        shapes = checkpoint.model_shapes(model)
        config, source, start, resume_from, weights = check_run_settings(args, plan, spec, shapes)
    except RUN_ERRORS as e:
        refuse(str(e))
    info = CheckpointInfo.of_run(spec.name, plan, shapes, config, total_steps=args.steps)
    checkpoints = Checkpointing(Path(args.checkpoint_dir), args.checkpoint_every, info) if args.checkpoint_dir else None
    record = StepRecord(plan.world_size)
    try:
        return train_and_report(args, plan, spec, model, record, source, config, checkpoints, start, resume_from, weights)
    except ModelFileError as e:          # the dataset's samples, read during the run
        refuse(str(e))
    except Stopped as e:
        if int(os.environ.get("RANK", "0")) == 0:
            # stderr: plan run, which stopped the ranks, says it once itself (and hides this)
            print(f"{e.signal_name}: stopped after step {e.step}; saved {e.saved} (continue with --resume).", file=sys.stderr, flush=True)
        os._exit(130 if e.signal_name == "SIGINT" else 143)
    except Exception as e:  # noqa: BLE001 - a hang or a lost rank is expected; anything else is a bug
        rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
        if is_peer_lost(e):
            print(f"rank {rank}: lost the connection to another rank (it stopped or crashed), so the run stops.",
                  file=sys.stderr, flush=True)
            # Leave after torchrun has seen the rank that really failed (it polls every 0.1 s),
            # so that its report, and plan run's sentence, name that rank and not this one.
            time.sleep(PEER_LOST_GRACE_S)
            os._exit(EXIT_PEER_LOST)
        if not is_timeout(e):
            raise
        print(timeout_sentence(rank, args.timeout, record), file=sys.stderr, flush=True)
        os._exit(EXIT_TIMEOUT)


def train_and_report(args: argparse.Namespace, plan: Plan, spec: ModelSpec, model: torch.nn.Sequential,
                     record: StepRecord, source, config: TrainConfig, checkpoints: Checkpointing | None,
                     start: int, resume_from: Path | None, weights: dict[str, str] | None) -> int:
    init_distributed(plan, args.timeout)
    parallel = apply_plan(model, plan, spec.loss_fn, spec.tp_plan)
    del model  # the layers of other stages go with it
    trainer = Trainer(parallel, source, config, checkpoints)
    if weights is not None:
        load_weights(parallel.named_parameters(), args.init_from, weights)
        if dist.get_rank() == 0:
            print(f"weights from {args.init_from}", flush=True)
    if resume_from is not None:
        checkpoint.load(parallel, resume_from)
        if dist.get_rank() == 0:
            restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
            print(f"{f'restart {restart}: ' if restart else ''}resumed from {resume_from} (after step {start})", flush=True)
            saved, now = checkpoint.read_info(resume_from).config, config.to_json()
            if saved != now:
                changed = ", ".join(k for k in now if saved.get(k) != now[k])
                print(f"note: the training settings differ from the checkpoint's ({changed}); the steps go on with the new ones.", flush=True)
    printer = progress_printer(trainer, args.tensorboard)

    local_losses, report = trainer.train(args.steps, start, on_step=printer, on_start=lambda step: record.begun(step + 1))
    losses = reduce_losses(local_losses, parallel.has_last_stage, plan, parallel.device)
    reports: list[RankReport | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        run = RunReport(plan_path=args.plan, plan_sha256=hashlib.sha256(Path(args.plan).read_bytes()).hexdigest(),
                        world_size=plan.world_size, steps=args.steps - start, losses=losses, device=device_name(plan),
                        torch_version=torch.__version__, ranks=reports, first_step=start, global_batch=plan.global_batch,
                        tokens_per_sample=trainer.tokens_per_sample, checkpoint=str(trainer.saved or ""),
                        host_cpus=os.cpu_count() or 0, profiled_steps=profiled_count(args.steps - start))
        run.mfu = measured_mfu(plan, run.step_s)
        run.validate()                   # what verify will check: a bug here, not a bad run document
        run.save(args.out)
        print_summary(run)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    leave(main())
