"""The profile document (profile.json) and its dataclasses. Torch-free: the planner reads it.

A profile holds, per layer, the figures that do not depend on the micro-batch size
(parameter shapes and bytes, gradient and optimizer-state bytes) and, per measured micro-batch
size b, a `LayerSample` of the figures that do. A linear fit a*b + c of every size-dependent
figure lets the planner ask for sizes that were not measured.

Memory terms, per layer and micro-batch (all bytes, one storage counted once):
  saved        what autograd keeps for backward, the layer's parameters excluded
  saved_input  the part of `saved` that is the layer's input (the previous layer may keep it too)
  saved_output the part of `saved` that is the layer's output (the next layer may keep it too)
  fwd_transient  the forward's peak above what is live after it (saved + output)
  bwd_peak       the backward's peak above what is live when it starts (gradients are new)
  bwd_accum_peak the same when gradients already exist (later micro-batches of accumulation)
  ckpt_*         the same figures with the layer under activation checkpointing, where the
                 forward keeps only its input and the backward first recomputes the forward
  sac_*          the same under selective checkpointing (profiles/checkpointing.py): the
                 forward keeps its input and its compute-heavy ops' outputs (sac_saved: those
                 outputs, sac_saved_output: the part that is the layer's output); the
                 backward first recomputes the rest, taking sac_recompute_s
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

SCHEMA_VERSION = 6   # 2: layers timed with the runtime's threads per process; optimizer steps measured; 3: tp_times; 4: sac_*; 5: sp_samples;
                     # 6: a "vocab" head's split logits (vocab_head, the loss's split_samples)
TP_MEASURED = 2   # the tensor-parallel degree layers are measured at, besides 1
TP_TIMED = 4      # the second degree measured profiles time tensor-parallel layers at (tp_times)
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")
PRECISIONS = ("fp32", "bf16", "mixed")


class ProfileError(Exception):
    """A profile that cannot be used; the message is one sentence with the fix."""


@dataclass
class ParamInfo:
    """One parameter of a layer."""

    name: str                 # inside the layer, e.g. "attn.q.weight"
    shape: list[int]
    tp_dim: int | None = None  # dim the tp_plan shards under tensor parallelism; None: replicated


@dataclass
class LayerSample:
    """Size-dependent figures of one layer at one micro-batch size (bytes, seconds, FLOPs)."""

    input_bytes: int = 0
    output_bytes: int = 0
    saved_bytes: int = 0
    saved_input_bytes: int = 0
    saved_output_bytes: int = 0
    fwd_transient_bytes: int = 0
    bwd_peak_bytes: int = 0
    bwd_accum_peak_bytes: int = 0
    ckpt_saved_bytes: int = 0
    ckpt_fwd_transient_bytes: int = 0
    ckpt_bwd_peak_bytes: int = 0
    ckpt_bwd_accum_peak_bytes: int = 0
    sac_saved_bytes: int = 0
    sac_saved_output_bytes: int = 0
    sac_fwd_transient_bytes: int = 0
    sac_bwd_peak_bytes: int = 0
    sac_bwd_accum_peak_bytes: int = 0
    sac_recompute_s: float = 0.0   # what selective checkpointing adds to the backward (the ops it runs again)
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_io_bytes: int = 0      # bytes the forward's ops read and write (roofline's memory term)
    bwd_io_bytes: int = 0
    fwd_ops: int = 0           # ops the forward dispatches, views too: the host issues each (Hardware.op_launch_s); 0 where not counted
    bwd_ops: int = 0
    tp_fwd_comm_bytes: int = 0  # bytes the tensor-parallel all-reduces of the forward carry (tp samples only)
    tp_bwd_comm_bytes: int = 0
    tp_fwd_comm_count: int = 0  # number of those all-reduces
    tp_bwd_comm_count: int = 0
    sac_tp_bwd_comm_bytes: int = 0  # the backward's all-reduces under selective checkpointing (recomputed ones included)
    sac_tp_bwd_comm_count: int = 0
    # Sequence parallelism's all-gathers and reduce-scatters (bytes of the whole tensor; sp samples only)
    sp_fwd_comm_bytes: int = 0
    sp_bwd_comm_bytes: int = 0
    sp_fwd_comm_count: int = 0
    sp_bwd_comm_count: int = 0
    sac_sp_bwd_comm_bytes: int = 0
    sac_sp_bwd_comm_count: int = 0
    # Gradients that leave the backward in another layout than their parameter's (under sequence
    # parallelism a norm's, a partial sum over this rank's slice of the sequence): one TP
    # all-reduce each, once per step, when the runtime (or FSDP2) gives them their parameter's
    # layout (bytes of the local gradients; tp and sp samples; 0 where not counted)
    tp_grad_sync_bytes: int = 0
    tp_grad_sync_count: int = 0


SAMPLE_FIELDS = [f.name for f in fields(LayerSample)]
INT_FIELDS = {f.name for f in fields(LayerSample) if f.type == "int"}
TP_COMM_FIELDS = {"tp_fwd_comm_bytes", "tp_bwd_comm_bytes", "tp_fwd_comm_count", "tp_bwd_comm_count",
                  "sac_tp_bwd_comm_bytes", "sac_tp_bwd_comm_count", "sp_fwd_comm_bytes", "sp_bwd_comm_bytes",
                  "sp_fwd_comm_count", "sp_bwd_comm_count", "sac_sp_bwd_comm_bytes", "sac_sp_bwd_comm_count",
                  "tp_grad_sync_bytes", "tp_grad_sync_count"}
TIME_FIELDS = {"fwd_s", "bwd_s", "sac_recompute_s"}
# Whether a layer keeps its input or output is a yes/no fact of its ops, not a size that
# shrinks with tensor parallelism; these are taken from the tp=1 sample as they are.
TP_FIXED_FIELDS = {"input_bytes", "output_bytes", "saved_input_bytes", "saved_output_bytes", "sac_saved_output_bytes"}
# ... except the output of a layer whose "vocab" head leaves its logits split: that shrinks.
OUTPUT_FIELDS = {"output_bytes", "saved_output_bytes", "sac_saved_output_bytes"}
# Op counts do not shrink with the degree either: each rank issues every op of its shard. Under
# tensor (and sequence) parallelism they are the counts measured under it, DTensor's own ops and
# the collectives included, at any degree.
OP_COUNT_FIELDS = {"fwd_ops", "bwd_ops"}


@dataclass
class Fit:
    """value(b) ~= a * b + c over the measured sizes; max_residual is the worst miss."""

    a: float
    c: float
    max_residual: float

    def __call__(self, b: int) -> float:
        return max(0.0, self.a * b + self.c)


def fit_line(xs: list[int], ys: list[float]) -> Fit:
    n = len(xs)
    if n == 1:
        return Fit(a=ys[0] / xs[0], c=0.0, max_residual=0.0)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    c = my - a * mx
    return Fit(a=a, c=c, max_residual=max(abs(a * x + c - y) for x, y in zip(xs, ys)))


@dataclass
class Sampled:
    """Figures measured at several micro-batch sizes, with fits for the sizes in between."""

    samples: dict[int, LayerSample] = field(default_factory=dict)
    fits: dict[str, Fit] = field(default_factory=dict)

    def refit(self) -> None:
        bs = sorted(self.samples)
        self.fits = {name: fit_line(bs, [getattr(self.samples[b], name) for b in bs]) for name in SAMPLE_FIELDS}

    def at(self, b: int) -> LayerSample:
        """The measured sample at b, or one from the fits."""
        if b in self.samples:
            return self.samples[b]
        vals = {}
        for name in SAMPLE_FIELDS:
            v = self.fits[name](b)
            vals[name] = int(math.ceil(v)) if name in INT_FIELDS else v
        return LayerSample(**vals)


@dataclass
class LayerProfile(Sampled):
    """One layer. `samples` are measured without tensor parallelism; `tp_samples`, for layers
    the tp_plan touches, under tensor parallelism of degree TP_MEASURED (a fake process group):
    a figure f then splits into a replicated part r and a sharded part s, f(t) = r + s / t.

    Times measured on a device are split through t = TP_MEASURED and TP_TIMED instead (tp_times),
    for t >= 2: a DTensor layer pays a per-op cost that the plain layer (t = 1) does not, and a
    line through t = 1 and 2 reads that cost as negative sharding, growing with t. On this CPU
    a GPT block took 9.4 ms alone and 20-24 ms per rank at t = 2, which the line through 1 and
    2 put at 48-62 ms for t = 4.
    """

    index: int = 0
    name: str = ""             # the child's name in the Sequential ("0", "1", ...)
    kind: str = ""             # its class name
    signature: str = ""        # equal for layers that are identical in every measured figure
    param_count: int = 0
    param_bytes: int = 0       # as stored: fp32 master weights under mixed precision
    compute_param_bytes: int = 0  # the copy compute runs on (bf16 under mixed precision)
    buffer_bytes: int = 0
    grad_bytes: int = 0
    optimizer_state_bytes: int = 0
    tp_param_bytes: int = 0    # part of param_bytes that the tp_plan shards
    optimizer_step_s: float = 0.0  # measured optimizer step of all the layer's parameters (0: not measured, fake)
    fsdp_overhead_s: dict[str, float] = field(default_factory=dict)  # what each FSDP2 unit kind's hooks and copies add per micro-batch (replicate_sync: once per step)
    params: list[ParamInfo] = field(default_factory=list)
    tp_samples: dict[int, LayerSample] = field(default_factory=dict)
    tp_times: dict[int, list[float]] = field(default_factory=dict)  # b -> [fwd_s, bwd_s] at TP_TIMED (measured profiles)
    sp_samples: dict[int, LayerSample] = field(default_factory=dict)  # as tp_samples, under sequence parallelism, for the
                                                                      # layers it changes (those that run it and their successors)
    vocab_head: bool = False   # its tp_plan names a "vocab" head: under TP its output is the logits split by vocabulary

    def refit(self) -> None:
        super().refit()
        self._tp = Sampled(samples=self.tp_samples)
        if self.tp_samples:
            self._tp.refit()
        bs = sorted(self.tp_times)
        self._tp_time_fits = [fit_line(bs, [self.tp_times[b][k] for b in bs]) for k in (0, 1)] if bs else []
        self._sp = Sampled(samples=self.sp_samples)
        if self.sp_samples:
            self._sp.refit()

    def at_tp(self, b: int, tp: int, sequence_parallel: bool = False, sequence_times: bool = False) -> LayerSample:
        """Figures at micro-batch b under tensor parallelism of degree tp (with sequence
        parallelism: memory, FLOPs and collectives from sp_samples, where the layer's input and
        output are split too; times too with `sequence_times`, where sp_samples' times are the
        op-by-op roofline a fake profile gives every sample, else as without it: a measured
        profile does not time layers under sequence parallelism; docs/cost-model.md)."""
        if sequence_parallel and tp > 1 and self.sp_samples:
            # The layer's input and output are split too: no figure is held at its t = 1 value.
            sp = self._sp.at(b)
            vals = split_between(self.at(b), sp, tp, fixed=set())
            vals.update({name: getattr(sp, name) for name in OP_COUNT_FIELDS})
            if not sequence_times:
                base = self.at_tp(b, tp)
                vals.update({name: getattr(base, name) for name in TIME_FIELDS})
            return LayerSample(**vals)
        one = self.at(b)
        if tp == 1 or not self.tp_samples:
            return one
        two = self._tp.at(b)
        vals = split_between(one, two, tp, fixed=TP_FIXED_FIELDS - OUTPUT_FIELDS if self.vocab_head else TP_FIXED_FIELDS)
        vals.update({name: getattr(two, name) for name in OP_COUNT_FIELDS})
        if self.tp_times:
            # f(t) = r + s/t through f(TP_MEASURED) and f(TP_TIMED), both under DTensor.
            lo, hi = TP_MEASURED, TP_TIMED
            for k, name in enumerate(("fwd_s", "bwd_s")):
                v_lo = getattr(two, name)
                v_hi = self.tp_times[b][k] if b in self.tp_times else self._tp_time_fits[k](b)
                shard = (v_lo - v_hi) / (1 / lo - 1 / hi)
                vals[name] = max(0.0, v_lo - shard / lo + shard / tp)
            # What selective checkpointing runs again is part of the forward: it shrinks with it.
            if one.fwd_s > 0:
                vals["sac_recompute_s"] = one.sac_recompute_s * vals["fwd_s"] / one.fwd_s
        return LayerSample(**vals)


@dataclass
class LossProfile(Sampled):
    """The loss function, as if it were one more layer without parameters. When the model's
    head is a "vocab" one, `split_samples[t]`: the loss on logits split over t ranks (under
    loss_parallel, a fake process group), measured at t = TP_MEASURED and TP_TIMED. A figure
    at t >= 2 is r + s/t through those two, not through t = 1: loss_parallel is another
    algorithm than the plain loss (its own max, exponentials and target gather, three
    all-reduces), and a line from the plain loss's figures reads that difference as a
    negative shard that grows with t (measured on examples/gpt.py's head: a forward transient
    of 0 bytes at t = 1 and 133 KB at t = 2, which the line through both put at 199 KB at t = 4)."""

    split_samples: dict[int, dict[int, LayerSample]] = field(default_factory=dict)

    def refit(self) -> None:
        super().refit()
        self._split = {t: Sampled(samples=samples) for t, samples in self.split_samples.items()}
        for fits in self._split.values():
            fits.refit()

    def at_tp(self, b: int, tp: int) -> LayerSample:
        """Figures at micro-batch b with the logits split over tp ranks (as at b without a split)."""
        if tp == 1 or not self.split_samples:
            return self.at(b)
        lo, hi = TP_MEASURED, TP_TIMED
        at_lo = self._split[lo].at(b)
        vals = split_between(at_lo, self._split[hi].at(b), tp, fixed=set(), degrees=(lo, hi))
        vals.update({name: getattr(at_lo, name) for name in OP_COUNT_FIELDS})
        return LayerSample(**vals)


def split_between(one: LayerSample, two: LayerSample, tp: int, fixed: set[str],
                  degrees: tuple[int, int] = (1, TP_MEASURED)) -> dict:
    """Every figure at degree tp from its values at the two `degrees` (`one` at the first, `two`
    at the second; by default t = 1 and t = TP_MEASURED): f(t) = r + s/t through both, except
    the collectives (taken from `two` as they are) and the `fixed` fields (from `one`)."""
    lo, hi = degrees
    vals = {}
    for name in SAMPLE_FIELDS:
        v1, v2 = getattr(one, name), getattr(two, name)
        if name in TP_COMM_FIELDS:
            v = v2
        elif name in fixed:
            v = v1
        else:
            shard = (v1 - v2) / (1 / lo - 1 / hi)
            v = max(0.0, v1 - shard / lo + shard / tp)
        vals[name] = int(math.ceil(v)) if name in INT_FIELDS else v
    return vals


@dataclass
class Profile:
    model: dict                 # path, sha256, source ("file" | "hf-config"), name
    torch_version: str
    device: str                 # as torch reports it ("cpu", "NVIDIA H200")
    device_type: str            # "cpu" | "cuda"
    method: str                 # "measured" | "fake"
    hardware: str | None        # preset whose roofline gave the times (fake) or that matches the device
    precision: str              # fp32 | bf16 | mixed
    optimizer: str              # sgd | momentum | adam | adamw
    batch_sizes: list[int]
    layers: list[LayerProfile]
    loss: LossProfile           # the loss function, as if it were one more layer without parameters
    batch: dict                 # per-sample bytes of inputs and targets: {"input_bytes": Fit-like, ...}
    seq_len: int | None = None
    tp_divides: list[int] = field(default_factory=list)   # numbers a tensor-parallel degree must divide (head counts)
    threads: int = 1            # intra-op threads the layers were timed with (the runtime's per process on CPU)
    schema: int = SCHEMA_VERSION
    kind: str = "profile"

    # -- derived ----------------------------------------------------------------
    @property
    def sequence_parallel(self) -> bool:
        """Whether the model's tp_plan offers sequence parallelism (some layer was measured under it)."""
        return any(layer.sp_samples for layer in self.layers)

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def batch_bytes(self, b: int) -> int:
        """Bytes of one micro-batch's inputs and targets."""
        return int(self.batch["input_bytes_per_sample"] * b + self.batch["target_bytes_per_sample"] * b)

    # -- JSON -------------------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        for layer in d["layers"]:
            layer["samples"] = {str(b): s for b, s in layer["samples"].items()}
            layer["tp_samples"] = {str(b): s for b, s in layer["tp_samples"].items()}
            layer["tp_times"] = {str(b): t for b, t in layer["tp_times"].items()}
            layer["sp_samples"] = {str(b): s for b, s in layer["sp_samples"].items()}
        d["loss"]["samples"] = {str(b): s for b, s in d["loss"]["samples"].items()}
        d["loss"]["split_samples"] = {str(t): {str(b): s for b, s in samples.items()}
                                      for t, samples in d["loss"]["split_samples"].items()}
        return d

    @classmethod
    def from_json(cls, d: dict, source: str = "profile") -> "Profile":
        try:
            if d.get("kind") != "profile":
                raise ProfileError(f"{source} is not a profile (its 'kind' is {d.get('kind')!r}); pass the profile.json that `plan profile` wrote.")
            if d.get("schema") != SCHEMA_VERSION:
                raise ProfileError(f"{source} has schema {d.get('schema')!r} but this plan reads schema {SCHEMA_VERSION}; profile the model again with `plan profile`.")
            layers = [_layer_from_json(x) for x in d["layers"]]
            split = {int(t): _samples_from_json(samples) for t, samples in d["loss"]["split_samples"].items()}
            if split and sorted(split) != [TP_MEASURED, TP_TIMED]:
                raise ValueError(f"the loss's split_samples are at {sorted(split)} ranks, not {TP_MEASURED} and {TP_TIMED}")
            loss = _sampled_from_json(LossProfile(split_samples=split), d["loss"])
            prof = cls(model=dict(d["model"]), torch_version=str(d["torch_version"]), device=str(d["device"]),
                       device_type=str(d["device_type"]), method=str(d["method"]), hardware=d.get("hardware"),
                       precision=str(d["precision"]), optimizer=str(d["optimizer"]),
                       batch_sizes=[int(b) for b in d["batch_sizes"]], layers=layers, loss=loss,
                       batch=dict(d["batch"]), seq_len=d.get("seq_len"),
                       tp_divides=[int(n) for n in d.get("tp_divides", [])], threads=int(d["threads"]))
        except ProfileError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ProfileError(f"{source} is damaged or hand-edited ({type(e).__name__}: {e}); profile the model again with `plan profile`.") from None
        prof.validate(source)
        return prof

    def validate(self, source: str = "profile") -> None:
        def bad(what):
            raise ProfileError(f"{source} is damaged or hand-edited: {what}; profile the model again with `plan profile`.")
        if self.precision not in PRECISIONS:
            bad(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.optimizer not in OPTIMIZERS:
            bad(f"optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if not self.layers:
            bad("it has no layers")
        if [layer.index for layer in self.layers] != list(range(len(self.layers))):
            bad("its layer indices are not 0, 1, 2, ... in order")
        if self.threads < 1:
            bad(f"threads is {self.threads}, not a positive count")
        if not self.batch_sizes or any(b <= 0 for b in self.batch_sizes):
            bad("its batch sizes are not positive")
        for layer in self.layers:
            for name in ("param_count", "param_bytes", "grad_bytes", "optimizer_state_bytes", "buffer_bytes"):
                v = getattr(layer, name)
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    bad(f"layer {layer.index} has {name} = {v!r}, not a non-negative integer")
            if not math.isfinite(layer.optimizer_step_s) or layer.optimizer_step_s < 0:
                bad(f"layer {layer.index} has optimizer_step_s = {layer.optimizer_step_s!r}, not a non-negative number")
            for mode, v in layer.fsdp_overhead_s.items():
                if mode not in ("replicate", "replicate_sync", "shard", "shard_keep") or not math.isfinite(v) or v < 0:
                    bad(f"layer {layer.index} has fsdp_overhead_s[{mode!r}] = {v!r}; it takes replicate, replicate_sync, "
                        "shard, shard_keep and non-negative seconds")
            for b, t in layer.tp_times.items():
                if b not in layer.tp_samples or not all(math.isfinite(x) and x >= 0 for x in t):
                    bad(f"layer {layer.index} has tp_times at micro-batch {b} = {t!r}, not two non-negative "
                        "seconds at a micro-batch of its tp_samples")
            if sorted(layer.samples) != sorted(self.batch_sizes):
                bad(f"layer {layer.index} was measured at {sorted(layer.samples)}, not at the profile's batch sizes {self.batch_sizes}")
            for b, s in layer.samples.items():
                for name in SAMPLE_FIELDS:
                    v = getattr(s, name)
                    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0 or (isinstance(v, float) and not math.isfinite(v)):
                        bad(f"layer {layer.index} at micro-batch {b} has {name} = {v!r}, not a non-negative number")
        # What a layer hands on is what the next one takes: the cost model reads a pipeline
        # boundary as the last layer's output, the layout MILP as the next layer's input (as
        # the planner reads it: plain, split over TP_MEASURED ranks, and sequence-parallel).
        for prev, layer in zip(self.layers, self.layers[1:]):
            for b in self.batch_sizes:
                for tp, sp in ((1, False), (TP_MEASURED, False), (TP_MEASURED, True)):
                    out, into = prev.at_tp(b, tp, sp).output_bytes, layer.at_tp(b, tp, sp).input_bytes
                    if out != into:
                        split = "" if tp == 1 else f" over {tp} tensor-parallel ranks" + (" with sequence parallelism" if sp else "")
                        bad(f"layer {prev.index} outputs {out} bytes at micro-batch {b}{split} but layer {layer.index} takes {into}")

    def save(self, path: str | Path) -> None:
        write_json_atomic(path, self.to_json())


def _sampled_from_json(obj: Sampled, d: dict) -> Sampled:
    obj.samples = {int(b): _sample_from_json(s) for b, s in d["samples"].items()}
    obj.refit()
    return obj


def splits_evenly(params: list[ParamInfo], head_counts: list[int], tp: int) -> bool:
    """Whether every dim the tp_plan shards (`params`) and every number a degree must divide
    (the model's head counts) splits evenly over tp ranks."""
    return (all(p.shape[p.tp_dim] % tp == 0 for p in params if p.tp_dim is not None)
            and all(n % tp == 0 for n in head_counts))


def _sample_from_json(s: dict) -> LayerSample:
    unknown = set(s) - set(SAMPLE_FIELDS)
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    return LayerSample(**s)


def _samples_from_json(d: dict) -> dict[int, LayerSample]:
    return {int(b): _sample_from_json(s) for b, s in d.items()}


def _layer_from_json(d: dict) -> LayerProfile:
    layer = LayerProfile(
        index=d["index"], name=d["name"], kind=d["kind"], signature=d["signature"],
        param_count=d["param_count"], param_bytes=d["param_bytes"], compute_param_bytes=d["compute_param_bytes"],
        buffer_bytes=d["buffer_bytes"], grad_bytes=d["grad_bytes"], optimizer_state_bytes=d["optimizer_state_bytes"],
        tp_param_bytes=d["tp_param_bytes"], optimizer_step_s=float(d["optimizer_step_s"]),
        fsdp_overhead_s={str(k): float(v) for k, v in d["fsdp_overhead_s"].items()},
        params=[ParamInfo(**p) for p in d["params"]],
        tp_samples=_samples_from_json(d["tp_samples"]),
        tp_times={int(b): [float(t[0]), float(t[1])] for b, t in d["tp_times"].items()},
        sp_samples=_samples_from_json(d["sp_samples"]), vocab_head=bool(d["vocab_head"]),
    )
    return _sampled_from_json(layer, d)


def read_json_document(path: str | Path, what: str, create: str, redo: str, error: type[Exception]) -> dict:
    """The JSON object in `path`, or `error` with one sentence: "<what> <path> does not exist;
    <create>." or "... is not valid JSON ...; <redo>."."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} {path} does not exist; {create}.")
    try:
        d = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{what} {path} is not valid JSON ({e}); {redo}.") from None
    if not isinstance(d, dict):
        raise error(f"{what} {path} is not a JSON object; {redo}.")
    return d


def load_profile(path: str | Path) -> Profile:
    d = read_json_document(path, "profile", f"create it with `plan profile MODEL.py -o {path}`",
                           "profile the model again with `plan profile`", ProfileError)
    return Profile.from_json(d, source=f"profile {path}")


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write JSON so that a failure leaves either the old file or none, never half a file."""
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=False) + "\n")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write text so that a failure leaves either the old file or none, never half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
