"""Each step's samples, this data-parallel rank's share only.

Two sources, both a function of (seed, step) alone, so a resumed run continues exactly where
the checkpoint left off and two runs with one seed see the same batches:

- the model file's `dataset()`, a map-style dataset (`len(ds)`, `ds[i] -> (input, target)`,
  one sample each, shaped as one row of make_batch's): the samples are read in a fresh
  permutation per epoch (`torch.randperm` seeded by seed + epoch), step t takes positions
  [t*G, (t+1)*G) of that endless sequence (G the global batch), and a dp rank reads only its
  rows of them, as DistributedSampler does; a dataset shorter than a batch wraps into the
  next epoch's permutation;
- otherwise `make_batch(global_batch)` drawn after `torch.manual_seed(seed + 1 + t)` (the
  synthetic default): every rank draws the whole batch and keeps its rows.
"""

from __future__ import annotations

import torch

from planner.plan import Plan
from profiles.model_file import ModelFileError, ModelSpec, call_make_batch, describe


def global_batch(spec: ModelSpec, plan: Plan, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s whole synthetic global batch, on CPU; every rank draws the same one."""
    torch.manual_seed(plan.seed + 1 + step)
    return call_make_batch(spec, plan.global_batch)


class SyntheticBatches:
    """make_batch's batches: this dp rank's rows of each step's global batch."""

    def __init__(self, spec: ModelSpec, plan: Plan):
        self.spec, self.plan = spec, plan
        self.rows = plan.micro_batch_size * plan.num_micro_batches

    def batch(self, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = global_batch(self.spec, self.plan, step)
        lo, hi = dp_rank * self.rows, (dp_rank + 1) * self.rows
        return inputs[lo:hi].clone(), targets[lo:hi].clone()   # copies, so the rest can be freed


class DatasetBatches:
    """A map-style dataset's samples, read by index: this dp rank's rows of each step only."""

    def __init__(self, dataset, spec: ModelSpec, plan: Plan):
        self.dataset, self.spec = dataset, spec
        self.size = len(dataset)
        self.seed, self.global_batch = plan.seed, plan.global_batch
        self.rows = plan.micro_batch_size * plan.num_micro_batches
        self._perm: tuple[int, torch.Tensor] | None = None     # (epoch, its permutation)
        self.shapes = sample_shapes(spec)

    def index(self, position: int) -> int:
        """The dataset index at this position of the endless epoch-by-epoch sequence."""
        epoch, at = divmod(position, self.size)
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch)))
        return int(self._perm[1][at])

    def indices(self, step: int, dp_rank: int) -> list[int]:
        start = step * self.global_batch + dp_rank * self.rows
        return [self.index(q) for q in range(start, start + self.rows)]

    def batch(self, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        samples = [checked_sample(self.dataset, i, self.shapes, self.spec) for i in self.indices(step, dp_rank)]
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])


def sample_shapes(spec: ModelSpec) -> tuple[tuple, tuple]:
    """(shape, dtype) of one input row and one target row, as make_batch gives them (what was profiled)."""
    inputs, targets = call_make_batch(spec, 1)
    return (tuple(inputs.shape[1:]), inputs.dtype), (tuple(targets.shape[1:]), targets.dtype)


def checked_sample(dataset, i: int, shapes, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """dataset[i], refused in one sentence unless it is (input, target) shaped as make_batch's rows."""
    try:
        sample = dataset[i]
    except Exception as e:  # noqa: BLE001 - user code
        raise ModelFileError(f"dataset()[{i}] in {spec.path} raised {type(e).__name__}: {e}; fix the dataset's __getitem__.") from None
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2 and all(isinstance(t, torch.Tensor) for t in sample)):
        raise ModelFileError(f"dataset()[{i}] in {spec.path} returned {describe(sample)}; each sample must be a pair of tensors (input, target).")
    for what, t, (shape, dtype) in zip(("input", "target"), sample, shapes):
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ModelFileError(f"dataset()[{i}] in {spec.path} gives {describe(t)} as its {what}, but make_batch's rows are "
                                 f"{str(dtype).replace('torch.', '')} of shape {shape}; make the two agree (the model was profiled on make_batch's).")
    return sample[0], sample[1]


def batch_source(spec: ModelSpec, plan: Plan, check: bool = False) -> SyntheticBatches | DatasetBatches:
    """The model file's dataset when it defines one, else make_batch's. With `check` its first
    sample is read and checked now (`plan run` does, before launching; the ranks do not, so
    that each reads only its own samples, and refuse a bad one when they read it)."""
    if spec.dataset is None:
        return SyntheticBatches(spec, plan)
    try:
        dataset = spec.dataset()
        size = len(dataset)
    except Exception as e:  # noqa: BLE001 - user code
        raise ModelFileError(f"dataset() in {spec.path} failed ({type(e).__name__}: {e}); it must return a map-style dataset "
                             "(len(ds) and ds[i] -> (input, target)).") from None
    if size < 1:
        raise ModelFileError(f"dataset() in {spec.path} is empty; give it samples, or remove dataset() to train on make_batch's.")
    source = DatasetBatches(dataset, spec, plan)
    if check:
        checked_sample(dataset, 0, source.shapes, spec)
    return source
