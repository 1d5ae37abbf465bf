"""Pipelines of several stages a rank, solved rank by rank from each stage's listed layouts.

Under the multi-stage schedules (interleaved 1F1B, looped BFS) the stage sizes are pinned even
(partition.even_stage_sizes), so every stage's layers are known and what is left to choose is
each layer's checkpoint and offload. milp.solve_layout describes that for all ranks at once with
counts per segment, records gated by binaries and chains of neighbour variables; on NeMo's
Llama 70B with VP 5 (20 stages) HiGHS took 5-9 s for three of its four ZeRO candidates and ran
into its 20 s limit on the fourth.

Here each stage's layouts are listed, as the MILP describes them (each run's layers split among
the open choices in canonical order), and evaluated by the cost model itself: the stage's time
terms (CostModel.stage_terms) and its part in its rank's walk (memory.walk_chunk: what it holds
all step, its totals as the rank's other moments read them, its highest record for each kind of
action). A rank's live bytes at a moment are one such term per stage (memory.walk_rank), so with
one binary per listed layout each memory row is linear and exact. Ranks share no layer and, but
for a node's host memory, no row; only the step couples them (solve_listed says how the sweep
over the fullest rank's once-per-step work finds the optimum from each rank's own program).
A rank's program keeps only the layouts no other of the same stage beats in every figure it
reads, and only the rows no other row tops for every layout kept.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from functools import cache

import numpy as np

from . import lp
from .cost import Candidate, CostModel, must_offload
from .memory import (Moment, StageBytes, final_reduction_record, held_at, holds_sends, peak_moments, schedule_actions,
                     walk_chunk)
from .milp import CUTOFF_SLACK, MS, Choice, Layout, _no_banner, _solve, beyond, runs_of
from .partition import _splits
from .plan import Placed

MAX_LISTED = 4096      # a stage's layouts listed at most; past it milp.solve_layout describes them
ONCE_STEP = 1e-6       # each round of the sweep bounds the once-per-step work this much (relative, ms) below the last
BYTE_FIELDS = ("grads", "step_grads", "kept_unsharded", "left_after_backward", "per_micro_batch", "after_backward", "sent")
# A rank's program listed (RankProgram._enumerate): the pairs of a partial layout and a chunk's
# option looked at in one block, and the partial layouts kept; past the latter, HiGHS decides.
MAX_PAIRS = 2_000_000
MAX_ENUMERATED = 200_000


def within(bound: float) -> float:
    """A bound on a sum, less strict by rounding: sums taken in another order than the rows'."""
    return bound + 1e-12 * max(1.0, abs(bound))


@dataclass
class StageOptions:
    """One stage's listed layouts: per option its choices (in layer order) and what it brings."""

    picks: list[tuple[Choice, ...]]
    time_ms: np.ndarray          # (options,) time per micro-batch
    once_ms: np.ndarray          # (options,) once-per-step work (optimizer, unhidden gradient sync)
    static: np.ndarray           # (options,) bytes held all step (memory.ChunkWalk.static)
    fields: np.ndarray           # (options, BYTE_FIELDS) its StageBytes
    highest: dict                # (F | B, gradients exist) -> (options,) its highest record's bytes
    final_flat: np.ndarray       # (options,) its final reduction's largest flat buffer
    host: np.ndarray             # (options,) host bytes it offloads
    final: bool                  # some option's layers reduce at the step's end (memory.final_reduction_record)


def list_stage(model: CostModel, cand: Candidate, s: int, a: int, b: int, open_to: list[list[Choice]],
               runs: list[tuple[int, int]], cache: dict) -> StageOptions | None:
    """Every layout of the stage holding layers a..b (None past MAX_LISTED), evaluated; stages
    of the same layers, at the same ends of the model, share one list (`cache`)."""
    held = [(r, min(start + length - 1, b) - max(start, a) + 1) for r, (start, length) in enumerate(runs)
            if start <= b and start + length - 1 >= a]
    parts = [_splits(count, len(open_to[r])) for r, count in held]
    if math.prod(len(p) for p in parts) > MAX_LISTED:
        return None
    n = model.profile.n_layers
    key = (tuple(model.profile.layers[i].signature for i in range(a, b + 1)), a == 0, b == n - 1,
           tuple(tuple(open_to[r]) for r, _ in held))
    if key in cache:
        return cache[key]
    picks, rows = [], []
    for combo in itertools.product(*parts):
        pick = tuple(c for (r, _), split in zip(held, combo) for c, k in zip(open_to[r], split) for _ in range(int(k)))
        layers = [Placed(i, c.checkpoint, c.offload) for i, c in zip(range(a, b + 1), pick)]
        terms = model.stage_terms(cand, s, layers)
        walk = walk_chunk(model.chunk(cand, s, layers), reshard_after_backward=cand.pp == 1, input_is_held=True)
        picks.append(pick)
        rows.append((terms.per_micro_batch * MS, terms.once_per_step * MS, walk,
                     sum(model.layer(cand, i, ck, off).memory.host for i, ck, off in layers)))
    walks = [w for _, _, w, _ in rows]
    out = cache[key] = StageOptions(
        picks=picks,
        time_ms=np.array([t for t, *_ in rows]), once_ms=np.array([o for _, o, *_ in rows]),
        static=np.array([w.static for w in walks], dtype=np.float64),
        fields=np.array([[getattr(w.bytes, f) for f in BYTE_FIELDS] for w in walks], dtype=np.float64),
        highest={kg: np.array([w.highest[kg][0] for w in walks], dtype=np.float64)
                 for kg in itertools.product("FB", (False, True))},
        final_flat=np.array([w.final_flat for w in walks], dtype=np.float64),
        host=np.array([h for *_, h in rows], dtype=np.float64),
        final=any(w.reduces_at_end for w in walks))
    return out


def solve_listed(model: CostModel, cand: Candidate, choices: list[Choice], sizes: list[int], solver: str = "highs",
                 time_limit: float | None = None, memory: bool = True, cutoff: float | None = None,
                 run_choices: list[list[Choice]] | None = None) -> Layout | None:
    """milp.solve_layout's answer for a candidate with these stage sizes (the same layout space
    and statuses), rank by rank from listed stage layouts; None where it cannot be had so (a
    stage with more than MAX_LISTED layouts, a layer that must offload, a node holding ranks of
    two pipeline ranks whose offloads share its host memory): the caller then asks the MILP.

    The pp ranks share no layer and, but for host memory, no row: only the step couples them,
    through the sum and the largest of their times per micro-batch and the largest of their
    once-per-step work (CostModel.pipeline_step_s). For a bound w on the latter, each rank's
    fastest layout doing at most w once per step is its own small program, and the step is
    least with all of them. So w sweeps down from unbounded, each time below the fullest rank's
    work, re-solving only that rank, until the step with the least work any rank could do
    cannot beat the best found: the optimum is among the steps seen (a layout's work is at most
    some w of the sweep, where every rank is at least as fast as in it)."""
    if must_offload(cand, model.precision):
        return None
    runs = runs_of([layer.signature for layer in model.profile.layers])
    open_to = run_choices if run_choices is not None else [choices] * len(runs)
    starts = list(itertools.accumulate((0, *sizes)))
    cache: dict = {}
    stages = []
    for s in range(len(sizes)):
        listed = list_stage(model, cand, s, starts[s], starts[s + 1] - 1, open_to, runs, cache)
        if listed is None:
            return None
        stages.append(listed)
    limit = model.memory_limit if memory else None
    host_rows = _host_rows(model, cand, stages, limit)
    if host_rows is None:
        return None
    ranks = [RankProgram(model, cand, stages, rank, limit, host_rows.get(rank), solver) for rank in range(cand.pp)]

    m, v = cand.num_micro_batches, cand.virtual_stages
    if limit is None:
        best = _combine_frontiers(model, cand, [r.frontier() for r in ranks])
        return _layout(stages, starts, ranks, best, "optimal", cutoff)
    least_once = max(r.least_once for r in ranks)          # no layout's fullest rank does less
    most_time = math.inf                                    # a rank's time per micro-batch under the cutoff
    if cutoff is not None:
        most_time = (cutoff * MS * (1 + CUTOFF_SLACK) - least_once - sum(r.least_time for r in ranks) / v) / (m - 1 / v)
    deadline = None if time_limit is None else time.perf_counter() + time_limit
    status, best = "optimal", None
    found = [r.fastest(math.inf, most_time, deadline) for r in ranks]
    while all(f is not None for f in found):
        status = "time limit" if any(f.status == "time limit" for f in found) else status
        if any(f.picks is None for f in found):
            break
        times, once = [f.time_ms for f in found], [f.once_ms for f in found]
        step = _step(model, cand, times, once)
        if best is None or step < best[0]:
            best = (step, [f.picks for f in found])
        # The least work once per step a better layout can have: each of its ranks takes at most
        # `cap` a micro-batch (no rank is faster than now), and within that, even with no memory
        # limit, does at least its frontier's least (RankProgram.least_once_within); each floor
        # tightens the cap in turn.
        floor = least_once
        for _ in range(8):
            cap = (best[0] - sum(times) / v - floor) / (m - 1 / v) * (1 + 1e-9)
            tighter = max(r.least_once_within(cap) for r in ranks)
            if tighter <= floor:
                break
            floor = tighter
        if model.pipeline_step_s(m, v, sum(times), max(times), floor) >= best[0] * (1 - 1e-12):
            break                    # less work once per step cannot make up for the slower ranks
        # Below the fullest rank's work by more than the solver's feasibility tolerance
        # (1e-7 of a row), so that each round excludes it; values closer are the same work.
        w = max(once) - ONCE_STEP * max(1.0, max(once))
        found = [f if f.once_ms <= w else r.fastest(w, most_time, deadline) for r, f in zip(ranks, found)]
        if any(f is not None and f.once_ms > max(once) for f in found):
            break                    # (never seen: a solver that ignored the bound would loop)
    return _layout(stages, starts, ranks, best, status, cutoff)


def _layout(stages: list[StageOptions], starts: list[int], ranks: list["RankProgram"], best: tuple | None, status: str,
            cutoff: float | None) -> Layout:
    """The Layout of the best (step ms, per rank its options) found, or why none."""
    if best is None or beyond(best[0] / MS, cutoff):
        return Layout("cut off" if cutoff is not None else "infeasible", None, None)
    layout = [[]] * len(stages)
    for r, picks in zip(ranks, best[1]):
        for s, j in zip(r.stages, picks):
            layout[s] = [Placed(i, c.checkpoint, c.offload) for i, c in zip(range(starts[s], starts[s + 1]), stages[s].picks[j])]
    return Layout(status, layout, best[0] / MS)


def _step(model: CostModel, cand: Candidate, times: list[float], once: list[float]) -> float:
    """The step (ms) of ranks taking `times` a micro-batch and doing `once` once per step."""
    return model.pipeline_step_s(cand.num_micro_batches, cand.virtual_stages, sum(times), max(times), max(once))


def _combine_frontiers(model: CostModel, cand: Candidate, frontiers: list[list[tuple]]) -> tuple | None:
    """The best step of the ranks' (time, once, picks) frontiers: for each bound on the work
    once per step some rank's point has, every rank its fastest point within it."""
    best = None
    for w in sorted({o for f in frontiers for _, o, _ in f}):
        points = [next((p for p in f if p[1] <= w), None) for f in frontiers]      # each frontier fastest first
        if None in points:
            continue
        step = _step(model, cand, [t for t, _, _ in points], [o for _, o, _ in points])
        if best is None or step < best[0]:
            best = (step, [p[2] for p in points])
    return best


def _host_rows(model: CostModel, cand: Candidate, stages: list[StageOptions], limit: int | None) -> dict | None:
    """Per pp rank, the most of its ranks a node holds, where its offloads must fit the node's
    host memory (CostModel.host_peak_bytes); None where a node holds ranks of two pipeline
    ranks that offload (a row across ranks)."""
    if limit is None or not any(x.host.any() for x in stages):
        return {}
    rows: dict = {}
    for counts in model.ranks_per_stage_on_nodes(cand):
        holding = [rank for rank, n in enumerate(counts) if n]
        if len(holding) > 1:
            return None
        rows[holding[0]] = max(rows.get(holding[0], 0), counts[holding[0]])
    return rows


@dataclass
class RankFound:
    """A rank's fastest layout within a bound on its once-per-step work."""

    status: str                  # "optimal" | "time limit"
    picks: list[int] | None      # per stage of the rank, its option (None: the deadline came first)
    time_ms: float
    once_ms: float


class RankProgram:
    """One pp rank's program: one binary per (stage of the rank, option no other of its stage
    beats in every figure the program reads), each memory row of the rank within the limit."""

    def __init__(self, model: CostModel, cand: Candidate, stages: list[StageOptions], rank: int, limit: int | None,
                 host_ranks: int | None, solver: str):
        pp, v, m = cand.pp, cand.virtual_stages, cand.num_micro_batches
        self.stages = list(range(rank, len(stages), pp))
        self.options = [stages[s] for s in self.stages]
        self.limit, self.solver = limit, solver
        self.host_limit = model.hw.usable_host_bytes() / host_ranks if host_ranks else None
        cols: list[list[np.ndarray]] = [[] for _ in self.stages]    # chunk -> its options' bytes in each row
        if limit is not None:
            sends_held = holds_sends(cand.schedule)
            actions = schedule_actions(cand.schedule, pp, rank, m, v)
            for mo in peak_moments(actions, v, sends_held):    # every moment that can peak
                held = _held(mo, cand.pp == 1, v)
                for k, x in enumerate(self.options):
                    cols[k].append(x.static + x.fields @ held[k] + (x.highest[mo.kind, mo.grads_here] if k == mo.chunk else 0))
            if any(x.final for x in self.options):             # the final gradient reduction
                fin = _final(len(actions) // 2 // v if sends_held else 0, v)
                for biggest in range(v):                        # its largest flat buffer is some chunk's
                    for k, x in enumerate(self.options):
                        cols[k].append(x.static + x.fields @ fin[k] + (x.final_flat if k == biggest else 0))
            for k, x in enumerate(self.options):               # the optimizer step
                cols[k].append(x.static + x.fields[:, BYTE_FIELDS.index("step_grads")])
        rows = [np.stack(c, axis=1) if c else np.zeros((len(x.picks), 0)) for c, x in zip(cols, self.options)]
        host = self.host_limit is not None
        self.kept = [_undominated(np.column_stack([x.time_ms, x.once_ms, r] + ([x.host] if host else [])))
                     for x, r in zip(self.options, rows)]
        # A row another row tops for every kept option of every chunk never binds first; with
        # it gone, the options are pruned again on the rows left (which alone say what fits).
        binding = _undominated(-np.concatenate([r[kept] for r, kept in zip(rows, self.kept)]).T)
        self.rows = [r[:, binding] for r in rows]
        self.kept = [[kept[j] for j in _undominated(np.column_stack([x.time_ms, x.once_ms, r] + ([x.host] if host else []))[kept])]
                     for x, r, kept in zip(self.options, self.rows, self.kept)]
        self._frontier = None                 # frontier(), made when least_once_within first asks
        self.least_time = sum(x.time_ms[kept].min() for x, kept in zip(self.options, self.kept))
        self.least_once = sum(x.once_ms[kept].min() for x, kept in zip(self.options, self.kept))

    def least_once_within(self, most_time: float) -> float:
        """The least once-per-step work of any layout of the rank taking at most `most_time` a
        micro-batch, memory aside (inf where none is that fast): a floor, from its frontier."""
        if self._frontier is None:
            self._frontier = self.frontier()
        within = [o for t, o, _ in self._frontier if t <= most_time]
        return min(within) if within else math.inf

    def frontier(self) -> list[tuple[float, float, list[int]]]:
        """Without memory rows: every (time per micro-batch, once-per-step work, options) of
        the rank that no other beats in both, fastest first: each chunk's such options, summed
        chunk by chunk and pruned to the same frontier."""
        t, o, picks = np.zeros(1), np.zeros(1), np.zeros((1, 0), dtype=np.int64)
        for x, kept in zip(self.options, self.kept):
            kept = np.asarray(kept)
            t = (t[:, None] + x.time_ms[kept][None, :]).ravel()              # (points x options,)
            o = (o[:, None] + x.once_ms[kept][None, :]).ravel()
            picks = np.hstack([np.repeat(picks, len(kept), axis=0), np.tile(kept, len(picks))[:, None]])
            order = np.lexsort((o, t))                                       # fastest first, then least work
            least_before = np.concatenate([[np.inf], np.minimum.accumulate(o[order])[:-1]])
            order = order[o[order] < least_before]                           # less work than every faster one
            t, o, picks = t[order], o[order], picks[order]
        return [(float(a), float(b), [int(j) for j in row]) for a, b, row in zip(t, o, picks)]

    def fastest(self, most_once: float, most_time: float, deadline: float | None) -> RankFound | None:
        """The rank's fastest layout within the memory limit doing at most `most_once` once per
        step and taking at most `most_time` a micro-batch (ms); None where there is none.
        Status "time limit" with no picks where the deadline came first (HiGHS's branch and
        bound, where the enumeration (_enumerate) gave up)."""
        prob = lp.Model("rank")
        # z[k][j]: the rank's chunk k takes its option kept[k][j]
        z = [[prob.add_variable(f"z_c{k:03d}_o{j:05d}", cat="Binary") for j in range(len(kept))]
             for k, kept in enumerate(self.kept)]

        def total(figure) -> lp.Lin:
            """A figure of the rank's layout (per chunk, its options' values) as an expression."""
            return lp.lin_sum(lp.Lin({zj.index: float(values[j]) for zj, j in zip(z[k], kept) if values[j]})
                              for k, (values, kept) in enumerate(zip(figure, self.kept)))

        for k, zk in enumerate(z):
            prob += lp.lin_sum(zk) == 1, f"chunk{k}_takes_one_layout"
        for q in range(self.rows[0].shape[1]):
            prob += total([rows[:, q] for rows in self.rows]) * (1 / self.limit) <= 1, f"memory_row{q}"
        if self.host_limit is not None:
            prob += total([x.host for x in self.options]) * (1 / self.host_limit) <= 1, "host_memory"
        time_ms = total([x.time_ms for x in self.options])
        once_ms = total([x.once_ms for x in self.options])
        if most_once < math.inf:
            prob += once_ms <= most_once, "once_per_step_within_bound"
        if most_time < math.inf:
            prob += time_ms <= most_time, "time_within_cutoff"
        prob += time_ms, "time_per_micro_batch"
        if self.solver == "highs" and self.limit is not None:
            listed = self._enumerate(prob, most_once, most_time)
            if listed is not None:
                return listed[0]
        left = None if deadline is None else max(0.0, deadline - time.perf_counter())
        status = _solve(prob, self.solver, left)
        if status == "infeasible":
            return None
        if status != "optimal" and status != "time limit":          # the deadline, with nothing found
            return RankFound("time limit", None, math.inf, math.inf)
        picks = [kept[max(range(len(zk)), key=lambda j: zk[j].value())] for zk, kept in zip(z, self.kept)]
        return self._found(status, picks)

    def _found(self, status: str, picks: list[int]) -> RankFound:
        return RankFound(status, picks, sum(float(x.time_ms[j]) for x, j in zip(self.options, picks)),
                         sum(float(x.once_ms[j]) for x, j in zip(self.options, picks)))

    def _enumerate(self, prob: lp.Model, most_once: float, most_time: float) -> tuple[RankFound | None] | None:
        """The program's optimum without branch and bound, or None where its enumeration would
        hold more than MAX_ENUMERATED partial layouts (the MILP then decides): (RankFound,) or
        (None,) where no layout is within the rows.

        The linear relaxation's row duals give multipliers lam >= 0; with them every layout
        within the rows takes
            time >= g = sum over chunks of g_k(option) + const
        (each row's slack times its multiplier is >= 0), one term per chunk. So every layout
        faster than U has g < U: the layouts with g and time at most U are listed chunk by
        chunk (a partial one kept only while it can still meet every row, g and U), each
        checked exactly, and the fastest of them is the optimum. U starts just above the least
        g and doubles its distance from it until a layout is found (or passes every layout's
        time: none fits). Any lam >= 0 would make g a bound; the duals make its least the
        relaxation's, so few layouts are listed."""
        with _no_banner():
            relaxed = prob.solve_highs(None, 0.0, relax=True)
        if relaxed != "optimal":
            return (None,) if relaxed == "infeasible" else None
        dual = {name: abs(d) for (name, _), d in zip(prob.rows, prob.row_duals)}
        T = [np.asarray(x.time_ms[kept], dtype=np.float64) for x, kept in zip(self.options, self.kept)]
        O = [np.asarray(x.once_ms[kept], dtype=np.float64) for x, kept in zip(self.options, self.kept)]
        R = [np.asarray(rows[kept], dtype=np.float64) / self.limit for rows, kept in zip(self.rows, self.kept)]
        H = [np.asarray(x.host[kept], dtype=np.float64) / self.host_limit for x, kept in zip(self.options, self.kept)] \
            if self.host_limit is not None else [np.zeros(len(t)) for t in T]
        lam = np.array([dual.get(f"memory_row{q}", 0.0) for q in range(R[0].shape[1])])
        lam_host = dual.get("host_memory", 0.0)
        lam_once = dual.get("once_per_step_within_bound", 0.0) if most_once < math.inf else 0.0
        lam_time = dual.get("time_within_cutoff", 0.0) if most_time < math.inf else 0.0
        const = -lam.sum() - lam_host * (self.host_limit is not None) - lam_once * (most_once if lam_once else 0.0) \
            - lam_time * (most_time if lam_time else 0.0)
        G = [(1 + lam_time) * t + lam_once * o + r @ lam + lam_host * h for t, o, r, h in zip(T, O, R, H)]
        order = sorted(range(len(T)), key=lambda k: len(T[k]))        # the chunk of most options last
        K = len(order)
        least = lambda arrays: [sum(arrays[k].min(axis=0) for k in order[i:]) for i in range(K + 1)]  # noqa: E731
        least_g, least_t, least_o, least_r, least_h = (least(x) for x in (G, T, O, R, H))
        floor = least_g[0] + const
        top = sum(float(x.max()) for x in T)          # no layout takes longer
        bar = floor + max(1e-9, 1e-4 * abs(floor))
        while True:
            states = self._states(order, bar - const, G, T, O, R, H, least_g, least_t, least_o, least_r, least_h,
                                  most_once, min(most_time, bar))
            if states is None:
                return None
            t, o, fullest_row, picks = states
            if len(t):
                # ties (to a nanosecond) to less once-per-step work, then the lower peak
                j = int(np.lexsort((fullest_row, o, np.round(t, 6)))[0])
                return (self._found("optimal", [self.kept[k][int(picks[j, i])] for k, i in sorted(zip(order, range(K)))]),)
            if bar >= top:
                return (None,)
            bar = floor + 2 * (bar - floor)

    @staticmethod
    def _states(order, most_g, G, T, O, R, H, least_g, least_t, least_o, least_r, least_h, most_once, most_time):
        """Every layout with g at most `most_g` (less the constant) within every row: its
        time, once-per-step work, fullest row and options (per chunk in `order`); None past
        MAX_ENUMERATED."""
        g, t, o, h = (np.zeros(1) for _ in range(4))
        r = np.zeros((1, R[0].shape[1]))
        picks = np.zeros((1, 0), dtype=np.int64)
        for i, k in enumerate(order):
            n, kept, listed = len(G[k]), [], 0
            for lo in range(0, len(g), max(1, MAX_PAIRS // n)):     # (partial layouts x options) a block at a time
                sl = slice(lo, lo + max(1, MAX_PAIRS // n))
                t2 = (t[sl, None] + T[k][None, :]) + least_t[i + 1]
                o2 = (o[sl, None] + O[k][None, :]) + least_o[i + 1]
                idx = np.nonzero(((g[sl, None] + G[k][None, :]) + least_g[i + 1] <= within(most_g)).ravel()
                                 & (o2 <= within(most_once)).ravel() & (t2 <= within(most_time)).ravel()
                                 & ((h[sl, None] + H[k][None, :]) + least_h[i + 1] <= within(1.0)).ravel())[0]
                a, b = idx // n + lo, idx % n
                fits = (r[a] + R[k][b] + least_r[i + 1] <= within(1.0)).all(axis=1)
                kept.append((a[fits], b[fits]))
                listed += int(fits.sum())
                if listed > MAX_ENUMERATED:
                    return None
            if not kept:
                return np.zeros(0), np.zeros(0), np.zeros(0), np.zeros((0, len(order)), dtype=np.int64)
            a, b = np.concatenate([x for x, _ in kept]), np.concatenate([y for _, y in kept])
            g, t, o, h, r = g[a] + G[k][b], t[a] + T[k][b], o[a] + O[k][b], h[a] + H[k][b], r[a] + R[k][b]
            picks = np.hstack([picks[a], b[:, None]])
        return t, o, r.max(axis=1, initial=0.0), picks


@cache
def _held(mo: Moment, reshard_after_backward: bool, v: int) -> tuple[np.ndarray, ...]:
    """Per chunk, what each of its StageBytes fields adds to the bytes held at moment `mo` (held_at)."""
    def fn(stage_bytes):
        h = held_at(mo, [stage_bytes(j) for j in range(v)], reshard_after_backward)
        return h.grads + h.activations + h.buffers
    return tuple(_unit_rows(fn, v))


@cache
def _final(micro_batches: int, v: int) -> tuple[np.ndarray, ...]:
    """Per chunk, what each of its StageBytes fields adds to the final reduction's record
    (final_reduction_record, its flat buffer aside)."""
    def fn(stage_bytes):
        r = final_reduction_record([stage_bytes(j) for j in range(v)], 0, micro_batches)
        return r.grads + r.activations + r.buffers
    return tuple(_unit_rows(fn, v))


def _unit_rows(fn, v: int) -> list[np.ndarray]:
    """fn's coefficient of each StageBytes field of each chunk, by evaluating it on unit
    vectors: memory.py stays the one place that says what a moment holds."""
    return [np.array([fn(lambda j, k=k, f=f: StageBytes(**{f: 1}) if j == k else StageBytes()) for f in BYTE_FIELDS],
                     dtype=np.float64) for k in range(v)]


def _undominated(x: np.ndarray) -> list[int]:
    """Indices of the rows of x (options x figures, lower is better) that no other row beats
    or equals in every figure (of equal rows, the first), in order. A row's dominator has no
    larger sum, so the rows are taken by their sums, a block at a time, and each block is
    compared with itself and with the rows kept so far only: what a dropped row would drop,
    its dominator drops too (dominance is transitive). On VP 5 of the 70B on 512 GPUs the
    widest lists held 2,016 rows of which 469 were kept: about a quarter of the comparisons
    of every row with every row."""
    n = len(x)
    order = np.argsort(x.sum(axis=1), kind="stable")
    kept = np.zeros(0, dtype=np.int64)

    def drops(p: np.ndarray, q: np.ndarray) -> np.ndarray:
        """[i, j]: row p[i] drops row q[j] (no larger anywhere; unequal, or equal and first)."""
        covers = (x[p][:, None, :] <= x[q][None, :, :]).all(axis=2)
        ahead = (x[p][:, None, :] != x[q][None, :, :]).any(axis=2) | (p[:, None] < q[None, :])
        return covers & ahead
    for lo in range(0, n, 256):
        block = order[lo:lo + 256]
        alive = ~drops(block, block).any(axis=0) & ~drops(kept, block).any(axis=0)
        # (a kept row can fall only to a block row of the same sum, where rounding ordered them)
        kept = np.concatenate([kept[~drops(block[alive], kept).any(axis=0)], block[alive]])
    return sorted(int(j) for j in kept)
