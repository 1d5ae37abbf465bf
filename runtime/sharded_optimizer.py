"""The optimizer step: a fused torch optimizer on parameters' local tensors, with ZeRO-1.

Every optimizer the plan can name (SGD, SGD with momentum, Adam, AdamW) is elementwise, so
stepping each parameter's local tensor (its TP and/or FSDP shard) is the same update as
stepping the DTensor. It also keeps `fused=True` possible: DTensor has no sharding rule for
`_fused_sgd_`.

ZeRO-1 (zero == 1): the parameters that replicate keeps in full on every dp rank are split
among the dp ranks by `partition_owners`; a rank runs the inner optimizer only on the ones it
owns, so only it holds their optimizer states, then every parameter is broadcast from its
owner over the dp group. Parameters FSDP2 already shards (offloaded layers) are stepped by
every rank on its own shard.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from planner.plan import OptimizerConfig


def build_optimizer(params: list[torch.Tensor], config: OptimizerConfig) -> torch.optim.Optimizer:
    if config.name == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=0.0, fused=True)
    if config.name == "momentum":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, fused=True)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[config.name]
    return cls(params, lr=config.lr, betas=tuple(config.betas), eps=config.eps,
               weight_decay=config.weight_decay, fused=True)


def partition_owners(numels: list[int], dp: int) -> list[int]:
    """ZeRO-1 owner (dp rank) of each parameter.

    Parameters in model order (stage by stage, then `module.parameters()` order), each to the
    dp rank that owns the fewest elements so far, the lowest rank on a tie. `numels` are the
    elements each rank holds of the parameter (after TP sharding).
    """
    loads = [0] * dp
    owners = []
    for n in numels:
        owner = loads.index(min(loads))
        owners.append(owner)
        loads[owner] += n
    return owners


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class ShardedOptimizer:
    """Steps `params` (this rank's, in model order) with the plan's optimizer.

    dp_group set (ZeRO-1): the parameters in `replicated` are owned one rank each.
    """

    def __init__(self, params: Iterable[nn.Parameter], config: OptimizerConfig,
                 dp_group: dist.ProcessGroup | None = None, replicated: Iterable[nn.Parameter] = ()):
        self.params = list(params)
        self.config = config
        self.group = dp_group
        shared_ids = {id(p) for p in replicated} if dp_group is not None else set()
        shared = [p for p in self.params if id(p) in shared_ids]
        owner_of = dict(zip(map(id, shared), partition_owners([local(p).numel() for p in shared], dp_group.size()))) if shared else {}
        me = dp_group.rank() if dp_group is not None else 0
        self.broadcasts = [(p, owner_of[id(p)]) for p in shared]
        self.stepped = [p for p in self.params if owner_of.get(id(p), me) == me]
        self.aliases: list[nn.Parameter] = []
        self.inner: torch.optim.Optimizer | None = None

    @property
    def state(self) -> dict:
        return self.inner.state if self.inner is not None else {}

    def state_of(self, params: Iterable[torch.Tensor]) -> list[dict]:
        """The optimizer states of these parameters (those this rank steps)."""
        by_id = {id(p): a for p, a in zip(self.stepped, self.aliases)}
        return [self.state[by_id[id(p)]] for p in params if id(p) in by_id and by_id[id(p)] in self.state]

    def step(self) -> None:
        if self.inner is None:
            # Built at the first step, after FSDP2's lazy init has settled every local tensor;
            # nn.Parameter(t) shares t's storage, so the update lands in the real parameter.
            self.aliases = [nn.Parameter(local(p).detach()) for p in self.stepped]
            self.inner = build_optimizer(self.aliases, self.config)
        for p, alias in zip(self.stepped, self.aliases):
            alias.grad = None if p.grad is None else local(p.grad)
        self.inner.step()
        for p, owner in self.broadcasts:
            dist.broadcast(local(p).detach(), group=self.group, group_src=owner)

    def zero_grad(self) -> None:
        """Drop every gradient (set_to_none), the aliases' too, so that none outlives the step."""
        for t in (*self.params, *self.aliases):
            t.grad = None
