"""Turn the search's answer into the plan document, and say why when nothing fits."""

from __future__ import annotations

import hashlib
from pathlib import Path

from profiles.schema import Profile

from .cost import Candidate, CostModel, Prediction
from .hardware import HOST_USABLE_FRACTION, Hardware, format_size, rank_noun, size_flag_at_least
from .plan import LayerChoice, OptimizerConfig, Placed, Plan, Predicted, PredictedStage, Stage, fsdp_unit
from .search import SearchResult, Solution, SolveError, SolveOptions, frugal_fit


def predicted(pred: Prediction) -> Predicted:
    """The cost model's prediction as the plan records it."""
    return Predicted(
        stages=[PredictedStage(index=s.index, layers=s.layers,
                               **{f"{k}_bytes": v for k, v in s.memory.categories().items()},
                               peak_phase=s.memory.phase, micro_batch_s=s.micro_batch_s, step_extra_s=s.step_extra_s,
                               parts_s=dict(s.parts))
                for s in pred.stages],
        peak_bytes=pred.peak_bytes, step_time_s=pred.step_s, components_s=pred.components,
        samples_per_s=pred.samples_per_s, mfu=pred.mfu, host_peak_bytes=pred.host_peak_bytes)


def summary(sol: Solution) -> dict:
    """One line of the top-K table, as the plan's `alternatives` records it."""
    c, p = sol.candidate, sol.prediction
    return {
        "dp": c.dp, "tp": c.tp, "sequence_parallel": c.sequence_parallel, "pp": c.pp, "zero": c.zero,
        "schedule": c.schedule, "virtual_stages": c.virtual_stages, "micro_batch_size": c.micro_batch_size, "num_micro_batches": c.num_micro_batches,
        "checkpointed_layers": [i for st in sol.stages for i, ck, _ in st if ck == "full"],
        "selective_layers": [i for st in sol.stages for i, ck, _ in st if ck == "selective"],
        "offloaded_layers": [i for st in sol.stages for i, _, off in st if off],
        "stage_layers": [[i for i, _, _ in st] for st in sol.stages],
        "step_time_s": p.step_s, "samples_per_s": p.samples_per_s, "mfu": p.mfu,
        "stage_peak_bytes": [s.memory.peak for s in p.stages],
    }


def layout_of(plan: Plan) -> tuple[Candidate, list[list[Placed]]]:
    """A plan's candidate and per-stage (layer, checkpoint, offload), as the search makes them
    (build_plan's inverse): to predict a plan again with another cost model."""
    offload = any(lc.offload for st in plan.stages for lc in st.layers)
    cand = Candidate(plan.dp, plan.tp, plan.pp, plan.micro_batch_size, plan.num_micro_batches, plan.zero, plan.schedule,
                     plan.wrapped_layout, offload, plan.virtual_stages, plan.sequence_parallel)
    return cand, [[Placed(lc.index, lc.checkpoint, lc.offload) for lc in st.layers] for st in plan.stages]


def launch_command(world_size: int, gpus_per_node: int, plan_path: str) -> str:
    per_node = min(world_size, gpus_per_node)
    nnodes = -(-world_size // per_node)
    nodes = f" --nnodes {nnodes} --node-rank <node rank> --rdzv-endpoint <host:port>" if nnodes > 1 else ""
    return f"torchrun --nproc-per-node {per_node}{nodes} -m runtime {plan_path}"


def build_plan(sol: Solution, others: list[Solution], profile: Profile, profile_path: str, hw: Hardware,
               opts: SolveOptions, memory_limit: int, plan_path: str) -> Plan:
    c = sol.candidate
    stages = [Stage(index=s, layers=[LayerChoice(i, ck, bool(off), unit=fsdp_unit(c.fsdp, c.zero, bool(off)))
                                     for i, ck, off in st])
              for s, st in enumerate(sol.stages)]
    return Plan(
        profile={"path": profile_path, "sha256": hashlib.sha256(Path(profile_path).read_bytes()).hexdigest(),
                 "threads": profile.threads},
        model=dict(profile.model),
        hardware=hw.to_json(),
        device_type=hw.device_type,
        world_size=c.world_size,
        gpus_per_node=opts.node_size,
        dp=c.dp, tp=c.tp, pp=c.pp, zero=c.zero,
        schedule=c.schedule,
        micro_batch_size=c.micro_batch_size,
        num_micro_batches=c.num_micro_batches,
        global_batch=c.global_batch,
        precision=profile.precision,
        optimizer=OptimizerConfig(name=profile.optimizer),
        stages=stages,
        sequence_parallel=c.sequence_parallel,
        seq_len=profile.seq_len,
        memory_limit_bytes=memory_limit,
        predicted=predicted(sol.prediction),
        launch=launch_command(c.world_size, opts.node_size, plan_path),
        alternatives=[summary(o) for o in others],
    )


def explain_no_fit(profile: Profile, opts: SolveOptions, result: SearchResult, memory_limit: int) -> list[str]:
    """Sentences for the user when no layout fits: how far off, and what would fit."""
    lines = []
    rank = rank_noun(opts.hardware.device_type)
    if result.closest:
        pred = result.closest
        cand, need = pred.candidate, pred.peak_bytes
        frugal = [w for w, on in (("selectively checkpointed" if opts.checkpoint == "selective" else "checkpointed",
                                   opts.checkpoint != "none"),
                                  ("offloaded", opts.offload == "auto" and cand.allow_offload)) if on]
        layout = f"{cand.describe()}{', every layer ' + ' and '.join(frugal) if frugal else ''}"
        if need > memory_limit:
            lines.append(f"The layout that needs the least memory ({layout}) peaks at {format_size(need)} per {rank}, "
                         f"{format_size(need - memory_limit)} more than the {format_size(memory_limit)} limit.")
            lines.append(f"It would fit with --memory-limit {size_flag_at_least(need)} or a {rank} with that much usable memory.")
        if pred.host_limit is not None and pred.host_peak_bytes > pred.host_limit:
            lines.append(f"The layout that needs the least memory per {rank} ({layout}) offloads {format_size(pred.host_peak_bytes)} "
                         f"of model states to the host memory of one node, more than the {format_size(pred.host_limit)} "
                         f"plans may use there ({HOST_USABLE_FRACTION:.0%} of host_memory_bytes); over more nodes each holds less of them.")
    for factor in (2, 4, 8):
        more = SolveOptions(**{**opts.__dict__, "gpus": opts.gpus * factor, "top_k": 1,
                               "dp": None, "global_batch": opts.batch})
        try:
            found = frugal_fit(profile, more)
        except SolveError:   # pinned flags may not scale; then say nothing about it
            continue
        if found:
            lines.append(f"With --gpus {more.gpus} it fits, e.g. {found.describe()}.")
            break
    if opts.micro_batch and opts.micro_batch > 1:
        lines.append("A smaller --micro-batch (or leaving it unpinned) lowers activation memory.")
    if opts.checkpoint in ("none", "selective") or opts.offload == "none":
        lines.append("Allowing --checkpoint auto and --offload auto lowers memory further.")
    return lines


def cost_model(profile: Profile, hw: Hardware, opts: SolveOptions) -> CostModel:
    return CostModel(profile, hw, opts.node_size, opts.memory_limit)
