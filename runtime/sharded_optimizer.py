"""The optimizer step: a fused torch optimizer on parameters' local tensors, with ZeRO-1.

Every optimizer the plan can name (SGD, SGD with momentum, Adam, AdamW) is elementwise, so
stepping each parameter's local tensor (its TP and/or FSDP shard) is the same update as
stepping the DTensor. It also keeps `fused=True` possible: DTensor has no sharding rule for
`_fused_sgd_`.

ZeRO-1 (zero == 1): every parameter that replicate keeps in full on each dp rank is split
into dp equal chunks of its flattened elements (`chunk_bounds`); a rank runs the inner
optimizer on its own chunk only, so it holds 1/dp of every optimizer state, then each layer's
chunks are broadcast from their owners over the dp group: one broadcast per layer and owner,
its chunks packed into one buffer (dp x layers broadcasts a step, not dp x parameters: on 4
gloo processes each broadcast cost 0.4-0.7 ms however small, so stop 47's per-parameter
broadcasts took 100-187 ms of the examples' ZeRO-1 steps in bench/time_fidelity.py). The
gradients of those parameters are spent by then and dropped first, so that the buffers
(a layer's chunk, at most its gradients' size) never raise the step's memory. Parameters FSDP2
already shards (offloaded layers) are stepped by every rank on its own shard.
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


def chunk_bounds(numel: int, dp: int) -> list[tuple[int, int]]:
    """[start, end) of each dp rank's chunk of a flattened parameter: ceil(numel / dp) elements
    each, the last ones shorter (or empty)."""
    size = -(-numel // dp)
    return [(min(r * size, numel), min((r + 1) * size, numel)) for r in range(dp)]


def broadcast_packed(chunks: list[torch.Tensor], owner: int, me: int, group) -> None:
    """The owner's `chunks` (tensors of one dtype) into every rank's, over `group`: one broadcast
    of them packed end to end, the owner packing, the others unpacking. plan calibrate times
    broadcasts with this, so that its fit holds what a ZeRO-1 step pays around each one."""
    if owner == me:
        dist.broadcast(torch.cat(chunks), group=group, group_src=owner)
        return
    packed = torch.empty(sum(c.numel() for c in chunks), dtype=chunks[0].dtype, device=chunks[0].device)
    dist.broadcast(packed, group=group, group_src=owner)
    for c, part in zip(chunks, packed.split([c.numel() for c in chunks])):
        c.copy_(part)


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class ShardedOptimizer:
    """Steps `params` (this rank's, in model order) with the plan's optimizer.

    dp_group set (ZeRO-1): each of the parameters in `replicated_layers` (one list per layer)
    is stepped in dp chunks, one per rank, then reassembled by one broadcast per layer and
    owner; step() then drops their gradients, as zero_grad would.
    """

    def __init__(self, params: Iterable[nn.Parameter], config: OptimizerConfig,
                 dp_group: dist.ProcessGroup | None = None,
                 replicated_layers: Iterable[Iterable[nn.Parameter]] = ()):
        self.params = list(params)
        self.config = config
        self.group = dp_group
        # each parameter in its first layer only: a weight two layers share is broadcast once
        self.layers: list[list[nn.Parameter]] = []
        shared_ids: set[int] = set()
        for layer in (replicated_layers if dp_group is not None else ()):
            self.layers.append([p for p in dict.fromkeys(layer) if id(p) not in shared_ids])
            shared_ids.update(id(p) for p in self.layers[-1])
        self.chunked = [p for p in self.params if id(p) in shared_ids]
        self.whole = [p for p in self.params if id(p) not in shared_ids]
        self.me = dp_group.rank() if dp_group is not None else 0
        self.aliases: list[nn.Parameter] = []
        self.inner: torch.optim.Optimizer | None = None
        self.pending: dict[int, dict[str, torch.Tensor]] = {}   # loaded states, installed when inner is built

    @property
    def state(self) -> dict:
        return self.inner.state if self.inner is not None else {}

    def state_of(self, params: Iterable[torch.Tensor]) -> list[dict]:
        """The optimizer states of these parameters (those this rank steps whole)."""
        by_id = {id(p): a for p, a in zip(self.whole, self.aliases)}
        return [self.state[by_id[id(p)]] for p in params if id(p) in by_id and by_id[id(p)] in self.state]

    def _my_chunk(self, t: torch.Tensor) -> torch.Tensor:
        lo, hi = chunk_bounds(t.numel(), self.group.size())[self.me]
        return t.view(-1)[lo:hi]

    def step(self, lr: float | None = None) -> None:
        """One update of every parameter from its gradient, at `lr` when given."""
        if self.inner is None:
            # Built at the first step, after FSDP2's lazy init has settled every local tensor;
            # nn.Parameter(view) shares the view's storage, so the update lands in the real parameter.
            self.aliases = ([nn.Parameter(local(p).detach()) for p in self.whole]
                            + [nn.Parameter(self._my_chunk(local(p).detach())) for p in self.chunked])
            self.inner = build_optimizer(self.aliases, self.config)
            for p, alias in zip(self.whole + self.chunked, self.aliases):
                if id(p) in self.pending:
                    self.inner.state[alias] = on_device_of(alias, self.pending.pop(id(p)))
        if lr is not None:
            for group in self.inner.param_groups:
                group["lr"] = lr
        n_whole = len(self.whole)
        for k, (p, alias) in enumerate(zip(self.whole + self.chunked, self.aliases)):
            if p.grad is None:
                alias.grad = None
            else:
                alias.grad = local(p.grad) if k < n_whole else self._my_chunk(local(p.grad))
        self.inner.step()
        for p, alias in zip(self.chunked, self.aliases[n_whole:]):
            p.grad = alias.grad = None          # spent: their memory holds the broadcasts' buffers
        for layer in self.layers:
            self._broadcast_chunks(layer)

    def _broadcast_chunks(self, layer: list[nn.Parameter]) -> None:
        """Every rank's chunks of the layer's parameters from their owner: per owner (and
        dtype), one broadcast of its chunks packed end to end."""
        dp = self.group.size()
        flats = [local(p).detach().view(-1) for p in layer]
        for dtype in dict.fromkeys(f.dtype for f in flats):
            of_dtype = [(f, chunk_bounds(f.numel(), dp)) for f in flats if f.dtype == dtype]
            for owner in range(dp):
                chunks = [f[lo:hi] for f, bounds in of_dtype for lo, hi in [bounds[owner]] if hi > lo]
                if chunks:
                    broadcast_packed(chunks, owner, self.me, self.group)

    def zero_grad(self) -> None:
        """Drop every gradient (set_to_none), the aliases' too, so that none outlives the step."""
        for t in (*self.params, *self.aliases):
            t.grad = None

    # -- checkpoints: states as their parameters' shards, keyed "name/state" -----------------
    def state_names(self) -> tuple[str, ...]:
        """The per-parameter states the optimizer keeps (torch's names)."""
        return {"sgd": (), "momentum": ("momentum_buffer",)}.get(self.config.name, ("step", "exp_avg", "exp_avg_sq"))

    def export_state(self, params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
        """Every state of every parameter in `params` (name -> parameter), as a tensor sharded
        like its parameter (a DTensor of the parameter's global shape where it is one); ZeRO-1
        chunks are gathered over dp first. Empty before the first step."""
        if self.inner is None:
            return {}
        alias_of = {id(p): a for p, a in zip(self.whole + self.chunked, self.aliases)}
        chunked = {id(p) for p in self.chunked}
        out = {}
        for name, p in params.items():
            state = self.inner.state.get(alias_of[id(p)], {})
            for key in self.state_names():
                t = state.get(key)
                if t is None:             # never stepped (no gradient yet): a fresh state is zeros
                    t = torch.zeros((), dtype=torch.float32) if key == "step" else torch.zeros_like(alias_of[id(p)])
                if key == "step":
                    out[f"{name}/{key}"] = t.detach().clone()
                    continue
                if id(p) in chunked:
                    t = self._gather_chunks(t, local(p))
                out[f"{name}/{key}"] = like(p, t)
        return out

    def state_templates(self, params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
        """export_state's keys and shardings, filled with zeros: what a checkpoint loads into."""
        out = {}
        for name, p in params.items():
            for key in self.state_names():
                out[f"{name}/{key}"] = (torch.zeros((), dtype=torch.float32, device=local(p).device) if key == "step"
                                        else like(p, torch.zeros_like(local(p))))
        return out

    def import_state(self, params: dict[str, nn.Parameter], states: dict[str, torch.Tensor]) -> None:
        """Install states shaped as export_state's (this rank's shards; ZeRO-1 keeps its chunk)."""
        chunked = {id(p) for p in self.chunked}
        alias_of = {id(p): a for p, a in zip(self.whole + self.chunked, self.aliases)}
        for name, p in params.items():
            state = {}
            for key in self.state_names():
                t = local(states[f"{name}/{key}"]).detach()
                state[key] = self._my_chunk(t).clone() if id(p) in chunked and key != "step" else t.clone()
            if not state:
                continue
            if self.inner is None:
                self.pending[id(p)] = state
            else:
                self.inner.state[alias_of[id(p)]] = on_device_of(alias_of[id(p)], state)

    def _gather_chunks(self, chunk: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
        """The dp ranks' chunks of one state, put together in the shape of `whole` (this rank's
        local tensor of the parameter)."""
        bounds = chunk_bounds(whole.numel(), self.group.size())
        size = bounds[0][1] - bounds[0][0]
        padded = torch.zeros(size, dtype=chunk.dtype, device=chunk.device)
        padded[:chunk.numel()] = chunk.reshape(-1)
        parts = [torch.empty_like(padded) for _ in bounds]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[:hi - lo] for part, (lo, hi) in zip(parts, bounds)]).view(whole.shape)


def on_device_of(alias: torch.Tensor, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A parameter's loaded states on the device its optimizer steps it on. An offloaded
    parameter's shard lives on the host, but its states come out of DCP on the mesh's device
    (DTensor.from_local moves a template's host tensor there), and the fused step refuses
    the mix (seen on an H200, 2026-12-04: a resumed plan with offloaded layers failed its
    first step)."""
    return {key: t.to(alias.device) for key, t in state.items()}


def like(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`t` (shaped as p's local tensor) sharded as p is: a DTensor of p's mesh, placements and
    global shape when p is one."""
    if not isinstance(p, DTensor):
        return t
    return DTensor.from_local(t, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
