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
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from rich.console import Console

from display import run_table
from planner.plan import Plan, PlanError, load_plan
from planner.run_report import RankReport, RunReport
from profiles.model_file import ModelFileError, ModelSpec, load_spec

from .launch import DEFAULT_TIMEOUT_S
from .parallel_dims import ParallelDims
from .pipeline import schedule_problem
from .train import Trainer, build_model, reduce_losses


EXIT_TIMEOUT = 4


class RunError(Exception):
    """A plan this launch cannot run; the message is one sentence with the fix."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime", description="Run a plan (under torchrun).")
    p.add_argument("plan", help="plan.json written by `plan solve`")
    p.add_argument("--steps", type=int, default=6, help="training steps; step 1 warms up, step 2 measures memory, "
                   "3..S-1 time, and (S >= 4) step S runs under the profiler for the time breakdown")
    p.add_argument("--out", default="run.json", help="where rank 0 writes the run report")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds a collective may wait for the other ranks before the run stops")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if not args.timeout > 0:
        p.error("--timeout must be a positive number of seconds")
    return args


def load_run_inputs(plan_path: str) -> tuple[Plan, ModelSpec, torch.nn.Sequential]:
    """The plan, the model file and the built model; raises PlanError, RunError or ModelFileError."""
    plan = load_plan(plan_path)
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
    model = build_model(spec, plan)
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


def agent_store(timeout_s: float) -> dist.TCPStore:
    """A client of torchrun's own store (TORCHELASTIC_USE_AGENT_STORE): no process group needed."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))


def wait_for_all_ranks(key: str, timeout_s: float = 15.0) -> None:
    store = agent_store(timeout_s)
    key = f"{key}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < int(os.environ["WORLD_SIZE"]) and time.monotonic() < deadline:
        time.sleep(0.05)


def init_distributed(plan: Plan, timeout_s: float) -> None:
    timeout = timedelta(seconds=timeout_s)
    if plan.device_type == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def is_timeout(e: BaseException) -> bool:
    """Whether a collective gave up waiting (gloo: "Timed out waiting ...", NCCL's watchdog: "Timeout")."""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("timed out" in text or "timeout" in text)


def device_name(plan: Plan) -> str:
    return torch.cuda.get_device_name() if plan.device_type == "cuda" else "cpu"


def print_summary(run: RunReport) -> None:
    console = Console()
    console.print(f"{run.plan_path}: {run.steps} steps on {run.world_size} x {run.device}, "
                  f"loss {run.losses[0]:.4f} -> {run.losses[-1]:.4f}", highlight=False, markup=False)
    console.print(run_table(run))


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


def progress_printer(trainer: Trainer, steps: int):
    """One line every few steps (about 20 in all, and the last) from the rank that holds the
    last stage for dp and tp rank 0: its loss is that replica's share of the batch."""
    if not (trainer.has_last_stage and trainer.dp_rank == 0 and trainer.tp_rank == 0):
        return None
    every = max(1, steps // 20)

    def on_step(step: int, loss: float | None, seconds: float) -> None:
        if (step + 1) % every == 0 or step + 1 == steps:
            print(f"step {step + 1}/{steps}: loss {loss:.4f} (dp rank 0's samples), {seconds:.3f} s", flush=True)
    return on_step


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        plan, spec, model = load_run_inputs(args.plan)
    except (PlanError, RunError, ModelFileError) as e:
        refuse(str(e))
    record = StepRecord(plan.world_size)
    try:
        return train_and_report(args, plan, spec, model, record)
    except Exception as e:  # noqa: BLE001 - a hang elsewhere is expected input; anything else is a bug
        if not is_timeout(e):
            raise
        rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
        print(timeout_sentence(rank, args.timeout, record), file=sys.stderr, flush=True)
        os._exit(EXIT_TIMEOUT)


def train_and_report(args: argparse.Namespace, plan: Plan, spec: ModelSpec, model: torch.nn.Sequential,
                     record: StepRecord) -> int:
    init_distributed(plan, args.timeout)
    mesh = ParallelDims.from_plan(plan).build_mesh(plan.device_type)
    trainer = Trainer(plan, spec, model, mesh)
    del model  # the layers of other stages go with it
    printer = progress_printer(trainer, args.steps)

    local_losses, report = trainer.train(args.steps, on_step=printer, on_start=lambda step: record.begun(step + 1))
    losses = reduce_losses(local_losses, trainer.has_last_stage, plan, trainer.device)
    reports: list[RankReport | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() == 0:
        run = RunReport(plan_path=args.plan, plan_sha256=hashlib.sha256(Path(args.plan).read_bytes()).hexdigest(),
                        world_size=plan.world_size, steps=args.steps, losses=losses, device=device_name(plan),
                        torch_version=torch.__version__, ranks=reports)
        run.validate()                   # what verify will check: a bug here, not a bad run document
        run.save(args.out)
        print_summary(run)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown: gloo's worker threads can still hold tensors
    # then, and releasing them during finalisation aborts the process now and then
    # ("terminate called without an active exception") after a run that went well.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
