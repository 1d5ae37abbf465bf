"""Exact pipeline layouts by stage sizes, for candidates of one stage a rank (1F1B, GPipe).

A pipeline candidate's MILP (milp.solve_layout) can find its best layout in a second or two and
then spend its whole time limit proving it: the relaxation spreads layers and checkpoints
fractionally over stages of nearly equal time, and the branch and bound works through which
stages take the extra layers (GPT-3 175B shape, 16 stages: 17-21 s to close a 0.34% gap). So
here the stage sizes are searched directly, best first by a lower bound on the step of any
layout with those sizes, and each vector the search reaches is solved exactly, until the next
bound is no lower than the best step found. Nothing is sampled: every vector whose bound is
below the answer was solved, so the answer is the candidate's optimum.

With the sizes pinned the stages are independent but for three figures of the step,
    sum_s T_s + (m - 1) max_s T_s + max_s O_s                (CostModel.pipeline_step_s)
with T_s a stage's time per micro-batch and O_s its once-per-step work. Where a stage's layouts
are few enough to list (each run's layers split among the choices in canonical order, as the
MILP describes them: a few thousand for a stage of tens of identical blocks), each stage's
fitting layouts are found by the walk itself, fastest first, and the vector's best layout is
their best combination (solve_sizes); else the size-pinned MILP solves it (0.3-0.6 s).

The bound of a vector: T_s is at least the fastest time of its layers over the choices that
pass the stage's *memory floor*: records of memory.walk_rank that every layout of the stage
reaches, made linear in how many of its layers take each choice (stage_floor below). O_s is
at least each layer's smallest step work plus the gradient sync its compute cannot hide at
that time (StageFloor.once_s). Layers of a run cost as the run's first layer, as in the MILP.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from dataclasses import dataclass, field
from functools import lru_cache
from types import SimpleNamespace

import numpy as np

from . import lp
from .cost import Candidate, CostModel, must_offload
from .memory import LayerMemory, holds_sends, moments, pipeline_buffers, schedule_actions
from .milp import CUTOFF_SLACK, Choice, Layout, _solve, runs_of, solve_layout
from .plan import Placed


MAX_SPLITS = 50_000      # a stage's choice splits its floor's fastest time is taken over (numpy); past it, a relaxation
# A stage's choice splits stage_options may list (numpy, one axis a run; a first stage of 18
# blocks with the embedding holds 1.2 million); past it, the vector's pinned MILP decides.
MAX_LISTED = 2_000_000
MAX_EXPANDED = 200_000   # partial size vectors expanded before the search gives up (reported as a time limit)
# Walks (CostModel.rank_memory, 1-2 ms each) one stage's listed layouts may take before the
# stage is left to the pinned MILP: its floor can let through many a layout the walk refuses.
# The most seen on bench/solve_real.py is 19.
MAX_WALKS = 200


def even_stage_sizes(n_layers: int, n_stages: int) -> list[int]:
    """Layers split evenly over the stages, how a pipeline of several stages a rank is laid
    out: each stage n // S layers, and the remainder one each to the stages from both ends
    inward (first, last, second, second to last, ...), the stages that also hold the
    embedding and the head; 82 Llama 70B layers (embedding, 80 blocks, head) over 4 x 5
    stages give NeMo's 4 blocks a stage.

    The interleaved step (CostModel.pipeline_step_s) holds for equal stages, and only the
    rank's total enters it, so with free sizes the MILP piles layers into a few chunks of a
    rank: its best layout for NeMo's Llama 70B with VP 5 held 1 to 17 layers a stage, predicted
    20.5 s, and took 39.5 s when its schedule was simulated action by action (planner.timeline);
    split evenly it is predicted 21.5 s and simulates at 21.5 s (tests/test_step_time.py
    bounds the error over random layouts)."""
    base, extra = divmod(n_layers, n_stages)
    ends = sorted([k // 2 if k % 2 == 0 else n_stages - 1 - k // 2 for k in range(extra)])
    return [base + (s in ends) for s in range(n_stages)]


def _backward_peak(x: LayerMemory, grads: bool) -> int:
    return x.bwd_accum_peak if grads else x.bwd_peak


# The figures of one layer (memory.LayerMemory) that a floor's single-layer terms take, by name;
# `grads`: whether gradients exist at that moment (stage_floor says where each enters).
FIGURES = {
    # the stage's last layer's backward: its output, unsharded copy and backward peak
    "last backward": lambda x, grads: x.output + x.unsharded + _backward_peak(x, grads),
    # a first layer's backward, or its all-gather's copy-out, whichever is more
    "own backward": lambda x, grads: x.output + x.unsharded + max(
        _backward_peak(x, grads), x.gather_flat if x.gathers_in_backward else 0),
    # what a layer keeps for its backward, its input aside
    "activations": lambda x, grads: x.own + (x.output if x.keeps_output else 0),
    # what its backward has not yet left (its gradients until they exist) and the copy it leaves
    "left": lambda x, grads: x.unsharded_after_backward + (0 if grads else x.grads),
    # the all-gather buffer of a layer gathered again for its backward (prefetched)
    "backward gather": lambda x, grads: x.gather_flat if x.gathers_in_backward else 0,
    # a first layer's forward: its activations, transient, unsharded copy and all-gather buffer
    "forward": lambda x, grads: x.own + x.output + x.fwd_transient + x.unsharded + x.gather_flat,
    # the unsharded copy a backward leaves
    "left unsharded": lambda x, grads: x.unsharded_after_backward,
}


@dataclass(frozen=True)
class StageFloor:
    """One stage's floor: per (run, choice) the bytes a layer adds to each record, and each
    record's room (the limit less what the stage holds whatever its choices)."""

    cols: tuple[tuple[int, Choice], ...]      # (run, choice), the variables: layers of the run taking the choice
    counts: dict[int, int]                    # run -> its layers in the stage
    # (bytes per layer of each column, room, terms of single layers: (offset into the stage,
    # sign, the figure under each choice))
    rows: tuple[tuple[tuple[float, ...], float, tuple], ...]
    time_s: tuple[float, ...]                 # each column's time per micro-batch
    const_s: float                            # the stage's time per micro-batch outside its layers
    # Once per step (CostModel.time_terms): optimizer steps and the gradient sync less what
    # share x its compute hides; each the least its layers' choices allow.
    step_s: float
    sync_s: float
    share: float
    unhidden_s: float                         # sync less share x compute, each layer's least
    not_compute_s: float                      # the time per micro-batch of its layers that is not compute

    def once_s(self, time_s: float) -> float:
        """At least the stage's once-per-step work when it takes `time_s` per micro-batch:
        its compute is at most that time less the stage's fixed part and what is not compute,
        so at most that much sync hides. (Less the longer the stage takes; the step gains more.)"""
        hidden = self.share * max(0.0, time_s - self.const_s - self.not_compute_s)
        return self.step_s + max(0.0, self.unhidden_s, self.sync_s - hidden)


@dataclass(frozen=True)
class StageOption:
    """A layout of one stage that fits: its time per micro-batch, its once-per-step work, the
    host bytes it offloads, and its (layer, checkpoint, offload)."""

    time_s: float
    once_s: float
    host: int
    layers: list[Placed]


@dataclass
class _StageLayouts:
    """One stage's splits within its floor, fastest first (then least once per step), and how
    far stage_options has walked them."""

    a: int                        # the stage's first layer
    parts: list                   # per run: its splits among the choices (_splits)
    index: np.ndarray             # (splits, runs): each split's row in every run's part
    time_s: np.ndarray            # (splits,): time per micro-batch
    once_s: np.ndarray            # (splits,): once-per-step work
    host: np.ndarray              # (splits,): host bytes offloaded
    cols: tuple                   # the columns' (run, choice), as StageFloor.cols
    next: int = 0                 # the first split not yet looked at
    walks: int = 0                # splits checked by the walk so far
    least_once: float = math.inf  # the least once-per-step work of a split found to fit
    frontier: list = field(default_factory=list)   # StageOption of each split found to fit and kept


class StageSizeSearch:
    """The search over stage sizes for one candidate (v = 1, pp > 1)."""

    def __init__(self, model: CostModel, cand: Candidate, choices: list[Choice], solver: str = "highs"):
        assert cand.virtual_stages == 1 and cand.pp > 1
        self.model, self.cand, self.choices, self.solver = model, cand, choices, solver
        prof = model.profile
        self.n, self.S, self.m = prof.n_layers, cand.pp, cand.num_micro_batches
        self.runs = runs_of([layer.signature for layer in prof.layers])
        self.run_of = [r for r, (_, length) in enumerate(self.runs) for _ in range(length)]
        self.cost = {(r, c): model.layer(cand, start, c.checkpoint, c.offload)
                     for r, (start, _) in enumerate(self.runs) for c in choices}
        self.fastest = [min(self.cost[self.run_of[i], c].micro_batch_s for c in choices) for i in range(self.n)]
        self.run_input = [model.sample(start, cand).input_bytes for start, _ in self.runs]
        self.loss = model.loss(cand)
        self._floors: dict = {}            # floor key (_floor_key) -> StageFloor; stages alike share one
        self._fastest: dict = {}
        self._floor_of_span: dict = {}     # (s, a, b) -> its StageFloor
        self._fastest_of_span: dict = {}   # (s, a, b, tight) -> fastest_stage_s
        self._moment_cache: dict = {}
        self._layouts: dict = {}
        self._figures: dict = {}
        self._column_cache: dict = {}      # the runs a stage holds -> their columns (_columns)

    # -- one stage ----------------------------------------------------------------------
    def stage_floor(self, s: int, a: int, b: int) -> StageFloor:
        """The floor of stage s holding layers a..b: records of memory.walk_rank, each lowered
        to be linear in how many of its layers take each choice, plus terms of single layers:
          optimizer step   weights + optimizer states + buffers + the gradients it steps
          final reduction  (pipelined FSDP units) the same with every unsharded gradient and copy
          backward         of the stage's last layer (the loss's on the last stage), of its first
                           (the last to run, and its all-gather copy-out) and of its second, at
                           the moment that holds the most micro-batches, with and without
                           gradients: the states, the kept unsharded copies, the held
                           micro-batches' activations, gradients and unsharded copies the
                           backwards so far left, and the running layer's own peak
          forward          of its first layer, likewise
        A micro-batch's activations are each layer's own, its output where kept and its input
        where it keeps that alone, less the inputs that the first layer of a kind can find kept
        already (in canonical order one, unless some choice keeps its output). Everything the
        walk adds beyond these (neighbours' FSDP buffers, the current micro-batch's partial
        activations) is left out, so a layout that fits meets every row (tested)."""
        span = (s, a, b)                  # asked hundreds of thousands of times: by span first
        if span in self._floor_of_span:
            return self._floor_of_span[span]
        key = self._floor_key(s, a, b)
        if key in self._floors:
            self._floor_of_span[span] = self._floors[key]
            return self._floors[key]
        model, cand, m = self.model, self.cand, self.m
        counts, last, stage_in, stage_out = dict(key[1]), key[3], key[4], key[5]
        # The stage's buffers (memory.pipeline_buffers), with the MILP's convention for a run's bytes.
        recv, per_mb, _, _ = pipeline_buffers(m, stage_in, stage_out, s == 0, last, holds_sends(cand.schedule))
        static = model.batch_bytes(cand, s == 0, last) + recv
        col = self._columns(key[1])
        cols, mem, kept = col.cols, col.mem, col.kept
        # A layer that keeps only its input finds it kept already when it is the stage's first
        # (the pipeline holds it) or follows a layer that keeps its output: in canonical order
        # the first of a kind at most, so a micro-batch counts at most those inputs too many.
        lost_inputs = max(v for (r, _), v in zip(cols, col.only_input) if r == self.run_of[a])
        if any(x.keeps_output for x in mem):
            lost_inputs += sum(col.only_input)
        limit = model.memory_limit
        rows = []

        def at(offset: int, figure: str, grads: bool = False, sign: int = 1) -> tuple:
            """A term of the layer `offset` layers into the stage: its FIGURES[figure] under each
            choice (the choice it takes follows from the counts, in canonical order)."""
            return offset, sign, self._figure(self.run_of[a + offset], figure, grads)

        def record(base: tuple[int, ...], held: int, room: float, *terms) -> None:
            """A row: per column, `base` (_columns) and `held` micro-batches of what a layer keeps."""
            rows.append((tuple(v + held * k for v, k in zip(base, kept)) if held else base, room, terms))

        record(col.optimizer_step, 0, limit - static)
        if any(x.step_grads is not None for x in mem):
            record(col.final_reduction, 0, limit - static)
        lm = self.loss.memory
        loss_kept = FIGURES["activations"](lm, False) if last else 0
        one_mb = per_mb + loss_kept - lost_inputs        # a held micro-batch, less its per-layer part

        for held, grads in self._moments(s, "B"):
            # The last layer's backward (the loss's on the last stage): every held micro-batch whole.
            if last:
                loss_peak, final = _backward_peak(lm, grads), ()
            else:
                loss_peak, final = 0, (at(b - a, "last backward", grads),)
            record(col.with_grads if grads else col.resident, held, limit - static - held * one_mb - loss_peak, *final)

            # The first layer's backward, the last to run, and its all-gather copy-out: the other
            # held micro-batches whole, this one's buffers and what its first layers keep, every
            # other layer's gradients (all of them once gradients exist) and the unsharded
            # copies their backwards left.
            room = limit - static - (held - 1) * one_mb - per_mb
            record(col.after_backward, held - 1, room, at(0, "own backward", grads), at(0, "activations"),
                   at(0, "left", grads, -1))
            if b > a:
                # The second layer's: the same, with the first layer's all-gather prefetched.
                record(col.after_backward, held - 1, room, at(1, "own backward", grads), at(0, "backward gather"),
                       at(0, "activations"), at(1, "activations"), at(0, "left", grads, -1), at(1, "left", grads, -1))
        for held, grads in self._moments(s, "F"):
            # The first layer's forward: every held micro-batch whole and, once gradients
            # exist, every gradient and every other layer's unsharded copy left by its backward.
            terms = [at(0, "forward")]
            if grads:
                terms.append(at(0, "left unsharded", sign=-1))
            record(col.after_backward if grads else col.resident, held, limit - static - held * one_mb, *terms)
        terms = model.time_terms(cand, 0.0, self.loss.micro_batch_s if last else 0.0,
                                 stage_in + (0 if last else stage_out), (s > 0) + (not last), 0.0, 0.0, 0.0)
        floor = StageFloor(cols, counts, tuple(rows), col.time_s, terms.per_micro_batch, share=model.sync_hidden_share,
                           **col.least)
        self._floors[key] = self._floor_of_span[span] = floor
        return floor

    def _columns(self, counts: tuple) -> SimpleNamespace:
        """What stage_floor needs of a stage's columns, its runs' layer counts given: per column
        (run, choice) the layer's memory figures summed as its rows take them, kept per set of
        runs (a search's thousands of floors hold a few: their counts differ, their runs
        rarely), and the stage's least once-per-step figures for these counts."""
        runs = tuple(r for r, _ in counts)
        if runs not in self._column_cache:
            cols = tuple((r, c) for r in runs for c in self.choices)
            mem = [self.cost[k].memory for k in cols]
            only_input = [x.input if (x.keeps_input and not x.keeps_output) else 0 for x in mem]
            resident = [x.weights + x.optim + x.buffers + x.kept_unsharded for x in mem]   # states and kept copies
            share = self.model.sync_hidden_share
            figures = {"step_s": lambda x: x.step_s, "sync_s": lambda x: x.sync_s,
                       "unhidden_s": lambda x: x.sync_s - share * x.compute_s,
                       "not_compute_s": lambda x: x.micro_batch_s - x.compute_s}
            self._column_cache[runs] = SimpleNamespace(
                cols=cols, mem=mem, only_input=only_input,
                kept=[FIGURES["activations"](x, False) + alone for x, alone in zip(mem, only_input)],
                # the optimizer step: states and the gradients it steps
                optimizer_step=tuple(x.weights + x.optim + x.buffers + (x.grads if x.step_grads is None else x.step_grads)
                                     for x in mem),
                # the final reduction of pipelined FSDP units: states, gradients, every unsharded copy
                final_reduction=tuple(x.weights + x.optim + x.buffers + x.grads + x.kept_unsharded
                                      + x.unsharded_after_backward for x in mem),
                resident=tuple(resident),
                with_grads=tuple(v + x.grads for v, x in zip(resident, mem)),
                after_backward=tuple(v + x.grads + x.unsharded_after_backward for v, x in zip(resident, mem)),
                time_s=tuple(self.cost[k].micro_batch_s for k in cols),
                least_per_layer={name: [min(f(self.cost[r, c]) for c in self.choices) for r in runs]
                                 for name, f in figures.items()})
        out = self._column_cache[runs]
        least = {name: sum(n * lo for (_, n), lo in zip(counts, per)) for name, per in out.least_per_layer.items()}
        return SimpleNamespace(**vars(out), least=least)

    def _figure(self, run: int, figure: str, grads: bool) -> tuple[float, ...]:
        """FIGURES[figure] of a layer of the run under each choice (kept: every stage of the
        search asks for the same few)."""
        key = (run, figure, grads)
        if key not in self._figures:
            self._figures[key] = tuple(FIGURES[figure](self.cost[run, c].memory, grads) for c in self.choices)
        return self._figures[key]

    def _floor_key(self, s: int, a: int, b: int) -> tuple:
        """What stage s's floor and fastest time depend on, holding layers a..b: its runs'
        counts, whether it is first or last, the bytes it receives and sends, its first and
        last layers' runs."""
        first, final = self.run_of[a], self.run_of[b]
        counts = tuple((r, min(b, start + length - 1) - max(a, start) + 1)
                       for r, (start, length) in enumerate(self.runs[first:final + 1], start=first))
        last = b == self.n - 1
        stage_in = self.run_input[first] if s > 0 else 0
        stage_out = self.model.sample(self.n - 1, self.cand).output_bytes if last else self.run_input[self.run_of[b + 1]]
        return (s, counts, a == 0, last, stage_in, stage_out, first, final)

    def _moments(self, s: int, kind: str) -> list[tuple[int, bool]]:
        """Stage s's moments of a kind ("F" or "B") holding the most micro-batches, without
        gradients and with them: (micro-batches held, the running one included for a backward;
        gradients present)."""
        if (s, kind) not in self._moment_cache:
            most: dict[bool, int] = {}
            for mo in moments(schedule_actions(self.cand.schedule, self.S, s, self.m, 1), 1):
                if mo.kind == kind:
                    most[mo.grads_here] = max(most.get(mo.grads_here, 0), mo.held[0] + (kind == "B"))
            self._moment_cache[s, kind] = sorted((h, g) for g, h in most.items())
        return self._moment_cache[s, kind]

    def fastest_stage_s(self, s: int, a: int, b: int, tight: bool = False) -> float:
        """The least time per micro-batch of stage s holding layers a..b over the choices
        within its memory floor (inf: none is within it): every split of each run's layers
        among its choices where there are few (numpy), else a linear relaxation, or with
        `tight` the integer program (3-14 ms: worth it only before a pinned MILP of tenths of a
        second, solve)."""
        span = (s, a, b, tight)
        if span in self._fastest_of_span:
            return self._fastest_of_span[span]
        key = (self._floor_key(s, a, b), tight)
        if key not in self._fastest:
            floor = self.stage_floor(s, a, b)
            if self._listable(floor):              # the splits are exact: `tight` adds nothing
                self._fastest[key] = (self.fastest_stage_s(s, a, b) if tight
                                      else floor.const_s + self._fastest_by_splits(floor, a))
            else:
                least = self._fastest_by_program(floor) if tight else self._fastest_by_relaxation(floor)
                self._fastest[key] = floor.const_s + least
        self._fastest_of_span[span] = self._fastest[key]
        return self._fastest[key]

    def _listable(self, floor: StageFloor, most: int = MAX_SPLITS) -> bool:
        """Whether the stage's splits among the choices are at most `most`."""
        k = len(self.choices)
        return math.prod(math.comb(count + k - 1, k - 1) for count in floor.counts.values()) <= most

    def _grid(self, floor: StageFloor, a: int) -> tuple[list[np.ndarray], np.ndarray]:
        """Every split of each run's layers among the choices, per run (_splits, columns as
        the run's in floor.cols), and whether each combination of them meets every floor row
        (an array with one axis a run; a layer's own terms by the choice it takes: runs in
        order, each run's choices in canonical order). A row's live bytes are a sum of one part
        per run, each depending on that run's split alone, so the parts are summed by
        broadcasting, not listed as a table (the 405B shape's 3,545 stages in 1.5 s where a
        table took 2.1: most of them hold tens of thousands of splits)."""
        k, sizes = len(self.choices), tuple(floor.counts.values())     # runs in column order (sorted)
        runs = sorted(floor.counts)
        parts = [_splits(count, k) for count in sizes]                  # per run: (its splits, k)
        fits = np.ones(tuple(len(part) for part in parts), dtype=bool)
        for per_layer, room, terms in floor.rows:
            w = np.array(per_layer, dtype=np.float64)
            own = [part @ w[q * k:(q + 1) * k] for q, part in enumerate(parts)]
            for offset, sign, values in terms:
                run = self.run_of[a + offset]
                before = a + offset - max(a, self.runs[run][0])          # the run's layers before it in the stage
                q = runs.index(run)
                own[q] = own[q] + sign * np.array(values, dtype=np.float64)[_choice_taken(sizes[q], k, before)]
            fits &= _broadcast_sum(own) <= room
        return parts, fits

    def _fastest_by_splits(self, floor: StageFloor, a: int) -> float:
        parts, fits = self._grid(floor, a)
        if not fits.any():
            return math.inf
        return float(_on_grid(parts, np.array(floor.time_s, dtype=np.float64))[fits].min())

    @staticmethod
    def _fastest_by_relaxation(floor: StageFloor) -> float:
        """A lower bound on the least time within the floor, by each row alone with the counts
        fractional and each layer's own terms at their least: for a row sum_j w_j n_j <= room
        (n_j the layers of column j, each run's summing to its count) and any price y >= 0,
        no layout within the row is faster than
            sum_runs count x min_{j in run} (t_j + y w_j) - y room
        (weak duality), and the best y is where two of a run's choices cost the same, so every
        such y of every row is tried at once (numpy) and the largest bound kept. Within 0.5% of
        the linear program over all rows together (a 70B stage of 40 blocks and six choices),
        in 0.1 ms where HiGHS took 1 ms and the integer program 3-14 ms."""
        runs = sorted(floor.counts)
        run_of_col = np.array([runs.index(r) for r, _ in floor.cols])
        member = run_of_col[None, :] == np.arange(len(runs))[:, None]          # (runs, cols)
        count = np.array([floor.counts[r] for r in runs], dtype=np.float64)     # (runs,)
        t = np.array(floor.time_s, dtype=np.float64)                            # (cols,)
        w = np.array([per_layer for per_layer, _, _ in floor.rows], dtype=np.float64)   # (rows, cols)
        room = np.array([room - sum(min(sign * v for v in values) for _, sign, values in terms)
                         for _, room, terms in floor.rows], dtype=np.float64)  # (rows,)

        def least_per_run(x: np.ndarray) -> np.ndarray:        # (..., cols) -> (..., runs)
            return np.where(member, x[..., None, :], np.inf).min(axis=-1)
        if (least_per_run(w) @ count > room).any():
            return math.inf                                     # a row no split can meet
        # Prices where a slower choice b of a run saves bytes over a faster one a.
        a, b = np.nonzero((run_of_col[:, None] == run_of_col[None, :]) & (t[None, :] > t[:, None]))
        saved = w[:, a] - w[:, b]                                                # (rows, pairs)
        price = np.where(saved > 0, (t[b] - t[a]) / np.where(saved > 0, saved, 1.0), 0.0)
        price = np.concatenate([np.zeros((len(room), 1)), price], axis=1)        # (rows, prices)
        bound = least_per_run(t + price[:, :, None] * w[:, None, :]) @ count - price * room[:, None]
        return float(bound.max())

    def _fastest_by_program(self, floor: StageFloor) -> float:
        """The least time within the floor, the counts integral and each layer's own terms at
        their least (a small integer program)."""
        prob = lp.Model("stage_floor")
        n = {k: prob.add_variable(f"n{j:03d}", 0, floor.counts[k[0]], cat="Integer") for j, k in enumerate(floor.cols)}
        for r, count in floor.counts.items():
            prob += lp.lin_sum(v for (r2, _), v in n.items() if r2 == r) == count, f"run{r}"
        limit = self.model.memory_limit
        for j, (per_layer, room, terms) in enumerate(floor.rows):
            room -= sum(min(sign * v for v in values) for _, sign, values in terms)   # each layer's term at its least
            prob += lp.lin_sum(v * (w / limit) for v, w in zip(n.values(), per_layer)) <= room / limit, f"floor{j}"
        prob += lp.lin_sum(v * (t * 1e3) for v, t in zip(n.values(), floor.time_s)), "time_ms"
        status = _solve(prob, self.solver, None)
        return prob.objective_value() / 1e3 if status == "optimal" else math.inf

    def program_bound(self, sizes: tuple[int, ...]) -> float:
        """The bound of a whole vector (as `vectors` gives it) with each stage's floor by its
        integer program (fastest_stage_s, tight)."""
        starts = list(itertools.accumulate((0, *sizes)))
        times = [self.fastest_stage_s(s, starts[s], starts[s + 1] - 1, tight=True) for s in range(self.S)]
        if math.inf in times:
            return math.inf
        once = max(self.stage_floor(s, starts[s], starts[s + 1] - 1).once_s(t) for s, t in enumerate(times))
        return self.model.pipeline_step_s(self.m, 1, sum(times), max(times), once)

    # -- one stage exactly ----------------------------------------------------------------
    def stage_options(self, s: int, a: int, b: int, most_s: float) -> list[StageOption] | None:
        """Stage s holding layers a..b: its layouts that fit (the walk, memory.walk_rank, says
        so) and take at most `most_s` a micro-batch, each no slower and no fuller once per step
        than another: (time per micro-batch ascending, once-per-step work descending). None
        where its splits are too many to list, or too many passed its floor and not the walk
        (MAX_WALKS). The same layouts the MILP describes (each run's layers take the choices
        in canonical order), so a layout of pinned stage sizes is the best combination of
        these (solve_sizes). Splits are tried fastest first, each only if its floor lets it
        and it would do less once per step than every faster one that fits; made once per
        stage and extended as `most_s` grows."""
        key = self._floor_key(s, a, b)
        state = self._layouts.get(key)
        if state is None:
            floor = self.stage_floor(s, a, b)
            if not self._listable(floor, MAX_LISTED):
                return None
            parts, fits = self._grid(floor, a)
            where = np.nonzero(fits)              # per run, its split in each fitting combination

            def total(figure) -> np.ndarray:      # (splits,): a figure summed over each fitting split's layers
                return _on_grid(parts, np.array([figure(self.cost[c]) for c in floor.cols], dtype=np.float64))[where]
            time_s = floor.const_s + total(lambda x: x.micro_batch_s)
            window = total(lambda x: x.sync_s) - floor.share * total(lambda x: x.compute_s)
            once_s = total(lambda x: x.step_s) + np.maximum(0.0, window)
            order = np.lexsort((once_s, time_s))
            state = self._layouts[key] = _StageLayouts(a, parts, np.stack(where, axis=1)[order], time_s[order],
                                                       once_s[order], total(lambda x: x.memory.host)[order], floor.cols)
        limit = self.model.memory_limit
        while state.next < len(state.time_s) and state.time_s[state.next] <= most_s:
            j = state.next
            if state.once_s[j] >= state.least_once:
                state.next += 1
                continue                          # a faster layout that fits does less once per step
            if state.walks >= MAX_WALKS:
                return None
            state.next += 1
            state.walks += 1
            layers = self._stage_layout(state, j)
            if self.model.rank_memory(self.cand, s, [(s, layers)]).peak <= limit:
                state.frontier.append(StageOption(float(state.time_s[j]), float(state.once_s[j]),
                                                  int(state.host[j]), layers))
                state.least_once = state.once_s[j]
        return [o for o in state.frontier if o.time_s <= most_s]

    def _stage_layout(self, state: "_StageLayouts", j: int) -> list[Placed]:
        """The stage's (layer, checkpoint, offload) of split j: each run's layers take the
        choices in canonical order."""
        counts = np.concatenate([part[i] for part, i in zip(state.parts, state.index[j])])
        picks = [c for (_, c), count in zip(state.cols, counts) for _ in range(int(round(count)))]
        return [Placed(i, c.checkpoint, c.offload) for i, c in zip(range(state.a, state.a + len(picks)), picks)]

    def solve_sizes(self, sizes: tuple[int, ...], bar: float) -> Layout | None:
        """The best layout with these stage sizes whose step is within `bar`, without a MILP:
        each stage's options (stage_options), combined by the one figure they share, the
        fullest once-per-step work w: for each w, every stage takes its fastest option within
        w, since the step (sum T + (m - 1) max T + max O) grows with every T. None where a
        stage has no options list (stage_options), where the candidate must offload somewhere
        (a row across stages), or where the best combination overfills a node's host memory:
        the pinned MILP decides those."""
        if must_offload(self.cand, self.model.precision):
            return None
        m, starts = self.m, list(itertools.accumulate((0, *sizes)))
        spans = [(s, starts[s], starts[s + 1] - 1) for s in range(self.S)]
        least = sum(self.fastest_stage_s(s, a, b) for s, a, b in spans)
        # No stage of a layout within the bar takes more than this a micro-batch.
        most_s = math.inf if m == 1 or bar == math.inf else (bar - least) / (m - 1) * (1 + 1e-9)
        options = []
        for s, a, b in spans:
            found = self.stage_options(s, a, b, most_s)
            if found is None:
                return None
            if not found:
                return Layout("cut off" if bar < math.inf else "infeasible", None, None)
            options.append(found)
        best = None
        for w in sorted({o.once_s for found in options for o in found}):
            picks = [next((o for o in found if o.once_s <= w), None) for found in options]
            if None in picks:
                continue
            step = self.model.pipeline_step_s(m, 1, sum(o.time_s for o in picks), max(o.time_s for o in picks),
                                              max(o.once_s for o in picks))
            if best is None or step < best[0]:
                best = (step, picks)
        if best is None or best[0] > bar:
            return Layout("cut off" if bar < math.inf else "infeasible", None, None)
        stages = [o.layers for o in best[1]]
        pred = self.model.evaluate(self.cand, stages)
        if not pred.fits:
            return None                            # a node's host memory: the MILP's row
        return Layout("optimal", stages, pred.step_s)

    # -- the search ---------------------------------------------------------------------
    def vectors(self, bar):
        """Stage-size vectors in order of their bound, best first, as (bound, sizes), while the
        bound is within `bar()` (read again before each step: it falls as layouts are found).
        Ends early, after MAX_EXPANDED partial vectors, with (inf, None)."""
        n, S, m = self.n, self.S, self.m
        rest = [0.0] * (n + 1)                     # fastest time of layers i.. (a floor for what is left)
        for i in reversed(range(n)):
            rest[i] = rest[i + 1] + self.fastest[i]
        spread = least_slowest_stage(self.fastest, self.loss.micro_batch_s, S)

        def key(stages_left: int, a: int, total: float, slowest: float, once: float) -> float:
            """A bound on every vector that starts so: what is left takes at least its layers'
            fastest times (and the loss), and its slowest stage at least the least that any
            split of them into `stages_left` stages leaves the slowest."""
            left = rest[a] + (self.loss.micro_batch_s if stages_left else 0.0)
            return total + left + (m - 1) * max(slowest, spread[stages_left][a]) + once

        # (bound, sizes, sum T, max T, max O, the last stage's layers if its time is not yet
        # its floor's: pushed with its layers' fastest times, refined when it comes first)
        heap = [(key(S, 0, 0.0, 0.0, 0.0), (), 0.0, 0.0, 0.0, None)]
        floor_at: dict = {}            # (s, a, b) -> the stage's fastest time within its floor, its once-per-step floor then

        def refined(span: tuple, total: float, t0: float, slowest: float, once: float) -> tuple | None:
            """(sum T, max T, max O) of a vector whose last stage, `span`, was counted at its
            layers' fastest time t0 in `total`, with that stage at its floor's time instead;
            None where no layout of the stage is within its floor."""
            if span not in floor_at:
                t = self.fastest_stage_s(*span)
                floor_at[span] = (t, self.stage_floor(*span).once_s(t) if t < math.inf else math.inf)
            t, t_once = floor_at[span]
            return None if t == math.inf else (total - t0 + t, max(slowest, t), max(once, t_once))

        expanded = 0
        while heap:                    # (hundreds of thousands of steps on the 405B shape: kept lean)
            bound, sizes, total, slowest, once, rough = heapq.heappop(heap)
            if bound > bar():
                return
            s, a = len(sizes), sum(sizes)
            if rough is not None:
                child = refined((s - 1, *rough), total, rest[rough[0]] - rest[rough[1] + 1], slowest, once)
                if child is not None:
                    k = key(S - s, a, *child)
                    if k <= bar():
                        heapq.heappush(heap, (k, sizes, *child, None))
                continue
            if s == S:
                yield bound, sizes
                continue
            expanded += 1
            if expanded > MAX_EXPANDED:
                yield math.inf, None
                return
            most = bar()                           # (it changes only between yields)
            stages_left = S - s - 1
            for b in ([n - 1] if s == S - 1 else range(a, n - stages_left)):
                t0 = rest[a] - rest[b + 1]
                if (m - 1) * max(slowest, t0) + total > most:
                    break                          # longer stages only take longer
                if (s, a, b) in floor_at:
                    # Its floor is known (another prefix reached it): pushed as it would be
                    # refined, the same sums in the same order, not pushed and popped twice
                    # (the 405B shape's pp 16 candidates: 29,000 refinements a search -> 9,600).
                    child = refined((s, a, b), total + t0, t0, slowest, once)
                    if child is not None:
                        k = key(stages_left, b + 1, *child)
                        if k <= most:
                            heapq.heappush(heap, (k, sizes + (b - a + 1,), *child, None))
                    continue
                k = key(stages_left, b + 1, total + t0, slowest, once)
                if k <= most:
                    heapq.heappush(heap, (k, sizes + (b - a + 1,), total + t0, slowest, once, (a, b)))

    def solve(self, time_limit: float | None = None, cutoff: float | None = None,
              lower_bound: float | None = None) -> tuple[Layout, int]:
        """The candidate's best layout, and how many pinned MILPs that took. Status "optimal",
        "cut off" (nothing reaches `cutoff`), "infeasible", "time limit" (the best found, not
        proven) or "time limit reached" (none found in time)."""
        start = time.perf_counter()
        worst = math.inf if cutoff is None else cutoff * (1 + CUTOFF_SLACK)
        best: Layout | None = None
        solved = 0
        timed_out = False

        def bar() -> float:
            return worst if best is None else min(worst, best.objective * (1 + 1e-12))

        for bound, sizes in self.vectors(bar):
            if sizes is None or (time_limit is not None and time.perf_counter() - start > time_limit):
                timed_out = True
                break
            if best is not None and (bound >= best.objective
                                     or (lower_bound is not None and best.objective <= lower_bound * (1 + 1e-12))):
                break
            layout = self.solve_sizes(sizes, bar())
            if layout is None and self.program_bound(sizes) > bar():
                continue                  # the integer floors rule it out: no MILP
            if layout is None:
                left = None if time_limit is None else max(0.1, time_limit - (time.perf_counter() - start))
                layout = solve_layout(self.model, self.cand, self.choices, self.solver, time_limit=left,
                                      cutoff=best.objective if best is not None else cutoff,
                                      lower_bound=max(bound, lower_bound or 0.0), stage_sizes=list(sizes))
                solved += 1
            if layout.stages is not None and (best is None or layout.objective < best.objective):
                best = layout
            if layout.status == "time limit":
                timed_out = True
                break
        if best is None:     # (a time limit with nothing found: the MILP's status for it)
            status = "time limit reached" if timed_out else ("cut off" if cutoff is not None else "infeasible")
            return Layout(status, None, None), solved
        return Layout("time limit" if timed_out else "optimal", best.stages, best.objective), solved


def least_slowest_stage(times: list[float], loss_s: float, stages: int) -> list[list[float]]:
    """least[k][a]: the least, over every split of layers a.. into k contiguous non-empty
    stages, of the slowest stage's summed `times` (the last stage's with the loss); 0 for no
    stages and no layers, inf where the layers are fewer than the stages. A stage takes at
    least its layers' fastest times, so this bounds the slowest stage of what is left, and it
    is never below their average, the bound it replaces (least[1] is the whole sum)."""
    n = len(times)
    w = np.array(times, dtype=np.float64)
    w[-1] += loss_s
    prefix = np.concatenate([[0.0], np.cumsum(w)])                   # (n + 1,)
    seg = prefix[None, 1:] - prefix[:-1, None]                          # (a, b): layers a..b
    seg = np.where(np.arange(n)[None, :] >= np.arange(n)[:, None], seg, np.inf)
    least = [np.full(n + 1, np.inf)]
    least[0][n] = 0.0
    for _ in range(stages):
        after = least[-1][1:]                                            # (b,): layers b + 1.. in one stage fewer
        row = np.maximum(seg, after[None, :]).min(axis=1)                # (a,)
        least.append(np.append(row, np.inf))
    return [row.tolist() for row in least]


@lru_cache(maxsize=256)
def _splits(count: int, k: int) -> np.ndarray:
    """Every way of splitting `count` layers among k choices, one row each, in lexicographic
    order (the first choice's count ascending)."""
    if k == 1:
        return np.full((1, 1), float(count))
    rows = [np.hstack([np.full((len(rest), 1), float(first)), rest])
            for first in range(count + 1) for rest in [_splits(count - first, k - 1)]]
    out = np.vstack(rows)
    out.flags.writeable = False
    return out


def _broadcast_sum(per_run: list[np.ndarray]) -> np.ndarray:
    """Per run a figure of each of its splits -> the figure of every combination (one axis a
    run, the first run's slowest)."""
    shape = tuple(len(x) for x in per_run)
    return sum(x.reshape([n if j == q else 1 for j, n in enumerate(shape)]) for q, x in enumerate(per_run))


def _on_grid(parts: list[np.ndarray], per_column: np.ndarray) -> np.ndarray:
    """A per-column figure summed over a stage's columns, for every combination of its runs'
    splits (_broadcast_sum)."""
    k = parts[0].shape[1]
    return _broadcast_sum([part @ per_column[q * k:(q + 1) * k] for q, part in enumerate(parts)])


@lru_cache(maxsize=256)
def _choice_taken(count: int, k: int, before: int) -> np.ndarray:
    """In each row of _splits(count, k), the choice (index) a layer of the run takes with
    `before` of the run's layers ahead of it: choices in canonical order."""
    out = np.argmax(np.cumsum(_splits(count, k), axis=1) > before, axis=1)
    out.flags.writeable = False
    return out
