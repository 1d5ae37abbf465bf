"""Memory of one rank over one training step, from per-layer figures. Torch-free.

A step is a sequence of actions: the forward (F) and backward (B) of each micro-batch the
rank's pipeline stage runs, in the schedule's order, then the optimizer step. The peak is
the maximum of the live bytes over all of them, not a sum of per-phase maxima. At any
moment the live bytes are:

  static        weights + optimizer states + buffers (module buffers, this rank's batch,
                communication buffers that stay), and gradients once any exist
  in flight     for every micro-batch between its F and its B: what its layers keep for
                backward; the tensor between two layers (one's output, the next one's
                input) counted once if either keeps it
  the current   the input being consumed, the output being produced and the layer's own
  layer         transient peak above that (measured by the profiler)
  FSDP2         a fully_shard layer's unsharded copy while it computes; its all-gather's flat
  buffers       buffer, from its forward pre-hook until the next layer's copy-out (so the
                previous layer's is alive at a pre-hook, and the last layer's through the
                loss); in backward, the next layer (in backward order) is gathered ahead
                during this one, and this one's reduce-scatter input stays until the next
                layer's reduce-scatter (with the copy of the gradients it made, until the
                asynchronous collective completes: assumed to overlap the next copy-out)

These are written once, as records: `forward_records` and `backward_records` say what is live
while a layer runs, reading where the layer stands in its stage (a `Position`: what the layers
before it keep, what those after it left, its neighbours' buffers); `held_at` what the rank
holds besides at a moment; `pipeline_buffers` and `final_reduction_record` the rest. `walk_rank`
evaluates them on numbers, one layer at a time, for a concrete layout (the reference);
`planner/milp.py` evaluates the same functions on linear expressions of how many layers each
segment of a stage holds, and writes the results as its rows. Under the interleaved schedule a
rank runs several stages (chunks); the others' bytes stay live while one runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from typing import Any

import numpy as np

from .plan import MULTI_STAGE_SCHEDULES


@dataclass
class LayerMemory:
    """Memory figures of one layer on one rank (bytes), as a plan runs it."""

    weights: int             # parameters resident on the device between uses
    grads: int               # gradients resident after the layer's backward
    optim: int               # optimizer states on the device
    buffers: int             # module buffers and buffers that stay for the whole forward/backward
    input: int               # the layer's input (the previous layer's output)
    output: int
    own: int                 # what the forward keeps besides its input and output
    keeps_input: bool        # its input stays alive until its backward
    keeps_output: bool       # its output stays alive until its backward
    fwd_transient: int       # forward's peak above input + own + output
    bwd_peak: int            # backward's peak above what is live when it starts (gradients new)
    bwd_accum_peak: int      # the same when gradients already exist
    # FSDP2 units (fully_shard / replicate); 0 elsewhere:
    unsharded: int = 0       # the unsharded copy, gathered for this layer's forward and backward only
    kept_unsharded: int = 0  # the unsharded copy kept from the layer's forward to its backward
    unsharded_after_backward: int = 0   # the unsharded copy left after its backward until its next forward
    gather_flat: int = 0     # the all-gather's flat output buffer
    reduce_flat: int = 0     # the reduce-scatter's flat input buffer (each micro-batch)
    gathers_in_backward: bool = False   # parameters are gathered again for backward (resharded after forward)
    async_reduce: bool = False          # gradient reduction is a collective over more than one rank
    step_grads: int | None = None       # gradients at the optimizer step, when not `grads` (pipelining
                                        # accumulates unsharded gradients and reduces them at the end)
    final_reduce_flat: int = 0          # the reduce-scatter input of that final reduction
    host: int = 0                       # host memory this rank keeps for the layer (offloaded states)


@dataclass
class StageMemory:
    """The predicted peak of one rank and what it is made of at that moment."""

    peak: int
    phase: str                       # e.g. "B mb 0 layer 3", "optimizer step"
    weights: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0             # in-flight activations + the current layer's input/output/transient
    buffers: int = 0                 # batch, module buffers, communication buffers

    def categories(self) -> dict[str, int]:
        return {"weights": self.weights, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "buffers": self.buffers, "peak": self.peak}


def schedule_actions(schedule: str, pp: int, rank: int, m: int, v: int = 1) -> list[tuple[str, int, int]]:
    """The (F|B, chunk, micro-batch) order one pipeline rank runs in one step; `chunk` is the
    local stage (0..v-1: stages rank, rank + pp, ...; 0 unless the schedule runs several).

    pp == 1 is gradient accumulation: F0 B0 F1 B1 ... GPipe runs all forwards, then all
    backwards. 1F1B (torch.distributed.pipelining's Schedule1F1B) runs min(m, pp - stage)
    forwards, then alternates one backward and one forward, then the remaining backwards.
    Interleaved 1F1B (ScheduleInterleaved1F1B, v chunks a rank) is torch's order, rounds of
    m // pp micro-batches: a warm-up of forwards, chunk by chunk and round by round, then one
    forward and one backward (later chunks' backwards first), then the remaining backwards.
    Looped BFS (ScheduleLoopedBFS, v chunks a rank, Lamy-Poirier 2023) runs every micro-batch's
    forward chunk by chunk, then every backward, last chunk first, last micro-batch first.
    """
    if schedule == "interleaved":
        return _interleaved_actions(pp, v, rank, m)
    if schedule == "looped_bfs":
        return ([("F", c, k) for c in range(v) for k in range(m)]
                + [("B", c, k) for c in reversed(range(v)) for k in reversed(range(m))])
    if pp == 1:
        return [a for k in range(m) for a in (("F", 0, k), ("B", 0, k))]
    if schedule == "gpipe":
        return [("F", 0, k) for k in range(m)] + [("B", 0, k) for k in range(m)]
    warmup = min(m, pp - rank)
    actions = [("F", 0, k) for k in range(warmup)]
    for j in range(m - warmup):
        actions += [("B", 0, j), ("F", 0, warmup + j)]
    return actions + [("B", 0, k) for k in range(m - warmup, m)]


def interleaved_rounds(pp: int, m: int) -> int:
    """The rounds torch's ScheduleInterleaved1F1B splits m micro-batches into: m // pp (at
    least 1); it refuses an m that is not a multiple of them."""
    return max(1, m // pp)


def _interleaved_actions(pp: int, v: int, rank: int, m: int) -> list[tuple[str, int, int]]:
    """torch's ScheduleInterleaved1F1B order for one rank (its _get_warmup_ops and
    _get_1f1b_rank_ops without the idle slots; tests/test_step_time.py holds it to torch's)."""
    per_round = m // interleaved_rounds(pp, m)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), m * v)
    total = m * v
    next_mb = {"F": [0] * v, "B": [0] * v}
    actions = []

    def act(kind: str, chunk: int) -> None:
        actions.append((kind, chunk, next_mb[kind][chunk]))
        next_mb[kind][chunk] += 1

    for op in range(total + warmup):          # warm-up forwards, 1F1B pairs, cool-down backwards
        if op < total:
            act("F", (op // per_round) % v)
        if op >= warmup:
            act("B", v - 1 - ((op - warmup) // per_round) % v)
    return actions


def in_flight(schedule: str, pp: int, stage: int, m: int) -> int:
    """Most micro-batches a stage holds activations for at once."""
    live, most = 0, 0
    for kind, _, _ in schedule_actions(schedule, pp, stage, m):
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


@dataclass(frozen=True)
class Moment:
    """What a rank holds besides the running layer when one of its chunks starts a forward or
    a backward: the same moment gives the same live bytes, whatever the micro-batch."""

    kind: str                 # "F" | "B"
    chunk: int                # the chunk that runs
    held: tuple[int, ...]     # per chunk, micro-batches between their F and B (not this one)
    grads: tuple[bool, ...]   # per chunk, whether its gradients exist (before this action)
    after: int | None         # in a forward: the chunk whose backward ran last (its buffers still held)
    done: tuple[int, ...] = ()  # per chunk, backwards finished (where sends are held to the step's end)

    @property
    def grads_here(self) -> bool:
        return self.grads[self.chunk]

    def covers(self, other: "Moment") -> bool:
        """Whether every live byte of `other` is live here too, for any sizes: same action on
        the same chunk and its gradients alike, at least as much held, no fewer gradients."""
        return (self.kind == other.kind and self.chunk == other.chunk and self.grads_here == other.grads_here
                and all(a >= b for a, b in zip(self.held, other.held))
                and all(a >= b for a, b in zip(self.grads, other.grads))
                and all(a >= b for a, b in zip(self.done, other.done))
                and other.after in (None, self.after))


def moments(actions: list[tuple[str, int, int]], v: int, count_done: bool = False) -> list[Moment]:
    """The moment of each action, in order (`count_done`: with the backwards each chunk finished)."""
    held, grads, after, done = [0] * v, [False] * v, None, [0] * v
    out = []
    for kind, chunk, _ in actions:
        if kind == "B":
            held[chunk] -= 1
        out.append(Moment(kind, chunk, tuple(held), tuple(grads), after if kind == "F" else None,
                          tuple(done) if count_done else ()))
        if kind == "F":
            held[chunk] += 1
        else:
            grads[chunk], after = True, chunk
            done[chunk] += 1
    return out


def holds_sends(schedule: str) -> bool:
    """Whether the schedule keeps every send's tensor until the step's end: torch's
    _PipelineScheduleRuntime (the multi-stage schedules) waits on its sends only then, so each
    finished micro-batch's stage output and input gradient stay; Schedule1F1B and
    ScheduleGPipe wait on each send at once."""
    return schedule in MULTI_STAGE_SCHEDULES


def peak_moments(actions: list[tuple[str, int, int]], v: int, count_done: bool = False) -> list[Moment]:
    """The moments a record can peak in (no other covers them), forwards before backwards,
    gradients absent before present: the MILP's memory rows are written at these alone.
    (Quadratic in the distinct moments and the same for every layout of a candidate: kept.)"""
    return list(_peak_moments(tuple(actions), v, count_done))


@lru_cache(maxsize=256)
def _peak_moments(actions: tuple, v: int, count_done: bool) -> tuple[Moment, ...]:
    distinct = list(dict.fromkeys(moments(list(actions), v, count_done)))
    # Moment.covers, for every pair at once: only moments of one action, chunk and gradients
    # there can cover each other, and among those, one covers another where it holds at least
    # as much of every count and follows the same backward, if the other follows one (a rank
    # of a VP 5 pipeline of 64 micro-batches: 0.16 s pair by pair, 5 ms so; the same moments).
    groups: dict[tuple, list[int]] = {}
    for i, mo in enumerate(distinct):
        groups.setdefault((mo.kind, mo.chunk, mo.grads_here), []).append(i)
    covered = np.zeros(len(distinct), dtype=bool)
    for members in groups.values():
        counts = np.array([distinct[i].held + distinct[i].grads + distinct[i].done for i in members], dtype=np.int64)
        after = np.array([-1 if distinct[i].after is None else distinct[i].after for i in members])
        holds_all = (counts[:, None, :] >= counts[None, :, :]).all(axis=2)       # [a, b]: a holds all b does
        follows = (after[None, :] == -1) | (after[:, None] == after[None, :])   # b follows none, or a's backward
        covers = holds_all & follows
        np.fill_diagonal(covers, False)
        covered[members] = covers.any(axis=0)
    kept = [mo for mo, c in zip(distinct, covered) if not c]
    return tuple(sorted(kept, key=lambda mo: (mo.chunk, mo.kind != "F", mo.grads_here)))


def kept_bytes(seq: list[LayerMemory], first_kept_by_caller: bool) -> list[int]:
    """What each layer adds to the activations kept for backward (one micro-batch).

    The tensor entering seq[i] is counted by seq[i] when seq[i] keeps it and seq[i-1] does
    not keep it as its output (so a tensor both keep is counted once). The first layer's
    input is counted by the caller (the batch, or the pipeline's cached stage input) when
    `first_kept_by_caller`.
    """
    out = []
    for i, l in enumerate(seq):
        prev_keeps = first_kept_by_caller if i == 0 else seq[i - 1].keeps_output
        out.append(l.own + (l.output if l.keeps_output else 0) + (l.input if l.keeps_input and not prev_keeps else 0))
    return out


@dataclass
class Chunk:
    """One pipeline stage a rank runs (a rank runs v of them under the interleaved schedule)."""

    layers: list[LayerMemory]
    loss: LayerMemory | None = None      # on the model's last stage
    static_buffers: int = 0              # alive the whole step besides weights, grads and optimizer
                                         # states (module buffers, the batch, persistent
                                         # communication buffers)
    per_micro_batch_buffers: int = 0     # each in-flight micro-batch holds outside the layers, from
                                         # the end of its forward to its backward (the pipeline's
                                         # cached stage output; counted even when the last layer keeps
                                         # its output too: a small overcount for such layers)
    after_backward_buffers: int = 0      # alive during a forward that follows this chunk's backward
                                         # (what the pipeline still holds from that backward)
    sent_per_backward: int = 0           # what each finished micro-batch leaves held by its sends
                                         # until the step's end (holds_sends)
    name: str = ""                       # in phase names ("stage 3 "), where a rank runs several


@dataclass(slots=True)
class Position:
    """What a layer's records read about where the layer stands in its stage, for one
    micro-batch: numbers in the walk (layer i), linear expressions of the layer counts in the
    MILP (a segment's first, second, ..., last layer). The same records (forward_records,
    backward_records) are evaluated on both, so the memory model is written once."""

    kept_before: Any = 0          # activations this micro-batch's earlier layers keep for backward
    kept_through: Any = 0         # the same with this layer's own (kept_bytes)
    input_unless_kept: Any = 0    # the layer's input, unless the layer before keeps it (or the caller holds it)
    unsharded_through: Any = 0    # FSDP2 copies kept from forward to backward alive here: the layers' up
                                  # to this one, or the whole stage's under pipelining
    left_after: Any = 0           # unsharded copies the backwards of the later layers left
    grads_after: Any = 0          # gradients of the later layers (a first backward creates them in turn)
    prev_gather_flat: Any = 0     # the all-gather flat buffer of the layer before
    prev_backward_flat: Any = 0   # ... when that layer gathers again for its backward (prefetched)
    next_reduce_flat: Any = 0     # the reduce-scatter input of the layer after (its backward ran first)
    stage_grads: Any = 0          # all of the stage's gradients
    stage_micro_batch: Any = 0    # what the stage holds per micro-batch outside its layers (Chunk)


@dataclass(slots=True)
class Record:
    """One place a rank's live bytes can peak while a layer runs: the stage's gradients, its
    activations and its FSDP2 buffers there (the rank's static and held bytes come on top)."""

    phase: str                    # "" or " (gather)": the all-gather's copy-out before compute
    grads: Any
    activations: Any
    buffers: Any


def forward_records(l: LayerMemory, at: Position, grads_exist: bool, is_loss: bool) -> list[Record]:
    """Layer l's forward: its all-gather's copy-out (the layer before's flat buffer still
    alive), then its compute (input, own saved bytes, output and transient). The loss sees
    the last layer's flat buffer, held through it."""
    grads = at.stage_grads if grads_exist else 0
    acts = at.kept_before + at.input_unless_kept
    fsdp = at.unsharded_through + (at.left_after if grads_exist else 0)
    records = []
    if l.gather_flat or l.unsharded:
        records.append(Record(" (gather)", grads, acts, fsdp + at.prev_gather_flat + (l.gather_flat + l.unsharded)))
    records.append(Record("", grads, acts + (l.own + l.output + l.fwd_transient),
                          fsdp + (l.unsharded + l.gather_flat) + (at.prev_gather_flat if is_loss else 0)))
    return records


def backward_records(l: LayerMemory, at: Position, grads_exist: bool, is_loss: bool,
                     reshard_after_backward: bool) -> list[Record]:
    """Layer l's backward: its compute (what the micro-batch keeps through it, the output's
    gradient, its peak), with the layer whose backward comes next gathered ahead and the
    reduce-scatter input of the one whose backward came before still alive; then, when it
    gathers for backward, the copy-out of that all-gather: no peak yet, the previous reduction's
    input twice (with the copy of the gradients it made, while the collective runs
    asynchronously), and under pipelining the prefetched flat buffer of the layer before (the
    collective can still hold this one's: measured with gloo). The loss starts from a scalar
    and sees the last layer's forward flat buffer."""
    grads = at.stage_grads if grads_exist else at.grads_after
    kept = at.kept_through + at.stage_micro_batch + (0 if is_loss else l.output)
    peak = l.bwd_accum_peak if grads_exist else l.bwd_peak
    ahead = 0 if is_loss else at.prev_backward_flat
    behind = at.prev_gather_flat if is_loss else at.next_reduce_flat
    fsdp = at.unsharded_through + at.left_after + l.unsharded
    records = [Record("", grads, kept + peak, fsdp + ahead + behind)]
    if l.gathers_in_backward:
        records.append(Record(" (gather)", grads, kept, fsdp + l.gather_flat + (2 if l.async_reduce else 1) * behind
                              + (0 if reshard_after_backward else ahead)))
    return records


def positions(seq: list[LayerMemory], n_layers: int, reshard_after_backward: bool, input_is_held: bool,
              micro_batch_buffers: int) -> list[Position]:
    """Each layer's Position in a stage running `seq` (its layers, then the loss if it has it)."""
    adds = kept_bytes(seq, input_is_held)
    kept = list(accumulate(adds, initial=0))                                        # kept[i]: layers 0..i-1
    unsharded = list(accumulate(l.kept_unsharded for l in seq))                     # layers 0..i
    left = list(accumulate((l.unsharded_after_backward for l in reversed(seq)), initial=0))[::-1]   # layers i..
    grads = list(accumulate((l.grads if i < n_layers else 0 for i, l in reversed(list(enumerate(seq)))), initial=0))[::-1]
    out = []
    for i, l in enumerate(seq):
        prev = seq[i - 1] if i > 0 else None
        nxt = seq[i + 1] if i + 1 < len(seq) else None
        out.append(Position(
            kept_before=kept[i], kept_through=kept[i + 1],
            input_unless_kept=(0 if input_is_held else l.input) if prev is None else (0 if prev.keeps_output else l.input),
            unsharded_through=unsharded[i] if reshard_after_backward else unsharded[-1],
            left_after=left[i + 1], grads_after=grads[i + 1],
            prev_gather_flat=prev.gather_flat if prev else 0,
            prev_backward_flat=prev.gather_flat if prev and prev.gathers_in_backward else 0,
            next_reduce_flat=nxt.reduce_flat if nxt else 0,
            stage_grads=grads[0], stage_micro_batch=micro_batch_buffers))
    return out


@dataclass(slots=True)
class StageBytes:
    """A stage's totals over its layers, as the records of its rank read them while another
    of the rank's stages runs, and at the step's end (numbers in the walk, expressions in the MILP)."""

    static: Any = 0               # weights, optimizer states, buffers, its batch, its receive buffers
    grads: Any = 0                # its gradients, once it ran a backward
    step_grads: Any = 0           # its gradients at the optimizer step
    kept_unsharded: Any = 0       # FSDP2 copies kept from forward to backward
    left_after_backward: Any = 0  # unsharded copies its backwards leave (pipelining)
    per_micro_batch: Any = 0      # what one of its in-flight micro-batches keeps
    after_backward: Any = 0       # what a forward that follows its backward still sees
    sent: Any = 0                 # what each finished micro-batch's sends hold (holds_sends)


def pipeline_buffers(m: int, stage_in, stage_out, is_first: bool, is_last: bool, sends_held: bool):
    """The tensors a pipeline stage receives and sends, as (static, per micro-batch, after a
    backward, held per finished backward): receive buffers for every micro-batch, the stage
    output per in-flight micro-batch, and what a forward that follows a backward still sees:
    the last backward's input gradient until its send completes and, on the last stage, the
    previous micro-batch's output (the schedule's loop variable). The multi-stage schedules
    hold every send (stage output and input gradient) to the step's end instead (holds_sends)."""
    static = (0 if is_first else m * stage_in) + (0 if is_last else m * stage_out)
    after_backward = (0 if is_first else stage_in) + (stage_out if is_last else 0)
    sent = (0 if is_first else stage_in) + (0 if is_last else stage_out)
    return (static, stage_out, 0, sent) if sends_held else (static, stage_out, after_backward, 0)


def held_at(moment: Moment, stages: list[StageBytes], reshard_after_backward: bool) -> Record:
    """What a rank holds at `moment` besides its static bytes and the running stage's records:
    every stage's in-flight micro-batches (the running one excluded) and held sends, what a
    forward that follows a backward still sees, and the other stages' gradients and unsharded
    copies once they ran a backward (their kept copies too, under pipelining)."""
    acts = sum((h * st.per_micro_batch for h, st in zip(moment.held, stages) if h), 0) \
        + sum((d * st.sent for d, st in zip(moment.done, stages) if d), 0)
    if moment.kind == "F" and moment.after is not None:
        acts = acts + stages[moment.after].after_backward
    rest = [c for c in range(len(stages)) if c != moment.chunk]
    grads = sum((stages[c].grads for c in rest if moment.grads[c]), 0)
    fsdp = sum(((0 if reshard_after_backward else stages[c].kept_unsharded)
                + (stages[c].left_after_backward if moment.grads[c] else 0) for c in rest), 0)
    return Record("", grads, acts, fsdp)


def final_reduction_record(stages: list[StageBytes], largest_flat, micro_batches: int) -> Record:
    """Pipelining reduces the accumulated unsharded gradients at the step's end, layer by layer.
    Each layer frees its unsharded copy, reduces its unsharded gradients through a flat copy
    (and a temporary of the same size), then frees them for a sharded result: the first
    layer's reduction is the high point. Every finished micro-batch's sends are still held."""
    return Record("final gradient reduction", sum((st.grads for st in stages), 0),
                  sum((micro_batches * st.sent for st in stages), 0),
                  sum((st.kept_unsharded + st.left_after_backward for st in stages), 0) + largest_flat)


@dataclass
class ChunkWalk:
    """One chunk's part in its rank's walk (walk_chunk): what it holds all step, its totals as
    the rank's moments read them, and for each kind of action its highest record. A rank's
    live bytes at a moment are its chunks' static bytes, what it holds besides (held_at) and
    the running chunk's highest record for that kind of action: each term one chunk's alone,
    which is what lets planner/listed.py write a rank's rows from listed layouts of its chunks."""

    static: int                   # weights, optimizer states, buffers (its static_buffers too)
    bytes: StageBytes
    # (F | B, its gradients exist) -> (the record's live bytes, its layer, the record): the
    # first of the highest in the order the action runs its layers
    highest: dict[tuple[str, bool], tuple[int, int, Record]]
    final_flat: int               # the largest flat buffer of its final reduction (pipelining)
    reduces_at_end: bool          # some layer reduces its gradients at the step's end (pipelining)


def walk_chunk(chunk: Chunk, reshard_after_backward: bool, input_is_held: bool) -> ChunkWalk:
    """Every record of one chunk's layers (forward_records, backward_records) reduced to what
    its rank's walk reads of them (ChunkWalk)."""
    seq = chunk.layers + ([chunk.loss] if chunk.loss is not None else [])
    at = positions(seq, len(chunk.layers), reshard_after_backward, input_is_held, chunk.per_micro_batch_buffers)
    highest = {}
    for kind in ("F", "B"):
        for grads in (False, True):
            best = None
            for i in (range(len(seq)) if kind == "F" else reversed(range(len(seq)))):
                l = seq[i]
                records = (forward_records(l, at[i], grads, l is chunk.loss) if kind == "F"
                           else backward_records(l, at[i], grads, l is chunk.loss, reshard_after_backward))
                for r in records:
                    live = r.grads + r.activations + r.buffers
                    if best is None or live > best[0]:
                        best = (live, i, r)
            highest[kind, grads] = best
    layers = chunk.layers
    return ChunkWalk(
        static=sum(l.weights + l.optim + l.buffers for l in layers) + chunk.static_buffers,
        bytes=StageBytes(grads=sum(l.grads for l in layers),
                         step_grads=sum(l.grads if l.step_grads is None else l.step_grads for l in layers),
                         kept_unsharded=sum(l.kept_unsharded for l in layers),
                         left_after_backward=sum(l.unsharded_after_backward for l in layers),
                         per_micro_batch=sum(kept_bytes(seq, input_is_held)) + chunk.per_micro_batch_buffers,
                         after_backward=chunk.after_backward_buffers, sent=chunk.sent_per_backward),
        highest=highest,
        final_flat=max(l.final_reduce_flat for l in layers),
        reduces_at_end=any(l.step_grads is not None for l in layers))


@lru_cache(maxsize=256)
def _walked_moments(actions: tuple, v: int, sends_held: bool) -> tuple[tuple[Moment, tuple], ...]:
    """The moments a rank's walk records, each with its first action: actions at the same
    moment give identical records, so one is walked; where sends are held every moment differs
    (finished backwards count), and only those that can peak are walked. The same for every
    layout of a candidate: kept (a VP 5 rank's 640 moments took 4 ms a walk)."""
    at = moments(list(actions), v, sends_held)
    walked = set(at) - set(peak_moments(list(actions), v, True)) if sends_held else set()
    out = []
    for moment, action in zip(at, actions):
        if moment not in walked:
            walked.add(moment)
            out.append((moment, action))
    return tuple(out)


def walk_rank(chunks: list[Chunk], actions: list[tuple[str, int, int]], *, reshard_after_backward: bool = True,
              input_is_held: bool = True, sends_held: bool = False) -> StageMemory:
    """Walk one step of a rank running `chunks` in the order `actions` (schedule_actions): the
    records of every layer (forward_records, backward_records) at every moment, over what the
    rank holds besides (its static bytes, its in-flight micro-batches, its other chunks).

    reshard_after_backward: FSDP2 frees a layer's kept unsharded copy after its backward
        (without pipelining); pipelining keeps every one until the step's end.
    input_is_held: each chunk's first layer's input is alive anyway (the batch, or the
        pipeline's cached input), so it is never counted as an activation.
    sends_held: finished micro-batches' sends stay until the step's end (holds_sends).
    While one chunk runs, the others hold their static bytes, their in-flight micro-batches,
    their gradients and unsharded copies once they ran a backward, and (under pipelining) their
    kept unsharded copies. At a moment the held bytes are the same for each of the running
    chunk's records, so each chunk's highest record for the kind of action (walk_chunk) is
    the moment's peak.
    """
    walks = [walk_chunk(c, reshard_after_backward, input_is_held) for c in chunks]
    every = [l for c in chunks for l in c.layers]
    weights = sum(l.weights for l in every)
    optim = sum(l.optim for l in every)
    static = sum(w.static for w in walks)
    stages = [w.bytes for w in walks]

    timeline: list[tuple] = []   # (phase, live, grads, activations); a layer's phase named only if it wins

    def record(phase, grads, acts, other=0):
        timeline.append((phase, static + other + grads + acts, grads, acts))

    for moment, (kind, j, mb) in _walked_moments(tuple(actions), len(chunks), sends_held):
        held = held_at(moment, stages, reshard_after_backward)
        _, i, r = walks[j].highest[kind, moment.grads_here]
        record((f"{kind} mb {mb} {chunks[j].name}", i, len(chunks[j].layers), r.phase),
               held.grads + r.grads, held.activations + r.activations, held.buffers + r.buffers)
    if any(w.reduces_at_end for w in walks):
        final = final_reduction_record(stages, max(w.final_flat for w in walks),
                                       len(actions) // 2 // len(chunks) if sends_held else 0)
        record(final.phase, final.grads, final.activations, final.buffers)
    record("optimizer step", sum(st.step_grads for st in stages), 0)

    phase, live, g, acts = max(timeline, key=lambda t: t[1])
    if isinstance(phase, tuple):
        prefix, i, n_layers, suffix = phase
        phase = prefix + (f"layer {i}" if i < n_layers else "loss") + suffix
    return StageMemory(peak=live, phase=phase, weights=weights, grads=g, optimizer=optim, activations=acts,
                       buffers=live - weights - optim - g - acts)
