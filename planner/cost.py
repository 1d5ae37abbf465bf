"""The cost model: memory and step time of a layout, per rank, from a profile. Torch-free.

A layout is a `Candidate` (parallel degrees, micro-batching, ZeRO stage, schedule) plus a
choice per layer (pipeline stage, checkpointing, offload). `CostModel.layer` turns one
layer's profile figures into what that layer costs one rank under the candidate
(`LayerCost`: a `LayerMemory` for the memory walk, and times); `CostModel.evaluate` puts the
layers of every stage together into a `Prediction`. The MILP in `milp.py` uses the same
`LayerCost`s, so the two can only differ in how they add them up, which the tests check.

How each knob is costed (it mirrors what runtime/ does):
- tensor parallelism (tp): the profile's tp = 2 measurements split every figure into a
  replicated and a sharded part, f(t) = r + s/t; parameter bytes come from the shapes and
  the dim the tp_plan shards; each of the layer's TP all-reduces costs the hardware's
  calibrated all-reduce (plan calibrate), or a ring all-reduce inside the node where none was
  measured (collective_terms).
- data parallelism and ZeRO: the plain path (no wrapper) when dp == 1, no layer is
  offloaded and precision is not mixed; otherwise every layer is an FSDP2 unit:
  zero 3 and offloaded layers `fully_shard` (reshard after forward), zero 2 `fully_shard`
  without resharding after forward, zero 0/1 FSDP-based `replicate` (zero 1 adds a sharded
  optimizer). Sharded sizes are FSDP2's: dim 0 padded to a multiple of dp.
- pipeline parallelism: per stage, the schedule's order of forwards and backwards (see
  memory.schedule_actions); the stage input and output of every in-flight micro-batch are
  held; the step takes every stage's time per micro-batch once plus m - 1 times the
  slowest stage's (pipeline_step_s, Alpa's formula; time_terms: every stage adds the
  hardware's pipeline overhead for its forward and its backward, and each boundary the
  activation's bytes both ways).
- CPU processes: a rank's compute is slowed where more ranks are busy than the cores run at
  full speed (compute_scale); FSDP2 units add their measured hooks and copies.
- checkpointing: the layer's figures under its mode (full: keeps its input, runs the whole
  forward again in backward; selective: keeps its matmuls' and attention's outputs too and
  runs the rest again, measured by the profiler).
- offload: the layer's parameters, gradients and optimizer states leave the device; each
  micro-batch copies its parameter shard in (forward and backward) and its gradient shard
  out; the host runs the optimizer step for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from profiles.schema import LayerProfile, LayerSample, Profile, splits_evenly

from .hardware import PRESETS, Hardware
from .memory import Chunk, LayerMemory, StageMemory, holds_sends, pipeline_buffers, schedule_actions, walk_rank
from .plan import Placed, checkpoint_mode, fsdp_unit, wraps_layers

ITEMSIZE = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True, order=True)
class Candidate:
    """Everything about a layout except the per-layer choices."""

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    num_micro_batches: int
    zero: int            # 0..3; with dp == 1 only 0 (no one to shard with) unless offloading
    schedule: str        # "1f1b" | "gpipe" | "interleaved" | "looped_bfs"; "1f1b" when pp == 1
    fsdp: bool           # every layer an FSDP2 unit (False: the plain path, no wrapper)
    allow_offload: bool  # the per-layer offload choice is open (needs fsdp)
    virtual_stages: int = 1   # stages per pp rank (v): more than 1 only with a multi-stage schedule
    sequence_parallel: bool = False   # activations outside the TP regions split along the sequence (tp > 1)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch_size * self.num_micro_batches

    @property
    def n_stages(self) -> int:
        """Pipeline stages: pp x v; stage s runs on pp rank s % pp."""
        return self.pp * self.virtual_stages

    def describe(self) -> str:
        schedule = "" if self.pp == 1 else self.schedule + (f" v{self.virtual_stages}" if self.virtual_stages > 1 else "")
        return (f"dp{self.dp} tp{self.tp}{' sp' if self.sequence_parallel else ''} pp{self.pp} "
                f"b{self.micro_batch_size}x{self.num_micro_batches} "
                f"zero{self.zero} {schedule}").strip()


@dataclass
class LayerCost:
    """What one layer costs one rank under a candidate and a choice."""

    memory: LayerMemory
    compute_s: float       # forward + backward (+ recompute) per micro-batch
    comm_s: float          # exposed collective time per micro-batch (TP all-reduces, FSDP gathers / reduce-scatters)
    offload_s: float       # host<->device copies per micro-batch
    step_s: float          # once per step, never hidden: optimizer step (device or host), ZeRO-1 broadcasts, settling gradients
    sync_s: float          # once per step, hideable behind the last backward: gradient all-reduce (replicate), final reduction (pipelining)
    model_flops: int       # forward + backward FLOPs of one micro-batch on this rank, no recompute
    tp_comm_s: float = 0.0  # the part of comm_s that is TP collectives
    forward_s: float = 0.0    # the part of compute_s that is the forward
    recompute_s: float = 0.0  # the part of compute_s that runs the forward again (checkpointed)
    # FSDP2's hooks and copies (profiled): in compute_s per micro-batch, and replicate's
    # reduction copies in step_s; the runtime's breakdown counts both as dp_comm (stage_parts)
    fsdp_hooks_s: float = 0.0
    fsdp_sync_copies_s: float = 0.0
    # Gradients left in another layout than their parameter's (sequence parallelism's norms):
    # their TP all-reduces, in step_s; the breakdown counts them as tp_comm (stage_parts)
    tp_grad_sync_s: float = 0.0

    @property
    def micro_batch_s(self) -> float:
        """The layer's time per micro-batch: compute, exposed collectives, host copies."""
        return self.compute_s + self.comm_s + self.offload_s


@dataclass
class TimeTerms:
    """A stage's time (see CostModel.time_terms): per micro-batch, and once per step."""

    per_micro_batch: float
    step: float                 # optimizer steps and broadcasts
    sync_minus_window: float    # gradient collectives less what the backward can hide of them

    @property
    def exposed_sync(self) -> float:
        """The MILP writes this as exposed >= sync_minus_window, exposed >= 0."""
        return max(0.0, self.sync_minus_window)

    @property
    def once_per_step(self) -> float:
        return self.step + self.exposed_sync


@dataclass
class StagePrediction:
    index: int
    layers: list[int]
    memory: StageMemory
    micro_batch_s: float    # one micro-batch's forward + backward on this stage, comms included
    step_extra_s: float     # once per step: exposed gradient sync + optimizer
    parts: dict[str, float] = field(default_factory=dict)  # micro_batch_s and step_extra_s by component (stage_parts)
    host_bytes: int = 0     # host memory one rank of the stage fills with offloaded states


@dataclass
class Prediction:
    candidate: Candidate
    stages: list[StagePrediction]
    step_s: float
    components: dict[str, float]
    samples_per_s: float
    mfu: float
    memory_limit: int
    host_peak_bytes: int = 0     # the fullest node's host memory: offloaded states of all its ranks
    host_limit: int | None = None

    @property
    def peak_bytes(self) -> int:
        return max(s.memory.peak for s in self.stages)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.memory_limit and (self.host_limit is None or self.host_peak_bytes <= self.host_limit)


def must_offload(cand: Candidate, precision: str) -> bool:
    """Whether the candidate wraps layers only to offload them (one rank, no mixed precision):
    a layout of it that offloads nothing runs on the plain path, which is another candidate."""
    return cand.fsdp and not wraps_layers(cand.dp, precision, any_offload=False)


class CostModel:
    """Costs of layouts for one profile on one kind of hardware."""

    def __init__(self, profile: Profile, hardware: Hardware, gpus_per_node: int | None = None,
                 memory_limit: int | None = None):
        self.profile = profile
        self.hw = hardware
        self.gpus_per_node = gpus_per_node or hardware.gpus_per_node
        self.memory_limit = memory_limit or hardware.usable_memory_bytes()
        self.precision = profile.precision
        self.store_isz = 2 if profile.precision == "bf16" else 4          # parameters, gradients, states
        self.compute_isz = 4 if profile.precision == "fp32" else 2        # the copy compute runs on
        self.measured_here = self._times_transfer()
        self._cache: dict = {}

    # -- hardware ---------------------------------------------------------------------
    def _times_transfer(self) -> bool:
        """Use the profile's measured times as they are (same kind of device), else roofline."""
        p = self.profile
        if p.method != "measured":
            return p.hardware == self.hw.name
        if p.device_type == "cpu":
            return self.hw.device_type == "cpu"
        return self.hw.device_type == "cuda" and _same_gpu(p.device, self.hw.name)

    def _times(self, s: LayerSample) -> tuple[float, float]:
        if self.measured_here:
            return s.fwd_s, s.bwd_s
        # Measured elsewhere: the totals at this hardware's best achievable rates, and no less
        # than its host issues the ops (as in a fake profile, flops.OpCost; 0 ops: not counted).
        hw, p = self.hw, self.precision
        return (max(hw.op_seconds(p, "other", s.fwd_flops, s.fwd_io_bytes), s.fwd_ops * hw.op_launch_s),
                max(hw.op_seconds(p, "other", s.bwd_flops, s.bwd_io_bytes), s.bwd_ops * hw.op_launch_s))

    def _link(self, group_span: int) -> tuple[float, float]:
        """Bandwidth and latency for a group whose ranks span `group_span` consecutive ranks."""
        if group_span <= self.gpus_per_node:
            return self.hw.intra_node_bandwidth, self.hw.intra_node_latency
        return self.hw.inter_node_bandwidth, self.hw.inter_node_latency

    # -- one layer --------------------------------------------------------------------
    def sample(self, i: int, cand: Candidate) -> LayerSample:
        """Layer i's figures at the candidate's micro-batch size, tensor and sequence parallelism (memoised)."""
        key = ("sample", i, cand.micro_batch_size, cand.tp, cand.sequence_parallel)
        if key not in self._cache:
            self._cache[key] = self.profile.layers[i].at_tp(cand.micro_batch_size, cand.tp, cand.sequence_parallel,
                                                            sequence_times=self.profile.method == "fake")
        return self._cache[key]

    def layer(self, cand: Candidate, i: int, checkpoint: str, offload: bool) -> LayerCost:
        """Layer i under the candidate, checkpointed in mode `checkpoint` (CHECKPOINT_MODES), offloaded or not."""
        checkpoint = checkpoint_mode(checkpoint)
        key = (self._layer_key(cand), i, checkpoint, offload)
        if key not in self._cache:
            self._cache[key] = self._layer(cand, i, checkpoint, offload)
        return self._cache[key]

    def _layer_key(self, cand: Candidate):
        """What a layer's cost depends on: not the schedule, and the micro-batch count and
        stages a rank only through busy_ranks (CPU processes sharing cores: compute_scale and
        the collectives' fits). Candidates that
        differ in those alone share their layers' costs (a search visits hundreds of such
        candidates)."""
        return (cand.dp, cand.tp, cand.sequence_parallel, cand.pp, cand.micro_batch_size, cand.zero, cand.fsdp,
                (cand.num_micro_batches, cand.virtual_stages) if self.hw.device_type == "cpu" else 0)

    def loss(self, cand: Candidate) -> LayerCost:
        key = (cand, "loss")
        if key not in self._cache:
            # On logits a "vocab" head leaves split (profiles' tp_plan), loss_parallel's:
            # 1/tp of the work and memory, and its all-reduces on the critical path.
            s = self.profile.loss.at_tp(cand.micro_batch_size, cand.tp)
            mem = LayerMemory(0, 0, 0, 0, s.input_bytes, s.output_bytes,
                              own=s.saved_bytes - s.saved_input_bytes - s.saved_output_bytes,
                              keeps_input=s.saved_input_bytes > 0, keeps_output=s.saved_output_bytes > 0,
                              fwd_transient=s.fwd_transient_bytes, bwd_peak=s.bwd_peak_bytes,
                              bwd_accum_peak=s.bwd_accum_peak_bytes)
            f, b = self._times(s)
            count = s.tp_fwd_comm_count + s.tp_bwd_comm_count
            tp_comm = self.collective_s("all_reduce", s.tp_fwd_comm_bytes + s.tp_bwd_comm_bytes, cand.tp, cand,
                                        count=count, after_s=(f + b) / count if count else None)
            self._cache[key] = LayerCost(mem, f + b, tp_comm, 0.0, 0.0, 0, s.fwd_flops + s.bwd_flops, tp_comm, forward_s=f)
        return self._cache[key]

    def _layer(self, cand: Candidate, i: int, checkpoint: str, offload: bool) -> LayerCost:
        lp = self.profile.layers[i]
        s = self.sample(i, cand)
        d, t = cand.dp, cand.tp
        shapes = local_shapes(lp, t)
        full_numel = sum(_numel(sh) for sh in shapes)
        n_tensors = len(shapes)

        # Which FSDP2 unit this layer is, and the sizes that follow from it.
        mode = fsdp_unit(cand.fsdp, cand.zero, offload)
        if mode in ("shard", "shard_keep"):
            shard_numel = sum(_padded_shard(sh, d) for sh in shapes)
        else:
            shard_numel = full_numel
        reduce_isz = self.store_isz
        weights = shard_numel * self.store_isz
        grads = shard_numel * reduce_isz
        # The elements this rank's optimizer steps: its shard, or under ZeRO-1 ceil(n / dp) of
        # every parameter (rank 0 the most).
        zero1 = cand.fsdp and cand.zero == 1 and mode == "replicate"
        stepped_numel = sum(-(-_numel(sh) // d) for sh in shapes) if zero1 else shard_numel
        optim = optimizer_bytes(self.profile.optimizer, stepped_numel, n_tensors, self.store_isz)

        unsharded = full_numel * self.compute_isz                 # the copy FSDP2 gathers compute onto
        gather_flat = d * shard_numel * self.compute_isz if (mode in ("shard", "shard_keep") and d > 1) else 0
        host = weights + grads + optim if offload else 0     # CPUOffloadPolicy: the shard's states live on the host
        if offload:
            weights = grads = optim = 0

        if checkpoint == "full":
            own, keeps_in, keeps_out = s.ckpt_saved_bytes, True, False
            fwd_t, bwd_p, bwd_a = s.ckpt_fwd_transient_bytes, s.ckpt_bwd_peak_bytes, s.ckpt_bwd_accum_peak_bytes
        elif checkpoint == "selective":
            own, keeps_in, keeps_out = s.sac_saved_bytes, True, s.sac_saved_output_bytes > 0
            fwd_t, bwd_p, bwd_a = s.sac_fwd_transient_bytes, s.sac_bwd_peak_bytes, s.sac_bwd_accum_peak_bytes
        else:
            own = s.saved_bytes - s.saved_input_bytes - s.saved_output_bytes
            keeps_in, keeps_out = s.saved_input_bytes > 0, s.saved_output_bytes > 0
            fwd_t, bwd_p, bwd_a = s.fwd_transient_bytes, s.bwd_peak_bytes, s.bwd_accum_peak_bytes

        # FSDP2's buffers (see memory.walk_rank for when each is alive): the unsharded copy
        # compute runs on, the all-gather's flat output, the reduce-scatter's flat input.
        fsdp_mem: dict = {}
        sharding = mode in ("shard", "shard_keep")
        rs_bytes = d * shard_numel * reduce_isz if sharding else full_numel * reduce_isz
        if mode == "shard":
            fsdp_mem.update(unsharded=unsharded, gathers_in_backward=True, async_reduce=d > 1)
            if cand.pp == 1:
                bwd_a = bwd_p              # unsharded gradients never accumulate: each micro-batch reduces its own
        elif mode in ("shard_keep", "replicate"):
            fsdp_mem.update(kept_unsharded=unsharded)
        if sharding:
            fsdp_mem.update(gather_flat=gather_flat)
        if mode != "plain" and cand.pp > 1:
            # Pipelining turns gradient reduction and resharding after backward off for every
            # micro-batch and reduces once at the step's end: unsharded gradients (compute dtype)
            # accumulate (so the mode's accumulating backward peak stands), and a
            # resharded-after-forward layer keeps its copy after backward.
            fsdp_mem.update(step_grads=grads, final_reduce_flat=rs_bytes)
            grads = full_numel * self.compute_isz
            if mode == "shard":
                fsdp_mem.update(unsharded_after_backward=unsharded)
        elif mode != "plain":
            # fully_shard reduce-scatters and replicate all-reduces through a flat copy of the
            # gradients (with dp 1 too), which stays until the next layer's reduction.
            fsdp_mem.update(reduce_flat=rs_bytes)

        mem = LayerMemory(weights=weights, grads=grads, optim=optim, buffers=lp.buffer_bytes,
                          input=s.input_bytes, output=s.output_bytes, own=own, keeps_input=keeps_in,
                          keeps_output=keeps_out, fwd_transient=fwd_t, bwd_peak=bwd_p, bwd_accum_peak=bwd_a,
                          host=host, **fsdp_mem)

        # Time per micro-batch (TimeTerms: the one definition the MILP and the bound share).
        fwd_s, bwd_s = self._times(s)
        recompute = {"full": fwd_s, "selective": self._sac_recompute_s(s, fwd_s)}.get(checkpoint, 0.0)
        # the unit's hooks and buffer copies, measured (profiled alone: slowed like compute)
        hooks = lp.fsdp_overhead_s.get(mode, 0.0) if self.measured_here and mode != "plain" else 0.0
        scale = self.compute_scale(cand)
        compute = (fwd_s + bwd_s + recompute + hooks) * scale
        # TP collectives sit on the critical path; a fully checkpointed layer runs its forward's
        # again, a selective one whatever its backward was measured to run. Under sequence
        # parallelism they are all-gathers and reduce-scatters where the regions' all-reduces
        # were, in pairs (a region gathers in and scatters out, its backward the mirror image):
        # half of them costed as each kind.
        def per_micro_batch(fwd, bwd, sac):
            return fwd + sac if checkpoint == "selective" else fwd * (2 if checkpoint == "full" else 1) + bwd
        tp_count = per_micro_batch(s.tp_fwd_comm_count, s.tp_bwd_comm_count, s.sac_tp_bwd_comm_count)
        sp_count = per_micro_batch(s.sp_fwd_comm_count, s.sp_bwd_comm_count, s.sac_sp_bwd_comm_count)
        # FSDP2's per micro-batch: all-gathers (forward, and again in backward if resharded
        # after forward) and, sharded without pipelining, the reduce-scatter.
        gathers = {"shard": 2, "shard_keep": 1}.get(mode, 0)
        reduce_each = sharding and cand.pp == 1
        # The rank's own work (alone; FSDP2's hooks and copies are CPU work too) before each of
        # those, on average: a collective costs more the longer the ranks worked before it
        # (CollectiveFit.slice_s; TP's come every fraction of a layer, FSDP2's every third).
        in_step = (tp_count + sp_count if t > 1 else 0) + (gathers + reduce_each if d > 1 else 0)
        after_s = (fwd_s + bwd_s + recompute + hooks) / in_step if in_step else None
        tp_comm = self.collective_s("all_reduce", per_micro_batch(s.tp_fwd_comm_bytes, s.tp_bwd_comm_bytes,
                                                                  s.sac_tp_bwd_comm_bytes), t, cand,
                                    count=tp_count, after_s=after_s)
        sp_bytes = per_micro_batch(s.sp_fwd_comm_bytes, s.sp_bwd_comm_bytes, s.sac_sp_bwd_comm_bytes)
        tp_comm += sum(self.collective_s(k, sp_bytes / 2, t, cand, count=sp_count / 2, after_s=after_s)
                       for k in ("all_gather", "reduce_scatter"))
        gather = self.collective_s("all_gather", d * shard_numel * self.compute_isz, d, cand, span=d * t, after_s=after_s)
        # The step's gradient reductions. replicate's, one after each layer's backward, come
        # after that backward (its TP collectives counted as the compute alone they stand for)
        # and cost what the slice rule says but never less than the fit as timed: the MLP's,
        # after 0.4 ms of backward each, took 8.7 ms where the fit says 8.4 and the slice rule
        # 7.8; the GPT's and the Llama's, after 3 and 8 ms, were the dp 4 rows most under their
        # runs (one traced dp 4 step each, 2026-12-07). A pipeline's, back to back at the
        # step's end, keep the fit as timed, with every rank of the node at work (all_busy):
        # the last stage reduces beside the first's last backwards, where the mean over the
        # pipeline's slots priced them as if only the ranks computing in a slot were (2 of 4
        # in pp 2 x dp 2 at one micro-batch, the GPT's free choice, under by 10-21% in all six
        # kept runs that chose it; -14% -> -9% on average with this, every model's mean median
        # over the seven kept sets lower by 0.05-0.3 points).
        reduce_after = after_s if reduce_each else None
        if mode == "replicate" and cand.pp == 1:
            tp_in_step = tp_count + sp_count
            tp_backward = tp_comm * (1 - (s.tp_fwd_comm_count + s.sp_fwd_comm_count) / tp_in_step) if tp_in_step else 0.0
            reduce_after = bwd_s + recompute + hooks + tp_backward / scale
        reduce = self.collective_s("reduce_scatter" if sharding else "all_reduce", rs_bytes, d, cand, span=d * t,
                                   after_s=reduce_after, at_least_fit=mode == "replicate", all_busy=cand.pp > 1)
        fsdp_comm = sync = 0.0
        if mode == "shard":
            fsdp_comm = 2 * gather               # forward, and again in backward (resharded after forward)
        elif mode == "shard_keep":
            fsdp_comm = gather
        if mode != "plain":
            if cand.pp > 1 or mode == "replicate":
                sync = reduce                    # once per step: after the last micro-batch (replicate) or at the step's end (pipelining)
            else:
                fsdp_comm += reduce              # fully_shard reduce-scatters every micro-batch
        comm = tp_comm + self.exposed_s(fsdp_comm, compute)
        offload_s = 0.0
        step_s = self._optimizer_s(lp, stepped_numel)
        if offload:
            h2d = self.hw.host_to_device_bandwidth
            offload_s = (2 * shard_numel * self.store_isz + shard_numel * reduce_isz) / h2d
            step_s = shard_numel / self.hw.cpu_adam_params_per_s
        sync_copies = (lp.fsdp_overhead_s.get("replicate_sync", 0.0) * scale   # replicate's reduction copies
                       if self.measured_here and mode == "replicate" else 0.0)
        step_s += sync_copies
        # One TP all-reduce a step for each gradient that leaves the backward in another layout
        # than its parameter's (profiles' gradients_to_settle: a sequence-parallel norm's).
        tp_grad_sync = self.collective_s("all_reduce", s.tp_grad_sync_bytes, t, cand, count=s.tp_grad_sync_count)
        step_s += tp_grad_sync
        if zero1 and d > 1:
            # The sharded optimizer broadcasts the layer's chunks from each of their d owners,
            # packed (d broadcasts moving the layer's parameters in all), and each rank copies
            # them in and out of the packed buffers: a calibrated fit holds those copies (plan
            # calibrate times the runtime's broadcast_packed), the link model reads and writes
            # them once each.
            full_bytes = full_numel * self.store_isz
            step_s += self.collective_s("broadcast", full_bytes, d, cand, count=d, span=d * t)
            if self.hw.collective("broadcast", d, d * t) is None:
                step_s += 2 * full_bytes / self.hw.memory_bandwidth()
        return LayerCost(mem, compute, comm, offload_s, step_s, sync, s.fwd_flops + s.bwd_flops, tp_comm,
                         forward_s=fwd_s * scale, recompute_s=recompute * scale, fsdp_hooks_s=hooks * scale,
                         fsdp_sync_copies_s=sync_copies, tp_grad_sync_s=tp_grad_sync)

    def _sac_recompute_s(self, s: LayerSample, fwd_s: float) -> float:
        """What selective checkpointing runs again in backward: as measured here, else (times
        from the roofline) the same share of this hardware's forward as where it was measured."""
        if self.measured_here or s.fwd_s <= 0:
            return s.sac_recompute_s
        return fwd_s * s.sac_recompute_s / s.fwd_s

    def busy_ranks(self, cand: Candidate) -> list[float]:
        """How many of the node's ranks work at once in each slot of a step (busy_per_slot)."""
        m, pp = cand.num_micro_batches * cand.virtual_stages, cand.pp
        key = ("busy", m, pp, cand.world_size)
        if key not in self._cache:
            self._cache[key] = busy_per_slot(m, pp, min(cand.world_size, self.gpus_per_node))
        return self._cache[key]

    def compute_scale(self, cand: Candidate) -> float:
        """How much slower a rank computes than the profile measured (one process alone), on
        CPU processes that share the node's cores (contention_scale over busy_ranks, with the
        cores that run at full speed at once: host_cores). On GPUs ranks share no cores (1)."""
        if self.hw.device_type != "cpu":
            return 1.0
        return contention_scale(self.busy_ranks(cand), min(min(cand.world_size, self.gpus_per_node), self.hw.host_cores))

    def collective_terms(self, kind: str, group: int, cand: Candidate, span: int | None = None,
                         all_busy: bool = False) -> tuple[float, float]:
        """(latency, seconds per byte) of one collective over `group` ranks of this candidate:
        the calibrated fit (plan calibrate) where there is one, else the ring model on the link
        across the `span` consecutive ranks the group covers (default `group`: TP groups are
        consecutive ranks; a DP group strides over tp, so it spans dp x tp; a pipeline
        neighbour is dp x tp ranks away). With `all_busy`, the fit for every rank of the node
        at work, whatever a pipeline's slots keep busy."""
        return self._collective_fit(kind, group, cand, span, all_busy)[:2]

    def slice_terms(self, kind: str, group: int, cand: Candidate) -> tuple[float, float]:
        """(per_slice, at_none): what one collective adds for each second of one rank's compute
        (alone) before it, and what the fit's latency holds of it at the slice it was timed
        after (CollectiveFit.slice_s), so that after `c` seconds it adds per_slice x c - at_none.
        Both 0 where nothing was measured (GPUs, link figures)."""
        return self._collective_fit(kind, group, cand, None)[2:]

    def _collective_fit(self, kind: str, group: int, cand: Candidate, span: int | None,
                        all_busy: bool = False) -> tuple[float, float, float, float]:
        if group <= 1:
            return 0.0, 0.0, 0.0, 0.0
        key = ("collective", kind, group, span, cand.num_micro_batches * cand.virtual_stages, cand.pp, cand.world_size,
               all_busy)
        if key not in self._cache:                 # what it depends on (busy_ranks' key with the group's)
            self._cache[key] = self._fit_terms(kind, group, cand, span, all_busy)
        return self._cache[key]

    def _fit_terms(self, kind: str, group: int, cand: Candidate, span: int | None,
                   all_busy: bool = False) -> tuple[float, float, float, float]:
        if self.hw.device_type == "cpu" and self.hw.collectives and not all_busy:
            # Each fit was measured with a number of processes busy; a pipeline keeps fewer busy
            # some of the step (busy_ranks), as compute_scale counts: the mean over the slots
            # of the fit for as many busy (the kept runs of bench/time_fidelity.py: pp 2 x tp 2,
            # whose TP collectives then cost 2 ranks' figures 2 slots in 5, +42% -> +28% at worst).
            fits = [self.hw.collective(kind, group, max(group, busy)) for busy in self.busy_ranks(cand)]
            if all(fits):
                n = len(fits)
                return (sum(f.latency_s for f in fits) / n, sum(1.0 / f.bandwidth for f in fits) / n,
                        sum(f.per_slice_s for f in fits) / n, sum(f.per_slice_s * f.slice_s for f in fits) / n)
        fit = self.hw.collective(kind, group, min(cand.world_size, self.gpus_per_node))
        if fit is not None:
            return fit.latency_s, 1.0 / fit.bandwidth, fit.per_slice_s, fit.per_slice_s * fit.slice_s
        bw, lat = self._link(span or group)
        if kind == "all_reduce":
            return 2 * (group - 1) * lat, 2 * (group - 1) / group / bw, 0.0, 0.0
        if kind in ("all_gather", "reduce_scatter"):
            return (group - 1) * lat, (group - 1) / group / bw, 0.0, 0.0
        return lat, 1.0 / bw, 0.0, 0.0         # broadcast (pipelined), send/receive

    def collective_s(self, kind: str, nbytes: float, group: int, cand: Candidate, count: int = 1,
                     span: int | None = None, after_s: float | None = None, at_least_fit: bool = False,
                     all_busy: bool = False) -> float:
        """`count` collectives moving `nbytes` in all (each nbytes / count), each after `after_s`
        of one rank's compute (alone) where that is known (a layer's collectives within its
        micro-batch), else as the fit was timed (slice_terms); with `at_least_fit`, never less
        than as the fit was timed."""
        if group <= 1 or nbytes <= 0 or count <= 0:
            return 0.0
        lat, per_byte = self.collective_terms(kind, group, cand, span, all_busy)
        if after_s is not None:
            per_slice, at_none = self.slice_terms(kind, group, cand)
            lat = max(lat if at_least_fit else 0.0, lat + per_slice * after_s - at_none)
        return count * lat + nbytes * per_byte

    def exposed_s(self, comm: float, window: float) -> float:
        """Collective time compute does not hide: `window` seconds of compute, of which the
        hardware's overlap share can run beside collectives (gloo on CPU: none; NCCL's streams:
        all, assumed)."""
        return max(0.0, comm - self.hw.collective_overlap * window)

    def _optimizer_s(self, lp: LayerProfile, numel: int) -> float:
        """The optimizer step of `numel` of the layer's elements: the profile's measured step
        (same device) scaled by elements, else bytes read and written over memory bandwidth."""
        if self.measured_here and lp.optimizer_step_s > 0 and lp.param_count > 0:
            return lp.optimizer_step_s * numel / lp.param_count
        touches = {"sgd": 3, "momentum": 5, "adam": 7, "adamw": 7}[self.profile.optimizer]
        return numel * touches * self.store_isz / self.hw.memory_bandwidth()

    # -- a whole layout -------------------------------------------------------------------
    def stage_costs(self, cand: Candidate, stage: int, choices: list[Placed]) -> tuple[list[LayerCost], LayerCost | None]:
        costs = [self.layer(cand, i, ck, off) for i, ck, off in choices]
        last = choices[-1][0] == self.profile.n_layers - 1
        return costs, (self.loss(cand) if last else None)

    def stage_buffers(self, cand: Candidate, stage: int, choices: list[Placed]) -> tuple[int, int, int, int]:
        """Bytes outside the layers: (alive all step, per in-flight micro-batch, in a forward
        that follows a backward, held by the sends of each finished micro-batch).

        One chunk's, where a rank runs several: the batch (inputs on the first stage, targets on
        the last) and what torch.distributed.pipelining keeps (memory.pipeline_buffers). Its
        receive buffers are allocated once and kept between steps; a received activation is
        used in place.
        """
        first, last = choices[0][0], choices[-1][0]
        is_first, is_last = first == 0, last == self.profile.n_layers - 1
        batch = self.batch_bytes(cand, is_first, is_last)
        if cand.pp == 1:
            return batch, 0, 0, 0
        static, per_mb, after_backward, sent = pipeline_buffers(
            cand.num_micro_batches, self.sample(first, cand).input_bytes, self.sample(last, cand).output_bytes,
            is_first, is_last, holds_sends(cand.schedule))
        return batch + static, per_mb, after_backward, sent

    def batch_bytes(self, cand: Candidate, is_first: bool, is_last: bool) -> int:
        """The step's batch a stage holds all step: inputs on the first stage, targets on the last."""
        b, m = cand.micro_batch_size, cand.num_micro_batches
        return (int(self.profile.batch["input_bytes_per_sample"] * b * m) if is_first else 0) \
            + (int(self.profile.batch["target_bytes_per_sample"] * b * m) if is_last else 0)

    def rank_memory(self, cand: Candidate, rank: int, chunks: list[tuple[int, list[Placed]]]) -> StageMemory:
        """The memory of pp rank `rank` over a step, running `chunks`: (stage index, its layers' choices)
        of each of its stages (stages rank, rank + pp, ...)."""
        mine = tuple((s, tuple(choices)) for s, choices in chunks)
        key = ("rank", cand, rank, mine)
        if key not in self._cache:
            self._cache[key] = self._rank_memory(cand, rank, mine)
        return self._cache[key]

    def chunk(self, cand: Candidate, stage: int, choices: list[Placed], name: str = "") -> Chunk:
        """Stage `stage` as its rank's walk reads it (memory.Chunk): its layers' memory, the loss
        on the last stage, and the bytes outside its layers (stage_buffers)."""
        costs, loss = self.stage_costs(cand, stage, list(choices))
        static, per_mb, after_backward, sent = self.stage_buffers(cand, stage, list(choices))
        return Chunk([c.memory for c in costs], loss.memory if loss else None, static, per_mb, after_backward, sent, name=name)

    def _rank_memory(self, cand: Candidate, rank: int, mine) -> StageMemory:
        chunks = [self.chunk(cand, s, choices, name=f"stage {s} " if len(mine) > 1 else "") for s, choices in mine]
        actions = schedule_actions(cand.schedule, cand.pp, rank, cand.num_micro_batches, cand.virtual_stages)
        return walk_rank(chunks, actions, reshard_after_backward=cand.pp == 1, input_is_held=True,
                         sends_held=holds_sends(cand.schedule))

    def stage_times(self, cand: Candidate, stage: int, choices: list[Placed]) -> tuple[float, float]:
        """(time per micro-batch, time once per step) of one stage."""
        terms = self.stage_terms(cand, stage, choices)
        return terms.per_micro_batch, terms.once_per_step

    def stage_terms(self, cand: Candidate, stage: int, choices: list[Placed]) -> TimeTerms:
        costs, loss = self.stage_costs(cand, stage, choices)
        first, last = choices[0][0], choices[-1][0]
        terms = self.time_terms(
            cand, layers_s=sum(c.micro_batch_s for c in costs), loss_s=loss.micro_batch_s if loss else 0.0,
            sent_bytes=self.boundary_bytes(cand, first, last), boundaries=(first > 0) + (last < self.profile.n_layers - 1),
            step_s=sum(c.step_s for c in costs), sync_s=sum(c.sync_s for c in costs),
            compute_s=sum(c.compute_s for c in costs))
        return terms

    def time_terms(self, cand: Candidate, layers_s, loss_s, sent_bytes, boundaries, step_s, sync_s, compute_s) -> "TimeTerms":
        """A stage's time from sums over its layers, the one definition of it: the cost model
        passes numbers, the MILP passes affine expressions of its variables (hence only + and
        *). Per micro-batch: its layers, the loss, the pipeline schedule's overhead, and at each
        pipeline boundary the activation sent one way and its gradient back. Once per step: optimizer steps and broadcasts, and
        the gradient collectives that half the backward may hide."""
        lat, per_byte = self.collective_terms("send_recv", 2, cand, span=cand.dp * cand.tp * 2) if cand.pp > 1 else (0.0, 0.0)
        if self.hw.pipeline_overhead_s > 0:
            # Measured (plan calibrate), per action: every stage of a pipeline runs a forward and
            # a backward a micro-batch, at either end as in the middle; the small send's and
            # receive's latency is in it. (Counted per boundary it gave the end stages half of
            # theirs, and the CPU time bench's pipelines were 5-35% under their runs.) It is the
            # rank's own work, so where busy ranks outnumber the cores it is slowed as compute is
            # (compute_scale). Until 2026-12-07 a separately calibrated wait for a core
            # (pipeline_contention_s, 0-1.7 ms from one calibration to the next) was added
            # instead; with host_cores timed on layer-like work this took the median errors of
            # four kept sets of bench/time_fidelity.py down in 11 of their 12 model cells, no
            # rank correlation down (docs/cost-model.md), with no figure of its own to calibrate.
            fixed = 2 * self.hw.pipeline_overhead_s * self.compute_scale(cand) if boundaries else 0.0
        else:
            fixed = boundaries * 2 * lat           # the link: each boundary's send one way and its gradient back
        return TimeTerms(per_micro_batch=layers_s + loss_s + fixed + 2 * sent_bytes * per_byte,
                         step=step_s, sync_minus_window=sync_s - self.sync_hidden_share * compute_s)

    @property
    def sync_hidden_share(self) -> float:
        """The share of a stage's compute per micro-batch that gradient collectives can hide
        behind (TimeTerms.sync_minus_window): the overlapped share of half the backward."""
        return self.hw.collective_overlap * 0.5

    @staticmethod
    def pipeline_step_s(m: int, v: int, stages_total, slowest, fullest_once):
        """The step of m micro-batches through a pipeline, the one definition of it: each
        stage's time per micro-batch once (`stages_total`, their sum: the first micro-batch
        fills the pipeline and the last drains it), m - 1 more of the `slowest` rank's, and
        the `fullest_once` rank's once-per-step work. The critical path through the slowest
        stage, Alpa's pipeline latency (Zheng et al., OSDI 2022, eq. 2), for 1F1B and GPipe
        alike; with equal stages it is the familiar (m + pp - 1) x the stage time. Exact for
        GPipe, an upper estimate for 1F1B, which can overlap the slowest stage's backwards
        with later stages' work (docs/cost-model.md gives the simulated error).

        With v stages a rank (interleaved 1F1B, looped BFS), a rank's time per micro-batch is
        its v stages' together, and filling and draining the pipeline passes each rank once
        per chunk, 1/v of its time: m x the slowest rank + (stages_total - slowest) / v, which
        for v = 1 is the above and with equal stages gives Narayanan et al.'s (SC 2021) bubble
        of (pp - 1) / (v m) of the ideal, for looped BFS too when m >= pp (Lamy-Poirier 2023;
        both simulated action by action in tests/test_step_time.py). Numbers or the MILP's
        affine expressions."""
        return stages_total * (1 / v) + (m - 1 / v) * slowest + fullest_once

    def boundary_bytes(self, cand: Candidate, first: int, last: int) -> int:
        """Activation bytes a stage from layer `first` to `last` exchanges with its neighbours per micro-batch."""
        nbytes = 0
        if cand.pp > 1 and first > 0:
            nbytes += self.sample(first, cand).input_bytes
        if cand.pp > 1 and last < self.profile.n_layers - 1:
            nbytes += self.sample(last, cand).output_bytes
        return nbytes

    def evaluate(self, cand: Candidate, stages: list[list[Placed]]) -> Prediction:
        """Memory and time of a layout; `stages[s]` lists (layer, checkpoint, offload) in order.
        A stage's memory is its rank's (all the stages it runs)."""
        preds = []
        for s, choices in enumerate(stages):
            rank = s % cand.pp
            mem = self.rank_memory(cand, rank, [(t, stages[t]) for t in range(rank, len(stages), cand.pp)])
            per_mb, per_step = self.stage_times(cand, s, choices)
            costs, _ = self.stage_costs(cand, s, choices)
            preds.append(StagePrediction(s, [c[0] for c in choices], mem, per_mb, per_step,
                                         self.stage_parts(cand, s, choices, per_mb, per_step),
                                         host_bytes=sum(c.memory.host for c in costs)))
        return self.finish(cand, preds)

    def overfills_a_rank(self, cand: Candidate, stages: list[list[Placed]]) -> bool:
        """Whether some pp rank of the layout peaks over the memory limit: evaluate's `fits` on
        the device side alone, stopping at the first rank over (rank 0 first: it holds the most
        micro-batches in flight)."""
        return any(self.rank_memory(cand, rank, [(t, stages[t]) for t in range(rank, len(stages), cand.pp)]).peak
                   > self.memory_limit for rank in range(cand.pp))

    def ranks_per_stage_on_nodes(self, cand: Candidate) -> list[tuple[int, ...]]:
        """For each distinct kind of node, how many of its ranks hold each pipeline stage.
        Ranks are numbered pp-major with tp innermost (runtime/parallel_dims.MESH_DIMS), so a
        node holds a contiguous block of gpus_per_node ranks."""
        per_stage, world = cand.dp * cand.tp, cand.world_size
        key = ("nodes", cand.pp, per_stage)
        if key not in self._cache:
            g = min(self.gpus_per_node, world)
            kinds = set()
            for first in range(0, world, g):
                counts = [0] * cand.pp
                for rank in range(first, min(first + g, world)):
                    counts[rank // per_stage] += 1
                kinds.add(tuple(counts))
            self._cache[key] = sorted(kinds)
        return self._cache[key]

    def host_peak_bytes(self, cand: Candidate, stage_host: list[int]) -> int:
        """The fullest node's host memory: every rank's offloaded states (`stage_host`: one rank of each stage)."""
        return max(sum(n * h for n, h in zip(counts, stage_host)) for counts in self.ranks_per_stage_on_nodes(cand))

    def stage_parts(self, cand: Candidate, stage: int, choices, per_mb: float, per_step: float) -> dict[str, float]:
        """One stage's time per micro-batch and once per step by component (they add up to both).
        FSDP2's hooks and copies are dp_comm, as the runtime's breakdown counts them (its
        FSDP:: regions), though they are costed as compute (profiled on one process)."""
        costs, loss = self.stage_costs(cand, stage, choices)
        hooks = sum(c.fsdp_hooks_s for c in costs)
        compute = sum(c.compute_s for c in costs) + (loss.compute_s if loss else 0.0) - hooks
        tp = sum(c.tp_comm_s for c in costs) + (loss.tp_comm_s if loss else 0.0)
        offload = sum(c.offload_s for c in costs)
        dp_mb = sum(c.comm_s - c.tp_comm_s for c in costs) + hooks
        tp_sync = sum(c.tp_grad_sync_s for c in costs)
        step = sum(c.step_s - c.fsdp_sync_copies_s for c in costs) - tp_sync
        forward = sum(c.forward_s for c in costs) + (loss.forward_s if loss else 0.0)
        recompute = sum(c.recompute_s for c in costs)
        return {"compute": compute, "tp_comm": tp, "offload": offload, "dp_comm": dp_mb,
                "p2p": per_mb - compute - tp - offload - dp_mb,
                "optimizer": step, "tp_sync": tp_sync, "dp_sync": per_step - step - tp_sync,
                # compute split for the timeline (they add up to compute)
                "forward": forward, "recompute": recompute, "backward": compute - forward - recompute}

    def finish(self, cand: Candidate, preds: list[StagePrediction]) -> Prediction:
        m, v = cand.num_micro_batches, cand.virtual_stages
        ranks = [rank_total(preds[r::cand.pp]) for r in range(cand.pp)]    # each pp rank's stages together
        slowest = max(ranks, key=lambda p: p.micro_batch_s)
        fullest = max(ranks, key=lambda p: p.step_extra_s)
        total = sum(p.micro_batch_s for p in preds)
        step = self.pipeline_step_s(m, v, total, slowest.micro_batch_s, fullest.step_extra_s)
        flops = sum(self.layer(cand, i, "none", False).model_flops for i in range(self.profile.n_layers)) \
            + self.loss(cand).model_flops
        # Per step: every dp replica runs m micro-batches; TP ranks each did 1/tp of the FLOPs
        # already (the profile's tp figures), so count tp of them.
        total_flops = flops * m * cand.dp * cand.tp
        mfu = total_flops / (step * cand.world_size * self.hw.flops(self.precision)) if step > 0 else 0.0
        # The step by component: m micro-batches of the slowest rank, the bubble (the other
        # ranks' one micro-batch each, over v), and the once-per-step work of the rank with the most of it.
        sp, fp = slowest.parts, fullest.parts
        comps = {k: m * sp[k] for k in ("compute", "offload", "p2p")}
        comps["tp_comm"] = m * sp["tp_comm"] + fp["tp_sync"]
        comps["dp_comm"] = m * sp["dp_comm"] + fp["dp_sync"]
        comps["bubble"] = (total - slowest.micro_batch_s) * (1 / v)
        comps["optimizer"] = fp["optimizer"]
        comps["total"] = step
        return Prediction(cand, preds, step, comps, cand.global_batch / step if step > 0 else 0.0, mfu,
                          self.memory_limit, self.host_peak_bytes(cand, [p.host_bytes for p in preds]),
                          self.hw.usable_host_bytes())


def rank_total(stages: list[StagePrediction]) -> StagePrediction:
    """The stages one pp rank runs, as one: their times and parts added (itself when one)."""
    if len(stages) == 1:
        return stages[0]
    parts = {k: sum(p.parts[k] for p in stages) for k in stages[0].parts}
    return StagePrediction(stages[0].index, [i for p in stages for i in p.layers], stages[0].memory,
                           sum(p.micro_batch_s for p in stages), sum(p.step_extra_s for p in stages), parts)


def busy_per_slot(m: int, pp: int, ranks: int) -> list[float]:
    """How many of a node's `ranks` work at once in each slot of a step (CPU processes, which
    share the node's cores). A pipeline's ranks are not all busy at once: in each of the step's
    m + pp - 1 slots (stages of equal time), min(k + 1, pp, m, m + pp - 1 - k) stages of each
    pipeline work, ranks / pp each. With v stages a rank, pass m v: the slots are a chunk's, so
    ranks are busy together more of the step (the interleaved pipeline's smaller bubble).
    Without pipelining (pp 1) every rank, every slot."""
    slots = m + pp - 1
    return [min(k + 1, pp, m, slots - k) * ranks / pp for k in range(slots)]


def contention_scale(busy: list[float], cores: float) -> float:
    """How much slower ranks run than alone where `busy[k]` of them work in slot k and `cores`
    run at full speed at once: the mean over the slots of max(1, busy / cores)."""
    return sum(max(1.0, b / cores) for b in busy) / len(busy)


def zero_model_state_bytes(param_bytes: float, grad_bytes: float, optimizer_bytes: float, zero: int, dp: int) -> float:
    """Model-state bytes per rank under ZeRO's definitions (Rajbhandari et al., 2020):
    stage 1 shards optimizer states, stage 2 also gradients, stage 3 also parameters.

    The runtime realises stages 0 and 3 exactly so (FSDP2 `replicate`, `fully_shard`). Its
    stage 2 (`fully_shard` without resharding after forward) also keeps a sharded copy of the
    parameters beside the unsharded one, and its stage 1 (`replicate` + a sharded optimizer)
    keeps fp32 parameters whole under mixed precision, where ZeRO keeps fp16 ones; `_layer`
    costs what the runtime does, docs/cost-model.md lists the differences.
    """
    return (param_bytes / (dp if zero >= 3 else 1) + grad_bytes / (dp if zero >= 2 else 1)
            + optimizer_bytes / (dp if zero >= 1 else 1))


def single_device_peak(profile: Profile, micro_batch_size: int, checkpoint: list[str] | None = None,
                       num_micro_batches: int = 1) -> StageMemory:
    """Peak memory of plain training steps on one device (no wrapper): the simplest use of
    the cost model, and the one PyTorch's MemTracker can referee directly."""
    cand = Candidate(1, 1, 1, micro_batch_size, num_micro_batches, 0, "1f1b", False, False)
    model = CostModel(profile, PRESETS["cpu"], 1, 1 << 62)   # memory does not depend on the hardware
    checkpoint = checkpoint or ["none"] * profile.n_layers
    return model.rank_memory(cand, 0, [(0, [Placed(i, c, False) for i, c in enumerate(checkpoint)])])


def _numel(shape) -> int:
    return math.prod(shape) if shape else 1


def local_shapes(lp: LayerProfile, tp: int) -> list[list[int]]:
    """Each parameter's shape on one TP rank."""
    out = []
    for p in lp.params:
        shape = list(p.shape)
        if tp > 1 and p.tp_dim is not None:
            shape[p.tp_dim] = -(-shape[p.tp_dim] // tp)
        out.append(shape)
    return out


def _padded_shard(shape: list[int], d: int) -> int:
    """Elements of one rank's FSDP2 shard: dim 0 padded to a multiple of d."""
    if not shape:
        return 1
    rows = -(-shape[0] // d)
    return rows * _numel(shape[1:])


def optimizer_bytes(optimizer: str, numel: int, n_tensors: int, itemsize: int) -> int:
    """States of the fused torch.optim step (see profiles.measure.optimizer_state_bytes)."""
    if optimizer == "sgd":
        return 0
    if optimizer == "momentum":
        return numel * itemsize
    return 2 * numel * itemsize + 4 * n_tensors


def _same_gpu(device_name: str, preset: str) -> bool:
    name = device_name.lower().replace(" ", "")
    key = preset.split("-")[0]
    return key in name


def tp_divides(profile: Profile, tp: int) -> bool:
    """Every dimension the tp_plan shards, and every number the model says a degree must
    divide (its head counts), splits evenly over tp ranks."""
    return splits_evenly([p for layer in profile.layers for p in layer.params], profile.tp_divides, tp)
