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

`walk_stage` walks these actions one layer at a time; it is the reference the MILP in
`planner/milp.py` is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate


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
    timeline: list[tuple[str, int]] = field(default_factory=list, repr=False)

    def categories(self) -> dict[str, int]:
        return {"weights": self.weights, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "buffers": self.buffers, "peak": self.peak}


def schedule_actions(schedule: str, pp: int, stage: int, m: int) -> list[tuple[str, int]]:
    """The (F|B, micro-batch) order one pipeline stage runs in one step.

    pp == 1 is gradient accumulation: F0 B0 F1 B1 ... GPipe runs all forwards, then all
    backwards. 1F1B (torch.distributed.pipelining's Schedule1F1B) runs min(m, pp - stage)
    forwards, then alternates one backward and one forward, then the remaining backwards.
    """
    if pp == 1:
        return [a for k in range(m) for a in (("F", k), ("B", k))]
    if schedule == "gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    warmup = min(m, pp - stage)
    actions = [("F", k) for k in range(warmup)]
    for j in range(m - warmup):
        actions += [("B", j), ("F", warmup + j)]
    return actions + [("B", k) for k in range(m - warmup, m)]


def in_flight(schedule: str, pp: int, stage: int, m: int) -> int:
    """Most micro-batches a stage holds activations for at once."""
    live, most = 0, 0
    for kind, _ in schedule_actions(schedule, pp, stage, m):
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


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


def walk_stage(layers: list[LayerMemory], loss: LayerMemory | None, *, static_buffers: int,
               actions: list[tuple[str, int]], per_micro_batch_buffers: int = 0,
               after_backward_buffers: int = 0, reshard_after_backward: bool = True,
               input_is_held: bool = True) -> StageMemory:
    """Walk one step of a stage holding `layers` (and the loss, on the last stage).

    static_buffers: bytes alive the whole step besides weights, grads and optimizer states
        (module buffers, this rank's batch, persistent communication buffers).
    per_micro_batch_buffers: bytes each in-flight micro-batch holds outside the layers, from
        the end of its forward to its backward (the pipeline's cached stage output; counted
        even when the last layer keeps its output too: a small overcount for such layers).
    after_backward_buffers: bytes alive during a forward that follows a backward (what the
        pipeline still holds from that backward).
    reshard_after_backward: FSDP2 frees a layer's kept unsharded copy after its backward
        (without pipelining); pipelining keeps every one until the step's end.
    input_is_held: the first layer's input is alive anyway (the batch, or the pipeline's
        cached input), so it is never counted as an activation.
    """
    seq = layers + ([loss] if loss is not None else [])
    n = len(seq)
    weights = sum(l.weights for l in layers)
    optim = sum(l.optim for l in layers)
    buffers = sum(l.buffers for l in layers) + static_buffers
    grads_all = sum(l.grads for l in layers)
    step_grads = sum(l.grads if l.step_grads is None else l.step_grads for l in layers)
    kept_unsharded_all = sum(l.kept_unsharded for l in layers)
    add = kept_bytes(seq, input_is_held)
    per_mb = sum(add) + per_micro_batch_buffers        # one finished forward, held until its backward
    first_input = 0 if input_is_held else seq[0].input

    timeline: list[tuple[str, int, int, int]] = []   # (phase, live, grads, activations)

    def record(phase, grads, acts, other=0):
        timeline.append((phase, weights + optim + buffers + other + grads + acts, grads, acts))

    kept_upto = list(accumulate(l.kept_unsharded for l in seq))                  # layers 0..i
    left_from = list(accumulate((l.unsharded_after_backward for l in reversed(seq)), initial=0))[::-1]  # layers i..n-1

    def unsharded_through(i: int) -> int:
        """Kept unsharded copies alive at layer i: layers 0..i (gathered by their forward, freed
        by their backward), or all of them under pipelining."""
        return kept_upto[i] if reshard_after_backward else kept_unsharded_all

    def left_after(i: int) -> int:
        """Unsharded copies the backwards of the layers after i left behind."""
        return left_from[i + 1]

    held = 0                 # micro-batches between their F and their B
    grads_exist = False      # after the first backward, every gradient stays allocated
    walked = set()           # actions alike in what is live give identical records: walk one
    for kind, mb in actions:
        if kind == "B":
            held -= 1
        key = (kind, held, grads_exist)
        if key not in walked:
            walked.add(key)
            others = held * per_mb
            if kind == "F":
                g = grads_all if grads_exist else 0
                # This micro-batch's own per-micro-batch buffers (the stage output) appear only
                # as its last layer's output; the held ones are in `others`.
                kept = after_backward_buffers if grads_exist else 0
                for i, l in enumerate(seq):
                    x_extra = first_input if i == 0 else (0 if seq[i - 1].keeps_output else l.input)
                    prev_flat = seq[i - 1].gather_flat if i > 0 else 0
                    fsdp = unsharded_through(i) + (left_after(i) if grads_exist else 0)
                    name = f"F mb {mb} {_name(i, layers)}"
                    if l.gather_flat or l.unsharded:
                        record(name + " (gather)", g, others + kept + x_extra, fsdp + prev_flat + l.gather_flat + l.unsharded)
                    record(name, g, others + kept + x_extra + l.own + l.output + l.fwd_transient,
                           fsdp + l.unsharded + l.gather_flat + (prev_flat if l is loss else 0))
                    kept += add[i]
            else:
                kept = per_mb
                grads_done = 0
                for i in reversed(range(n)):
                    l = seq[i]
                    g = grads_all if grads_exist else grads_done
                    g_out = 0 if (loss is not None and i == n - 1) else l.output   # the loss starts from a scalar
                    delta = l.bwd_accum_peak if grads_exist else l.bwd_peak
                    # Gathered ahead: the layer whose backward comes next (if it gathers);
                    # still alive: the reduce-scatter input of the layer whose backward came before,
                    # and the last layer's forward all-gather buffer while the loss runs.
                    ahead = seq[i - 1].gather_flat if (i > 0 and seq[i - 1].gathers_in_backward and l is not loss) else 0
                    behind = seq[i + 1].reduce_flat if i + 1 < n else 0
                    if l is loss and i > 0:
                        behind = seq[i - 1].gather_flat
                    fsdp = unsharded_through(i) + left_after(i) + l.unsharded
                    record(f"B mb {mb} {_name(i, layers)}", g, others + kept + g_out + delta, fsdp + ahead + behind)
                    if l.gathers_in_backward:
                        # Copy-out of this layer's all-gather: the previous reduction's input may
                        # not be freed yet, nor the copy it made of the gradients (asynchronous
                        # when there is someone to reduce with). Under pipelining the prefetch of
                        # the layer before is issued while this layer's all-gather output can
                        # still be held by the collective (measured with gloo).
                        record(f"B mb {mb} {_name(i, layers)} (gather)", g, others + kept + g_out,
                               fsdp + l.gather_flat + (2 if l.async_reduce else 1) * behind
                               + (0 if reshard_after_backward else ahead))
                    kept -= add[i]
                    if i < len(layers):
                        grads_done += l.grads
        if kind == "F":
            held += 1
        else:
            grads_exist = True
    final = [l for l in layers if l.step_grads is not None]
    if final:
        # Pipelining reduces the accumulated unsharded gradients at the step's end, layer by layer.
        # Each layer frees its unsharded copy, reduces its unsharded gradients through a flat
        # copy (and a temporary of the same size), then frees them for a sharded result: the
        # first layer's reduction is the high point.
        still = kept_unsharded_all + sum(l.unsharded_after_backward for l in layers)
        record("final gradient reduction", grads_all, 0, still + max(l.final_reduce_flat for l in final))
    record("optimizer step", step_grads, 0)

    phase, live, g, acts = max(timeline, key=lambda t: t[1])
    return StageMemory(peak=live, phase=phase, weights=weights, grads=g, optimizer=optim, activations=acts,
                       buffers=live - weights - optim - g - acts, timeline=[(p, v) for p, v, _, _ in timeline])


def _name(i: int, layers: list) -> str:
    return f"layer {i}" if i < len(layers) else "loss"
