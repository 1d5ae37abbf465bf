"""The search: every candidate layout, pruned by proven bounds, each solved exactly.

A candidate fixes the parallel degrees (dp, tp, pp), the micro-batch size and count, the
ZeRO stage and the pipeline schedule; `milp.solve_layout` then places layers, checkpointing
and offload (a pipeline of one stage a rank: `partition.StageSizeSearch`, by its stage
sizes). Candidates are visited in order of a lower bound on their step time (perfect
balance, nothing recomputed or offloaded); once that bound reaches the K-th best step time
found, no later candidate can enter the top K and the search stops. A candidate whose
memory lower bound exceeds the limit is skipped as infeasible. Nothing is sampled.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from profiles.schema import Profile

from .cost import Candidate, CostModel, Prediction, must_offload, tp_divides
from .hardware import Hardware
from .memory import Position, backward_records, forward_records, interleaved_rounds
from .milp import CHECKPOINT_FLAGS, Layout, beyond, choices_for, runs_of, solve_layout
from .parallel import Job, Workers
from .listed import solve_listed
from .partition import StageSizeSearch, even_stage_sizes
from .plan import CHECKPOINT_MODES, MULTI_STAGE_SCHEDULES, SCHEDULES, Placed, tp_within_nodes, wraps_layers


class SolveError(Exception):
    """Flags that cannot describe any layout; the message is one sentence with the fix."""


@dataclass
class SolveOptions:
    gpus: int
    hardware: Hardware
    gpus_per_node: int | None = None
    global_batch: int | None = None          # default: 8 samples per GPU
    memory_limit: int | None = None          # bytes per GPU; default: the hardware's usable memory
    top_k: int = 5
    solver: str = "highs"
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    micro_batch: int | None = None
    zero: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None         # stages per pp rank under a multi-stage schedule (pins it)
    checkpoint: str = "auto"                 # none | selective | all | auto (milp.CHECKPOINT_FLAGS)
    sequence_parallel: str = "auto"          # on | off | auto: under tp > 1, where the model's tp_plan offers it
    offload: str = "auto"                    # none | auto
    time_limit: float = 20.0                 # seconds per candidate's memory solve (a MILP, or a pipeline's stage sizes); past it the layout is reported as unproven
    workers: int | None = None               # processes solving candidates ahead (planner.parallel); default: the cores, 1: none

    @property
    def node_size(self) -> int:
        return self.gpus_per_node or self.hardware.gpus_per_node

    @property
    def batch(self) -> int:
        return 8 * self.gpus if self.global_batch is None else self.global_batch


@dataclass
class Solution:
    candidate: Candidate
    stages: list[list[Placed]]
    prediction: Prediction


@dataclass
class SearchResult:
    solutions: list[Solution]                          # best first
    candidates: int                                    # how many were enumerated
    solved: int                                        # candidates solved within the memory limit (a MILP or their stage sizes)
    pruned: int                                        # skipped by the time bound, or cut off by the K-th best time
    infeasible: int                                    # proven not to fit (bound or MILP)
    closest: Prediction | None = None                  # when nothing fits: the frugal layout that comes closest
    free_solved: int = 0                               # memory-free MILPs (the candidate's fastest layout, no limit)
    free_fits: int = 0                                 # of those, layouts that fit: the candidate's optimum, no memory MILP needed
    milps: int = 0                                     # MILPs with memory rows that ran (size-pinned ones among them)
    notes: list[str] = field(default_factory=list)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_options(profile: Profile, opts: SolveOptions) -> None:
    """Impossible flags fail before any work, with one sentence each."""
    n = opts.gpus
    if n < 1:
        raise SolveError(f"--gpus is {n}; give a positive number of GPUs.")
    if opts.memory_limit is not None and opts.memory_limit < 1:
        raise SolveError(f"--memory-limit is {opts.memory_limit} bytes; give a positive size such as 70GiB.")
    if opts.gpus_per_node is not None and opts.gpus_per_node < 1:
        raise SolveError(f"--gpus-per-node is {opts.gpus_per_node}; give a positive number of GPUs.")
    if n > opts.node_size and n % opts.node_size:
        raise SolveError(f"--gpus {n} is not a whole number of nodes of {opts.node_size} GPUs (torchrun starts as many "
                         f"processes on every node); use a multiple of {opts.node_size}, or the --gpus-per-node your nodes have.")
    for name in ("dp", "tp", "pp", "micro_batch"):
        v = getattr(opts, name)
        if v is not None and v < 1:
            raise SolveError(f"--{name.replace('_', '-')} is {v}; give a positive number.")
    pinned = {k: getattr(opts, k) for k in ("dp", "tp", "pp") if getattr(opts, k)}
    prod = 1
    for v in pinned.values():
        prod *= v
    if n % prod:
        what = " x ".join(f"--{k} {v}" for k, v in pinned.items()) + (f" = {prod}" if len(pinned) > 1 else "")
        raise SolveError(f"{n} GPUs cannot be split into the pinned degrees ({what}); pin degrees whose product divides --gpus.")
    if opts.dp and opts.tp and opts.pp and prod != n:
        raise SolveError(f"--dp {opts.dp} x --tp {opts.tp} x --pp {opts.pp} = {prod} is not --gpus {n}; make the product equal the GPU count.")
    if opts.pp and opts.pp > profile.n_layers:
        raise SolveError(f"--pp {opts.pp} is more pipeline stages than the model's {profile.n_layers} layers; use --pp {profile.n_layers} or fewer.")
    if opts.tp and not tp_divides(profile, opts.tp):
        raise SolveError(f"--tp {opts.tp} does not divide the dimensions the model's tp_plan splits or its tp_divides (head counts {profile.tp_divides or 'none given'}); use a tp that divides them.")
    if opts.tp and not tp_within_nodes(opts.tp, n, opts.node_size):
        raise SolveError(f"--tp {opts.tp} groups would straddle nodes of {opts.node_size} GPUs; tensor parallelism stays inside a node, use a --tp that divides {opts.node_size}.")
    g = opts.batch
    if g < 1:
        raise SolveError(f"--global-batch is {g}; give a positive number of samples.")
    if opts.dp and g % opts.dp:
        raise SolveError(f"--global-batch {g} is not divisible by --dp {opts.dp}; use a multiple of {opts.dp}.")
    if opts.micro_batch and opts.dp and g % (opts.dp * opts.micro_batch):
        raise SolveError(f"--global-batch {g} is not divisible by --dp {opts.dp} x --micro-batch {opts.micro_batch}; use a multiple of {opts.dp * opts.micro_batch}.")
    if opts.micro_batch and g % opts.micro_batch:
        raise SolveError(f"--global-batch {g} is not divisible by --micro-batch {opts.micro_batch}; use a multiple of it.")
    if opts.zero is not None and opts.zero not in (0, 1, 2, 3):
        raise SolveError(f"--zero {opts.zero} is not a ZeRO stage; use 0, 1, 2 or 3.")
    if opts.schedule is not None and opts.schedule not in SCHEDULES:
        raise SolveError(f"--schedule {opts.schedule} is not one the planner lays out; use {', '.join(SCHEDULES)}.")
    multi_stage = opts.schedule if opts.schedule in MULTI_STAGE_SCHEDULES else "interleaved"   # --virtual-stages alone: interleaved
    if opts.virtual_stages is not None:
        if opts.schedule not in (None, *MULTI_STAGE_SCHEDULES):
            raise SolveError(f"--virtual-stages applies to the interleaved and looped_bfs schedules, not {opts.schedule}; "
                             "use --schedule interleaved or drop --virtual-stages.")
        if opts.virtual_stages < 2:
            raise SolveError(f"--virtual-stages is {opts.virtual_stages}; the {multi_stage} schedule runs 2 or more stages a rank.")
        if opts.pp and opts.pp * opts.virtual_stages > profile.n_layers:
            raise SolveError(f"--pp {opts.pp} x --virtual-stages {opts.virtual_stages} is more stages than the model's "
                             f"{profile.n_layers} layers; use fewer.")
        if 2 * opts.virtual_stages > profile.n_layers:
            raise SolveError(f"--virtual-stages {opts.virtual_stages} needs {2 * opts.virtual_stages} layers for the "
                             f"fewest pipeline ranks (2) and the model has {profile.n_layers}; use --virtual-stages "
                             f"{profile.n_layers // 2} or fewer.")
    if opts.schedule == "looped_bfs" and ((opts.dp or 1) > 1 or profile.precision == "mixed"):
        why = f"--dp {opts.dp}" if (opts.dp or 1) > 1 else "a mixed-precision profile"
        raise SolveError(f"the looped_bfs schedule is planned without FSDP units only, and {why} makes every layer one; "
                         f"{LOOPED_BFS_NEEDS}: use --schedule interleaved, or --dp 1 with an fp32 or bf16 profile.")
    if (opts.schedule in MULTI_STAGE_SCHEDULES or opts.virtual_stages) and opts.pp == 1:
        raise SolveError(f"the {multi_stage} schedule needs pipeline stages; use --pp 2 or more, or leave --pp free.")
    if opts.checkpoint not in CHECKPOINT_FLAGS:
        raise SolveError(f"--checkpoint {opts.checkpoint} is not one of {', '.join(CHECKPOINT_FLAGS)}.")
    if opts.sequence_parallel not in ("on", "off", "auto"):
        raise SolveError(f"--sequence-parallel {opts.sequence_parallel} is not one of on, off, auto.")
    if opts.sequence_parallel == "on" and not profile.sequence_parallel:
        raise SolveError("--sequence-parallel on needs a tp_plan that names the model's norms as \"sequence\" modules "
                         "(none of its layers was profiled under sequence parallelism); add them and profile again, "
                         "or drop the flag.")
    if opts.sequence_parallel == "on" and opts.tp == 1:
        raise SolveError("--sequence-parallel on splits the activations of tensor-parallel layers; use --tp 2 or more, "
                         "or leave --tp free.")
    if opts.offload not in ("none", "auto"):
        raise SolveError(f"--offload {opts.offload} is not one of none, auto.")
    if opts.top_k < 1:
        raise SolveError(f"--top is {opts.top_k}; give 1 or more.")
    if opts.time_limit <= 0:
        raise SolveError(f"--time-limit is {opts.time_limit}; give a positive number of seconds.")
    if opts.solver not in ("cbc", "highs"):
        raise SolveError(f"--solver {opts.solver} is not cbc or highs.")
    if opts.workers is not None and opts.workers < 1:
        raise SolveError(f"--workers is {opts.workers}; give 1 (no workers) or more.")
    if not any(True for _ in enumerate_candidates(profile, opts)):
        raise SolveError(f"no layout of {n} GPUs matches the pinned flags and a global batch of {g}; unpin a degree or change --global-batch.")


def micro_batch_sizes(profile: Profile, per_replica: int, pinned: int | None) -> list[int]:
    """Powers of two (and the measured sizes) that divide the per-replica batch, up to 8x the
    largest measured size (beyond that the profile's linear fits are not trusted)."""
    if pinned:
        return [pinned] if per_replica % pinned == 0 else []
    cap = 8 * max(profile.batch_sizes)
    sizes = {b for b in profile.batch_sizes} | {1 << k for k in range(0, 20)}
    return sorted(b for b in sizes if b <= min(cap, per_replica) and per_replica % b == 0)


def enumerate_candidates(profile: Profile, opts: SolveOptions):
    n, g = opts.gpus, opts.batch
    for pp in divisors(n):
        if pp > profile.n_layers or (opts.pp and pp != opts.pp):
            continue
        for tp in divisors(n // pp):
            if (opts.tp and tp != opts.tp) or not tp_within_nodes(tp, n, opts.node_size) or not tp_divides(profile, tp):
                continue
            dp = n // (pp * tp)
            if (opts.dp and dp != opts.dp) or g % dp:
                continue
            for b in micro_batch_sizes(profile, g // dp, opts.micro_batch):
                m = g // (dp * b)
                for schedule, v in pipeline_schedules(profile, opts, pp, m):
                    for zero, fsdp, offload in _data_parallel_modes(profile, dp, opts):
                        if schedule == "looped_bfs" and fsdp:
                            continue    # (LOOPED_BFS_NEEDS)
                        for sp in sequence_parallel_modes(profile, opts, tp):
                            yield Candidate(dp, tp, pp, b, m, zero, schedule, fsdp, offload, v, sp)


def sequence_parallel_modes(profile: Profile, opts: SolveOptions, tp: int):
    """Sequence parallelism off, on, or both: only with tp > 1 and a tp_plan that names
    "sequence" modules (--sequence-parallel on leaves out the layouts without TP)."""
    offered = tp > 1 and profile.sequence_parallel
    if opts.sequence_parallel != "on":
        yield False
    if offered and opts.sequence_parallel != "off":
        yield True


# Why looped BFS is laid out without FSDP units (dp 1, not mixed precision, nothing offloaded):
# torch's runtime schedules reduce a stage's gradients and free its unsharded copies right after
# its last backward, where memory.walk_rank holds them to the step's end; under looped BFS a
# rank's later stage finishes long before its first, and the walk over-predicted the peak by
# 16-30% (bench/fidelity.py, pp2 x dp2). Under interleaved 1F1B, whose stages finish together
# in the cool-down, by 2.3% at most.
LOOPED_BFS_NEEDS = "the memory walk holds FSDP gradients to the step's end, where torch reduces each stage's after its last backward"

FREE_VIRTUAL_STAGES = (2,)   # v the search tries under a multi-stage --schedule when --virtual-stages is free


def pipeline_schedules(profile: Profile, opts: SolveOptions, pp: int, m: int):
    """(schedule, stages per rank) the runtime can run for pp ranks and m micro-batches: 1F1B,
    interleaved 1F1B and looped BFS need m >= pp (looped BFS: below it the step is longer than
    pipeline_step_s says, tests/test_step_time.py), and torch's interleaved schedule m a
    multiple of its rounds (m // pp of them; runtime/pipeline.schedule_problem); each stage
    needs a layer.

    The multi-stage schedules only when asked for (--schedule interleaved | looped_bfs,
    --virtual-stages): their memory MILPs couple a rank's stages and take 4-70x longer than
    1F1B's, and a free search with interleaved open went from 1.4 s to 61 s (80 layers on 64
    GPUs; docs/cost-model.md). Looped BFS has interleaved 1F1B's step and holds every
    micro-batch of every chunk at once: a free search would never prefer it."""
    multi = opts.schedule in MULTI_STAGE_SCHEDULES or opts.virtual_stages
    if pp == 1:
        if not multi:
            yield "1f1b", 1
        return
    pinned = opts.schedule or ("interleaved" if opts.virtual_stages else None)
    for schedule in SCHEDULES:
        if (pinned and schedule != pinned) or (schedule != "gpipe" and m < pp) or (schedule in MULTI_STAGE_SCHEDULES and not pinned):
            continue
        if schedule not in MULTI_STAGE_SCHEDULES:
            yield schedule, 1
            continue
        if schedule == "interleaved" and m % interleaved_rounds(pp, m):
            continue
        for v in ([opts.virtual_stages] if opts.virtual_stages else FREE_VIRTUAL_STAGES):
            if pp * v <= profile.n_layers:
                yield schedule, v


def _data_parallel_modes(profile: Profile, dp: int, opts: SolveOptions):
    """(zero, fsdp, allow_offload) the runtime can run for this dp degree."""
    zeros = [opts.zero] if opts.zero is not None else [0, 1, 2, 3]
    want_offload = opts.offload == "auto"
    for zero in zeros:
        if dp > 1:
            yield zero, True, want_offload
            continue
        # Nothing to shard with: the plain path, or FSDP2 units where offloading or mixed
        # precision needs them (zero 3: each unit's unsharded copy lives only while it computes).
        if zero == 0 and not wraps_layers(1, profile.precision, any_offload=False):
            yield 0, False, False
        if wraps_layers(1, profile.precision, want_offload) and (zero == 3 or (zero == 0 and profile.precision == "mixed")):
            yield zero, True, want_offload


def time_lower_bound(model: CostModel, cand: Candidate, choices) -> float:
    """No layout of this candidate is faster.

    step = (sum of the stages' times per micro-batch) / v + (m - 1/v) * tau + omega
    (CostModel.pipeline_step_s), with tau at least every rank's time per micro-batch (its v
    stages') and omega at least every rank's once-per-step work (CostModel.time_terms:
    optimizer and broadcasts, plus gradient collectives less what half the backward hides,
    never below 0). Both are at least their average over ranks, and the stages' times add up
    to at least their layers' and the loss's, so
        step >= sum over layers of min over choices of ((m + (pp - 1) / v) * t + once + sync - hidden) / pp
    and the same without the sync term; also tau is at least the fullest rank's time. Each
    layer's best choice is taken on its own: a lower bound.
    """
    m, pp, v = cand.num_micro_batches, cand.pp, cand.virtual_stages
    runs = runs_of([l.signature for l in model.profile.layers])
    share = model.sync_hidden_share
    with_sync = without_sync = 0.0
    fullest_run = 0.0                          # some stage holds ceil(len / pp) layers of each run
    fastest_each: list[float] = []             # every layer's fastest time per micro-batch
    for start, length in runs:
        best_w = best_wo = best_t = None
        for c in choices:
            lc = model.layer(cand, start, c.checkpoint, c.offload)
            t = lc.micro_batch_s
            wo = (m + (pp - 1) / v) * t + lc.step_s
            w = wo + lc.sync_s - share * lc.compute_s
            best_w = w if best_w is None else min(best_w, w)
            best_wo = wo if best_wo is None else min(best_wo, wo)
            best_t = t if best_t is None else min(best_t, t)
        with_sync += length * best_w
        without_sync += length * best_wo
        fullest_run = max(fullest_run, -(-length // pp) * best_t)
        fastest_each += [best_t] * length
    loss_s = model.loss(cand).micro_batch_s
    loss = (m + (pp - 1) / v) * loss_s
    # Some rank holds at least ceil(n / pp) layers, so it takes at least as long as that
    # many of the fastest layers; with pp > 1 it also exchanges one activation.
    n = len(fastest_each)
    fullest = max(fullest_run, sum(sorted(fastest_each)[: -(-n // pp)]))
    if pp > 1:
        smallest = min(model.sample(i, cand).input_bytes
                       for start, length in runs for i in (start, start + length - 1) if i > 0)
        fullest += model.time_terms(cand, 0.0, 0.0, smallest, 1, 0.0, 0.0, 0.0).per_micro_batch
    return max((with_sync + loss) / pp, (without_sync + loss) / pp,
               model.pipeline_step_s(m, v, sum(fastest_each) + loss_s, fullest, 0.0))


def memory_lower_bound(model: CostModel, cand: Candidate, choices) -> int:
    """No layout of this candidate needs less on its fullest rank.

    Some stage holds at least 1/pp of the model states that cannot leave the device, and
    every layer must fit its states with the smaller of its own forward and backward records
    (memory.forward_records, backward_records: the layer alone, its input not yet kept).
    """
    states = 0
    single = 0
    for start, length in runs_of([l.signature for l in model.profile.layers]):
        best_state, best_alone = None, None
        for c in choices:
            m = model.layer(cand, start, c.checkpoint, c.offload).memory
            st = m.weights + m.optim + m.grads
            at = Position(input_unless_kept=m.input, unsharded_through=m.kept_unsharded)
            compute = [r for r in forward_records(m, at, False, False) + backward_records(m, at, False, False, True)
                       if not r.phase]
            alone = m.weights + m.optim + m.buffers + min(r.grads + r.activations + r.buffers for r in compute)
            best_state = st if best_state is None else min(best_state, st)
            best_alone = alone if best_alone is None else min(best_alone, alone)
        states += length * best_state
        single = max(single, best_alone)
    return max(states // cand.pp, single)


# A search starts its workers (planner.parallel) once one candidate's solves took this long
# here, or at a candidate of several stages a rank on a model this deep (its one MILP holds
# every moment a rank's stages can peak: 3-15 s for NeMo's 70B layout). Where solves are
# short, the candidates a worker solves ahead under a cutoff that falls before the search
# reaches them, and the caches each worker fills again, cost more than the second core gives
# (the free solves of bench/solve_real.py, 1-4 s, took 5-15% longer with workers from the start).
PARALLEL_AFTER_SOLVE_S = 1.0
PARALLEL_MULTI_STAGE_LAYERS = 24
AHEAD_PER_WORKER = 2     # candidates handed out ahead of the search, per worker
STALE_WAIT_S = 0.25      # how long the search waits on a job asked under a looser cutoff than its own


def step_time_trust(profile: Profile, hardware, measured_here: bool) -> str:
    """How far the step times of a solve can be trusted, from what measured them against runs
    (docs/fidelity.md): said once, so that no table's figure reads as exact."""
    if measured_here and hardware.device_type == "cpu":
        return ("step times are predictions: on 4 CPU processes of a 2-core VM, 55 layouts of three models "
                "measured within 3-11% of them at the median and 14-22% at worst over the last three runs, and "
                "a layout's own step moved by 7-82% from one run to the next at the median, as the machine's "
                "speed moved (bench/time_fidelity.py, docs/fidelity.md)")
    if measured_here and profile.method == "measured":
        return ("step times are predictions: on one H200, single-GPU plans measured within 13% of them; "
                "layouts over several GPUs have not yet been checked on hardware (docs/fidelity.md)")
    return ("step times from FLOPs and bytes at the hardware's achievable rates are indicative: published runs "
            "with their layouts pinned measured -17% to 0% of them for torchtitan's eager PyTorch and +8% to "
            "+35% for NeMo's fused kernels (bench/results/published.md, docs/fidelity.md)")


def search(profile: Profile, opts: SolveOptions, on_progress: Callable[[int, int], None] | None = None) -> SearchResult:
    """The top-K fastest layouts that fit, best first."""
    check_options(profile, opts)
    model = CostModel(profile, opts.hardware, opts.node_size, opts.memory_limit)
    cands = list(enumerate_candidates(profile, opts))
    bounded = sorted(((time_lower_bound(model, c, choices_for(opts.checkpoint, opts.offload, c.allow_offload)), c)
                      for c in cands), key=lambda t: (t[0], t[1]))
    result = SearchResult([], len(cands), 0, 0, 0)
    if not model.measured_here:
        timed = (f"computed for {profile.hardware}" if profile.method == "fake"
                 else f"measured on {profile.device}")
        redo = (f"profile with --fake --hardware {opts.hardware.name}" if opts.hardware.device_type != "cpu"
                else "profile on the CPU the plan will run on")
        result.notes.append(f"the profile's times were {timed}; for {opts.hardware.name} each layer's time is "
                            f"estimated from its FLOPs, bytes and op count (indicative): {redo} to time its ops one by one")
    result.notes.append(step_time_trust(profile, opts.hardware, model.measured_here))
    busy = min(opts.gpus, opts.node_size)
    if opts.hardware.device_type == "cpu" and busy > opts.hardware.host_cores:
        result.notes.append(f"{busy} CPU processes share cores worth {opts.hardware.host_cores:.2f} processes at full "
                            "speed: their compute and a pipeline's overhead are costed slower by as many as are busy "
                            "at once (docs/cost-model.md)")
    misses: list[tuple[int, Candidate]] = []     # (memory lower bound, candidate) of those that do not fit
    known: dict[Candidate, float] = {}           # candidate -> a step time one of its fitting layouts reaches (exact, or seeded)
    seeds: dict[Candidate, tuple[float, list]] | None = None   # seed_steps: (step time, layout), made once
    one_f_one_b: dict[Candidate, float] = {}     # solved 1F1B candidates -> step time
    free_layouts: dict[Candidate, Layout] = {}   # 1F1B twin -> its memory-free MILP's answer
    memory_bound: dict[Candidate, int] = {}      # memory_lower_bound, asked once
    needed_of: dict[Candidate, list[list]] = {}  # fastest_choices, asked once

    def cutoff_now() -> float | None:
        """Once K candidates are known to reach some step time, a candidate matters only if it
        can beat the K-th smallest of those: the K best optima are no slower."""
        return sorted(known.values())[opts.top_k - 1] if len(known) >= opts.top_k else None

    def triage(k: int) -> str:
        """What candidate k asks for as things stand: "stop" (no later candidate can enter the
        top K), "no fit" (its memory bound is over the limit), "seeds" (the cutoff is to be
        seeded first), "pruned" (its time bound cannot beat the K-th) or "solve"."""
        bound, cand = bounded[k]
        if len(result.solutions) >= opts.top_k and bound >= result.solutions[opts.top_k - 1].prediction.step_s:
            return "stop"
        choices = choices_for(opts.checkpoint, opts.offload, cand.allow_offload)
        if cand not in memory_bound:
            memory_bound[cand] = memory_lower_bound(model, cand, choices)
        if memory_bound[cand] > model.memory_limit:
            return "no fit"
        if cand not in needed_of:            # per run, what a memory-free optimum can need
            needed_of[cand] = fastest_choices(model, cand, choices)
        if seeds is None and len(known) < opts.top_k and not takes_its_choices(model, cand, needed_of[cand]):
            return "seeds"                   # before the first MILP without a cutoff
        return "pruned" if beyond(bound, cutoff_now()) else "solve"

    # Workers (planner.parallel) solve the candidates the search will reach next, each with the
    # cutoff of the moment it was handed out; the search takes an answer only where it is the
    # one it would have got itself (Outcome), so the plan is the same with or without them.
    n_workers = available_cores() if opts.workers is None else opts.workers
    workers = None
    handed: dict[Candidate, Job] = {}            # candidate -> its job (args: a SolveJob), until taken
    scanned = 0                                  # candidates before this one have been looked at to hand out
    slowest_here = 0.0                           # the longest a candidate's solves took here

    def job_args(cand: Candidate) -> SolveJob:
        return SolveJob(cand, choices_for(opts.checkpoint, opts.offload, cand.allow_offload), needed_of[cand], cutoff_now(),
                        free_layouts.get(one_f_one_b_twin(cand)))

    def hand_out(k: int) -> None:
        """Keep AHEAD_PER_WORKER candidates a worker handed out, from candidate k on, each
        with the cutoff of now (those not yet started are handed out again when it fell)."""
        nonlocal workers, scanned, n_workers
        if workers is not None and workers.broken:
            return
        if workers is None:
            slow = slowest_here >= PARALLEL_AFTER_SOLVE_S or (
                bounded[k][1].virtual_stages > 1 and profile.n_layers >= PARALLEL_MULTI_STAGE_LAYERS)
            if n_workers < 2 or not slow:
                return
            try:
                workers = Workers(profile, opts, n_workers)
            except OSError:                  # no process can be started here: the search goes on alone
                n_workers = 1
                return
        cutoff = cutoff_now()
        for cand, job in list(handed.items()):
            if job.args.cutoff != cutoff and job.future.cancel():
                handed[cand] = workers.submit(job_args(cand))
        scanned = max(scanned, k)
        while len(handed) < AHEAD_PER_WORKER * n_workers and scanned < len(bounded):
            verdict = triage(scanned)
            if verdict in ("stop", "seeds"):
                return                       # (a verdict that changes: look again next time)
            cand = bounded[scanned][1]
            scanned += 1                     # "no fit" and "pruned" stay so: the cutoff only falls
            if verdict == "solve":
                handed[cand] = workers.submit(job_args(cand))

    def taken(cand: Candidate) -> Outcome | None:
        """The candidate's Outcome from its job, if one was handed out. One asked under a
        looser cutoff than now's may take far longer than the search would (a proof of an
        optimum it now cuts off): past STALE_WAIT_S it is abandoned, and solved here."""
        job = handed.pop(cand, None)
        if job is None:
            return None
        try:
            if job.args.cutoff != cutoff_now():
                wait([job.future], timeout=STALE_WAIT_S)
                if not job.future.done():
                    workers.abandon(job)
                    return None
            return job.future.result()
        except Exception:                    # a worker that failed or was stopped: the search solves it itself
            return None

    def add_solution(cand: Candidate, stages, pred: Prediction) -> None:
        """A candidate's best layout, which fits: its step is known, and it is listed if in the top K."""
        if cand.schedule == "1f1b" and cand.pp > 1:
            one_f_one_b[cand] = pred.step_s
        known[cand] = pred.step_s
        result.solutions.append(Solution(cand, stages, pred))
        result.solutions.sort(key=_rank)
        del result.solutions[opts.top_k:]

    try:
        for k, (bound, cand) in enumerate(bounded):
            if on_progress:
                on_progress(k, len(bounded))
            verdict = triage(k)
            if verdict == "seeds":
                seeds = seed_steps(model, opts, bounded[k:])
                known = {**{c: step for c, (step, _) in seeds.items()}, **known}
                verdict = triage(k)
            if verdict == "stop":
                result.pruned += len(bounded) - k
                break
            if verdict == "no fit":
                result.infeasible += 1
                misses.append((memory_bound[cand], cand))
                continue
            if verdict == "pruned":
                result.pruned += 1
                continue
            choices = choices_for(opts.checkpoint, opts.offload, cand.allow_offload)
            needed, cutoff = needed_of[cand], cutoff_now()
            hand_out(k)
            outcome = taken(cand)
            solving = time.perf_counter()
            # The fastest layout with no memory limit (the memory-free MILP, no memory rows) is a
            # lower bound for this candidate, and when it fits, the candidate's optimum.
            # The schedule enters only the memory rows, so a GPipe candidate's memory-free MILP is its
            # 1F1B twin's: solved once. (A cutoff only falls, so a cut-off twin vouches for it too.)
            twin = one_f_one_b_twin(cand)
            free = free_layouts.get(twin)
            if free is None or free.status == "time limit":
                answer = outcome.free_answer(cutoff) if outcome else None
                free, milps = answer or memory_free_layout(model, cand, choices, needed, opts, cutoff)
                result.free_solved += milps
                free_layouts[twin] = free
            if free.status == "optimal" and beyond(free.objective, cutoff):
                free = Layout("cut off", None, None)
            if free.status == "cut off":           # not even without a memory limit faster than the K-th
                result.pruned += 1
                continue
            if free.status == "optimal":
                if cand.schedule == "gpipe" and gpipe_only_ties(twin, free.objective, one_f_one_b):
                    result.pruned += 1
                    continue
                # Simplified only where it fits and may be listed (outside_top_k): undoing checkpointing
                # or offload adds memory, and a layout that does not fit goes on to the memory solve,
                # which reaches the same step if any fitting layout does (the 405B shape: 134 of
                # these, none changed by simplify, took 1.9 of its 13 s).
                free_stages, free_pred = free.stages, fitting_prediction(model, cand, free.stages)
                if free_pred is not None and not outside_top_k(result, opts.top_k, free_pred.step_s):
                    free_stages = simplify(model, cand, free.stages, CHECKPOINT_FLAGS[opts.checkpoint])
                    free_pred = model.evaluate(cand, free_stages)
                if free_pred is not None and free_pred.fits:
                    result.free_fits += 1
                    add_solution(cand, free_stages, free_pred)
                    continue
            result.solved += 1
            bound = free.objective if free.status == "optimal" else None
            answer = outcome.memory_answer(cutoff, bound) if outcome else None
            layout, milps = answer or solve_memory_layout(model, cand, choices, opts, cutoff, bound)
            slowest_here = max(slowest_here, time.perf_counter() - solving)
            result.milps += milps
            if layout.status == "cut off":
                # (A cut-off 1F1B twin does not vouch for its GPipe twin: that one is asked with the
                # same cutoff, usually as quickly as a memory-free bound would be found.)
                result.pruned += 1
                continue
            if layout.status == "time limit":
                result.notes.append(f"{cand.describe()}: the solver hit its {opts.time_limit:.0f} s limit; its layout is the best found, not proven optimal")
            seed = (seeds or {}).get(cand)
            stages = pred = None
            if layout.stages is not None:
                stages, pred = layout.stages, model.evaluate(cand, layout.stages)
                if not (pred.fits and outside_top_k(result, opts.top_k, pred.step_s)):
                    stages = simplify(model, cand, layout.stages, CHECKPOINT_FLAGS[opts.checkpoint])
                    pred = model.evaluate(cand, stages)
                if not pred.fits:
                    # The MILP's rows are the walk's records, so this means a solver tolerance let a
                    # layout through that the cost model says does not fit: never list it.
                    result.notes.append(f"{cand.describe()}: the solver's layout peaks at {pred.peak_bytes / 2**30:.2f} GiB, "
                                        "over the limit by the cost model; left out")
                    stages = pred = None
            if seed is not None and (pred is None or pred.step_s > seed[0]):
                # A seeded candidate counts in the cutoff, so it is listed with its seed layout where
                # the solver found nothing better in its time: the cutoff's promise is kept.
                result.notes.append(f"{cand.describe()}: the solver found nothing faster than an even split in its "
                                    f"{opts.time_limit:.0f} s; that layout is listed, not proven optimal")
                stages = seed[1]
                pred = model.evaluate(cand, stages)
            if pred is None and layout.stages is None and cutoff is not None:
                # Stopped at the time limit before finding a layout faster than the K-th best.
                result.notes.append(f"{cand.describe()}: the solver hit its {opts.time_limit:.0f} s limit before finding a layout "
                                    f"faster than the {opts.top_k}th best; not proven slower")
                result.pruned += 1
                continue
            if pred is None:
                result.infeasible += 1
                if layout.stages is None:
                    misses.append((memory_bound[cand], cand))
                continue
            add_solution(cand, stages, pred)
    finally:
        if workers is not None:
            workers.close()
    if on_progress:
        on_progress(len(bounded), len(bounded))
    if not result.solutions and misses:
        result.closest = closest_miss(model, opts, misses)
    measured = max(profile.batch_sizes)
    if profile.method == "measured" and result.solutions and result.solutions[0].candidate.micro_batch_size > measured:
        b = result.solutions[0].candidate.micro_batch_size
        # bench/pipeline_contention.py: the MLP's one micro-batch of 16, its sub-millisecond
        # layers extended from 1, 2 and 4, was predicted 60-85% slower than it ran.
        result.notes.append(f"the best layout's micro-batch of {b} is beyond the profiled sizes (up to {measured}): its "
                            f"layer times are extended along a line through them; profile with --batch-sizes "
                            f"{','.join(map(str, sorted(set(profile.batch_sizes) | {b})))} to measure it")
    return result


def available_cores() -> int:
    """The cores this process may run on (its affinity where the OS says)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                   # (macOS, Windows)
        return os.cpu_count() or 1


def fitting_prediction(model: CostModel, cand: Candidate, stages) -> Prediction | None:
    """The layout's prediction where it fits, else None: a memory-free layout that fits is its
    candidate's optimum, and settles it (checked rank by rank first, stopping at the first rank
    over the limit, before the whole evaluation)."""
    if model.overfills_a_rank(cand, stages):
        return None
    pred = model.evaluate(cand, stages)
    return pred if pred.fits else None


def one_f_one_b_twin(cand: Candidate) -> Candidate:
    """The 1F1B candidate a GPipe one shares its memory-free MILP with (the schedule enters only
    the memory rows); any other candidate is its own."""
    return dataclasses.replace(cand, schedule="1f1b") if cand.schedule == "gpipe" else cand


def _looser(then: float | None, now: float | None) -> bool:
    """Whether cutoff `then` lets through every layout cutoff `now` does (None: no cutoff)."""
    return then is None or (now is not None and then >= now)


class SolveJob(NamedTuple):
    """A candidate's solves as handed to a worker: solve_candidate's arguments after the model
    and options (a tuple, so a worker passes it on as they are)."""

    cand: Candidate
    choices: list
    needed: list[list]
    cutoff: float | None         # the cutoff of the moment it was handed out
    given: Layout | None         # its 1F1B twin's memory-free answer, if known


@dataclass
class Outcome:
    """What solve_candidate found for a candidate, and the cutoff it was asked with; the
    search takes an answer from it only where it is the one it would get itself now."""

    cutoff: float | None
    free: Layout | None          # the memory-free answer it solved (None: it went on from its twin's)
    free_milps: int
    used: Layout                 # the memory-free answer it went on from
    memory: Layout | None        # the memory solve's answer (None: the memory-free answer settled it)
    memory_milps: int

    def free_answer(self, cutoff: float | None) -> tuple[Layout, int] | None:
        """The memory-free answer and its MILPs, if the search would get it with `cutoff`: asked
        with the same cutoff, or cut off (or slower than `cutoff`) under a looser one."""
        if self.free is None:
            return None
        if self.cutoff == cutoff:
            return self.free, self.free_milps
        if _looser(self.cutoff, cutoff) and (self.free.status == "cut off" or (
                self.free.status == "optimal" and beyond(self.free.objective, cutoff))):
            return Layout("cut off", None, None), self.free_milps
        return None

    def memory_answer(self, cutoff: float | None, bound: float | None) -> tuple[Layout, int] | None:
        """The memory solve's answer and its MILPs, if the search would get it with `cutoff`
        and lower bound `bound`: asked with both the same, or cut off (or slower than `cutoff`,
        or infeasible) under a looser cutoff, which a lower bound does not change."""
        if self.memory is None:
            return None
        status = self.memory.status
        if _looser(self.cutoff, cutoff) and (status in ("cut off", "infeasible") or (
                status == "optimal" and beyond(self.memory.objective, cutoff))):
            return Layout("cut off" if cutoff is not None else "infeasible", None, None), self.memory_milps
        if self.cutoff == cutoff and (self.used.objective if self.used.status == "optimal" else None) == bound:
            return self.memory, self.memory_milps
        return None


def solve_candidate(model: CostModel, opts: SolveOptions, cand: Candidate, choices, needed: list[list],
                    cutoff: float | None, given: Layout | None) -> Outcome:
    """A candidate's solves as the search asks them under this cutoff (a worker's job,
    planner.parallel): its memory-free layout, unless `given` (its 1F1B twin's answer), then,
    unless that answer is cut off or fits, its memory solve."""
    free, free_milps, used = None, 0, given
    if given is None or given.status == "time limit":
        free, free_milps = memory_free_layout(model, cand, choices, needed, opts, cutoff)
        used = free
    settled = used.status == "cut off" or (used.status == "optimal" and (
        beyond(used.objective, cutoff) or fitting_prediction(model, cand, used.stages) is not None))
    if settled:
        return Outcome(cutoff, free, free_milps, used, None, 0)
    bound = used.objective if used.status == "optimal" else None
    memory, milps = solve_memory_layout(model, cand, choices, opts, cutoff, bound)
    return Outcome(cutoff, free, free_milps, used, memory, milps)


CLOSEST_TRIED = 32   # no-fit explanation: frugal layouts evaluated, of the candidates with the lowest bounds


def closest_miss(model: CostModel, opts: SolveOptions, misses: list[tuple[int, Candidate]]) -> Prediction:
    """Of the candidates that do not fit, the frugal layout that peaks lowest on the device
    (then on the host): a layout that fits once the limits are that high (a lower bound on
    memory would not be one)."""
    tried = []
    for _, cand in sorted(misses, key=lambda t: (t[0], t[1]))[:CLOSEST_TRIED]:
        stages = frugal_layout(model, cand, choices_for(opts.checkpoint, opts.offload, cand.allow_offload))
        tried.append(model.evaluate(cand, stages))
    return min(tried, key=lambda p: (p.peak_bytes, p.host_peak_bytes, p.candidate))


def frugal_fit(profile: Profile, opts: SolveOptions) -> Candidate | None:
    """A candidate whose frugal layout fits, or None: a quick, sufficient test (no MILP) of
    whether anything fits, for the no-fit explanation's "with more GPUs"."""
    check_options(profile, opts)
    model = CostModel(profile, opts.hardware, opts.node_size, opts.memory_limit)
    bounded = []
    for cand in enumerate_candidates(profile, opts):
        choices = choices_for(opts.checkpoint, opts.offload, cand.allow_offload)
        bound = memory_lower_bound(model, cand, choices)
        if bound <= model.memory_limit:
            bounded.append((bound, cand, choices))
    for _, cand, choices in sorted(bounded, key=lambda t: (t[0], t[1]))[:CLOSEST_TRIED]:
        if model.evaluate(cand, frugal_layout(model, cand, choices)).fits:
            return cand
    return None


def frugal_layout(model: CostModel, cand: Candidate, choices) -> list[list[Placed]]:
    """Layers split evenly over the stages, each with the choice that keeps the least on the
    device (checkpointed, and offloaded where offload is open)."""
    return uniform_layout(model, cand, max(choices, key=lambda ch: (ch.offload, CHECKPOINT_MODES.index(ch.checkpoint))))


def uniform_layout(model: CostModel, cand: Candidate, c) -> list[list[Placed]]:
    """Layers split evenly over the stages (even_stage_sizes), every one with choice c."""
    bounds = list(itertools.accumulate(even_stage_sizes(model.profile.n_layers, cand.n_stages), initial=0))
    return [[Placed(i, c.checkpoint, c.offload) for i in range(a, b)] for a, b in zip(bounds, bounds[1:])]


SEED_TRIED = 4   # seeding the cutoff: candidates tried per layout wanted (top K), in bound order


def seed_steps(model: CostModel, opts: SolveOptions, bounded) -> dict[Candidate, tuple[float, list]]:
    """Step times some candidates are known to reach, before any MILP: of each candidate in
    bound order, the fastest fitting layout that splits layers evenly with one choice for all,
    until K candidates have one (or SEED_TRIED x K were tried). Each is an upper bound on its
    candidate's optimum, so the K-th smallest is a cutoff from the start: the K best optima are
    no slower. Without it the first K candidates, the lowest bounds, ran without a cutoff, and
    the deep pipelines among them took 10-20 s each to be solved to optimality only to be
    beaten (80 GPT blocks on 8192 GPUs: four such MILPs, 69 s)."""
    seeds: dict[Candidate, tuple[float, list]] = {}
    for k, (_, cand) in enumerate(bounded):
        if len(seeds) >= opts.top_k or k >= SEED_TRIED * opts.top_k:
            break
        if cand.pp > 1 and cand.schedule == "gpipe":
            continue            # the search leaves out a GPipe layout that ties its 1F1B twin: no promise to keep
        choices = choices_for(opts.checkpoint, opts.offload, cand.allow_offload)
        if memory_lower_bound(model, cand, choices) > model.memory_limit:
            continue
        for c in choices:
            if must_offload(cand, model.precision) and not c.offload:
                continue
            stages = uniform_layout(model, cand, c)
            pred = model.evaluate(cand, stages)
            if pred.fits and (cand not in seeds or pred.step_s < seeds[cand][0]):
                seeds[cand] = (pred.step_s, stages)
    return seeds


def takes_its_choices(model: CostModel, cand: Candidate, needed: list[list]) -> bool:
    """Whether the candidate's memory-free optimum needs no MILP: one stage, one choice left per
    run (fastest_choices), and an offloaded one among them where the candidate must offload."""
    return (cand.pp == 1 and all(len(o) == 1 for o in needed)
            and not (must_offload(cand, model.precision) and not any(o[0].offload for o in needed)))


FREE_TIME_LIMIT_S = 2.0   # the memory-free MILP is a shortcut: past this, the full MILP decides
# A multi-stage candidate's rank-by-rank sweep (planner.listed) within the memory limit: NeMo's
# Llama 70B VP 5 candidates took 1-9 s each (2 cores; their MILPs 5-20 s, one unproven at its
# 20 s limit); past this the MILP decides.
LISTED_BUDGET_S = 15.0


def fastest_choices(model: CostModel, cand: Candidate, choices: list) -> list[list]:
    """Per run of identical layers, the choices a layout with no memory limit needs; the
    others are proven never to make it faster.

    A layer's choice enters the step only through three sums over its stage (TimeTerms): the
    time per micro-batch T (micro_batch_s), the once-per-step work (step_s) and the sync less
    the backward's window (sync_s - share x compute_s, share = collective_overlap x 0.5; the
    stage exposes its positive part). Switch one layer of any layout from choice c' to a
    choice c with T_c <= T_c': the stages' sum falls by T_c' - T_c, the slowest stage cannot
    grow, and the fullest once-per-step work grows by at most
        max(0, (step_c - step_c') + max(0, sync_window_c - sync_window_c')),
    so the step (CostModel.pipeline_step_s) does not grow when that is at most T_c' - T_c.
    Then c' is dropped: switching every such layer, one at a time, turns a fastest layout
    into one that uses only what is left (each c is earlier in (T, order) than the c' it
    replaces, so the switches end). This drops, for one, offload where its host copies cost
    more than the sync it takes off the step's end, and checkpointing where the recompute
    costs more than the sync it hides; taken run by run, an embedding that recomputes for
    free keeps its checkpointed choice without holding the blocks to theirs. Where offload is
    the candidate's reason to exist (must_offload), an offload choice is replaced only by
    another. A Llama 70B on 16 stages is left one choice per run: its memory-free MILP takes
    0.5 s where over four choices it took 8 s.
    """
    share = model.sync_hidden_share
    keep_offload = must_offload(cand, model.precision)
    per_run = []
    for start, _ in runs_of([layer.signature for layer in model.profile.layers]):
        cost = {c: model.layer(cand, start, c.checkpoint, c.offload) for c in choices}
        t = {c: cost[c].micro_batch_s for c in choices}
        window = {c: cost[c].sync_s - share * cost[c].compute_s for c in choices}
        order = {c: k for k, c in enumerate(choices)}

        def replaces(c, other) -> bool:
            """Switching a layer from `other` to `c` never slows the step."""
            if (t[c], order[c]) >= (t[other], order[other]) or (keep_offload and c.offload != other.offload):
                return False
            grows = max(0.0, cost[c].step_s - cost[other].step_s + max(0.0, window[c] - window[other]))
            return grows <= t[other] - t[c]
        per_run.append([c for c in choices if not any(replaces(o, c) for o in choices)])
    return per_run


def memory_free_layout(model: CostModel, cand: Candidate, choices, needed: list[list], opts: SolveOptions,
                       cutoff: float | None) -> tuple[Layout, int]:
    """The candidate's fastest layout with no memory limit (a lower bound on its step, and its
    optimum when it fits), and how many MILPs that took; `needed`: fastest_choices. Where it
    takes its choices (takes_its_choices) every layer takes its run's one choice, no MILP.
    Status "skipped" for one stage where some run keeps two or more choices: its memory MILP
    is small, and the shortcut is never needed for exactness."""
    if takes_its_choices(model, cand, needed):
        runs = runs_of([layer.signature for layer in model.profile.layers])
        stages = [[Placed(i, o[0].checkpoint, o[0].offload) for (start, length), o in zip(runs, needed)
                   for i in range(start, start + length)]]
        return Layout("optimal", stages, model.evaluate(cand, stages).step_s), 0
    if cand.pp == 1 and any(len(o) > 1 for o in needed):
        return Layout("skipped", None, None), 0
    limit = FREE_TIME_LIMIT_S if opts.time_limit is None else min(FREE_TIME_LIMIT_S, opts.time_limit)
    sizes = pinned_stage_sizes(model, cand)
    listed = sizes and solve_listed(model, cand, choices, sizes, opts.solver, time_limit=limit, memory=False,
                                    cutoff=cutoff, run_choices=needed)
    return listed or solve_layout(model, cand, choices, opts.solver, time_limit=limit, memory=False, cutoff=cutoff,
                                  run_choices=needed, stage_sizes=sizes), 1


def pinned_stage_sizes(model: CostModel, cand: Candidate) -> list[int] | None:
    """The stage sizes a candidate's layouts must have: even under a multi-stage schedule
    (partition.even_stage_sizes says why), free otherwise."""
    return even_stage_sizes(model.profile.n_layers, cand.n_stages) if cand.virtual_stages > 1 else None


def solve_memory_layout(model: CostModel, cand: Candidate, choices, opts: SolveOptions, cutoff: float | None,
                        lower_bound: float | None) -> tuple[Layout, int]:
    """The candidate's best layout within the memory limit (milp.solve_layout's statuses), and
    how many MILPs that took.

    A pipeline of one stage a rank (1F1B, GPipe) is solved by its stage sizes
    (planner.partition): best first by a bound that sees each stage's memory, each vector
    without a MILP where a stage's layouts can be listed, by a size-pinned MILP where not. Its
    MILP over every layout at once could find its answer in a second and then spend its whole
    limit proving it: the Llama 70B on 64 GPUs spent 96 of 116 s in five such MILPs; by stage
    sizes they take 0.1-0.3 s each; on 512 GPUs its 41 pipeline candidates take 0.003-0.36 s
    (median 0.006 s, one pinned MILP in all) where their MILPs took 0.07-0.25 s, the slowest 1.3 s.
    A pipeline of several stages a rank is solved rank by rank from its stages' listed layouts
    (planner.listed; NeMo's 70B VP 5 candidates in 1-9 s where their MILPs took 5-9 s and
    one stopped at its 20 s limit), by the MILP where that cannot be had or took its budget."""
    if cand.pp > 1 and cand.virtual_stages == 1:
        return StageSizeSearch(model, cand, choices, opts.solver).solve(time_limit=opts.time_limit, cutoff=cutoff,
                                                                        lower_bound=lower_bound)
    sizes = pinned_stage_sizes(model, cand)
    budget = LISTED_BUDGET_S if opts.time_limit is None else min(LISTED_BUDGET_S, opts.time_limit)
    listed = sizes and solve_listed(model, cand, choices, sizes, opts.solver, time_limit=budget, cutoff=cutoff)
    if listed and listed.status != "time limit":
        return listed, 1
    # Not proven within its budget: the MILP decides, under the best step the sweep found.
    found = listed.objective if listed and listed.stages else None
    bar = cutoff if found is None else found if cutoff is None else min(found, cutoff)
    milp = solve_layout(model, cand, choices, opts.solver, time_limit=opts.time_limit, cutoff=bar,
                        lower_bound=lower_bound, stage_sizes=sizes)
    if found is not None and not beyond(found, cutoff) and milp.status in ("cut off", "time limit") \
            and (milp.objective is None or found <= milp.objective):
        # nothing beats the sweep's layout, or the MILP stopped before it did
        return Layout("optimal" if milp.status == "cut off" else "time limit", listed.stages, found), 2
    return milp, 1 + bool(listed)


def gpipe_only_ties(twin: Candidate, free_step_s: float, one_f_one_b: dict[Candidate, float]) -> bool:
    """Whether a GPipe candidate can at best tie its solved 1F1B `twin` (same degrees,
    micro-batching, ZeRO). Both schedules take CostModel.pipeline_step_s, so with no memory
    limit they share the fastest layout (`free_step_s`), a lower bound for both; if the twin
    already reached it, no GPipe layout is faster, and the tie is not listed twice. (1F1B
    candidates are visited first: they sort before GPipe.)"""
    return twin in one_f_one_b and one_f_one_b[twin] <= free_step_s * (1 + 1e-9)


def simplify(model: CostModel, cand: Candidate, stages, modes: list[str] = CHECKPOINT_FLAGS["auto"]):
    """Drop checkpointing or offload the solver chose where it buys nothing; `modes`: the
    checkpoint modes open (milp.CHECKPOINT_FLAGS; one mode: the user pinned it, it stays).

    The MILP only minimises step time, so a stage that is not the slowest may carry
    checkpointing it does not need. Undo one layer's checkpoint (to the first mode after its
    own in full, selective, none that fits and is no slower: a head whose selective mode keeps
    its logits can skip it) or offload at a time (the last one of its kind in a stage) while the
    layout still fits and is no slower; once the last of a kind must stay, the identical ones
    before it stay.
    """
    lighter = {m: modes[k + 1:] for k, m in enumerate(modes)}   # a mode -> those that recompute less, in order
    stages = [list(st) for st in stages]
    best = model.evaluate(cand, stages)
    signature = [layer.signature for layer in model.profile.layers]
    changed = True
    while changed:                                    # until a whole pass changes nothing
        changed = False
        for s, st in enumerate(stages):
            for knob in ("checkpoint", "offload"):
                refused = set()                       # (layer kind, choice) whose last one had to stay
                for j in reversed(range(len(st))):
                    kind = (signature[st[j].layer], st[j].checkpoint, st[j].offload)
                    options = lighter.get(st[j].checkpoint, []) if knob == "checkpoint" else ([False] if st[j].offload else [])
                    if not options or kind in refused:
                        continue
                    for undone in options:
                        trial = [list(x) for x in stages]
                        trial[s][j] = st[j]._replace(**{knob: undone})
                        if must_offload(cand, model.precision) and not any(o for t in trial for _, _, o in t):
                            continue                  # this candidate exists only to offload
                        pred = model.evaluate(cand, trial)
                        if pred.fits and pred.step_s <= best.step_s * (1 + 1e-12):
                            stages, best, changed = trial, pred, True
                            st = stages[s]            # go on with the layers before it
                            break
                    else:
                        refused.add(kind)
    return stages


def outside_top_k(result: SearchResult, k: int, step_s: float) -> bool:
    """Whether a layout of this step can no longer enter the top k (slower than the k-th, past
    any tie): simplify is not worth its walks there (it keeps a layout's step: the MILP's is
    the fastest, and simplify takes no slower one)."""
    return len(result.solutions) >= k and step_s > result.solutions[k - 1].prediction.step_s * (1 + 1e-9)


def _rank(sol: Solution):
    """Fastest first; ties to the smaller peak, then the simpler layout, then a fixed order."""
    p = sol.prediction
    ck = sum(CHECKPOINT_MODES.index(c) for st in sol.stages for _, c, _ in st)   # selective is simpler than full
    off = sum(o for st in sol.stages for _, _, o in st)
    return (round(p.step_s, 12), p.peak_bytes, ck + off, sol.candidate)

