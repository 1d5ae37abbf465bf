"""`plan`: profile a model, solve for the best training layout, run it, verify it.

Thin by design: each command parses its flags, calls the packages, and prints with rich.
Every expected failure is one sentence and exit code 2 (3 when no layout fits).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import display
from planner.hardware import DEFAULT_HARDWARE
from runtime.config import HELP as TRAIN_HELP
from runtime.launch import DEFAULT_STEPS, DEFAULT_TIMEOUT_S

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)
out = Console()
err = Console(stderr=True)

WIDE = typer.Option(False, "--wide", help="Every column (the default fits 80 columns; a terminal of 160 or more shows all).")

EXIT_BAD_INPUT = 2
EXIT_NO_FIT = 3


def fail(message: str, code: int = EXIT_BAD_INPUT):
    err.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def version() -> str:
    from importlib.metadata import PackageNotFoundError, version as installed
    try:
        return installed("plan")
    except PackageNotFoundError:     # run from a checkout without installing
        return "unknown (not installed)"


def show_version(value: bool) -> None:
    if value:
        out.print(f"plan {version()}", highlight=False)
        raise typer.Exit()


@app.callback()
def main(_version: bool = typer.Option(False, "--version", callback=show_version, is_eager=True,
                                       help="Print plan's version and exit.")):
    """Profile a PyTorch model, solve for the fastest training layout that fits, run it, and check the prediction.

    How it works: docs/design.md.
    """


def expected_errors():
    """The exceptions that mean bad input (one sentence each), not a bug."""
    from planner.hardware import HardwareError
    from planner.plan import PlanError
    from planner.run_report import RunReportError
    from planner.search import SolveError
    from profiles.schema import ProfileError
    errors = (HardwareError, PlanError, RunReportError, SolveError, ProfileError)
    from runtime.config import ConfigError
    errors += (ConfigError,)
    try:
        from profiles.model_file import ModelFileError
        from runtime.__main__ import RunError
        from runtime.checkpoint import CheckpointError
        from runtime.weights import WeightsError
        errors += (ModelFileError, RunError, CheckpointError, WeightsError)
    except ImportError:  # torch missing: the planner still runs
        pass
    return errors


# ----------------------------------------------------------------------------------------
# plan profile
# ----------------------------------------------------------------------------------------

@app.command()
def profile(
    model: str = typer.Argument(..., help="Model file (build_model, make_batch; see docs/design.md), or a Hugging Face causal-LM config: a config.json, a folder holding one, or a built-in name (llama-3-8b, llama-3-70b, mistral-7b, qwen2-7b, gpt2)."),
    output: Path = typer.Option(Path("profile.json"), "-o", "--output", help="Where to write the profile."),
    batch_sizes: str = typer.Option("1,2,4", help="Micro-batch sizes to measure, comma-separated."),
    optimizer: str = typer.Option("adamw", help="sgd | momentum | adam | adamw."),
    precision: str = typer.Option("fp32", help="fp32 | bf16 | mixed (bf16 compute, fp32 master weights, gradients and states)."),
    device: str = typer.Option("cpu", help="cpu | cuda."),
    fake: bool = typer.Option(False, "--fake", help="Profile without allocating (FakeTensorMode); times from --hardware's achievable rates."),
    hardware: Optional[str] = typer.Option(None, help=f"Hardware preset or .toml cluster file for --fake times (see `plan hardware`; default: plan solve's, {DEFAULT_HARDWARE})."),
    csv: Optional[Path] = typer.Option(None, "--csv", help="Also write the flat per-layer table as CSV."),
    wide: bool = WIDE,
    repeats: int = typer.Option(5, help="Timed repeats per layer (median), after 2 warm-up runs."),
    threads: int = typer.Option(1, help="Intra-op threads to time layers with: what each rank will run with (plan run gives CPU ranks this many)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per sample of a Hugging Face model (default: the smaller of 4096 and its max_position_embeddings)."),
):
    """Measure every layer: memory by category, time and FLOPs at each micro-batch size."""
    try:
        from profiles.measure import ProfileOptions, profile_model
        from profiles.model_file import load_model_file
        from planner.hardware import get_hardware
        from profiles.schema import OPTIMIZERS, PRECISIONS

        if optimizer not in OPTIMIZERS:
            fail(f"--optimizer {optimizer} is not one of {', '.join(OPTIMIZERS)}.")
        if precision not in PRECISIONS:
            fail(f"--precision {precision} is not one of {', '.join(PRECISIONS)}.")
        if device not in ("cpu", "cuda"):
            fail(f"--device {device} is not cpu or cuda.")
        try:
            sizes = tuple(sorted({int(x) for x in batch_sizes.split(",") if x.strip()}))
        except ValueError:
            fail(f"--batch-sizes {batch_sizes!r} is not a comma-separated list of integers, e.g. 1,2,4.")
        if not sizes or min(sizes) < 1:
            fail(f"--batch-sizes {batch_sizes!r} must list positive integers, e.g. 1,2,4.")
        if repeats < 1:
            fail(f"--repeats is {repeats}; give 1 or more.")
        if threads < 1:
            fail(f"--threads is {threads}; give 1 or more.")
        check_writable(output)
        if csv:
            check_writable(csv, "--csv")
        op_seconds = None
        if fake:
            if not hardware:
                hardware = DEFAULT_HARDWARE
                err.print(f"--fake: times from the {hardware} preset (the default; --hardware to change).", highlight=False)
            hw = get_hardware(hardware)
            op_seconds = lambda kind, flops, io, mnk: hw.op_seconds(precision, kind, flops, io, mnk)  # noqa: E731
            hardware = hw.name     # a cluster file's name, as `plan solve --hardware FILE` will know it
        elif hardware:
            hardware = get_hardware(hardware).name

        from profiles.hf import is_hf_source, load_hf_spec
        if is_hf_source(model):
            spec = load_hf_spec(model, seq_len)
        elif seq_len is not None:
            fail(f"--seq-len applies to Hugging Face configs only; {model} is a model file, whose make_batch sets the sequence length.")
        else:
            spec = load_model_file(model)
        opts = ProfileOptions(batch_sizes=sizes, optimizer=optimizer, precision=precision, device=device,
                              fake=fake, hardware=hardware, repeats=repeats, threads=threads,
                              op_launch_s=hw.op_launch_s if fake else 0.0)
        with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, transient=True) as bar:
            task = bar.add_task("profiling", total=None)
            prof = profile_model(spec, opts, op_seconds=op_seconds,
                                 on_progress=lambda msg, total: bar.update(task, advance=1, total=total, description=msg))
        prof.save(output)
        if csv:
            write_profile_csv(prof, csv)
    except expected_errors() as e:
        fail(str(e))
    print_profile(prof, wide=wide)
    out.print(f"wrote [bold]{escape(str(output))}[/]" + (f" and [bold]{escape(str(csv))}[/]" if csv else ""))


def write_profile_csv(prof, path: Path) -> None:
    import os
    import tempfile
    from dataclasses import asdict

    import pandas as pd
    rows = []
    for layer in prof.layers:
        for b in sorted(layer.samples):
            rows.append({"layer": layer.index, "name": layer.name, "kind": layer.kind, "micro_batch": b,
                         "param_count": layer.param_count, "param_bytes": layer.param_bytes,
                         "grad_bytes": layer.grad_bytes, "optimizer_state_bytes": layer.optimizer_state_bytes,
                         "buffer_bytes": layer.buffer_bytes, **asdict(layer.samples[b])})
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        pd.DataFrame(rows).to_csv(tmp, index=False)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def print_profile(prof, b: int | None = None, wide: bool = False) -> None:
    out.print(display.profile_table(prof, b or max(prof.batch_sizes), display.is_wide(out, wide)))


# ----------------------------------------------------------------------------------------
# plan show / plan hardware
# ----------------------------------------------------------------------------------------

@app.command()
def show(path: Path = typer.Argument(..., help="A profile.json, plan.json or run.json."),
         batch: Optional[int] = typer.Option(None, help="Micro-batch size to show a profile at (default: the largest measured)."),
         wide: bool = WIDE,
         plot: Optional[Path] = typer.Option(None, "--plot", help="A plan: also draw its memory per stage and its step's timeline to this PNG file.")):
    """Print a profile's, plan's or run's summary again."""
    try:
        if plot:
            check_writable(plot, "--plot")
        if not path.is_file():
            fail(f"{path} does not exist; give the path of a profile.json, plan.json or run.json.")
        try:
            kind = json.loads(path.read_text()).get("kind")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            fail(f"{path} is not a JSON document written by plan; give a profile.json, plan.json or run.json.")
        if kind == "profile":
            from profiles.schema import load_profile
            if plot:
                fail("--plot draws a plan; solve the profile, then `plan show plan.json --plot FILE`.")
            prof = load_profile(path)
            if batch is not None and batch < 1:
                fail(f"--batch is {batch}; give a positive micro-batch size.")
            print_profile(prof, batch, wide)
        elif kind == "plan":
            from planner.plan import load_plan
            plan = load_plan(path)
            print_plan(plan, wide)
            if plot:
                if plan.predicted is None:
                    fail(f"{path} has no prediction to draw (written by hand); solve it with `plan solve`.")
                import plots
                plots.plot_plan(plan, plot)
                out.print(f"drew {escape(str(plot))}", highlight=False)
        elif kind == "run":
            from planner.run_report import load_run
            if plot:
                fail(f"--plot draws a plan; for a run, use `plan verify PLAN {path} --plot FILE`.")
            print_run(load_run(path))
        else:
            fail(f"{path} is not a profile, plan or run document (its 'kind' is {kind!r}).")
    except expected_errors() as e:
        fail(str(e))


@app.command("hardware")
def hardware_cmd(wide: bool = WIDE):
    """List the hardware presets (a TOML cluster file can describe anything else)."""
    from planner.hardware import PRESETS
    out.print(display.hardware_table(PRESETS, display.is_wide(out, wide)))
    out.print("Sources for every number: planner/hardware.py (Hardware.sources).")


@app.command()
def calibrate(
    device: str = typer.Option("cpu", help="cpu (processes over gloo) | cuda (GPUs of this node over NCCL)."),
    processes: str = typer.Option("2,4", help="Process counts to measure collectives at, comma-separated (cuda: GPUs; 1 measures rates only)."),
    base: Optional[str] = typer.Option(None, help="Preset whose other figures the file keeps (default: cpu, or h100-sxm-80g)."),
    output: Path = typer.Option(Path("cluster.toml"), "-o", "--output", help="Where to write the cluster file."),
    runs: int = typer.Option(1, help="Calibrations in a row; the file takes each figure's median (3: steadier, 3x as long)."),
):
    """Measure this machine's collectives and rates; write a cluster file for `plan solve --cluster`."""
    from planner.hardware import PRESETS
    try:
        counts = tuple(sorted({int(x) for x in processes.split(",") if x.strip()}))
    except ValueError:
        fail(f"--processes {processes!r} is not a comma-separated list of integers, e.g. 2,4.")
    if device not in ("cpu", "cuda"):
        fail(f"--device {device} is not cpu or cuda.")
    # One GPU still has rates to measure (matmul, attention, copies); one CPU process has no collective.
    least = 1 if device == "cuda" else 2
    if not counts or min(counts) < least:
        fail(f"--processes {processes!r} must list counts of {least} or more, e.g. {'1' if least == 1 else '2,4'}.")
    if base is not None and base not in PRESETS:
        fail(f"--base {base} is not a preset; use one of {', '.join(PRESETS)}.")
    if runs < 1:
        fail(f"--runs {runs} must be 1 or more, e.g. 3.")
    import torch
    if device == "cuda" and torch.cuda.device_count() < max(counts):
        fail(f"--device cuda --processes {processes} needs {max(counts)} GPUs but torch sees {torch.cuda.device_count()}; "
             "give fewer processes.")
    check_writable(output)
    from profiles.calibrate import calibrate as run_calibration, median_calibration, write_cluster_file
    base_name = base or ("cpu" if device == "cpu" else "h100-sxm-80g")
    cals = []
    with Progress(TextColumn("[progress.description]{task.description}"), TimeElapsedColumn(), console=err,
                  transient=True) as bar:
        task = bar.add_task("calibrating", total=None)
        for k in range(runs):
            run = f"run {k + 1} of {runs}: " if runs > 1 else ""
            cals.append(run_calibration(device, counts, base_name,
                                        on_progress=lambda msg, run=run: bar.update(task, description=run + msg)))
    cal = median_calibration(cals)
    write_cluster_file(cal, base_name, output)
    for note in cal.notes:
        out.print(escape(note), highlight=False)
    out.print(f"wrote [bold]{escape(str(output))}[/]; plan with it: plan solve --cluster {escape(str(output))} --gpus N",
              highlight=False)


def check_writable(path: Path, flag: str = "-o") -> None:
    """Fail before any work when `path` cannot be written (as write_text_atomic writes it: a
    temporary file beside it, then a rename)."""
    import os
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        fail(f"{flag} {path} is a directory; give a file name.")
    if not parent.is_dir():
        what = "is a file" if parent.exists() else "does not exist"
        fail(f"{flag} {path}: the folder {parent} {what}; create the folder or give another path.")
    if not os.access(parent, os.W_OK):
        fail(f"{flag} {path}: the folder {parent} is not writable; give another path.")
    try:
        longest = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    if len(path.name.encode()) + 16 > longest:        # 16: the temporary name's additions
        fail(f"{flag} {path}: the file name is longer than the {longest - 16} characters this folder allows; give a shorter one.")


# ----------------------------------------------------------------------------------------
# plan solve
# ----------------------------------------------------------------------------------------

@app.command()
def solve(
    profile_path: Path = typer.Argument(Path("profile.json"), metavar="[PROFILE]", help="The profile to plan from."),
    gpus: int = typer.Option(..., help="Number of GPUs (or CPU processes with --hardware cpu)."),
    gpus_per_node: Optional[int] = typer.Option(None, help="GPUs per node (default: the hardware's)."),
    hardware: str = typer.Option(DEFAULT_HARDWARE, help="Hardware preset (see `plan hardware`)."),
    cluster: Optional[Path] = typer.Option(None, help="TOML cluster file instead of a preset."),
    global_batch: Optional[int] = typer.Option(None, help="Samples per step (default: 8 per GPU)."),
    memory_limit: Optional[str] = typer.Option(None, help="Memory per GPU plans may use, e.g. 70GiB (default: the hardware's usable memory)."),
    top: int = typer.Option(5, help="How many of the best layouts to show and keep."),
    solver: str = typer.Option("highs", help="highs (in-process, the default) | cbc (bundled with PuLP; slower)."),
    time_limit: float = typer.Option(20.0, help="Seconds per candidate's layout solve (its MILP, or for a pipeline its search over stage sizes); a layout found at the limit is marked unproven."),
    dp: Optional[int] = typer.Option(None, help="Pin the data-parallel degree."),
    tp: Optional[int] = typer.Option(None, help="Pin the tensor-parallel degree."),
    pp: Optional[int] = typer.Option(None, help="Pin the pipeline-parallel degree."),
    micro_batch: Optional[int] = typer.Option(None, help="Pin the micro-batch size."),
    zero: Optional[int] = typer.Option(None, help="Pin the ZeRO stage (0-3)."),
    schedule: Optional[str] = typer.Option(None, help="Pin the pipeline schedule: 1f1b | gpipe | interleaved | looped_bfs (the last two: several stages a rank)."),
    virtual_stages: Optional[int] = typer.Option(None, help="Pin the stages per pipeline rank of the interleaved or looped_bfs schedule (2 or more; alone it implies --schedule interleaved; under either schedule it is 2 unless pinned)."),
    checkpoint: str = typer.Option("auto", help="Activation checkpointing, every layer pinned to one mode: none | selective (recompute all but matmuls and attention) | all (recompute the whole layer); or auto: each layer's mode solved."),
    offload: str = typer.Option("auto", help="CPU offload of layers: none | auto."),
    sequence_parallel: str = typer.Option("auto", help="Sequence parallelism under tensor parallelism (the tp_plan's \"sequence\" modules, its norms, on slices of the sequence): on | off | auto."),
    workers: Optional[int] = typer.Option(None, help="Processes that solve candidates ahead of the search once one candidate's solve takes a second (default: the cores this process may use; 1: none). The plan is the same for any number."),
    output: Path = typer.Option(Path("plan.json"), "-o", "--output", help="Where to write the plan."),
    wide: bool = WIDE,
):
    """Find the fastest layout that fits: degrees, micro-batching, ZeRO, checkpointing, offload."""
    from planner.build import build_plan, explain_no_fit
    from planner.hardware import format_size, get_hardware, load_cluster_file, parse_size
    from planner.search import SolveOptions, search
    from profiles.schema import load_profile
    try:
        check_writable(output)
        prof = load_profile(profile_path)
        check_model_unchanged(prof)
        hw = load_cluster_file(cluster) if cluster else get_hardware(hardware)
        limit = parse_size(memory_limit, what="--memory-limit") if memory_limit else None
        opts = SolveOptions(gpus=gpus, hardware=hw, gpus_per_node=gpus_per_node, global_batch=global_batch,
                            memory_limit=limit, top_k=top, solver=solver, dp=dp, tp=tp, pp=pp,
                            micro_batch=micro_batch, zero=zero, schedule=schedule, virtual_stages=virtual_stages,
                            checkpoint=checkpoint, sequence_parallel=sequence_parallel,
                            offload=offload, time_limit=time_limit, workers=workers)
        with Progress(TextColumn("solving"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True) as bar:
            task = bar.add_task("solve", total=None)
            result = search(prof, opts, on_progress=lambda k, n: bar.update(task, completed=k, total=n))
        limit_bytes = limit or hw.usable_memory_bytes()
        if not result.solutions:
            err.print(f"[bold red]no layout fits[/] {gpus} x {escape(hw.name)} with {format_size(limit_bytes)} {display.per_rank(hw.device_type)} "
                      f"({result.candidates} layouts considered).", highlight=False)
            for line in explain_no_fit(prof, opts, result, limit_bytes):
                err.print("  " + escape(line), highlight=False)
            raise typer.Exit(EXIT_NO_FIT)
        best, others = result.solutions[0], result.solutions[1:]
        plan = build_plan(best, others, prof, str(profile_path), hw, opts, limit_bytes, str(output))
        plan.save(output)
    except expected_errors() as e:
        fail(str(e))
    print_top(result, limit_bytes, hw.device_type, wide)
    print_plan(plan, wide)
    # A memory-free MILP whose fastest layout fits needs no second one with the memory rows.
    out.print(f"{result.candidates} layouts, {result.free_solved + result.milps} MILPs ({result.free_solved} without "
              f"the memory limit, {result.free_fits} of whose fastest layouts fit; {result.milps} with it): "
              f"{result.pruned} ruled out as slower than the top {top} (by a bound or when solved), "
              f"{result.infeasible} as not fitting.")
    for note in result.notes:
        out.print(f"[yellow]note:[/] {escape(note)}", highlight=False)
    out.print(f"wrote [bold]{escape(str(output))}[/]; run it with:\n  {escape(plan.launch)}", highlight=False)


def check_model_unchanged(prof) -> None:
    """A profile is only good for the model file it measured."""
    import hashlib

    from profiles.schema import ProfileError
    path = Path(prof.model["path"])
    if prof.model.get("source", "file") != "file":
        return
    if not path.is_file():
        raise ProfileError(f"the profile's model file {path} no longer exists; profile the model again.")
    if hashlib.sha256(path.read_bytes()).hexdigest() != prof.model["sha256"]:
        raise ProfileError(f"model file {path} has changed since it was profiled; profile it again with `plan profile {path}`.")


def print_top(result, limit: int, device_type: str, wide: bool = False) -> None:
    out.print(display.top_table(result.solutions, limit, display.is_wide(out, wide), device_type))


def print_plan(plan, wide: bool = False) -> None:
    from planner.hardware import format_size
    out.print(display.plan_table(plan, display.is_wide(out, wide)))
    pred = plan.predicted
    if pred:
        out.print(f"predicted step {pred.step_time_s:.4f} s, {pred.samples_per_s:,.1f} samples/s, "
                  + (f"MFU {100 * pred.mfu:.1f}%, " if display.shows_mfu(plan.device_type) else "")
                  + f"peak {format_size(pred.peak_bytes)} of {format_size(plan.memory_limit_bytes)}"
                  + (f"; offloaded states fill {format_size(pred.host_peak_bytes)} of a node's host memory"
                     if pred.host_peak_bytes else ""), highlight=False)


# ----------------------------------------------------------------------------------------
# plan run / plan verify
# ----------------------------------------------------------------------------------------

@app.command()
def run(
    plan_path: Path = typer.Argument(Path("plan.json"), metavar="[PLAN]"),
    steps: Optional[int] = typer.Option(None, help=f"Training steps (default {DEFAULT_STEPS}: 1 warms up, 1 measures memory, the last 3 (the last, under 12 steps) run under the profiler, the rest are timed)."),
    run_out: Optional[Path] = typer.Option(None, "--out", help="Where rank 0 writes run.json (default: run.json here)."),
    nnodes: Optional[int] = typer.Option(None, help="Nodes (torchrun --nnodes; default: the plan's)."),
    node_rank: int = typer.Option(0, help="This node's rank (torchrun --node-rank)."),
    rdzv_endpoint: Optional[str] = typer.Option(None, help="host:port of the rendezvous (several nodes)."),
    timeout: float = typer.Option(DEFAULT_TIMEOUT_S, help="Seconds a collective may wait for the other ranks; past it the run stops and names the rank that fell behind."),
    print_only: bool = typer.Option(False, "--print", help="Only print the torchrun command."),
    slurm: bool = typer.Option(False, "--slurm", help="Only print an sbatch script that runs the plan on its nodes."),
    checkpoint_dir: Optional[Path] = typer.Option(None, help="Write checkpoints (torch.distributed.checkpoint) into this folder, after the last step and every --checkpoint-every."),
    checkpoint_every: int = typer.Option(0, help="Also write a checkpoint every N steps (0: after the last only)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest complete checkpoint in --checkpoint-dir (under this plan or another of the same model)."),
    init_from: Optional[Path] = typer.Option(None, help="Start from a Hugging Face model's weights in this local folder (what save_pretrained writes; safetensors), each rank reading only its shards."),
    tensorboard: Optional[Path] = typer.Option(None, help="Also write the log lines' figures (loss, lr, grad norm, step time, tokens/s) as TensorBoard scalars into this folder (needs tensorboard)."),
    max_restarts: int = typer.Option(0, help="Restart every rank after a failure, up to this many times, resuming from the latest checkpoint (torchrun --max-restarts)."),
    config: Optional[Path] = typer.Option(None, help="A TOML file of the training settings below (flags win)."),
    lr: Optional[float] = typer.Option(None, help=TRAIN_HELP["lr"]),
    weight_decay: Optional[float] = typer.Option(None, help=TRAIN_HELP["weight_decay"]),
    beta1: Optional[float] = typer.Option(None, help=TRAIN_HELP["beta1"]),
    beta2: Optional[float] = typer.Option(None, help=TRAIN_HELP["beta2"]),
    momentum: Optional[float] = typer.Option(None, help=TRAIN_HELP["momentum"]),
    seed: Optional[int] = typer.Option(None, help=TRAIN_HELP["seed"]),
    lr_schedule: Optional[str] = typer.Option(None, help=TRAIN_HELP["lr_schedule"]),
    warmup_steps: Optional[int] = typer.Option(None, help=TRAIN_HELP["warmup_steps"]),
    decay_steps: Optional[int] = typer.Option(None, help=TRAIN_HELP["decay_steps"]),
    min_lr_ratio: Optional[float] = typer.Option(None, help=TRAIN_HELP["min_lr_ratio"]),
    clip_grad_norm: Optional[float] = typer.Option(None, help=TRAIN_HELP["clip_grad_norm"]),
    log_every: Optional[int] = typer.Option(None, help=TRAIN_HELP["log_every"]),
):
    """Launch the plan under torchrun (`torchrun ... -m runtime plan.json`) and train it; Ctrl-C stops every rank."""
    import os
    import shlex

    from planner.plan import load_plan
    from runtime.config import train_args
    from runtime.launch import STOP_GRACE_S, STOP_SAVE_GRACE_S, build_command, run_torchrun, slurm_script
    if steps is not None and steps < 1:
        fail(f"--steps is {steps}; give 1 or more.")
    if not timeout > 0:
        fail(f"--timeout is {timeout:g}; give a positive number of seconds.")
    if checkpoint_every < 0 or max_restarts < 0:
        fail(f"--{'checkpoint-every' if checkpoint_every < 0 else 'max-restarts'} is negative; give 0 or more.")
    if max_restarts and not checkpoint_dir:
        fail("--max-restarts resumes from checkpoints; pass --checkpoint-dir too (and --checkpoint-every N to lose at most N steps).")
    extra = train_args(config, lr=lr, weight_decay=weight_decay, beta1=beta1, beta2=beta2, momentum=momentum, seed=seed,
                       lr_schedule=lr_schedule, warmup_steps=warmup_steps, decay_steps=decay_steps,
                       min_lr_ratio=min_lr_ratio, clip_grad_norm=clip_grad_norm, log_every=log_every)
    if checkpoint_dir:
        extra += ["--checkpoint-dir", str(checkpoint_dir)] + (["--checkpoint-every", str(checkpoint_every)] if checkpoint_every else [])
    extra += ["--resume"] if resume else []
    extra += ["--init-from", str(init_from)] if init_from else []
    extra += ["--tensorboard", str(tensorboard)] if tensorboard else []
    try:
        plan = load_plan(plan_path)
        if nnodes is not None and nnodes != plan.nodes:
            fail(f"the plan lays its {plan.world_size} ranks out on {plan.nodes} node(s) of {plan.gpus_per_node}; "
                 f"pass --nnodes {plan.nodes}, or solve again with --gpus-per-node for your nodes.")
        nnodes = plan.nodes
        if slurm:
            out.print(escape(slurm_script(plan_path, plan, steps, run_out, timeout, extra=extra, max_restarts=max_restarts)),
                      highlight=False, soft_wrap=True)
            return
        cmd = build_command(str(plan_path), plan, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                            steps=steps, out=str(run_out) if run_out else None, timeout_s=timeout, extra=extra,
                            max_restarts=max_restarts)
        if not print_only:
            # What every rank would refuse, refused here once, before torchrun starts.
            check_run_inputs(plan, cmd[cmd.index("runtime") + 1:])
            check_writable(run_out or Path("run.json"), "--out")
            check_devices(plan, plan.world_size // nnodes)
    except expected_errors() as e:
        fail(str(e))
    except ValueError as e:
        fail(f"{e}; check --nnodes, --node-rank and --rdzv-endpoint.")
    out.print(escape(shlex.join(cmd)), highlight=False, soft_wrap=True)
    if print_only:
        return
    # Each CPU rank runs with the threads its layers were timed with (the profile's; torchrun
    # alone would set one thread only for several processes).
    env = {**os.environ}
    if plan.device_type == "cpu":
        env.setdefault("OMP_NUM_THREADS", str(plan.threads))
    grace = STOP_GRACE_S
    if checkpoint_dir:
        # Ctrl-C: the ranks end their step and write a checkpoint; torchrun waits that long too.
        grace = STOP_SAVE_GRACE_S
        env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(grace)))
    code, signal_name, failure = run_torchrun(cmd, env, grace_s=grace + 5)
    if signal_name:
        err.print(f"interrupted ({signal_name}): stopped torchrun and its {plan.world_size // nnodes} ranks"
                  f"{escape(latest_checkpoint_words(checkpoint_dir))}.", highlight=False)
        raise typer.Exit(130 if signal_name == "SIGINT" else 143)
    if code:
        what = escape(failure) if failure else f"the run failed (torchrun exit code {code})"
        retried = f" (after {max_restarts} restart{'s' if max_restarts > 1 else ''})" if max_restarts else ""
        err.print(f"[bold red]error:[/] {what}{retried}, so every rank stopped{escape(latest_checkpoint_words(checkpoint_dir))}; "
                  "the ranks' messages are above.", highlight=False)
        raise typer.Exit(code if 0 < code < 128 else 1)


def latest_checkpoint_words(checkpoint_dir: Path | None) -> str:
    """ "; the latest complete checkpoint is D/step-N (continue with --resume)", or "" when there is none."""
    if checkpoint_dir is None:
        return ""
    from runtime.checkpoint import complete_checkpoints
    found = complete_checkpoints(checkpoint_dir)
    if not found:
        return "; no checkpoint was completed"
    return f"; the latest complete checkpoint is {found[-1]} (continue with --resume)"


def check_run_inputs(plan, runtime_argv: list[str]) -> None:
    """What the ranks would refuse, checked with the runtime's own parser and checks: the
    model file loads, is the one solved for and has the plan's layers (built on the meta
    device: nothing allocated, whatever its size); the training settings, the dataset's
    first sample, and the checkpoint folder (to resume from, or free of another run's)."""
    import torch

    from profiles.model_file import build_checked_model, load_spec
    from runtime.__main__ import check_run_settings, parse_args
    from runtime.checkpoint import model_shapes
    spec = load_spec(plan.model)
    with torch.device("meta"):
        model = build_checked_model(spec)
    if len(model) != plan.n_layers:
        fail(f"the plan lays out {plan.n_layers} layers but {spec.path} builds {len(model)}; profile and solve again.")
    check_run_settings(parse_args(runtime_argv), plan, spec, model_shapes(model), check_data=True)


def check_devices(plan, per_node: int) -> None:
    """A CUDA plan needs its GPUs on this node before anything starts."""
    if plan.device_type != "cuda":
        return
    import torch
    have = torch.cuda.device_count()
    if have < per_node:
        fail(f"the plan runs {per_node} ranks on CUDA GPUs per node but torch sees {have} here; run it on a node "
             "with the GPUs, or solve for CPU processes with `plan solve --hardware cpu`.")


@app.command()
def verify(
    plan_path: Path = typer.Argument(..., metavar="PLAN"),
    run_path: Path = typer.Argument(..., metavar="RUN"),
    tolerance: float = typer.Option(3.0, help="Largest memory error (percent) that passes."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also draw predicted beside measured (memory per stage, time per component) to this PNG file."),
):
    """Predicted vs measured peak memory and step time, per stage; non-zero exit past --tolerance."""
    from planner.plan import load_plan
    from planner.run_report import load_run
    from planner.verify import VerifyError, compare, compare_time
    try:
        if plot:
            check_writable(plot, "--plot")
        plan = load_plan(plan_path)
        run_doc = load_run(run_path)
        rows, step = compare(plan, plan_path, run_doc)
        time_rows, time_rank = compare_time(plan, run_doc)
    except expected_errors() + (VerifyError,) as e:
        fail(str(e))
    t, worst = display.memory_check_table(rows, f"predicted vs measured: {plan_path} / {run_path}", tolerance)
    out.print(t)
    low, high, timed = run_doc.step_range_s
    out.print(f"step time: predicted {step[0]:.4f} s, measured {step[1]:.4f} s ({100 * (step[0] - step[1]) / step[1]:+.1f}%; "
              f"the median of {timed} timed steps, {low:.4f}-{high:.4f} s)")
    busy = display.cores_busy_line(run_doc)
    if busy:
        out.print(busy, highlight=False)
    ran = {r.threads for r in run_doc.ranks}
    if plan.device_type == "cpu" and ran and ran != {plan.threads}:
        out.print(f"[yellow]note:[/] the ranks ran with {', '.join(map(str, sorted(ran)))} threads but the profile timed "
                  f"its layers with {plan.threads}; the step time assumes {plan.threads} (set OMP_NUM_THREADS={plan.threads}).",
                  highlight=False)
    if time_rows:
        profiled = next(r for r in run_doc.ranks if r.rank == time_rank)
        whole = (step[0], profiled.breakdown_step_s) if profiled.breakdown_step_s else None
        out.print(display.time_check_table(time_rows, time_rank, whole))
        if whole:
            out.print(display.profiled_step_line(profiled.breakdown_step_s, profiled.median_step_s, run_doc.profiled_steps),
                      highlight=False)
        if plan.device_type == "cpu":
            out.print("On CPU processes sharing cores, a rank waiting for a core mostly shows as waiting in a collective.")
        else:
            out.print("On a GPU each component is its kernels' time, and other is the time the GPU ran none.")
    if plot:
        import plots
        plots.plot_verify(plan, rows, time_rows, plot)
        out.print(f"drew {escape(str(plot))}", highlight=False)
    if worst > tolerance:
        err.print(f"[bold red]memory error {worst:.2f}% exceeds --tolerance {tolerance}%[/]")
        raise typer.Exit(1)


def print_run(run) -> None:
    out.print(escape(display.run_summary(run)), highlight=False)
    out.print(display.run_table(run))
    out.print("losses: " + ", ".join(f"{x:.4f}" for x in run.losses))


if __name__ == "__main__":
    sys.exit(app())
