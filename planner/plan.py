"""The plan document (plan.json) and its dataclasses. Torch-free: the runtime reads it.

A plan says exactly how to train: the parallel degrees and how ranks map onto them, the
micro-batching, the ZeRO stage, the pipeline schedule, and for every layer its pipeline
stage, whether it is checkpointed and whether its parameters, gradients and optimizer
states live on the CPU. It also records what the planner predicted, so that `plan verify`
can hold the run to it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple
from pathlib import Path

from profiles.schema import OPTIMIZERS, PRECISIONS, read_json_document, write_json_atomic

PLAN_SCHEMA_VERSION = 3   # 3: a layer's checkpoint is a mode (CHECKPOINT_MODES), not true / false
SCHEDULES = ("1f1b", "gpipe", "interleaved", "looped_bfs")
# The schedules that run several stages a pp rank, stage k on rank k % pp (torch's
# ScheduleInterleaved1F1B and ScheduleLoopedBFS).
MULTI_STAGE_SCHEDULES = ("interleaved", "looped_bfs")
# How much of a layer's forward its backward runs again (profiles/checkpointing.py applies them):
#   none       nothing: autograd keeps what the layer's ops save
#   selective  keeps its input and the outputs of its compute-heavy ops (matmuls, attention,
#              collectives), recomputes the rest (elementwise ops, norms) in backward
#   full       keeps only its input, recomputes the whole forward in backward
CHECKPOINT_MODES = ("none", "selective", "full")


def checkpoint_mode(value) -> str:
    """A checkpoint mode from a mode or from the true / false of code written before there
    were three (True: "full"); anything else is returned as it is, for validation to refuse."""
    if isinstance(value, bool):
        return "full" if value else "none"
    return value
# What the runtime makes of a layer for data parallelism (runtime/parallelize.apply_fsdp):
#   plain       no wrapper at all (one rank, nothing offloaded, no mixed precision)
#   replicate   FSDP-based replicate: whole parameters, gradients all-reduced (ZeRO 0 and 1)
#   shard       fully_shard, resharded after forward (ZeRO 3, and every offloaded layer)
#   shard_keep  fully_shard keeping the unsharded parameters until backward (ZeRO 2)
UNITS = ("plain", "replicate", "shard", "shard_keep")


class PlanError(Exception):
    """A plan that cannot be used; the message is one sentence with the fix."""


def tp_within_nodes(tp: int, gpus: int, node_size: int) -> bool:
    """Whether every TP group lies inside one node: TP ranks are consecutive (tp innermost,
    runtime/parallel_dims.MESH_DIMS), so tp must divide the node's GPUs once there are several
    nodes (on one node any tp does); the cost model prices TP at the node's links."""
    return tp <= gpus if gpus <= node_size else node_size % tp == 0


def wraps_layers(dp: int, precision: str, any_offload: bool) -> bool:
    """Whether a layout's layers are FSDP2 units: to share with other dp ranks, to cast
    under mixed precision, or to offload. Else the plain path, no wrapper."""
    return dp > 1 or precision == "mixed" or any_offload


def fsdp_unit(wrapped: bool, zero: int, offload: bool) -> str:
    """Which unit (UNITS) a layer is, the one place it is decided: the cost model costs
    it, plan.json records it per layer, the runtime applies it. An offloaded layer is always
    fully sharded (CPUOffloadPolicy needs fully_shard)."""
    if not wrapped:
        return "plain"
    if offload or zero == 3:
        return "shard"
    return "shard_keep" if zero == 2 else "replicate"


class Placed(NamedTuple):
    """A layer as the planner's layouts hold it, per stage in order (`list[list[Placed]]`): a
    LayerChoice without its FSDP2 unit (the candidate decides that), immutable and hashable,
    because the cost model caches by layouts and the searches compare millions of them."""

    layer: int                 # its position in the model's nn.Sequential
    checkpoint: str            # CHECKPOINT_MODES
    offload: bool


@dataclass
class LayerChoice:
    index: int                 # position of the layer in the model's nn.Sequential
    checkpoint: str = "none"   # CHECKPOINT_MODES (True / False from hand-built plans mean "full" / "none")
    offload: bool = False      # parameters, gradients and optimizer states on the CPU (FSDP2 CPUOffloadPolicy)
    unit: str = ""             # its FSDP2 unit (UNITS); "" when built by hand: Plan fills it in (fsdp_unit)

    def __post_init__(self) -> None:
        self.checkpoint = checkpoint_mode(self.checkpoint)

    @property
    def recomputes(self) -> bool:
        """Whether its backward runs any of its forward again (selective or full)."""
        return self.checkpoint != "none"


@dataclass
class Stage:
    index: int                 # pipeline stage; with a multi-stage schedule, stage k runs on pp rank k % pp
    layers: list[LayerChoice]


@dataclass
class PredictedStage:
    """What the planner predicts for one pipeline stage (bytes on its fullest rank)."""

    index: int
    layers: list[int]
    weights_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int      # at the peak
    buffers_bytes: int          # at the peak: FSDP2 and pipeline buffers, the batch
    peak_bytes: int
    peak_phase: str             # the moment of the step the peak falls in (memory.walk_rank)
    micro_batch_s: float        # the stage's time per micro-batch
    step_extra_s: float         # its time once per step (optimizer, exposed gradient sync)
    parts_s: dict[str, float] = field(default_factory=dict)  # those two by component (cost.CostModel.stage_parts)


@dataclass
class Predicted:
    """The planner's prediction for the whole step (planner.cost.Prediction, as written)."""

    stages: list[PredictedStage]
    peak_bytes: int
    step_time_s: float
    components_s: dict[str, float]    # the step by component (cost.Prediction.components); they add up to it
    samples_per_s: float
    mfu: float
    host_peak_bytes: int = 0          # the fullest node's host memory holding offloaded states

    @classmethod
    def from_json(cls, d: dict) -> "Predicted":
        return cls(**{**d, "stages": [PredictedStage(**s) for s in d["stages"]]})

    def problem(self) -> str | None:
        """What is wrong with the figures a reader relies on, or None."""
        def number(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
        for s in self.stages:
            for name in ("weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes",
                         "peak_bytes", "micro_batch_s", "step_extra_s"):
                if not number(getattr(s, name)):
                    return f"stage {s.index}'s predicted {name} is {getattr(s, name)!r}"
        if not (number(self.step_time_s) and self.step_time_s > 0 and number(self.peak_bytes)):
            return f"its predicted step time {self.step_time_s!r} or peak {self.peak_bytes!r} is not a positive number"
        if not isinstance(self.components_s, dict) or not all(isinstance(v, (int, float)) for v in self.components_s.values()):
            return "its predicted components are not seconds by component"
        return None


@dataclass
class OptimizerConfig:
    name: str = "adamw"        # sgd | momentum | adam | adamw
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    momentum: float = 0.9      # for "momentum"

    def problem(self) -> str | None:
        """What a rank would refuse or crash on, or None."""
        def number(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")
        if self.name not in OPTIMIZERS:
            return f"optimizer {self.name!r} is not one of {', '.join(OPTIMIZERS)}"
        for name in ("lr", "eps", "weight_decay", "momentum"):
            v = getattr(self, name)
            if not number(v) or v < 0 or (name == "lr" and v == 0):
                return f"the optimizer's {name} is {v!r}, not a {'positive' if name == 'lr' else 'non-negative'} number"
        if len(self.betas) != 2 or not all(number(b) and 0 <= b < 1 for b in self.betas):
            return f"the optimizer's betas are {list(self.betas)!r}, not two numbers in [0, 1)"
        return None


@dataclass
class Plan:
    profile: dict              # {"path", "sha256", "threads"} of the profile it was solved from (threads: its layers' timing)
    model: dict                # {"path", "sha256", "source", "name"}: the model file the runtime loads
    hardware: dict             # the hardware description (preset or cluster file), as used
    device_type: str           # "cuda" (NCCL) or "cpu" (gloo)
    world_size: int
    gpus_per_node: int
    dp: int
    tp: int
    pp: int
    zero: int                  # 0: replicate; 1: optimizer states sharded; 2: + gradients; 3: + parameters
    schedule: str              # 1f1b | gpipe | interleaved | looped_bfs (pipeline schedule; "1f1b" when pp == 1)
    micro_batch_size: int      # samples per micro-batch on one dp rank
    num_micro_batches: int     # micro-batches per step on one dp rank (pipeline micro-batches or accumulation)
    global_batch: int          # = micro_batch_size * num_micro_batches * dp
    precision: str             # fp32 | bf16 | mixed
    optimizer: OptimizerConfig
    stages: list[Stage]
    sequence_parallel: bool = False   # the tp_plan's "sequence" modules run on slices of the sequence (tp > 1)
    seq_len: int | None = None
    seed: int = 0
    memory_limit_bytes: int = 0
    predicted: Predicted | None = None   # None for a plan written by hand
    launch: str = ""
    alternatives: list[dict] = field(default_factory=list)
    schema: int = PLAN_SCHEMA_VERSION
    kind: str = "plan"

    def __post_init__(self) -> None:
        for stage in self.stages:
            for lc in stage.layers:
                lc.unit = lc.unit or fsdp_unit(self.wrapped_layout, self.zero, lc.offload)

    @property
    def wrapped_layout(self) -> bool:
        """Whether this layout's layers are FSDP2 units (wraps_layers)."""
        return wraps_layers(self.dp, self.precision, any(lc.offload for s in self.stages for lc in s.layers))

    @property
    def wrapped(self) -> bool:
        """Whether the runtime wraps any layer (then each stage is a fully_shard root too)."""
        return any(lc.unit != "plain" for s in self.stages for lc in s.layers)

    @property
    def nodes(self) -> int:
        """Nodes the plan runs on: gpus_per_node ranks each (validate: a whole number)."""
        return max(1, self.world_size // self.gpus_per_node)

    @property
    def n_layers(self) -> int:
        return sum(len(s.layers) for s in self.stages)

    @property
    def threads(self) -> int:
        """Intra-op threads per rank the prediction assumes (the profile's timing)."""
        t = self.profile.get("threads", 1) if isinstance(self.profile, dict) else 1
        return t if isinstance(t, int) and not isinstance(t, bool) and t >= 1 else 1

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages per pp rank (more than 1 only for MULTI_STAGE_SCHEDULES)."""
        return len(self.stages) // self.pp

    def stages_of_rank(self, pp_rank: int) -> list[Stage]:
        return [s for s in self.stages if s.index % self.pp == pp_rank]

    def to_json(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        write_json_atomic(path, self.to_json())

    @classmethod
    def from_json(cls, d: dict, source: str = "plan") -> "Plan":
        if not isinstance(d, dict) or d.get("kind") != "plan":
            raise PlanError(f"{source} is not a plan; pass the plan.json that `plan solve` wrote.")
        if d.get("schema") != PLAN_SCHEMA_VERSION:
            raise PlanError(f"{source} has schema {d.get('schema')!r} but this plan reads schema {PLAN_SCHEMA_VERSION}; solve again with `plan solve`.")
        try:
            opt = OptimizerConfig(**{**d["optimizer"], "betas": tuple(d["optimizer"].get("betas", (0.9, 0.999)))})
            stages = [Stage(index=int(s["index"]), layers=[LayerChoice(**lc) for lc in s["layers"]]) for s in d["stages"]]
            if any(not lc.unit for st in stages for lc in st.layers):
                raise KeyError("unit")
            predicted = Predicted.from_json(d["predicted"]) if d.get("predicted") else None
            keys = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k not in ("optimizer", "stages", "predicted")}
            plan = cls(optimizer=opt, stages=stages, predicted=predicted, **keys)
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"{source} is damaged or hand-edited ({type(e).__name__}: {e}); solve again with `plan solve`.") from None
        plan.validate(source)
        return plan

    def validate(self, source: str = "plan") -> None:
        def bad(what):
            raise PlanError(f"{source} is inconsistent: {what}; solve again with `plan solve`.")
        for name in ("world_size", "gpus_per_node", "dp", "tp", "pp", "micro_batch_size", "num_micro_batches", "global_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(f"{name} is {v!r}, not a positive integer")
        if self.dp * self.tp * self.pp != self.world_size:
            bad(f"dp {self.dp} x tp {self.tp} x pp {self.pp} is not the world size {self.world_size}")
        if (self.world_size > self.gpus_per_node and self.world_size % self.gpus_per_node) or \
                not tp_within_nodes(self.tp, self.world_size, self.gpus_per_node):
            bad(f"its {self.world_size} ranks do not fill nodes of {self.gpus_per_node} GPUs with whole TP groups of {self.tp}")
        if self.micro_batch_size * self.num_micro_batches * self.dp != self.global_batch:
            bad(f"micro-batch {self.micro_batch_size} x {self.num_micro_batches} micro-batches x dp {self.dp} is not the global batch {self.global_batch}")
        if self.zero not in (0, 1, 2, 3):
            bad(f"zero is {self.zero!r}, not 0, 1, 2 or 3")
        if not isinstance(self.sequence_parallel, bool):
            bad(f"sequence_parallel is {self.sequence_parallel!r}, not true or false")
        if self.sequence_parallel and self.tp == 1:
            bad("sequence_parallel is on with tp 1 (it splits the activations of tensor-parallel layers)")
        if self.schedule not in SCHEDULES:
            bad(f"schedule is {self.schedule!r}, not one of {', '.join(SCHEDULES)}")
        if self.device_type not in ("cpu", "cuda"):
            bad(f"device_type is {self.device_type!r}, not cpu or cuda")
        if self.precision not in PRECISIONS:
            bad(f"precision is {self.precision!r}, not one of {', '.join(PRECISIONS)}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            bad(f"seed is {self.seed!r}, not an integer")
        if not isinstance(self.memory_limit_bytes, int) or isinstance(self.memory_limit_bytes, bool) or self.memory_limit_bytes < 0:
            bad(f"memory_limit_bytes is {self.memory_limit_bytes!r}, not a non-negative integer")
        for name in ("profile", "model", "hardware"):
            if not isinstance(getattr(self, name), dict):
                bad(f"its {name} is {getattr(self, name)!r}, not a table")
        if not isinstance(self.hardware.get("name", ""), str):
            bad(f"its hardware's name is {self.hardware['name']!r}, not text")
        if "device_type" in self.hardware:      # a full description (plan solve's); hand-written plans may name one only
            from .hardware import Hardware, HardwareError, retired_field
            if (old := retired_field(self.hardware)) is not None:
                raise PlanError(f"{source} was solved by an earlier version (its hardware has {old}, which the "
                                "cost model no longer uses); solve again with `plan solve`.")
            try:
                Hardware.from_json(self.hardware)
            except (HardwareError, KeyError, TypeError, ValueError) as e:
                bad(f"its hardware description is damaged ({e})")
        for lc in (lc for s in self.stages for lc in s.layers):
            if lc.checkpoint not in CHECKPOINT_MODES or not isinstance(lc.offload, bool):
                bad(f"layer {lc.index}'s checkpoint and offload are {lc.checkpoint!r} and {lc.offload!r}, "
                    f"not one of {', '.join(CHECKPOINT_MODES)} and true or false")
        problem = self.optimizer.problem()
        if problem:
            bad(problem)
        if not self.stages or len(self.stages) % self.pp:
            bad(f"it has {len(self.stages)} stages for pp {self.pp}")
        if sorted(s.index for s in self.stages) != list(range(len(self.stages))):
            bad("its stage indices are not 0, 1, 2, ...")
        order = [lc.index for s in sorted(self.stages, key=lambda s: s.index) for lc in s.layers]
        if order != list(range(len(order))) or any(not s.layers for s in self.stages):
            bad("its stages do not hold the layers 0, 1, 2, ... in order, each stage at least one")
        for lc in (lc for s in self.stages for lc in s.layers):
            want = fsdp_unit(self.wrapped_layout, self.zero, lc.offload)
            if lc.unit != want:
                bad(f"layer {lc.index} is a {lc.unit!r} unit where dp {self.dp}, ZeRO {self.zero} and its offload make it {want!r}")
        if self.predicted is not None:
            if [s.index for s in self.predicted.stages] != [s.index for s in self.stages]:
                bad("its prediction's stages are not its stages")
            if self.predicted.problem():
                bad(self.predicted.problem())
        if self.pp > 1 and self.num_micro_batches < self.pp and self.schedule != "gpipe":
            bad(f"{self.schedule} needs at least pp = {self.pp} micro-batches, it has {self.num_micro_batches}")


def load_plan(path: str | Path) -> Plan:
    d = read_json_document(path, "plan", "create it with `plan solve`", "solve again with `plan solve`", PlanError)
    return Plan.from_json(d, source=f"plan {path}")
