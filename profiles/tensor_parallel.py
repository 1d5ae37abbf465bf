"""Tensor parallelism of one layer, as the model file's tp_plan asks for it.

Used by the profiler (under a fake process group, to measure a layer at tp = 2 in one
process) and by the runtime (under the real one), so both apply exactly the same split.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def apply_tp(layer: nn.Module, matches: dict[str, str], tp_mesh: DeviceMesh) -> nn.Module:
    """Split the matched submodules of `layer` over `tp_mesh`; outputs stay local tensors
    (SDPA on DTensors fails on CPU, and the model's view(b, t, -1, hd) finds the local heads)."""
    if matches:
        parallelize_module(layer, tp_mesh, {name: STYLES[style]() for name, style in matches.items()})
    return layer


@contextlib.contextmanager
def fake_tp_mesh(device_type: str, degree: int):
    """A one-process mesh of `degree` ranks whose collectives do nothing: shapes and memory
    are those of real tensor parallelism, the numbers are not."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_tp_mesh needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=degree)
    try:
        yield init_device_mesh(device_type, (degree,))
    finally:
        dist.destroy_process_group()
