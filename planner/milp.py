"""The MILP that lays layers out for one candidate: stage boundaries, checkpointing, offload.

For a fixed `Candidate` (degrees, micro-batching, ZeRO, schedule) this chooses, to minimise
the predicted step time within every stage's memory limit:
  - contiguous pipeline stages (where the boundaries fall),
  - which layers are checkpointed,
  - which layers are offloaded to the host.

Identical layers share variables. The model is cut into *runs* of consecutive identical
layers (a GPT: embedding, N blocks, head). For each run r, stage s and choice c (a
checkpoint / offload combination) one integer variable counts the run's layers in that
stage with that choice; inside a stage a run's layers appear in a fixed order of choices
(fully checkpointed first, then selective, then none: the larger a layer's recompute spike,
the earlier, where it meets the least kept activation memory).
So the problem's size depends on the number of runs and stages, not on depth.

Memory is exact for this layout space, and written once, in `planner/memory.py`: a layer's
records (`forward_records`, `backward_records`) read its `Position` in the stage, and what the
rank holds besides (`held_at`, `final_reduction_record`) reads each stage's `StageBytes`. The
walk evaluates them on numbers, layer by layer; this MILP on linear expressions of the layer
counts. Within a homogeneous segment (same run, same choice) every record is affine in the
position, so its maximum is at the segment's first or last layer (or its second and
penultimate where a neighbour's FSDP2 buffer differs from the segment's own); the MILP
writes the records there, each gated by whether the segment has one, two or three layers.
What the MILP adds is how to evaluate a Position over segments: prefix sums of the segments
before, and chains of variables for the neighbours (`kp`: the layer before a segment keeps
its output, so a tensor two neighbouring layers keep is counted once; the FSDP2 flat buffers
of the layers before and after).

Under a multi-stage schedule (interleaved 1F1B, looped BFS) a pp rank runs v stages: its memory rows add the rank's other
stages at each moment the walk can peak (memory.peak_moments).

Time: every rank's time per micro-batch (its stages' together) is at most `tau`; the step is
CostModel.pipeline_step_s of the stages' times per micro-batch, `tau`, and the fullest
rank's once-per-step work `omega`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
import warnings
from dataclasses import dataclass
from itertools import product
from types import SimpleNamespace

from . import lp

from .cost import Candidate, CostModel, must_offload
from .memory import (Moment, Position, Record, StageBytes, backward_records, final_reduction_record, forward_records, held_at,
                     holds_sends, peak_moments, pipeline_buffers, schedule_actions)
from .plan import Placed, checkpoint_mode

GAP_REL = 1e-9          # solve to optimality: the solvers' default gaps would accept 0.01% worse layouts
CUTOFF_SLACK = 1e-6        # a cutoff keeps layouts this much above it (exact ties stay)
LOWER_BOUND_SLACK = 1e-12   # a proven bound enters as a row this much below it (rounding between two MILPs' sums)
MS = 1e3                # time rows in milliseconds, memory rows as a fraction of the limit: keeps
                        # coefficients near 1, without which CBC's cuts can cut off the optimum


def beyond(step_s: float, cutoff: float | None) -> bool:
    """Whether a step time cannot enter the top K under `cutoff` (None: no cutoff yet): over
    it by more than CUTOFF_SLACK, so that exact ties stay."""
    return cutoff is not None and step_s > cutoff * (1 + CUTOFF_SLACK)


@dataclass(frozen=True)
class Choice:
    checkpoint: str          # planner.plan.CHECKPOINT_MODES
    offload: bool

    def tag(self) -> str:
        return {"none": "pl", "selective": "sel", "full": "ck"}[self.checkpoint] + ("_off" if self.offload else "")


def runs_of(signatures: list[str]) -> list[tuple[int, int]]:
    """(first layer, length) of each run of consecutive layers with equal signatures."""
    runs: list[tuple[int, int]] = []
    for i, sig in enumerate(signatures):
        if runs and signatures[runs[-1][0]] == sig:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


@dataclass
class Layout:
    """The MILP's answer: per stage, (layer, checkpoint, offload) in order; or why not."""

    status: str                                   # "optimal" | "infeasible" | "cut off" | "time limit" | "skipped" (search: not asked) | solver status
    stages: list[list[Placed]] | None
    objective: float | None


def add_memory_row(prob: lp.Model, live, limit: int | None, gate, name: str) -> None:
    """live <= limit, enforced only when `gate` (a binary) is 1; scaled by the limit.

    The big-M is the tightest one the variables' bounds allow, so the relaxation stays tight.
    No limit, no row.
    """
    if limit is None:
        return
    if gate is None:
        prob += live * (1 / limit) <= 1, name
        return
    slack = max(0.0, prob.upper_bound(live) - limit)
    prob += live * (1 / limit) <= 1 + slack / limit * (1 - gate), name


def add_bytes_variable(prob: lp.Model, name: str, most: int, limit: int) -> lp.Lin:
    """A byte count the solver chooses (0..most), as an expression in bytes.

    The variable itself is a fraction of the memory limit: memory rows are scaled by 1/limit,
    and HiGHS drops matrix entries below 1e-9 (its small_matrix_value), so a variable counted
    in bytes would silently vanish from the rows of a GPU-sized limit (1/80e9 ~ 1e-11).
    """
    return prob.add_variable(name, 0, most / limit) * limit


def add_bytes_bound(prob: lp.Model, lhs, rhs, limit: int, name: str) -> None:
    """lhs >= rhs for byte expressions, scaled by the limit like the memory rows."""
    prob += (lhs - rhs) * (1 / limit) >= 0, name


def solve_layout(model: CostModel, cand: Candidate, choices: list[Choice], solver: str = "highs",
                 time_limit: float | None = None, fixed: list[list[Placed]] | None = None,
                 memory: bool = True, cutoff: float | None = None, lower_bound: float | None = None,
                 run_choices: list[list[Choice]] | None = None, stage_sizes: list[int] | None = None) -> Layout:
    """Solve the layout MILP for one candidate (`fixed`: only this layout, to check it;
    `memory=False`: with no memory limit, the fastest layout there is; `cutoff`: only a layout
    of at most this step time, else status "cut off"; `lower_bound`: a step time no layout of
    this candidate beats, as a row; `run_choices`: per run, the part of `choices` open to its
    layers, where the others are proven not to be needed; `stage_sizes`: how many layers each
    stage holds, for planner.partition)."""
    prof = model.profile
    runs = runs_of([l.signature for l in prof.layers])
    R, S = len(runs), cand.n_stages
    pp, v = cand.pp, cand.virtual_stages            # stage s runs on pp rank s % pp, as its chunk s // pp
    open_to = run_choices if run_choices is not None else [choices] * R    # open_to[r]: run r's choices
    m = cand.num_micro_batches
    limit = model.memory_limit if memory else None
    prob = lp.Model(f"layout_{cand.describe().replace(' ', '_')}")

    # -- variables -----------------------------------------------------------------------
    # L[r,s,c]: layers of run r in stage s with choice c.
    n = prof.n_layers

    # -- layer costs per (run, choice); every layer of a run costs the same -----------------
    cost = {(r, c): model.layer(cand, runs[r][0], c.checkpoint, c.offload) for r in range(R) for c in open_to[r]}
    loss = model.loss(cand)
    fastest_in_run = [min(cost[r, c].micro_batch_s for c in open_to[r]) for r in range(R)]

    # Under a cutoff, no rank of a layout that meets it is slower per micro-batch than
    # tau_most: the step is at least every layer's fastest time, the loss and every stage's
    # pipeline overhead once (over v), plus m - 1/v times the slowest rank (CostModel.pipeline_step_s).
    # So no stage holds more of a run than tau_most over the run's fastest layer allows. As
    # bounds on the variables these shrink every big-M the rows derive from them.
    tau_most = None
    if cutoff is not None and m - 1 / v > 0:
        overheads = sum(model.time_terms(cand, 0.0, 0.0, 0, (s > 0) + (s < S - 1), 0.0, 0.0, 0.0).per_micro_batch
                        for s in range(S)) if S > 1 else 0.0     # every stage's, with nothing sent
        least = sum(length * t for (_, length), t in zip(runs, fastest_in_run)) + loss.micro_batch_s + overheads
        tau_most = (cutoff * (1 + CUTOFF_SLACK) - least / v) / (m - 1 / v)

    def most(r: int, s: int) -> int:
        """How many of run r's layers stage s can hold: layer i fits stage s only if the s
        stages before it and the S - 1 - s after it can each get a layer; and, under a
        cutoff, only as many as tau_most allows."""
        start, length = runs[r]
        lo, hi = max(start, s), min(start + length - 1, n - S + s)
        if stage_sizes is not None:              # pinned: exactly the layers from its first
            first = sum(stage_sizes[:s])
            lo, hi = max(start, first), min(start + length - 1, first + stage_sizes[s] - 1)
        count = max(0, hi - lo + 1)
        if tau_most is not None and fastest_in_run[r] > 0:
            count = min(count, max(0, math.floor(tau_most / fastest_in_run[r] * (1 + 1e-9))))
        return count

    # Only where stage s can hold some of run r: a GPT's embedding fits stage 0 alone, its head
    # the last stage, so a middle stage's rows describe its blocks only (a 64-stage Llama
    # 405B: a third of the rows, and its cut rows' floors taken over the layers it can hold).
    # Not under a multi-stage schedule: on a Llama 70B with 5 stages a rank (dp32 tp4 pp4, ZeRO
    # 0) HiGHS 1.16 ran past 5 minutes of a 20 s time limit on the smaller model.
    L = {(r, s, c): prob.add_variable(f"L_r{r}_s{s}_{c.tag()}", 0, most(r, s), cat="Integer")
         for r in range(R) for s in range(S) if most(r, s) > 0 or v > 1 for c in open_to[r]}
    segs = {s: [(r, c) for r in range(R) for c in open_to[r] if (r, s, c) in L] for s in range(S)}  # stage s's segments, in order
    if not all(segs.values()) or any(not any((r, s, c) in L for s in range(S) for c in open_to[r]) for r in range(R)):
        return Layout("cut off" if tau_most is not None else "infeasible", None, None)   # a stage or a run has nowhere to go
    # e: the segment (r, s, c) has a layer; f: it has two or more (memory rows only).
    gates = L if memory else {}
    e = {k: prob.add_variable(f"e_{v.name[2:]}", cat="Binary") for k, v in gates.items()}
    f = {k: prob.add_variable(f"f_{v.name[2:]}", cat="Binary") for k, v in gates.items()}
    # full[r,s]: stages 0..s hold all of run r; started[r,s]: they hold some of it.
    full = {(r, s): prob.add_variable(f"full_r{r}_s{s}", cat="Binary") for r in range(R) for s in range(S)}
    started = {(r, s): prob.add_variable(f"started_r{r}_s{s}", cat="Binary") for r in range(R) for s in range(S)}
    # first[r,s]: stage s starts inside run r (defined for s >= 1, linear in `full`).
    # kp[r,s,c]: the layer before segment (r,s,c) keeps its output; E[r,s,c]: after the
    # segment, the last layer so far keeps its output. Upper-bounded by the truth; they only
    # lower memory, so the solver sets them to it whenever memory binds.
    kp = {k: prob.add_variable(f"kp_{v.name[2:]}", 0, 1) for k, v in gates.items()}
    E = {k: prob.add_variable(f"E_{v.name[2:]}", 0, 1) for k, v in gates.items()}
    tau = prob.add_variable("tau", 0)            # slowest rank's time per micro-batch (ms): its stages together
    omega = prob.add_variable("omega", 0)        # slowest rank's once-per-step work (ms)
    exposed = {s: prob.add_variable(f"exposed_sync_s{s}", 0) for s in range(S)}  # gradient all-reduce not hidden by backward (ms)

    stage_times = {}                             # each stage's time per micro-batch (ms), built below

    # -- every layer in exactly one stage, stages contiguous and non-empty -----------------
    for r, (start, length) in enumerate(runs):
        prob += lp.lin_sum(L[r, s, c] for s in range(S) for c in open_to[r] if (r, s, c) in L) == length, f"run{r}_all_layers_placed"
        for s in range(S):
            cum = lp.lin_sum(L[r, t, c] for t in range(s + 1) for c in open_to[r] if (r, t, c) in L)
            prob += cum >= length * full[r, s], f"full_r{r}_s{s}_means_all"
            prob += full[r, s] >= cum - (length - 1), f"full_r{r}_s{s}_when_all"
            prob += cum <= length * started[r, s], f"started_r{r}_s{s}_when_any"
            prob += started[r, s] <= cum, f"started_r{r}_s{s}_means_any"
            if r + 1 < R:
                prob += started[r + 1, s] <= full[r, s], f"prefix_r{r}_s{s}"
    for s in range(S):
        prob += lp.lin_sum(L[r, s, c] for r, c in segs[s]) >= 1, f"stage{s}_not_empty"
    if must_offload(cand, prof.precision):
        prob += lp.lin_sum(v for (r, s, c), v in L.items() if c.offload) >= 1, "fsdp_only_to_offload"
    for k in gates:
        most_k = L[k].hi                           # the most layers the segment can hold
        prob += L[k] >= e[k], f"e_{L[k].name[2:]}_lo"
        prob += L[k] <= most_k * e[k], f"e_{L[k].name[2:]}_hi"
        prob += L[k] >= 2 * f[k], f"f_{L[k].name[2:]}_lo"
        prob += L[k] <= 1 + max(0, most_k - 1) * f[k], f"f_{L[k].name[2:]}_hi"

    def first_in(r: int, s: int):
        """1 if stage s (s >= 1) starts inside run r."""
        before = 1 if r == 0 else full[r - 1, s - 1]
        return before - full[r, s - 1]

    run_input = [model.sample(start, cand).input_bytes for start, _ in runs]

    # The activation a stage receives, and the one it sends (its last layer's output).
    stage_in = {s: lp.lin_sum(first_in(r, s) * run_input[r] for r in range(R)) if s > 0 else 0 for s in range(S)}
    stage_out = {s: (lp.lin_sum(first_in(r, s + 1) * run_input[r] for r in range(R)) if s < S - 1
                     else model.sample(n - 1, cand).output_bytes) for s in range(S)}
    sums: dict = {}                     # stage -> its byte sums (stage_sums), made when first needed
    sends_held = holds_sends(cand.schedule)

    def stage_sums(s: int) -> SimpleNamespace:
        """Stage s's byte sums over its layers (with the rows that define its keeps-output chain)."""
        if s in sums:
            return sums[s]
        nonlocal prob                   # `prob += row` rebinds the name
        last_stage = s == S - 1
        seg = segs[s]
        mem = {k: cost[k].memory for k in seg}

        # "Keeps output" chain: E after each segment, kp before it.
        prev_E = 1                                               # the stage input is held by the caller
        for (r, c) in seg:
            k = (r, s, c)
            ko = 1 if mem[r, c].keeps_output else 0
            prob += kp[k] <= prev_E, f"kp_{L[k].name[2:]}_chain"
            prob += kp[k] <= e[k], f"kp_{L[k].name[2:]}_exists"
            prob += E[k] <= ko + (1 - e[k]), f"E_{L[k].name[2:]}_own"
            prob += E[k] <= prev_E + e[k], f"E_{L[k].name[2:]}_pass"
            prev_E = E[k]

        # The tensors a pipeline stage receives and sends (memory.pipeline_buffers).
        recv_buffers, pmb, after_backward, sent = 0, 0, 0, 0
        if S > 1:
            recv_buffers, pmb, after_backward, sent = pipeline_buffers(m, stage_in[s], stage_out[s], s == 0, last_stage,
                                                                       sends_held)

        # What each segment keeps for backward in one micro-batch, and its prefix sums.
        def seg_total(r, c):
            k, lm = (r, s, c), mem[r, c]
            a_in = lm.own + (lm.output if lm.keeps_output else 0) + (lm.input if (lm.keeps_input and not lm.keeps_output) else 0)
            ki = 1 if lm.keeps_input else 0
            ko = 1 if lm.keeps_output else 0
            # a_first - a_in = in * ki * (ko - kp): the first layer counts its input unless the layer before keeps it.
            return a_in * L[k] + lm.input * ki * ko * e[k] - lm.input * ki * kp[k], a_in

        totals = {k: seg_total(*k) for k in seg}
        # The loss, on the last stage, after all segments.
        loss_add, loss_kp = 0, 0
        if last_stage:
            lm = loss.memory
            loss_kp = prev_E
            loss_add = lm.own + (lm.output if lm.keeps_output else 0) + (lm.input * (1 - loss_kp) if lm.keeps_input else 0)
        per_mb = pmb + lp.lin_sum(t for t, _ in totals.values()) + loss_add

        weights = lp.lin_sum(mem[r, c].weights * L[r, s, c] for r, c in seg)
        optim = lp.lin_sum(mem[r, c].optim * L[r, s, c] for r, c in seg)
        grads_all = lp.lin_sum(mem[r, c].grads * L[r, s, c] for r, c in seg)
        bufs = lp.lin_sum(mem[r, c].buffers * L[r, s, c] for r, c in seg)
        kept_unsharded = lp.lin_sum(mem[r, c].kept_unsharded * L[r, s, c] for r, c in seg)
        step_grads = lp.lin_sum((mem[r, c].grads if mem[r, c].step_grads is None else mem[r, c].step_grads) * L[r, s, c]
                                for r, c in seg)
        static_batch = model.batch_bytes(cand, s == 0, last_stage)
        static = weights + optim + bufs + static_batch + recv_buffers
        # Unsharded copies FSDP2 keeps from forward to backward: all of them under pipelining,
        # else those of the layers up to the current one (`through` below).
        resharded = S == 1
        compute_static = static + (0 if resharded else kept_unsharded)
        uab_all = lp.lin_sum(mem[q].unsharded_after_backward * L[q[0], s, q[1]] for q in seg)
        sums[s] = SimpleNamespace(      # the stage's totals (what the rank's records read), and the MILP's own
            bytes=StageBytes(static=static, grads=grads_all, step_grads=step_grads, kept_unsharded=kept_unsharded,
                             left_after_backward=uab_all, per_micro_batch=per_mb, after_backward=after_backward, sent=sent),
            last_stage=last_stage, mem=mem, totals=totals, pmb=pmb, compute_static=compute_static,
            loss_add=loss_add, loss_kp=loss_kp, resharded=resharded)
        return sums[s]

    def add_stage_memory_rows(s: int) -> None:
        """The memory rows of stage s: every record of memory.walk_rank that can be its rank's
        peak while s runs, at the moments that can peak (memory.peak_moments)."""
        nonlocal prob                   # `prob += row` rebinds the name
        rank, chunk = s % pp, s // pp
        mine = [stage_sums(t) for t in range(rank, S, pp)]          # the rank's stages, this one at `chunk`
        x = mine[chunk]
        seg = segs[s]
        last_stage, mem, totals, pmb = x.last_stage, x.mem, x.totals, x.pmb
        static, grads_all, kept_unsharded, uab_all = x.bytes.static, x.bytes.grads, x.bytes.kept_unsharded, x.bytes.left_after_backward
        compute_static, loss_add, loss_kp, resharded = x.compute_static, x.loss_add, x.loss_kp, x.resharded
        rest = [y for j, y in enumerate(mine) if j != chunk]
        moments = peak_moments(schedule_actions(cand.schedule, pp, rank, m, v), v, sends_held)

        def held(mo: Moment):
            """What the rank holds at this moment besides this stage's static bytes and records
            (memory.held_at), with its other stages' static bytes."""
            h = held_at(mo, [y.bytes for y in mine], resharded)
            return lp.lin_sum([y.bytes.static for y in rest] + [h.grads, h.activations, h.buffers])

        def classes(kind: str) -> list:
            """Per class of this stage's moments (its own gradients absent, present): the rows'
            tag, the class, and what the rank holds at them (held). One moment (always so for
            one stage a rank): written out; several: one variable at least each moment's."""
            out = []
            for own in (False, True):
                alike = [mo for mo in moments if mo.chunk == chunk and mo.kind == kind and mo.grads_here == own]
                if not alike:
                    continue
                tag = f"{kind.lower()}{int(own)}"
                if len(alike) == 1:
                    out.append((tag, own, held(alike[0])))
                    continue
                terms = [held(mo) for mo in alike]
                worst = add_bytes_variable(prob, f"moments_s{s}_{tag}", max(prob.upper_bound(t) for t in terms), limit)
                for k, term in enumerate(terms):
                    add_bytes_bound(prob, worst, term, limit, f"moments_s{s}_{tag}_{k}")
                out.append((tag, own, worst))
            return out

        fwd, bwd = classes("F"), classes("B")
        rank_bytes = {tag: static + moment_bytes for tag, _, moment_bytes in fwd + bwd}   # static and held, per class

        def add_record_row(record: Record, tag: str, gate, name: str) -> None:
            """One of memory's records at a class of moments, within the limit where `gate` (its layer exists)."""
            add_memory_row(prob, lp.lin_sum((rank_bytes[tag], record.grads, record.activations, record.buffers)),
                           limit, gate, name)
        if chunk == 0:                  # one row for the rank
            add_memory_row(prob, lp.lin_sum(y.bytes.static + y.bytes.step_grads for y in mine), limit, None,
                           f"mem_s{s}_optimizer_step")
        if any(mem[q].step_grads is not None for q in seg):
            # Pipelining reduces the accumulated unsharded gradients at the step's end
            # (memory.final_reduction_record), its largest flat buffer the highest of this stage's.
            biggest = add_bytes_variable(prob, f"final_reduce_s{s}", max(mem[q].final_reduce_flat for q in seg), limit)
            for (r, c) in seg:
                add_bytes_bound(prob, biggest, mem[r, c].final_reduce_flat * e[r, s, c], limit, f"final_reduce_{L[r, s, c].name[2:]}")
            final = final_reduction_record([y.bytes for y in mine], biggest, m)
            add_memory_row(prob, lp.lin_sum([y.bytes.static for y in mine] + [final.grads, final.activations, final.buffers]),
                           limit, None, f"mem_s{s}_final_reduce")

        # FSDP2 buffers of neighbouring layers (memory.walk_rank): chains over the stage's
        # segments give the all-gather buffer of the layer before a segment (forward, and
        # backward when it gathers again) and the reduce-scatter buffer of the layer after it.
        # Each is bounded below by the truth and only adds memory, so it takes the truth.
        fsdp = any(mem[q].gather_flat or mem[q].reduce_flat or mem[q].unsharded or mem[q].kept_unsharded
                   or mem[q].unsharded_after_backward for q in seg)
        before_flat, before_bflat, after_rs = {}, {}, {}
        if fsdp:
            fl_max = max(mem[q].gather_flat for q in seg)
            rs_max = max(mem[q].reduce_flat for q in seg)
            prev_a = prev_b = 0
            for (r, c) in seg:
                k, lm = (r, s, c), mem[r, c]
                before_flat[r, c], before_bflat[r, c] = prev_a, prev_b
                a = add_bytes_variable(prob, f"flat_after_{L[k].name[2:]}", fl_max, limit)
                b = add_bytes_variable(prob, f"bflat_after_{L[k].name[2:]}", fl_max, limit)
                add_bytes_bound(prob, a, lm.gather_flat * e[k], limit, f"flat_after_{L[k].name[2:]}_own")
                add_bytes_bound(prob, a, prev_a - fl_max * e[k], limit, f"flat_after_{L[k].name[2:]}_pass")
                bf = lm.gather_flat if lm.gathers_in_backward else 0
                add_bytes_bound(prob, b, bf * e[k], limit, f"bflat_after_{L[k].name[2:]}_own")
                add_bytes_bound(prob, b, prev_b - fl_max * e[k], limit, f"bflat_after_{L[k].name[2:]}_pass")
                prev_a, prev_b = a, b
            last_flat = prev_a
            nxt = 0
            for (r, c) in reversed(seg):
                k, lm = (r, s, c), mem[r, c]
                after_rs[r, c] = nxt
                z = add_bytes_variable(prob, f"rs_from_{L[k].name[2:]}", rs_max, limit)
                add_bytes_bound(prob, z, lm.reduce_flat * e[k], limit, f"rs_from_{L[k].name[2:]}_own")
                add_bytes_bound(prob, z, nxt - rs_max * e[k], limit, f"rs_from_{L[k].name[2:]}_pass")
                nxt = z
        else:
            last_flat = 0
            for q in seg:
                before_flat[q] = before_bflat[q] = after_rs[q] = 0

        three: dict = {}                # h: the segment has three or more layers (made when needed)
        prefix = 0                      # kept activations of the segments before this one
        u_prefix = 0                    # kept unsharded copies of the segments before this one
        for idx, (r, c) in enumerate(seg):
            k, lm = (r, s, c), mem[r, c]
            total, a_in = totals[r, c]
            ku = lm.kept_unsharded if resharded else 0
            ki, ko = (1 if lm.keeps_input else 0), (1 if lm.keeps_output else 0)
            a_first = a_in + lm.input * ki * (ko - kp[k])
            name = L[k].name[2:]
            left_later = lp.lin_sum(mem[q].unsharded_after_backward * L[q[0], s, q[1]] for q in seg[idx + 1:])
            grads_later = lp.lin_sum(mem[q].grads * L[q[0], s, q[1]] for q in seg[idx + 1:])

            @functools.cache
            def at(where: str) -> Position:
                """The Position of the segment's first, second, penultimate, last or only layer.
                Inside a segment every record is affine in the position and its neighbours are
                its own kind: the first layer and the last bound it (with the second and the
                penultimate where a neighbour's FSDP2 buffer differs from the segment's own)."""
                starts, ends = where in ("first", "only"), where in ("last", "only")
                upto, later, kept_through = {                   # layers up to it, after it; kept through it
                    "first": (1, L[k] - 1, a_first), "only": (1, 0, a_first), "second": (2, L[k] - 2, a_first + a_in),
                    "penultimate": (L[k] - 1, 1, total - a_in), "last": (L[k], 0, total)}[where]
                kept_before = {"first": 0, "only": 0, "second": a_first, "penultimate": total - 2 * a_in,
                               "last": total - a_in}[where]
                return Position(
                    kept_before=prefix + kept_before, kept_through=prefix + kept_through,
                    input_unless_kept=lm.input * (1 - (kp[k] if starts else ko)),
                    unsharded_through=u_prefix + ku * upto if resharded else kept_unsharded,
                    left_after=left_later + lm.unsharded_after_backward * later, grads_after=grads_later + lm.grads * later,
                    prev_gather_flat=before_flat[r, c] if starts else lm.gather_flat,
                    prev_backward_flat=before_bflat[r, c] if starts else (lm.gather_flat if lm.gathers_in_backward else 0),
                    next_reduce_flat=after_rs[r, c] if ends else lm.reduce_flat,
                    stage_grads=grads_all, stage_micro_batch=pmb)

            def add_rows(record: Record, tag: str, gate, where: str) -> None:
                add_record_row(record, tag, gate, f"mem_{name}_{tag}_{where}{record.phase.replace(' (gather)', '_gather')}")

            # -- forward records (memory.forward_records): the segment's first layer and its last,
            # and for an all-gather's copy-out the second (the first to follow its own kind) --
            gathers = bool(lm.gather_flat or lm.unsharded)
            for tag, own, _ in fwd:
                # From the second layer on, a compute record grows by what a layer keeps and
                # shrinks by the copy its backward left (pipelining, once gradients exist). When it
                # shrinks, the first layer's is the highest, unless the layer keeps neither input
                # nor output: then the second counts its input, which the first may find kept by
                # the layer before, and can top it. Written there too in that case alone, so that
                # every other MILP keeps its rows.
                falls = (own and not lm.keeps_input and not lm.keeps_output
                         and lm.unsharded_after_backward > a_in and L[k].hi >= 2)
                where_gate = [("first", e[k]), ("last", f[k])] + ([("second", f[k])] if fsdp and (gathers or falls) else [])
                records = {where: forward_records(lm, at(where), own, False) for where, _ in where_gate}
                for where, gate in where_gate:      # its compute (the last record), at the second where it falls
                    if where != "second" or falls:
                        add_rows(records[where][-1], tag, gate, where)
                if gathers:                         # its all-gather's copy-out (the first)
                    for where, gate in where_gate:
                        add_rows(records[where][0], tag, gate, where)
            # -- backward records (memory.backward_records): the first, last and only layer, and
            # with FSDP2's neighbours the second and the penultimate (three or more layers) --
            for tag, own, _ in bwd:
                where_gate = [("first", f[k]), ("last", f[k]), ("only", e[k] - f[k])]
                if fsdp:
                    if k not in three:
                        three[k] = prob.add_variable(f"h_{name}", cat="Binary")   # the segment has three or more layers
                        prob += L[k] >= 3 * three[k], f"h_{name}_lo"
                        prob += L[k] <= 2 + max(0, L[k].hi - 2) * three[k], f"h_{name}_hi"
                    where_gate += [("second", three[k]), ("penultimate", three[k])]
                for where, gate in where_gate:
                    for record in backward_records(lm, at(where), own, False, resharded):
                        add_rows(record, tag, gate, where)
            prefix = prefix + total
            u_prefix = u_prefix + ku * L[k]
        # Valid cuts, the records above with their gates taken out. The stage's last layer runs
        # its backward with everything the stage keeps alive, whichever segment it is in; its
        # first layer runs its backward last, with every other layer's gradients (or all of
        # them) and the unsharded copies their backwards left. The smallest of each record over
        # the stage's kinds of layer is a floor no layout goes under. They restate nothing new
        # (each term is one of the rows above); they are there because a fractional gate
        # switches those rows off in the relaxation, which then saw no activation memory at all
        # (70B, 8 stages of ZeRO-3: root bound 18.2 -> 18.6 s of the 19.0 s optimum; ZeRO-2's
        # cutoff proof 9 s -> 2 s).
        for tag, own, moment_bytes in bwd:
            first_bwd = not own
            floor = min(mem[q].output + (mem[q].bwd_peak if first_bwd else mem[q].bwd_accum_peak) + mem[q].unsharded
                        for q in seg)
            add_memory_row(prob, compute_static + moment_bytes + pmb + prefix + u_prefix + floor
                           + (0 if first_bwd else grads_all), limit, None, f"cut_mem_s{s}_{tag}_last_layer")
            other_grads = (grads_all - max(mem[q].grads for q in seg)) if first_bwd else grads_all
            add_memory_row(prob, compute_static + moment_bytes + pmb + other_grads + uab_all
                           - max(mem[q].unsharded_after_backward for q in seg) + floor, limit, None,
                           f"cut_mem_s{s}_{tag}_first_layer")
        if last_stage:                  # the loss, after every segment
            lm = loss.memory
            at_loss = Position(kept_before=prefix, kept_through=prefix + loss_add, input_unless_kept=lm.input * (1 - loss_kp),
                               unsharded_through=u_prefix if resharded else kept_unsharded, prev_gather_flat=last_flat,
                               stage_grads=grads_all, stage_micro_batch=pmb)
            for tag, own, _ in fwd:
                for record in forward_records(lm, at_loss, own, True):
                    add_record_row(record, tag, None, f"mem_s{s}_loss_{tag}")
            for tag, own, _ in bwd:
                for record in backward_records(lm, at_loss, own, True, resharded):
                    add_record_row(record, tag, None, f"mem_s{s}_loss_{tag}")

    once = {}                                    # each stage's once-per-step work (ms)
    for s in range(S):
        last_stage, seg = s == S - 1, segs[s]
        if limit is not None:             # without a limit the rows are not needed (nor built)
            add_stage_memory_rows(s)

        # -- time (CostModel.time_terms, the cost model's own definition) ----------------
        terms = model.time_terms(
            cand,
            layers_s=lp.lin_sum(cost[r, c].micro_batch_s * L[r, s, c] for r, c in seg),
            loss_s=loss.micro_batch_s if last_stage else 0.0,
            sent_bytes=((stage_in[s] if s > 0 else 0) + (stage_out[s] if not last_stage else 0)) if S > 1 else 0,
            boundaries=(s > 0) + (not last_stage) if S > 1 else 0,
            step_s=lp.lin_sum(cost[r, c].step_s * L[r, s, c] for r, c in seg),
            sync_s=lp.lin_sum(cost[r, c].sync_s * L[r, s, c] for r, c in seg),
            compute_s=lp.lin_sum(cost[r, c].compute_s * L[r, s, c] for r, c in seg))
        stage_times[s] = terms.per_micro_batch * MS
        if s + pp >= S:                  # the rank's last stage: its time is its stages' together
            rank = f"s{s}" if v == 1 else f"rank{s % pp}"
            prob += tau >= lp.lin_sum(stage_times[t] for t in range(s % pp, S, pp)), f"time_{rank}_per_micro_batch"
        if any(cost[k].sync_s for k in cost):
            prob += exposed[s] >= terms.sync_minus_window * MS, f"time_s{s}_exposed_sync"
        once[s] = exposed[s] + terms.step * MS
        if s + pp >= S:
            prob += omega >= lp.lin_sum(once[t] for t in range(s % pp, S, pp)), f"time_{rank}_once_per_step"

    # -- host memory: a node's ranks together keep their offloaded states within its host memory
    if limit is not None and any(cost[k].memory.host for k in cost):
        host_limit = model.hw.usable_host_bytes()
        stage_host = [lp.lin_sum(cost[r, c].memory.host * L[r, s, c] for s in range(rank, S, pp)
                                 for r, c in segs[s] if c.offload)
                      for rank in range(pp)]     # one rank of each pp rank's stages
        for kind, counts in enumerate(model.ranks_per_stage_on_nodes(cand)):   # CostModel.host_peak_bytes, as rows
            node = lp.lin_sum(n * h for n, h in zip(counts, stage_host) if n)
            prob += node * (1 / host_limit) <= 1, f"host_memory_node_kind{kind}"

    step_time = model.pipeline_step_s(m, v, lp.lin_sum(stage_times.values()), tau, omega)
    prob += step_time, "step_time"

    # Valid cut: some rank holds at least ceil(n / pp) layers, so tau is at least as large as
    # that many of the fastest layers take. The relaxation balances layers fractionally and
    # misses this; with it, balanced layouts of identical layers are proven optimal at once.
    fastest = sorted(t for (_, length), t in zip(runs, fastest_in_run) for _ in range(length))
    prob += tau >= sum(fastest[: -(-n // pp)]) * MS, "cut_fullest_stage"
    for r, (_, length) in enumerate(runs):   # some rank holds ceil(len/pp) of run r
        prob += tau >= -(-length // pp) * fastest_in_run[r] * MS, f"cut_fullest_stage_run{r}"

    if fixed is not None:
        for s, layers in enumerate(fixed):
            for r in range(R):
                start, length = runs[r]
                for c in open_to[r]:
                    count = sum(1 for i, ck, off in layers if start <= i < start + length and Choice(checkpoint_mode(ck), off) == c)
                    if (r, s, c) in L:
                        prob += L[r, s, c] == count, f"fixed_{L[r, s, c].name}"
                    elif count:          # a layer where this stage cannot hold it
                        return Layout("infeasible", None, None)

    if stage_sizes is not None:
        for s, size in enumerate(stage_sizes):
            prob += lp.lin_sum(L[r, s, c] for r, c in segs[s]) == size, f"stage{s}_holds_{size}_layers"
    if lower_bound is not None:
        # A proven bound on this candidate's step (its memory-free optimum): the relaxation
        # starts from it instead of from its own, weaker one.
        # (Its slack is far inside the optimality gap: with a slack of the gap's size, a layout
        # that reaches the bound still showed a gap just over it, and the solver ran to its
        # time limit; GPT-3 175B on 1536 GPUs, twice.)
        prob += step_time >= lower_bound * MS * (1 - LOWER_BOUND_SLACK), "proven_lower_bound"
    if cutoff is not None:
        # Only a layout that could enter the top K is wanted. The bound lets the solver discard
        # whole branches at once; proving nothing is under it is usually far quicker than
        # finding the candidate's own optimum. (The tolerance keeps exact ties.)
        prob += step_time <= cutoff * MS * (1 + CUTOFF_SLACK), "cutoff_kth_best_step_time"

    status = _solve(prob, solver, time_limit)
    if cutoff is not None and status == "infeasible":
        return Layout("cut off", None, None)
    if status not in ("optimal", "time limit"):
        return Layout(status, None, None)

    stages: list[list[Placed]] = []
    placed = {r: runs[r][0] for r in range(R)}
    for s in range(S):
        layers = []
        for r, c in segs[s]:
            for _ in range(round(L[r, s, c].value())):
                layers.append(Placed(placed[r], c.checkpoint, c.offload))
                placed[r] += 1
        stages.append(layers)
    return Layout(status, stages, prob.objective_value() / MS)


def _solve(prob: lp.Model, solver: str, time_limit: float | None) -> str:
    """Run the solver with explicit options; return "optimal", "infeasible", "time limit" (a
    layout, not proven the best) or the solver's status.

    HiGHS (in-process, the model passed as one matrix) is the default: on these models CBC's
    presolve has returned layouts slower than the optimum while reporting optimality
    (docs/cost-model.md), so CBC runs with presolve off, which is exact but often much slower.
    """
    if solver == "highs":
        with _no_banner():          # highspy prints a banner on stdout even with output off
            return prob.solve_highs(time_limit, GAP_REL)
    import pulp
    pprob, cols = prob.to_pulp()
    # The CBC bundled with PuLP 3, single-threaded with fixed seeds: the same problem gives
    # the same answer.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # PuLP 4 moves CBC to an extra
        cmd = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit, threads=1, gapRel=GAP_REL, gapAbs=0,
                                options=["randomSeed 1", "randomCbcSeed 1", "presolve off"])
    pprob.solve(cmd)
    prob.values = [cols[i].varValue or 0.0 for i in range(len(prob.columns))]
    if pprob.status == pulp.LpStatusOptimal and pprob.sol_status == pulp.LpSolutionOptimal:
        return "optimal"
    if pprob.status == pulp.LpStatusInfeasible:
        return "infeasible"
    if pprob.sol_status == pulp.LpSolutionIntegerFeasible:
        return "time limit"
    return pulp.LpStatus[pprob.status].lower()


@contextlib.contextmanager
def _no_banner():
    """Silence file descriptor 1 (C-level stdout) for the duration."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(devnull)
        os.close(saved)


CHECKPOINT_FLAGS = {          # --checkpoint: the modes open to every layer, in canonical order
    "none": ["none"], "selective": ["selective"], "all": ["full"], "auto": ["full", "selective", "none"]}


def choices_for(checkpoint: str, offload: str, allow_offload: bool) -> list[Choice]:
    """The per-layer choices open to the solver (checkpoint: CHECKPOINT_FLAGS; offload: none|auto)."""
    cks = CHECKPOINT_FLAGS[checkpoint]
    offs = [True, False] if (offload == "auto" and allow_offload) else [False]
    # Canonical order inside a run's stretch of a stage: full, selective, none; offloaded before not.
    return [Choice(ck, off) for ck, off in product(cks, offs)]
