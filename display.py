"""What the CLI prints: every table, readable at 80 columns.

Each table has a default set of columns that fits 80 columns at the sizes it can hold (a
405B model's layers, 8192 GPUs, 64 stages); `wide` (`--wide`, or a terminal of 160 columns
or more) adds the rest. Units are in the title, chosen per table so numbers stay short;
columns are separated by one space and text folds rather than being cut.
"""

from __future__ import annotations

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from planner.hardware import SIZE_UNITS, format_size, rank_noun

WIDE_COLUMNS = 160          # a terminal at least this wide shows every column


def is_wide(console: Console, wide: bool) -> bool:
    return wide or console.width >= WIDE_COLUMNS


def table(columns: list[str], left: tuple[str, ...] = ()) -> Table:
    """A borderless table: a rule under the header, one space between columns."""
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 0), pad_edge=False, show_edge=False)
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right", overflow="fold")
    return t


def titled(title: str, t: Table) -> Group:
    """The title as a line of its own above the table (wrapped at the terminal, not the table)."""
    return Group(Text(title, style="bold"), t)


# -- numbers -------------------------------------------------------------------------------

def size_unit(values) -> tuple[str, float]:
    """The unit up to GiB that keeps the largest of `values` at 1 or more (bytes below 1 KiB)."""
    top = max((abs(v) for v in values), default=0)
    for unit, scale in SIZE_UNITS[1:]:              # from GiB down
        if top >= scale:
            return unit, scale
    return "B", 1


def number(v: float) -> str:
    """A figure in at most about 6 characters: 3 significant digits, thousands separated."""
    if v == 0:
        return "0"
    if abs(v) < 0.01:
        return f"{v:.2g}"
    if abs(v) < 10:
        return f"{v:.2f}"
    if abs(v) < 100:
        return f"{v:.1f}"
    return f"{v:,.0f}"


def count(n: int) -> str:
    """A parameter count: 856.7M, 1.05B, 4,096."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= 10 * scale if suffix == "K" else n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:,}"


def seconds_unit(values) -> tuple[str, float]:
    top = max((abs(v) for v in values), default=0)
    return ("s", 1.0) if top >= 1 else ("ms", 1e-3) if top >= 1e-3 else ("us", 1e-6)


def ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"; "-" for none."""
    if not xs:
        return "-"
    parts, start, prev = [], xs[0], xs[0]
    for x in xs[1:] + [None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return ",".join(parts)


# -- the tables ------------------------------------------------------------------------------

def profile_table(prof, b: int, wide: bool) -> Group:
    layers = [(layer, layer.at(b)) for layer in prof.layers]
    loss = prof.loss.at(b)
    unit, scale = size_unit([x for layer, s in layers for x in (layer.param_bytes, layer.optimizer_state_bytes,
                                                                  s.saved_bytes)] + [loss.saved_bytes])
    t_unit, t_scale = seconds_unit([x for _, s in layers for x in (s.fwd_s, s.bwd_s)])
    cols = ["layer", "kind", "params", "weights", "grads", "optim", "saved"] \
        + (["ckpt keeps"] if wide else []) + ["fwd", "bwd"] + (["GFLOP"] if wide else [])
    title = (f"{prof.model.get('name') or prof.model['path']}: {prof.n_layers} layers, {prof.precision}, "
              f"{prof.optimizer}, {prof.method} on {prof.device}, micro-batch {b} ({unit}, {t_unit})")
    t = table(cols, left=("kind",))

    def row(label, kind, params, weights, grads, optim, s):
        cells = [label, kind, params, weights, grads, optim, number(s.saved_bytes / scale)]
        if wide:
            cells.append(number((s.input_bytes + s.ckpt_saved_bytes) / scale) if label != "loss" else "")
        cells += [number(s.fwd_s / t_scale), number(s.bwd_s / t_scale)]
        if wide:
            cells.append(number((s.fwd_flops + s.bwd_flops) / 1e9))
        t.add_row(*cells)

    for layer, s in layers:
        row(str(layer.index), layer.kind, count(layer.param_count), number(layer.param_bytes / scale),
            number(layer.grad_bytes / scale), number(layer.optimizer_state_bytes / scale), s)
    row("loss", "", "", "", "", "", loss)
    return titled(title, t)


def hardware_table(presets: dict, wide: bool) -> Group:
    cols = ["name", "memory", "usable", "bf16", "fp32", "HBM", "GPUs", "intra", "inter", "host"]
    title = ("hardware presets, per GPU (memory GiB; dense TFLOP/s; GB/s per direction: HBM, within a node, "
              "across nodes, host<->device)")
    t = table(cols, left=("name",))
    for name, h in presets.items():
        t.add_row(name, number(h.memory_bytes / 2**30), f"{h.usable_fraction:.2f}", number(h.bf16_flops / 1e12),
                  number(h.fp32_flops / 1e12), number(h.hbm_bandwidth / 1e9), str(h.gpus_per_node),
                  number(h.intra_node_bandwidth / 1e9), number(h.inter_node_bandwidth / 1e9),
                  number(h.host_to_device_bandwidth / 1e9))
    return titled(title, t)


def per_rank(device_type: str) -> str:
    """What one rank of a plan is, as a table's title says it."""
    return f"per {rank_noun(device_type)}"


def shows_mfu(device_type: str) -> bool:
    """MFU only on GPUs: on CPU processes the "peak" is a nominal figure of the preset (one
    thread's matmul rate), and a share of it means nothing to a user."""
    return device_type != "cpu"


def top_table(solutions, limit: int, wide: bool, device_type: str = "cuda") -> Group:
    unit, scale = size_unit([s.memory.peak for sol in solutions for s in sol.prediction.stages])
    mfu = shows_mfu(device_type)
    cols = ["#", "dp x tp x pp", "zero", "sched", "micro-batch", "ckpt", "off", "step s", "samples/s"] \
        + (["MFU"] if mfu else []) + ["peak"] + (["peak per stage"] if wide else [])
    title = (f"best layouts (peak memory in {unit}, within {format_size(limit)} {per_rank(device_type)}; ckpt, off: layers "
             "checkpointed (+ selectively), offloaded)")
    t = table(cols)
    for k, sol in enumerate(solutions):
        c, p = sol.candidate, sol.prediction
        full = sum(1 for st in sol.stages for _, x, _ in st if x == "full")
        sel = sum(1 for st in sol.stages for _, x, _ in st if x == "selective")
        ck = f"{full}" + (f"+{sel}" if sel else "")
        off = sum(1 for st in sol.stages for _, _, x in st if x)
        sched = "-" if c.pp == 1 else c.schedule + (f" v{c.virtual_stages}" if c.virtual_stages > 1 else "")
        cells = [str(k + 1), f"{c.dp}x{c.tp}{' sp' if c.sequence_parallel else ''}x{c.pp}", str(c.zero), sched,
                 f"{c.micro_batch_size} x {c.num_micro_batches}", ck, str(off), f"{p.step_s:.4g}",
                 number(p.samples_per_s)] + ([f"{100 * p.mfu:.1f}%"] if mfu else []) + [number(p.peak_bytes / scale)]
        if wide:
            cells.append(" / ".join(number(s.memory.peak / scale) for s in p.stages))
        t.add_row(*cells)
    return titled(title, t)


def plan_table(plan, wide: bool) -> Group:
    pred = plan.predicted
    rows = list(zip(plan.stages, pred.stages if pred else []))
    unit, scale = size_unit([ps.peak_bytes for _, ps in rows])
    cols = ["stage", "layers", "ckpt", "offload", "weights", "grads", "optim", "activ", "buffers", "peak"] \
        + (["peak during"] if wide else [])
    v = plan.virtual_stages
    interleaved = (f", {plan.schedule.replace('_', ' ')}: {v} stages a rank (stage s on pp rank s mod {plan.pp}; memory is the rank's)"
                   if v > 1 else "")
    title = (f"plan: dp {plan.dp} x tp {plan.tp}{' (sequence-parallel)' if plan.sequence_parallel else ''} x pp {plan.pp}, ZeRO {plan.zero}, micro-batch "
              f"{plan.micro_batch_size} x {plan.num_micro_batches}, global batch {plan.global_batch}{interleaved} "
              f"({unit} {per_rank(plan.device_type)}; ckpt, offload: which layers; s: selectively checkpointed)")
    t = table(cols, left=("layers", "ckpt", "offload", "peak during"))
    for st, ps in rows:
        idx = [lc.index for lc in st.layers]
        cells = [str(st.index), f"{idx[0]}-{idx[-1]}", checkpoint_cell(st.layers),
                 ranges([lc.index for lc in st.layers if lc.offload])] + \
            [number(v / scale) for v in (ps.weights_bytes, ps.grads_bytes, ps.optimizer_bytes, ps.activations_bytes,
                                         ps.buffers_bytes, ps.peak_bytes)]
        if wide:
            cells.append(ps.peak_phase)
        t.add_row(*cells)
    return titled(title, t)


def checkpoint_cell(layers) -> str:
    """The stage's checkpointed layers: fully, then selectively ("s")."""
    full = [lc.index for lc in layers if lc.checkpoint == "full"]
    sel = [lc.index for lc in layers if lc.checkpoint == "selective"]
    parts = ([ranges(full)] if full else []) + ([f"s {ranges(sel)}"] if sel else [])
    return " ".join(parts) or "-"


def memory_check_table(rows, title: str, tolerance: float) -> tuple[Group, float]:
    """Predicted vs measured peak per stage, and on CUDA what the allocator reserved beside it;
    returns the table and the worst error (percent)."""
    reserved = any(r.reserved for r in rows)
    unit, scale = size_unit([x for r in rows for x in (r.predicted, r.measured, r.reserved)])
    title = f"{title} (peak memory, {unit})"
    t = table(["stage", "ranks", "predicted", "measured", "error"] + (["reserved"] if reserved else []), left=("ranks",))
    worst = 0.0
    for r in rows:
        worst = max(worst, abs(r.error_pct))
        colour = "green" if abs(r.error_pct) <= min(1.0, tolerance) else ("yellow" if abs(r.error_pct) <= tolerance else "red")
        t.add_row(str(r.stage), ranges(list(r.ranks)), number(r.predicted / scale), number(r.measured / scale),
                  f"[{colour}]{r.error_pct:+.2f}%[/]", *([number(r.reserved / scale)] if reserved else []))
    return titled(title, t), worst


def time_check_table(rows, rank: int, step: tuple[float, float] | None = None) -> Group:
    """Predicted vs measured time per component; `step`: (predicted step, the profiled step's
    wall time), a last row that says what the parts add up to on each side."""
    title = (f"step time by component (ms): predicted vs rank {rank}'s profiled step")
    t = table(["component", "predicted", "measured"], left=("component",))
    for r in rows:
        t.add_row(r.component, f"{r.predicted * 1e3:.1f}", f"{r.measured * 1e3:.1f}")
    if step:
        t.add_row("step", f"{step[0] * 1e3:.1f}", f"{step[1] * 1e3:.1f}")
    return titled(title, t)


def profiled_step_line(profiled_s: float, median_s: float, profiled: int = 1) -> str:
    """How far the profiled step (torch.profiler on; of `profiled`, the one of median wall time)
    is from the same rank's timed steps."""
    which = f"The profiled step of median time (of {profiled})" if profiled > 1 else "The profiled step"
    ratio = profiled_s / median_s
    if abs(ratio - 1) <= 0.05:
        return f"{which} took {profiled_s:.4f} s, within 5% of that rank's median timed step."
    return (f"{which} took {profiled_s:.4f} s, {ratio:.2f}x that rank's median timed step "
            f"({median_s:.4f} s): its parts carry torch.profiler's overhead and this machine's noise.")


def cores_busy_line(run) -> str | None:
    """On CPU processes: how many cores the ranks kept busy in a step (RunReport.cores_busy),
    of how many the machine has; None on GPUs and for runs that did not record it."""
    busy = run.cores_busy
    if run.device != "cpu" or busy is None:
        return None
    of = f" of the {run.host_cpus} this machine has" if run.host_cpus else ""
    full = " (bound by the cores)" if run.host_cpus and busy >= 0.85 * run.host_cpus else ""
    return f"CPU: the ranks kept {busy:.2f} cores busy over a step{of}{full}: their processes' CPU time / the step's."


def run_summary(run) -> str:
    """One line: what ran, the loss from first to last step, the throughput (and MFU on GPUs)."""
    rate = f"{run.tokens_per_s:,.0f} tokens/s" if run.tokens_per_sample else f"{run.samples_per_s:,.1f} samples/s"
    mfu = f", MFU {100 * run.mfu:.1f}%" if run.mfu and shows_mfu(run.device) else ""
    if not run.global_batch:              # a run document from before throughput was recorded
        rate, mfu = "", ""
    return (f"{run.plan_path}: {run.steps} steps on {run.world_size} x {run.device}, "
            f"loss {run.losses[0]:.4f} -> {run.losses[-1]:.4f}" + (f", {rate}{mfu}" if rate else ""))


def run_table(run) -> Group:
    unit, scale = size_unit([r.peak_bytes for r in run.ranks])
    steps = f"steps {run.first_step + 1}-{run.first_step + run.steps}" if run.first_step else f"{run.steps} steps"
    title = (f"run of {run.plan_path}: {run.world_size} ranks, {steps} (peak {unit}, median step s)")
    t = table(["rank", "pp", "dp", "tp", "peak", "step s"])
    for r in run.ranks:
        t.add_row(str(r.rank), str(r.pp_rank), str(r.dp_rank), str(r.tp_rank), number(r.peak_bytes / scale),
                  f"{r.median_step_s:.4f}")
    return titled(title, t)
