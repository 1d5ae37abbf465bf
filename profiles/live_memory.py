"""Live tensor-storage bytes: the memory figure `plan` measures on a CPU.

On a GPU, `torch.cuda.max_memory_allocated` answers "how much memory did the step need".
A CPU has no such counter, so this dispatch mode keeps one: every storage an op creates
while the mode is active (and every storage registered with `track`) is counted once, by
storage object, until it is freed; `peak` is the largest total seen after any op.
The profiler measures layers with it and the runtime measures whole steps with it, so both
sides of `plan verify` use the same instrument.

Under FakeTensorMode the same counting works on fake storages, which is how a 70B model is
measured without allocating it.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from functools import wraps

import torch
import torch.nn as nn
from torch.distributed._tools.common_utils import get_untyped_storages
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = None


_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default


class ShapePropagation:
    """Whether DTensor is working out an op's output shape: its ShardingPropagator runs the op
    on fake tensors of the global shape, which neither allocate nor move anything of the step.
    A dispatch mode that counts (LiveMemory, flops.OpCost) lets them through uncounted; counted,
    loss_parallel's handlers, which propagate afresh on every call, added two unsharded
    (tokens, vocabulary) float32 tensors to the loss's transient peak and three to its traffic.
    `watch()` installs the wrapper that keeps `depth` while a mode is active (CountingMode)."""

    depth = 0

    @staticmethod
    @contextmanager
    def watch():
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
        orig = ShardingPropagator._propagate_tensor_meta_non_cached
        if getattr(orig, "watched", False):       # a mode inside another
            yield
            return

        @wraps(orig)
        def propagate(self, op_schema):
            ShapePropagation.depth += 1
            try:
                return orig(self, op_schema)
            finally:
                ShapePropagation.depth -= 1
        propagate.watched = True
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate
        try:
            yield
        finally:
            ShardingPropagator._propagate_tensor_meta_non_cached = orig


class CountingMode(TorchDispatchMode):
    """A dispatch mode that counts what ops allocate or move: while it is active, DTensor's shape
    propagation is watched (ShapePropagation), and a subclass returns early when `depth` says
    an op is part of it."""

    def __enter__(self):
        self._watch = ShapePropagation.watch()
        self._watch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._watch.__exit__(None, None, None)
        return super().__exit__(*exc)


class LiveMemory(CountingMode):
    """Count the bytes of live tensor storages; `live` now, `peak` since the last reset."""

    def __init__(self) -> None:
        super().__init__()
        self._cells = WeakIdKeyDictionary()  # storage -> [bytes counted for it]
        self.live = 0
        self.peak = 0
        self._orig_resize = None

    # -- what is counted -------------------------------------------------------------
    def track(self, *objs) -> None:
        """Count tensors that already exist: modules (params, buffers, grads), optimizers, tensors."""
        for obj in objs:
            if isinstance(obj, nn.Module):
                for t in list(obj.parameters()) + list(obj.buffers()):
                    self._add(t)
                    if t.grad is not None:
                        self._add(t.grad)
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    tree_map_only(torch.Tensor, self._add, state)
            elif isinstance(obj, torch.Tensor):
                self._add(obj)
            elif obj is not None:
                tree_map_only(torch.Tensor, self._add, obj)
        self.peak = max(self.peak, self.live)

    def is_counted(self, t: torch.Tensor) -> bool:
        return all(st in self._cells for st in get_untyped_storages(t))

    def reset_peak(self) -> None:
        self.peak = self.live

    def _add(self, t: torch.Tensor) -> None:
        if DTensor is not None and isinstance(t, DTensor):
            t = t._local_tensor
        for st in get_untyped_storages(t):
            if st in self._cells:
                continue
            cell = [st.nbytes()]
            self._cells[st] = cell
            self.live += cell[0]
            weakref.finalize(st, self._free, cell)

    def _free(self, cell: list) -> None:
        self.live -= cell[0]
        cell[0] = 0

    def _resized(self, st: torch.UntypedStorage) -> None:
        cell = self._cells.get(st)
        if cell is None:
            return
        self.live += st.nbytes() - cell[0]
        cell[0] = st.nbytes()
        self.peak = max(self.peak, self.live)

    # -- the mode --------------------------------------------------------------------
    def __enter__(self):
        # FSDP2 frees and re-allocates unsharded parameters with UntypedStorage.resize_,
        # which is not a dispatched op; watch it directly.
        self._orig_resize = orig = torch.UntypedStorage.resize_
        tracker = self

        @wraps(orig)
        def resize_(st, size):
            out = orig(st, size)
            tracker._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Let DTensor lower itself to local-tensor ops first; those are what allocate.
        if DTensor is not None and any(t is DTensor for t in types):
            return NotImplemented
        if ShapePropagation.depth:
            return func(*args, **(kwargs or {}))
        if func is _WAIT_TENSOR and active_fake_mode() is not None:
            # Under FakeTensorMode wait_tensor returns a new tensor; eagerly it returns its input.
            return args[0]
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._add, out)
        if self.live > self.peak:
            self.peak = self.live
        return out
