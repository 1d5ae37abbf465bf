"""The plan document (plan.json) and its dataclasses. Torch-free: the runtime reads it.

A plan says exactly how to train: the parallel degrees and how ranks map onto them, the
micro-batching, the ZeRO stage, the pipeline schedule, and for every layer its pipeline
stage, whether it is checkpointed and whether its parameters, gradients and optimizer
states live on the CPU. It also records what the planner predicted, so that `plan verify`
can hold the run to it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from profiles.schema import read_json_document, write_json_atomic

PLAN_SCHEMA_VERSION = 1
SCHEDULES = ("1f1b", "gpipe", "interleaved")


class PlanError(Exception):
    """A plan that cannot be used; the message is one sentence with the fix."""


@dataclass
class LayerChoice:
    index: int                 # position of the layer in the model's nn.Sequential
    checkpoint: bool = False   # non-reentrant activation checkpointing of the whole layer
    offload: bool = False      # parameters, gradients and optimizer states on the CPU (FSDP2 CPUOffloadPolicy)


@dataclass
class Stage:
    index: int                 # pipeline stage; with the interleaved schedule, stage k runs on pp rank k % pp
    layers: list[LayerChoice]


@dataclass
class OptimizerConfig:
    name: str = "adamw"        # sgd | momentum | adam | adamw
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    momentum: float = 0.9      # for "momentum"


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
    schedule: str              # 1f1b | gpipe | interleaved (pipeline schedule; "1f1b" when pp == 1)
    micro_batch_size: int      # samples per micro-batch on one dp rank
    num_micro_batches: int     # micro-batches per step on one dp rank (pipeline micro-batches or accumulation)
    global_batch: int          # = micro_batch_size * num_micro_batches * dp
    precision: str             # fp32 | bf16 | mixed
    optimizer: OptimizerConfig
    stages: list[Stage]
    seq_len: int | None = None
    seed: int = 0
    memory_limit_bytes: int = 0
    predicted: dict = field(default_factory=dict)
    launch: str = ""
    alternatives: list[dict] = field(default_factory=list)
    schema: int = PLAN_SCHEMA_VERSION
    kind: str = "plan"

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
        """Pipeline stages per pp rank (more than 1 only for the interleaved schedule)."""
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
            keys = {k: d[k] for k in cls.__dataclass_fields__ if k in d and k not in ("optimizer", "stages")}
            plan = cls(optimizer=opt, stages=stages, **keys)
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
        if self.micro_batch_size * self.num_micro_batches * self.dp != self.global_batch:
            bad(f"micro-batch {self.micro_batch_size} x {self.num_micro_batches} micro-batches x dp {self.dp} is not the global batch {self.global_batch}")
        if self.zero not in (0, 1, 2, 3):
            bad(f"zero is {self.zero!r}, not 0, 1, 2 or 3")
        if self.schedule not in SCHEDULES:
            bad(f"schedule is {self.schedule!r}, not one of {', '.join(SCHEDULES)}")
        if self.device_type not in ("cpu", "cuda"):
            bad(f"device_type is {self.device_type!r}, not cpu or cuda")
        if not self.stages or len(self.stages) % self.pp:
            bad(f"it has {len(self.stages)} stages for pp {self.pp}")
        if sorted(s.index for s in self.stages) != list(range(len(self.stages))):
            bad("its stage indices are not 0, 1, 2, ...")
        order = [lc.index for s in sorted(self.stages, key=lambda s: s.index) for lc in s.layers]
        if order != list(range(len(order))) or any(not s.layers for s in self.stages):
            bad("its stages do not hold the layers 0, 1, 2, ... in order, each stage at least one")
        if self.pp > 1 and self.num_micro_batches < self.pp and self.schedule != "gpipe":
            bad(f"{self.schedule} needs at least pp = {self.pp} micro-batches, it has {self.num_micro_batches}")


def load_plan(path: str | Path) -> Plan:
    d = read_json_document(path, "plan", "create it with `plan solve`", "solve again with `plan solve`", PlanError)
    return Plan.from_json(d, source=f"plan {path}")
