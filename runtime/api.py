"""Apply a plan to a model inside your own training loop.

    import torch.distributed as dist
    from runtime import api

    plan = api.load_plan("plan.json")
    api.init_distributed(plan)                               # under torchrun
    parallel = api.apply_plan(build_model(), plan, loss_fn)  # this rank's stages, parallelized
    for step in range(steps):
        inputs, targets = ...                                # this dp rank's rows (runtime.data)
        loss = parallel.train_step(inputs, targets, lr=lr)   # micro-batches, schedule, clipping, step

`train_step` runs the plan's micro-batches (pipeline schedule or accumulation), clips the
gradients to a global norm when asked and steps the optimizer. `state_dict()` /
`load_state_dict()` give every rank's part of the model and optimizer keyed by the full
model's parameter names, as DTensors where they are sharded, so that
torch.distributed.checkpoint can write them under one plan and read them under another
(runtime/checkpoint.py). docs/runtime.md and examples/own_loop.py show a whole loop.
"""

from __future__ import annotations

import math
import os
import sys
from collections import OrderedDict
from datetime import timedelta
from typing import Callable, NoReturn

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from planner.plan import Plan, Stage, load_plan
from profiles.model_file import default_loss_fn, sequence_parallel_edges, tp_plan_matches
from profiles.tensor_parallel import loss_context

from .breakdown import optimizer_region
from .launch import DEFAULT_TIMEOUT_S
from .parallel_dims import MESH_DIMS, ParallelDims
from .parallelize import parallelize_stage
from .pipeline import build_pipeline_schedule
from .sharded_optimizer import ShardedOptimizer, local

__all__ = ["ParallelModel", "apply_plan", "init_distributed", "leave", "load_plan"]

WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def agent_store(timeout_s: float) -> dist.TCPStore:
    """A client of torchrun's own store (at MASTER_ADDR:MASTER_PORT): no process group needed."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))


def leave(code: int = 0) -> NoReturn:
    """End the process now, without the interpreter's teardown: gloo's worker threads can still
    hold tensors then, and releasing them during finalisation aborts the process now and then
    ("terminate called without an active exception") after a run that went well (40 runtime
    tests of one CI run, 2026-12-02). Call it once the process group is destroyed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def init_distributed(plan: Plan, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """The default process group for the plan's device: NCCL on CUDA (one GPU per local rank), else gloo.

    Its keys live in torchrun's store under a prefix of the restart count: after a restart
    (--max-restarts) the store still holds the failed attempt's addresses under torch's own
    keys, and a rank that read them would connect to a process that is gone (measured: gloo's
    "connectFullMesh failed ... Connection refused" on every restart here).
    """
    timeout = timedelta(seconds=timeout_s)
    store = {}
    if "TORCHELASTIC_RESTART_COUNT" in os.environ and "MASTER_ADDR" in os.environ:
        store = {"store": dist.PrefixStore(f"plan/attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}/", agent_store(timeout_s)),
                 "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
    if plan.device_type == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), timeout=timeout, **store)
    else:
        dist.init_process_group("gloo", timeout=timeout, **store)


def clean_name(name: str) -> str:
    """A parameter's name as in the full model: without checkpoint_wrapper's prefix."""
    return name.replace(WRAPPER_PREFIX, "")


def build_stage(model: nn.Sequential, stage: Stage) -> nn.Sequential:
    """The stage's layers in order, named by their index in the model (so names match the full model's)."""
    return nn.Sequential(OrderedDict((str(lc.index), model[lc.index]) for lc in stage.layers))


def stage_on_device(model: nn.Sequential, stage: Stage, tp_plan: dict[str, str], mesh: DeviceMesh, plan: Plan,
                    device: torch.device, edges: list | None) -> nn.Sequential:
    """The stage's layers parallelized on `device`. A model built on the meta device is
    parallelized there first and then allocated, each rank only its shards, uninitialised
    (its weights are loaded next); buffers that hold values (computed, not loaded) keep them."""
    module = build_stage(model, stage)
    if not any(t.is_meta for t in module.parameters()):
        return parallelize_stage(module.to(device), stage.layers, tp_plan, mesh, plan, edges)
    kept = {n: b.detach().clone() for n, b in module.named_buffers() if not b.is_meta}
    module = parallelize_stage(module, stage.layers, tp_plan, mesh, plan, edges)
    module.to_empty(device=device)
    with torch.no_grad():
        for n, b in module.named_buffers():
            if clean_name(n) in kept:
                b.copy_(kept[clean_name(n)])
    return module


class ParallelModel:
    """This rank's part of a model laid out as the plan says, its optimizer and its step."""

    def __init__(self, model: nn.Sequential, plan: Plan, loss_fn: Callable, mesh: DeviceMesh, tp_plan: dict[str, str]):
        self.plan, self.loss_fn, self.mesh = plan, loss_fn, mesh
        # A "vocab" head hands the loss its logits split: the loss's forward and backward (the
        # pipeline schedule's too) run under loss_parallel.
        self.loss_context = lambda: loss_context(tp_plan, plan.tp)
        self.device = torch.device("cuda", torch.cuda.current_device()) if plan.device_type == "cuda" else torch.device("cpu")
        self.pp_rank, self.dp_rank, self.tp_rank = (mesh.get_local_rank(d) for d in MESH_DIMS)
        stages = plan.stages_of_rank(self.pp_rank)
        self.stage_indices = [s.index for s in stages]
        # Under sequence parallelism a layer's edges depend on its neighbours, in other stages too.
        edges = sequence_parallel_edges([tp_plan_matches(layer, tp_plan) for layer in model]) \
            if plan.sequence_parallel else None
        self.modules = [stage_on_device(model, s, tp_plan, mesh, plan, self.device, edges) for s in stages]
        self.has_first_stage = 0 in self.stage_indices
        self.has_last_stage = len(plan.stages) - 1 in self.stage_indices

        layers = [(lc, list(m.get_submodule(str(lc.index)).parameters())) for s, m in zip(stages, self.modules)
                  for lc in s.layers]
        self.offloaded = [p for lc, ps in layers if lc.offload for p in ps]
        params = [p for m in self.modules for p in m.parameters()]
        zero1 = plan.wrapped and plan.zero == 1 and plan.dp > 1
        self.optimizer = ShardedOptimizer(params, plan.optimizer, mesh["dp"].get_group() if zero1 else None,
                                          replicated_layers=[ps for lc, ps in layers if not lc.offload])
        # Accumulation: replicate units (zero 0/1) all-reduce only after the last micro-batch;
        # fully_shard units (zero 2/3, offloaded layers) reduce-scatter after every one.
        self.sync_units = [u for m in self.modules for u in m.modules() if isinstance(u, ReplicateModule)]

        self.grad_norm: float | None = None            # the last step's, when asked for (train_step)
        self._norm_share: torch.Tensor | None = None
        self.schedule, self.pipeline_stages = None, []
        if plan.pp > 1:
            self.schedule, self.pipeline_stages = build_pipeline_schedule(
                list(zip(self.stage_indices, self.modules)), len(plan.stages), self.device,
                mesh["pp"].get_group(), plan.schedule, plan.num_micro_batches, loss_fn)

    # -- the step ------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        """Samples per step on one dp rank (micro-batch size x micro-batches)."""
        return self.plan.micro_batch_size * self.plan.num_micro_batches

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, lr: float | None = None,
                   clip_grad_norm: float = 0.0, grad_norm: bool = False) -> torch.Tensor | None:
        """Forward and backward over this dp rank's `rows` samples, then the optimizer step at
        `lr` (None: the optimizer's own). With clip_grad_norm > 0 the gradients are first scaled
        to at most that global L2 norm (as torch.nn.utils.clip_grad_norm_ on one process);
        the norm before clipping is then `self.grad_norm`. Without clipping, `grad_norm` asks
        for the norm too: this rank's share is summed here (no communication) and
        `global_grad_norm()`, a collective, adds the shares after the step.
        Returns this rank's mean loss (None off the last stage)."""
        with self.loss_context():
            loss = self._pipeline_step(inputs, targets) if self.schedule is not None else self._accumulation_step(inputs, targets)
        if self.plan.tp > 1:
            self._settle_grads()
        self.grad_norm, self._norm_share = None, None
        if clip_grad_norm > 0:
            self.grad_norm = self.clip_grad_norm_(clip_grad_norm)
        elif grad_norm:
            self._norm_share = self._squared_norm_share()
        with optimizer_region():
            self.optimizer.step(lr)
            self.optimizer.zero_grad()
        return loss

    def _accumulation_step(self, inputs, targets) -> torch.Tensor:
        m, b = self.plan.num_micro_batches, self.plan.micro_batch_size
        model = self.modules[0]
        losses = []
        for k in range(m):
            for unit in self.sync_units:
                unit.set_requires_gradient_sync(k == m - 1, recurse=False)
            rows = slice(k * b, (k + 1) * b)
            loss = self.loss_fn(model(inputs[rows]), targets[rows])
            (loss / m).backward()
            losses.append(local(loss.detach()))   # (under loss_parallel a replicated DTensor)
        return torch.stack(losses).mean()

    def _pipeline_step(self, inputs, targets) -> torch.Tensor | None:
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first_stage else ()
        kwargs = {"target": targets, "losses": losses} if self.has_last_stage else {}
        # return_outputs=False: the last stage would otherwise keep and concatenate every micro-batch's output.
        self.schedule.step(*args, return_outputs=False, **kwargs)
        return torch.stack([local(loss.detach()) for loss in losses]).mean() if self.has_last_stage else None

    def _settle_grads(self) -> None:
        """Give every TP gradient its parameter's layout. Some come out of backward in another:
        under sequence parallelism a norm's weight gradient is a partial sum over this rank's
        slice of the sequence, and a vocabulary-split embedding's is a partial sum of the whole
        table (DTensor's embedding backward). FSDP2 redistributes its units' gradients itself;
        this does it for the layers it does not wrap, so that the optimizer, which steps local
        tensors, sees this rank's part of the whole gradient."""
        for p in self.optimizer.params:
            g = p.grad
            if isinstance(g, DTensor) and isinstance(p, DTensor) and g.placements != p.placements:
                p.grad = g.redistribute(placements=p.placements)

    def clip_grad_norm_(self, max_norm: float) -> float:
        """The global L2 norm of every gradient of the model (all stages, all shards), the same
        on every rank; with max_norm > 0 the gradients are scaled by max_norm / (norm + 1e-6)
        where that is below 1 (torch.nn.utils.clip_grad_norm_'s rule).

        Each rank sums the squares of its gradients' local tensors, each divided by the number
        of ranks that hold the same elements: a stage's parameters live on its dp x tp ranks,
        and a local tensor is one of as many distinct pieces as the product of the mesh sizes
        its DTensor is sharded over (1 for a plain tensor). One all-reduce adds the rest.
        """
        total = self._squared_norm_share()
        dist.all_reduce(total)
        norm = float(total.sqrt())
        if max_norm > 0 and (coef := max_norm / (norm + 1e-6)) < 1:
            for p in self.optimizer.params:
                if p.grad is not None:
                    local(p.grad).mul_(coef)
        return norm

    def _squared_norm_share(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (see clip_grad_norm_)."""
        holders = self.plan.dp * self.plan.tp
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.optimizer.params:
            if (g := p.grad) is None:
                continue
            # not is_replicate(): FSDP2 over TP shards a second time as _StridedShard, for which is_shard() is False
            pieces = math.prod(g.device_mesh.size(d) for d, pl in enumerate(g.placements) if not pl.is_replicate()) if isinstance(g, DTensor) else 1
            # the tensor's norm in its own dtype (a reduction: no copy of the gradient, which
            # the memory peak would show), squared in float64
            norm = torch.linalg.vector_norm(local(g).detach()).to(self.device, torch.float64)
            total += norm * norm / (holders // pieces)
        return total

    def global_grad_norm(self) -> float | None:
        """The last step's global gradient norm (before clipping), the same on every rank; a
        collective when train_step was asked for it without clipping (every rank must call it)."""
        if self._norm_share is not None:
            dist.all_reduce(self._norm_share)
            self.grad_norm, self._norm_share = float(self._norm_share.sqrt()), None
        return self.grad_norm

    # -- checkpoints -----------------------------------------------------------------------
    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by their names in the full model ("3.attn.q.weight")."""
        return {clean_name(n): p for m in self.modules for n, p in m.named_parameters()}

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """{"model": parameter name -> tensor, "optimizer": "name/state" -> tensor}; sharded
        tensors as DTensors of the full parameter's shape, so that DCP reshards them."""
        params = self.named_parameters()
        return {"model": {n: p.detach() for n, p in params.items()},
                "optimizer": self.optimizer.export_state(params)}

    def empty_state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """state_dict()'s keys and shardings, to load into (the model's own tensors, empty optimizer states)."""
        params = self.named_parameters()
        return {"model": {n: p.detach() for n, p in params.items()},
                "optimizer": self.optimizer.state_templates(params)}

    def load_state_dict(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Take a state_dict()-shaped dict: the model's tensors are copied in, the optimizer's installed."""
        params = self.named_parameters()
        with torch.no_grad():
            for n, t in state["model"].items():
                if t.data_ptr() != params[n].detach().data_ptr():   # DCP loads in place; a dict of copies needs copying
                    local(params[n]).copy_(local(t))
        self.optimizer.import_state(params, state["optimizer"])


def apply_plan(model: nn.Sequential, plan: Plan | str, loss_fn: Callable | None = None,
               tp_plan: dict[str, str] | None = None, mesh: DeviceMesh | None = None) -> ParallelModel:
    """This rank's stages of `model` (the whole model, built the same on every rank) laid out
    as `plan` says, with the optimizer and step the plan names. A model built on the meta
    device gets each rank's shards allocated uninitialised: load its weights next.

    loss_fn(output, targets) defaults to cross-entropy; tp_plan (submodule globs -> "colwise" /
    "rowwise" / "sequence" / "vocab") is the model file's, needed when plan.tp > 1. With a
    "vocab" head and tp > 1 the output is a DTensor of logits split by vocabulary and loss_fn
    runs inside torch's loss_parallel() (train_step sees to it). The default process group must
    exist (init_distributed); the device mesh is built from the plan unless given.
    """
    plan = load_plan(plan) if isinstance(plan, (str, os.PathLike)) else plan
    if not dist.is_initialized():
        raise RuntimeError("apply_plan needs the default process group; call runtime.api.init_distributed(plan) first, under torchrun.")
    if dist.get_world_size() != plan.world_size:
        raise ValueError(f"the plan is for {plan.world_size} processes but this group has {dist.get_world_size()}.")
    if len(model) != plan.n_layers:
        raise ValueError(f"the plan lays out {plan.n_layers} layers but the model has {len(model)}.")
    if plan.tp > 1 and not tp_plan:
        raise ValueError(f"the plan is tensor-parallel (tp {plan.tp}) but no tp_plan was given; pass the model file's tp_plan.")
    if plan.sequence_parallel and "sequence" not in (tp_plan or {}).values():
        raise ValueError("the plan is sequence-parallel but the tp_plan names no \"sequence\" modules; pass the tp_plan "
                         "the model was profiled with.")
    mesh = mesh or ParallelDims.from_plan(plan).build_mesh(plan.device_type)
    return ParallelModel(model, plan, loss_fn or default_loss_fn, mesh, tp_plan or {})
