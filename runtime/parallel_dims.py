"""The parallel degrees of a run and the device mesh they span."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "tp")  # tp innermost: its ranks are contiguous, so on one node


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp: int
    tp: int
    world_size: int

    def __post_init__(self):
        for name in ("pp", "dp", "tp", "world_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} is {v!r}, not a positive integer")
        if self.pp * self.dp * self.tp != self.world_size:
            raise ValueError(f"pp {self.pp} x dp {self.dp} x tp {self.tp} is not the world size {self.world_size}")

    @classmethod
    def from_plan(cls, plan) -> "ParallelDims":
        return cls(pp=plan.pp, dp=plan.dp, tp=plan.tp, world_size=plan.world_size)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        return init_device_mesh(device_type, (self.pp, self.dp, self.tp), mesh_dim_names=MESH_DIMS)

