"""Pictures of a plan and of a run against it (matplotlib, written as PNG files).

`plan show plan.json --plot FILE`: each pipeline stage's predicted memory by category against
the memory limit, and the predicted timeline of one step (forward, recompute, backward and
communication per stage and micro-batch, then the once-per-step work).
`plan verify plan.json run.json --plot FILE`: predicted beside measured, per stage (peak
memory) and per time component.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import display
from planner.hardware import format_size
from planner.timeline import schedule_timeline

CATEGORIES = (("weights", "weights_bytes", "#4c72b0"), ("gradients", "grads_bytes", "#55a868"),
              ("optimizer", "optimizer_bytes", "#c44e52"), ("activations", "activations_bytes", "#dd8452"),
              ("buffers", "buffers_bytes", "#8172b3"))
PHASES = {"forward": "#4c72b0", "recompute": "#dd8452", "backward": "#55a868", "communication": "#999999",
          "once per step": "#8172b3"}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")            # files only: no display needed
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> None:
    """Write the PNG beside its final name, then rename: a failure leaves no half-written file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def stage_phases(stage) -> tuple[float, float, dict[str, float]]:
    """(forward, backward) time per micro-batch of a predicted stage, communication split
    evenly between them, and the parts drawn."""
    p = stage.parts_s
    compute = p.get("compute", stage.micro_batch_s)
    comm = max(0.0, stage.micro_batch_s - compute)
    forward = p.get("forward", compute / 3)
    recompute = p.get("recompute", 0.0)
    backward = p.get("backward", compute - forward - recompute)
    return forward + comm / 2, recompute + backward + comm / 2, \
        {"forward": forward, "recompute": recompute, "backward": backward, "communication": comm / 2}


def plot_plan(plan, path: Path) -> None:
    plt = _pyplot()
    pred = plan.predicted
    stages = pred.stages
    fig, (mem_ax, time_ax) = plt.subplots(2, 1, figsize=(11, 4 + 0.25 * plan.pp),
                                          gridspec_kw={"height_ratios": [1, max(1, plan.pp / 8)]})
    fig.suptitle(f"plan: dp {plan.dp} x tp {plan.tp} x pp {plan.pp}, ZeRO {plan.zero}, "
                 f"micro-batch {plan.micro_batch_size} x {plan.num_micro_batches} ({plan.schedule}"
                 + (f", {plan.virtual_stages} stages a rank)" if plan.virtual_stages > 1 else ")"))

    # Memory: a stacked bar per pipeline rank, the limit as a line (when it is on the same scale).
    # (With several stages a rank, each stage carries its rank's memory: one bar a rank.)
    where = "pipeline stage" if plan.virtual_stages == 1 else "pipeline rank"
    ranks = stages[:plan.pp]
    xs = [s.index for s in ranks]
    top = max(s.peak_bytes for s in ranks)
    unit, scale = display.size_unit([top])
    bottom = [0.0] * len(ranks)
    for label, field, colour in CATEGORIES:
        heights = [getattr(s, field) / scale for s in ranks]
        mem_ax.bar(xs, heights, bottom=bottom, label=label, color=colour, width=0.7)
        bottom = [b + h for b, h in zip(bottom, heights)]
    mem_ax.scatter(xs, [s.peak_bytes / scale for s in ranks], marker="_", s=300, color="black", label="peak", zorder=3)
    limit = plan.memory_limit_bytes
    if limit and limit <= 3 * top:
        mem_ax.axhline(limit / scale, color="red", linestyle="--", label="memory limit")
    mem_ax.set_xlabel(where)
    mem_ax.set_ylabel(f"{unit} per GPU at its peak")
    mem_ax.set_xticks(xs)
    mem_ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small")
    off_scale = f"; the limit, {format_size(limit)}, is off the scale" if limit and limit > 3 * top else ""
    mem_ax.set_title(f"predicted memory by category (at each stage's peak{off_scale})", fontsize="medium")

    # Timeline: every action of one step, then the once-per-step work.
    phases = [stage_phases(s) for s in stages]
    schedule = plan.schedule if plan.pp > 1 else "1f1b"
    actions = schedule_timeline(schedule, [f for f, _, _ in phases], [b for _, b, _ in phases], plan.num_micro_batches,
                               plan.virtual_stages)
    spans: dict[tuple[int, str], list[tuple[float, float]]] = {}    # (rank, phase) -> (start, length)
    ends: dict[int, float] = {}
    for a in actions:
        parts = phases[a.stage][2]
        order = ("forward", "communication") if a.kind == "F" else ("recompute", "backward", "communication")
        t = a.start_s
        row = a.stage % plan.pp
        for name in order:
            if parts[name] > 0:
                spans.setdefault((row, name), []).append((t, parts[name]))
                t += parts[name]
        ends[row] = max(ends.get(row, 0.0), a.end_s)
    for row in range(plan.pp):
        once = sum(s.step_extra_s for s in stages[row::plan.pp])
        if once > 0:
            spans[row, "once per step"] = [(ends[row], once)]
    thin = len(actions) > 400          # many micro-batches: no outlines, or they hide the bars
    for (stage, name), bars in spans.items():
        time_ax.broken_barh(bars, (stage - 0.4, 0.8), color=PHASES[name],
                            edgecolor="none" if thin else "white", linewidth=0.3)
    from matplotlib.patches import Patch
    time_ax.invert_yaxis()
    time_ax.set_yticks(xs)
    time_ax.set_ylabel(where)
    time_ax.set_xlabel("seconds into the step")
    time_ax.legend(handles=[Patch(color=c, label=n) for n, c in PHASES.items()], loc="upper left",
                   bbox_to_anchor=(1.01, 1), fontsize="small")
    time_ax.set_title(f"predicted timeline of one step ({pred.step_time_s:.3g} s; communication drawn after "
                      "each action)", fontsize="medium")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_verify(plan, rows, time_rows, path: Path) -> None:
    plt = _pyplot()
    panels = 2 if time_rows else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    mem_ax = axes[0][0]
    xs = list(range(len(rows)))
    unit, scale = display.size_unit([x for r in rows for x in (r.predicted, r.measured)])
    mem_ax.bar([x - 0.2 for x in xs], [r.predicted / scale for r in rows], width=0.4, label="predicted", color="#4c72b0")
    mem_ax.bar([x + 0.2 for x in xs], [r.measured / scale for r in rows], width=0.4, label="measured", color="#dd8452")
    mem_ax.set_xticks(xs, [str(r.stage) for r in rows])
    mem_ax.set_xlabel("pipeline stage")
    mem_ax.set_ylabel(f"peak {unit} per GPU")
    mem_ax.set_title("peak memory", fontsize="medium")
    mem_ax.legend(fontsize="small")
    if time_rows:
        ax = axes[0][1]
        ys = list(range(len(time_rows)))
        ax.barh([y - 0.2 for y in ys], [r.predicted * 1e3 for r in time_rows], height=0.4, label="predicted", color="#4c72b0")
        ax.barh([y + 0.2 for y in ys], [r.measured * 1e3 for r in time_rows], height=0.4, label="measured", color="#dd8452")
        ax.set_yticks(ys, [r.component for r in time_rows])
        ax.invert_yaxis()
        ax.set_xlabel("ms per step")
        ax.set_title("step time by component", fontsize="medium")
        ax.legend(fontsize="small")
    fig.suptitle(f"predicted vs measured: dp {plan.dp} x tp {plan.tp} x pp {plan.pp}")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
