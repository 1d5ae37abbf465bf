"""Load a user's model file and check it against the contract in docs/design.md.

A model file defines `build_model() -> nn.Sequential`, `make_batch(batch_size) -> (inputs,
targets)`, optionally `loss_fn(output, targets)`, `tp_plan` and `dataset()` (a map-style
dataset the runtime trains on instead of make_batch's batches; runtime/data.py). Every way the file can break
the contract raises `ModelFileError` with one sentence that names the problem and the fix;
the CLI prints it and exits 2.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import importlib.util
import io
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

TP_STYLES = ("colwise", "rowwise", "sequence", "vocab")
# "sequence": a per-token module (a norm) run on a slice of the sequence when the plan turns
#   sequence parallelism on.
# "vocab": the output head (an nn.Linear, the last layer's last module): column-parallel over the
#   vocabulary, its logits left split for the loss, which torch's loss_parallel computes on the
#   shards (Megatron's vocabulary-parallel cross-entropy) instead of gathering (B, T, V).


class ModelFileError(Exception):
    """A model file that breaks the contract; the message is one sentence with the fix."""


def default_loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dim, whatever the leading dims are."""
    return F.cross_entropy(output.flatten(0, -2), targets.flatten())


@dataclass
class ModelSpec:
    """What a model file provides, after loading."""

    path: str                          # as given by the user
    sha256: str                        # of the file's bytes; plans and runs check it
    build_model: Callable[[], nn.Sequential]
    make_batch: Callable[[int], tuple]
    loss_fn: Callable = default_loss_fn
    tp_plan: dict[str, str] = field(default_factory=dict)
    tp_divides: list[int] = field(default_factory=list)   # a tensor-parallel degree must divide each (e.g. head counts)
    dataset: Callable | None = None    # dataset() -> map-style dataset of (input, target) samples; None: make_batch's
    weight_names: Callable[[], dict[str, str]] | None = None   # our parameter name -> the name in saved weights (Hugging Face)
    # Filled by adapters (Hugging Face): what the model is, for the profile header.
    source: str = "file"
    name: str = ""
    seq_len: int | None = None         # tokens per sample, where the source fixes it (Hugging Face configs)


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_model_file(path: str | Path) -> ModelSpec:
    """Import the file and check that the names the contract needs are there."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"model file {path} does not exist; pass the path of a Python file that defines build_model() and make_batch().")
    try:
        source = p.read_text()
    except UnicodeDecodeError:
        raise ModelFileError(f"model file {path} is not Python source text (a binary file, such as a checkpoint?); "
                             "pass the .py file that defines build_model() and make_batch().") from None
    try:
        compile(source, str(p), "exec")
    except SyntaxError as e:
        raise ModelFileError(f"model file {path} has a syntax error at line {e.lineno}: {e.msg}; fix that line and run again.") from None
    mod_name = f"_plan_model_{hashlib.sha1(str(p.resolve()).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(mod_name, p)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses and pickling inside the file need this
    argv = sys.argv
    sys.argv = [str(p)]              # a file that parses the command line on import sees none
    said = io.StringIO()             # what it prints to stderr: replayed unless it exits (argparse's usage)
    try:
        with contextlib.redirect_stderr(said):
            spec.loader.exec_module(module)
        sys.stderr.write(said.getvalue())
    except SystemExit as e:
        raise ModelFileError(f"model file {path} exits when imported (SystemExit({e.code!r}): it calls sys.exit or parses "
                             "the command line at the top level); move that under `if __name__ == \"__main__\":`.") from None
    except MemoryError:
        raise ModelFileError(f"model file {path} ran out of memory when imported; profile it with --fake, which allocates nothing.") from None
    except Exception as e:  # noqa: BLE001 - any import-time failure of user code
        raise ModelFileError(f"model file {path} failed to import ({type(e).__name__}: {e}); fix the file so that `python {path}` runs.") from None
    finally:
        sys.argv = argv

    build = getattr(module, "build_model", None)
    if not callable(build):
        raise ModelFileError(f"model file {path} defines no build_model(); add a function build_model() that returns the model as an nn.Sequential.")
    make = getattr(module, "make_batch", None)
    if not callable(make):
        raise ModelFileError(f"model file {path} defines no make_batch(); add a function make_batch(batch_size) that returns (inputs, targets).")
    loss = getattr(module, "loss_fn", None) or default_loss_fn
    if not callable(loss):
        raise ModelFileError(f"loss_fn in model file {path} is not a function; define loss_fn(output, targets) or remove it to use cross-entropy.")
    tp_plan = getattr(module, "tp_plan", None) or {}
    check_tp_plan_types(tp_plan, path)
    tp_divides = getattr(module, "tp_divides", None) or []
    if not (isinstance(tp_divides, (list, tuple)) and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in tp_divides)):
        raise ModelFileError(f"tp_divides in model file {path} must be a list of positive integers that a tensor-parallel degree must divide, e.g. [N_HEAD].")
    dataset = getattr(module, "dataset", None)
    if dataset is not None and not callable(dataset):
        raise ModelFileError(f"dataset in model file {path} is not a function; define dataset() returning a map-style dataset, or remove it.")
    # The absolute path: a profile or plan read from another folder still finds the file.
    return ModelSpec(path=str(p.resolve()), sha256=file_sha256(p), build_model=build, make_batch=make,
                     loss_fn=loss, tp_plan=dict(tp_plan), name=p.stem, tp_divides=list(tp_divides), dataset=dataset)


def check_tp_plan_types(tp_plan, path) -> None:
    if not isinstance(tp_plan, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tp_plan.items()):
        raise ModelFileError(f"tp_plan in model file {path} must be a dict of submodule-name globs to style strings, e.g. {{'mlp.fc': 'colwise'}}.")
    for k, v in tp_plan.items():
        if v not in TP_STYLES:
            raise ModelFileError(f"tp_plan entry {k!r} in model file {path} has style {v!r}; use one of {', '.join(TP_STYLES)}.")


def build_checked_model(spec: ModelSpec) -> nn.Sequential:
    """Call build_model() and check it returned a non-empty nn.Sequential."""
    try:
        model = spec.build_model()
    except Exception as e:  # noqa: BLE001
        if is_out_of_memory(e):
            raise ModelFileError(f"build_model() in {spec.path} could not allocate the model "
                                 f"({str(e).split('memory: ')[-1].split('. ')[0]}); profile it with --fake, which allocates nothing.") from None
        raise ModelFileError(f"build_model() in {spec.path} raised {type(e).__name__}: {e}; fix build_model so that it returns the model.") from None
    if not isinstance(model, nn.Sequential):
        raise ModelFileError(f"build_model() in {spec.path} returned a {type(model).__name__}, not an nn.Sequential; return the layers as nn.Sequential(layer0, layer1, ...).")
    if len(model) == 0:
        raise ModelFileError(f"build_model() in {spec.path} returned an empty nn.Sequential; put the model's layers in it.")
    if not any(p.requires_grad for p in model.parameters()):
        raise ModelFileError(f"build_model() in {spec.path} returned a model with no trainable parameters; there is nothing "
                             "to train or lay out, give its layers parameters.")
    return model


def is_out_of_memory(e: BaseException) -> bool:
    """An allocator's failure (CPU: "can't allocate memory"; CUDA: torch.OutOfMemoryError)."""
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e)


def call_make_batch(spec: ModelSpec, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Call make_batch(batch_size) and check it returned (inputs, targets) tensors."""
    try:
        batch = spec.make_batch(batch_size)
    except Exception as e:  # noqa: BLE001
        raise ModelFileError(f"make_batch({batch_size}) in {spec.path} raised {type(e).__name__}: {e}; fix make_batch so that it returns (inputs, targets).") from None
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        what = f"a {type(batch).__name__}" + (f" of {len(batch)} items" if isinstance(batch, (tuple, list)) else "")
        raise ModelFileError(f"make_batch({batch_size}) in {spec.path} returned {what}; it must return a pair of tensors (inputs, targets).")
    inputs, targets = batch
    if inputs.shape[:1] != (batch_size,) or targets.shape[:1] != (batch_size,):
        raise ModelFileError(f"make_batch({batch_size}) in {spec.path} returned inputs of shape {tuple(inputs.shape)} and targets of shape {tuple(targets.shape)}; both must have the batch size {batch_size} as their first dim.")
    return inputs, targets


def layer_name(model: nn.Sequential, i: int) -> str:
    return f"layer {i} ({type(model[i]).__name__})"


def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).replace('torch.', '')} tensor of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def run_layer_checked(model: nn.Sequential, i: int, x, spec: ModelSpec):
    """Run layer i on x; a failure names both layers and the shape that did not fit."""
    try:
        return model[i](x)
    except Exception as e:  # noqa: BLE001
        src = "make_batch's inputs" if i == 0 else f"the output of {layer_name(model, i - 1)}"
        raise ModelFileError(f"{layer_name(model, i)} in {spec.path} cannot take {src}, {describe(x)} ({type(e).__name__}: {first_line(e)}); make each layer accept the previous layer's output.") from None


def run_loss_checked(spec: ModelSpec, output, targets) -> torch.Tensor:
    try:
        loss = spec.loss_fn(output, targets)
    except Exception as e:  # noqa: BLE001
        raise ModelFileError(f"the loss in {spec.path} cannot take the model's output, {describe(output)}, with targets {describe(targets)} ({type(e).__name__}: {first_line(e)}); fix loss_fn or the last layer.") from None
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise ModelFileError(f"the loss in {spec.path} returned {describe(loss)}; loss_fn must return a scalar tensor.")
    if not loss.is_meta and not getattr(loss, "fake_mode", None) and not torch.isfinite(loss.detach()).all():
        raise ModelFileError(f"the loss in {spec.path} is {float(loss):g} on make_batch's data; find the layer that "
                             "produces inf or NaN (its weights' initialisation, a division, a log of 0) and fix it.")
    return loss


def first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def tp_plan_matches(layer: nn.Module, tp_plan: dict[str, str]) -> dict[str, str]:
    """Submodule name -> style for the submodules of one layer that the tp_plan names."""
    out = {}
    for name, _ in layer.named_modules():
        if not name:
            continue
        for pattern, style in tp_plan.items():
            if fnmatch.fnmatchcase(name, pattern):
                out[name] = style
                break
    return out


def sequence_parallel_edges(per_layer: list[dict[str, str]]) -> list[tuple[bool, bool, bool]]:
    """Per layer (its tp_plan matches), under sequence parallelism: (it runs sequence-parallel,
    its input arrives as a slice of the sequence, its output must be the whole sequence).
    A layer runs sequence-parallel when its tp_plan names a "sequence" module; it then takes
    and returns slices, so its successor receives one; the model's last layer gives the loss
    the whole sequence (profiles/tensor_parallel.apply_tp)."""
    sp = ["sequence" in m.values() for m in per_layer]
    return [(sp[i], i > 0 and sp[i - 1], sp[i] and i == len(sp) - 1) for i in range(len(sp))]


def check_tp_plan(model: nn.Sequential, spec: ModelSpec) -> list[dict[str, str]]:
    """Per layer, the matched submodules; every entry must match something Linear-like."""
    per_layer = [tp_plan_matches(layer, spec.tp_plan) for layer in model]
    for pattern, style in spec.tp_plan.items():
        hits = [(i, name) for i, m in enumerate(per_layer) for name, st in m.items()
                if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            examples = sorted({n for layer in model for n, _ in layer.named_modules() if n})[:4]
            raise ModelFileError(f"tp_plan entry {pattern!r} in {spec.path} matches no submodule of any layer (names look like {', '.join(repr(e) for e in examples)}); fix the pattern or remove it.")
        for i, name in hits:
            sub = model[i].get_submodule(name)
            if style in ("colwise", "rowwise") and not isinstance(sub, (nn.Linear, nn.Embedding)):
                raise ModelFileError(f"tp_plan entry {pattern!r} in {spec.path} makes {name} of {layer_name(model, i)} {style}, but it is a {type(sub).__name__}; colwise and rowwise apply to nn.Linear and nn.Embedding only.")
            if style == "vocab" and not (isinstance(sub, nn.Linear) and i == len(model) - 1):
                raise ModelFileError(f"tp_plan entry {pattern!r} in {spec.path} makes {name} of {layer_name(model, i)} \"vocab\", but "
                                     f"\"vocab\" applies to the output head only: an nn.Linear in the last layer whose output is the logits the loss takes.")
            if style == "sequence" and any(True for _ in sub.children()):
                raise ModelFileError(f"tp_plan entry {pattern!r} in {spec.path} makes {name} of {layer_name(model, i)} sequence-parallel, but it is a {type(sub).__name__} with submodules; \"sequence\" applies to per-token modules such as norms.")
    heads = [name for name, style in per_layer[-1].items() if style == "vocab"]
    if len(heads) > 1:
        raise ModelFileError(f"the tp_plan of {spec.path} makes both {heads[0]} and {heads[1]} of {layer_name(model, len(model) - 1)} \"vocab\"; "
                             "name only the output head whose logits the loss takes.")
    for i, matches in enumerate(per_layer):
        # Under sequence parallelism every weight of such a layer must belong to a module the
        # plan splits or runs on slices: any other would see a slice and learn from part of it.
        if "sequence" in matches.values():
            loose = [n for n, _ in model[i].named_parameters() if not any(n.startswith(m + ".") for m in matches)]
            if loose:
                raise ModelFileError(f"{layer_name(model, i)} runs sequence-parallel (its tp_plan names \"sequence\" modules) but its parameter {loose[0]} belongs to no module the tp_plan names, so it would see a slice of the sequence and learn from part of its gradient; name its module \"sequence\", \"colwise\" or \"rowwise\".")
    return per_layer


def load_spec(model: dict) -> ModelSpec:
    """Load the model a profile or plan names ({"path", "sha256", "source", ...}).

    Checks that the file (or, for source "hf-config", the config and sequence length) has not
    changed since it was profiled.
    """
    if model.get("source") == "hf-config":
        from .hf import load_hf_spec
        spec = load_hf_spec(model["path"], model.get("seq_len"))
        if model.get("sha256") and spec.sha256 != model["sha256"]:
            raise ModelFileError(f"Hugging Face config {model['path']} has changed since it was profiled; profile it again with `plan profile {model['path']}` and solve again.")
        return spec
    spec = load_model_file(model["path"])
    if model.get("sha256") and spec.sha256 != model["sha256"]:
        raise ModelFileError(f"model file {model['path']} has changed since it was profiled; profile it again with `plan profile {model['path']}` and solve again.")
    return spec
