"""One step's pipeline timeline: when each stage runs each micro-batch's forward and backward.

Every pp rank runs memory.schedule_actions' order; an action starts once its stage is free and
its inputs exist: F(s, j) after F(s - 1, j), B(s, j) after F(s, j) and B(s + 1, j). With the
cost model's per-stage times this is what `plan show --plot` draws, and the reference
tests/test_step_time.py holds CostModel.pipeline_step_s to. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from .memory import schedule_actions


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str            # "F" or "B"
    micro_batch: int
    start_s: float
    end_s: float


def schedule_timeline(schedule: str, fwd: list[float], bwd: list[float], m: int, v: int = 1) -> list[Action]:
    """Every action of one step, stage by stage (fwd[s], bwd[s]: stage s's time per
    micro-batch; v stages a rank, stage s on rank s % pp)."""
    n_stages = len(fwd)
    pp = n_stages // v
    orders = [[(kind, chunk * pp + r, j) for kind, chunk, j in schedule_actions(schedule, pp, r, m, v)] for r in range(pp)]
    done: dict[tuple[str, int, int], float] = {}
    clock, pos = [0.0] * pp, [0] * pp
    actions: list[Action] = []
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, s, j = orders[r][pos[r]]
                deps = ([("F", s - 1, j)] if s > 0 else []) if kind == "F" else \
                    [("F", s, j)] + ([("B", s + 1, j)] if s < n_stages - 1 else [])
                if not all(d in done for d in deps):
                    break
                start = max([clock[r]] + [done[d] for d in deps])
                clock[r] = start + (fwd[s] if kind == "F" else bwd[s])
                done[kind, s, j] = clock[r]
                actions.append(Action(s, kind, j, start, clock[r]))
                pos[r] += 1
                moved = True
        if not moved:
            raise ValueError(f"the {schedule} schedule deadlocked for {n_stages} stages and {m} micro-batches")
    return actions


def makespan(actions: list[Action]) -> float:
    return max(a.end_s for a in actions)
