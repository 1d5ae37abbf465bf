"""Hold a run to its plan: predicted vs measured peak memory per stage, and step time."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from .plan import Plan
from .run_report import RunReport


class VerifyError(Exception):
    """A run that cannot be compared with its plan; the message is one sentence with the fix."""


@dataclass
class StageRow:
    stage: int            # pipeline rank
    ranks: list[int]      # the global ranks that hold it
    predicted: int        # bytes
    measured: int         # bytes: the largest peak among those ranks
    error_pct: float      # (predicted - measured) / measured, percent
    reserved: int = 0     # bytes the CUDA allocator held at most (its cache included); 0 on CPU


# The components the runtime's breakdown measures a step in (runtime/breakdown.py), and the
# rows predicted vs measured time is compared in.
MEASURED_COMPONENTS = ("compute", "tp_comm", "dp_comm", "p2p", "optimizer", "other")


@dataclass
class TimeRow:
    component: str        # compute | tp_comm | dp_comm | p2p (with the bubble) | optimizer | other
    predicted: float      # seconds per step
    measured: float       # seconds in the profiled step of the slowest rank


def compare_time(plan: Plan, run: RunReport) -> tuple[list[TimeRow], int | None]:
    """Predicted vs measured step time by component, for the rank with the slowest median
    step (its profiled step), and that rank; no rows when the run has no breakdown."""
    ranks = [r for r in run.ranks if r.breakdown_s]
    if not ranks:
        return [], None
    slowest = max(ranks, key=lambda r: r.median_step_s)
    pred = dict(predicted(plan).components_s)
    # The breakdown sees the bubble as waiting on a receive, and offload copies inside FSDP2's hooks.
    pred["p2p"] = pred.get("p2p", 0.0) + pred.pop("bubble", 0.0)
    pred["dp_comm"] = pred.get("dp_comm", 0.0) + pred.pop("offload", 0.0)
    rows = [TimeRow(k, float(pred.get(k, 0.0)), float(slowest.breakdown_s.get(k, 0.0))) for k in MEASURED_COMPONENTS]
    return rows, slowest.rank


def compare(plan: Plan, plan_path: str | Path, run: RunReport) -> tuple[list[StageRow], tuple[float, float]]:
    """Rows per pipeline rank, and (predicted, measured) step seconds."""
    sha = hashlib.sha256(Path(plan_path).read_bytes()).hexdigest()
    if run.plan_sha256 != sha:
        raise VerifyError(f"the run was made from a different plan than {plan_path} (its hash differs); run this plan with `plan run {plan_path}`.")
    if run.world_size != plan.world_size:
        raise VerifyError(f"the run has {run.world_size} ranks but the plan has {plan.world_size}; run this plan again.")
    if {r.pp_rank for r in run.ranks} != set(range(plan.pp)):
        raise VerifyError(f"the run's pipeline ranks are not the plan's 0..{plan.pp - 1}; run this plan again.")
    stages = predicted(plan).stages
    rows = []
    for pp_rank in range(plan.pp):
        mine = [r for r in run.ranks if r.pp_rank == pp_rank]
        peak = max(s.peak_bytes for s in stages if s.index % plan.pp == pp_rank)
        measured = max(r.peak_bytes for r in mine)
        rows.append(StageRow(pp_rank, [r.rank for r in mine], peak, measured, 100.0 * (peak - measured) / max(measured, 1),
                             max(r.reserved_bytes for r in mine)))
    # Every rank starts each step at once, so the step is its slowest rank's (RunReport.step_s).
    measured_step = run.step_s
    return rows, (predicted(plan).step_time_s, measured_step)


def predicted(plan: Plan):
    """The plan's prediction, or one sentence when it has none (a plan written by hand)."""
    if plan.predicted is None:
        raise VerifyError("the plan carries no prediction (it was not written by `plan solve`); solve one with `plan solve`.")
    return plan.predicted
