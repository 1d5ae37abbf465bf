"""Weights in: a Hugging Face model's safetensors from a local folder (`--init-from DIR`).

Nothing is downloaded. The folder is what `save_pretrained` writes (model.safetensors, or
shards with model.safetensors.index.json). Every parameter of the adapted model has a name in
those files (profiles.hf.hf_parameter_names); torch.distributed.checkpoint's
HuggingFaceStorageReader reads into each rank's parameters only the slices its shards hold,
so no rank materialises the whole model. A checkpoint saved with tied embeddings (no
lm_head.weight) gives the head the embedding's matrix, as Transformers does.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from profiles.model_file import ModelSpec

TIED = ("lm_head.weight", "transformer.wte.weight", "model.embed_tokens.weight")


class WeightsError(Exception):
    """Weights that cannot be loaded into this model; the message is one sentence with the fix."""


def saved_shapes(directory: Path) -> dict[str, list[int]]:
    """Every tensor's name and shape in the folder's safetensors files (headers only)."""
    from safetensors import safe_open
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"--init-from {directory} holds no .safetensors files; pass the folder save_pretrained wrote.")
    shapes = {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as st:
                for k in st.keys():
                    shapes[k] = list(st.get_slice(k).get_shape())
        except Exception as e:  # noqa: BLE001 - a damaged file
            raise WeightsError(f"{f} is not a readable safetensors file ({type(e).__name__}: {e}); save the weights again.") from None
    return shapes


def weight_sources(spec: ModelSpec, directory: str | Path, shapes: dict[str, list[int]]) -> dict[str, str]:
    """Our parameter name -> the saved tensor it is read from, every shape checked."""
    d = Path(directory)
    if not hasattr(dcp, "HuggingFaceStorageReader"):
        raise WeightsError(f"--init-from reads safetensors with torch.distributed.checkpoint's HuggingFaceStorageReader, "
                           f"which torch {torch.__version__} does not have; upgrade torch (2.8 or newer).")
    if spec.weight_names is None:
        raise WeightsError(f"--init-from loads Hugging Face weights, but {spec.path} is a model file; "
                           "load your own weights inside build_model(), or profile the model from its Hugging Face config.")
    if not d.is_dir():
        raise WeightsError(f"--init-from {directory} is not a folder; pass the folder save_pretrained wrote.")
    saved = saved_shapes(d)
    sources = {}
    for ours, theirs in spec.weight_names().items():
        if theirs not in saved and theirs == "lm_head.weight":
            theirs = next((k for k in TIED[1:] if k in saved), theirs)      # tied embeddings
        if theirs not in saved:
            raise WeightsError(f"the weights in {directory} have no {theirs}; they are of another model than {spec.path}, "
                               "pass the folder of this model's weights.")
        if saved[theirs] != shapes[ours]:
            raise WeightsError(f"{theirs} in {directory} has shape {tuple(saved[theirs])} but the model's is "
                               f"{tuple(shapes[ours])}; the weights are of another configuration, pass the folder whose config.json was profiled.")
        sources[ours] = theirs
    return sources


def load_weights(params: dict[str, torch.Tensor], directory: str | Path, sources: dict[str, str]) -> None:
    """Read each parameter (ours, by name; DTensors read only their shards) from the folder, in
    place. A collective under a process group; one process works without."""
    by_source: dict[str, list[str]] = {}
    for ours in params:
        by_source.setdefault(sources[ours], []).append(ours)
    # One read per use of a saved tensor (a tied matrix feeds two parameters); as many reads on
    # every rank (each is a collective), counted over the whole model.
    uses: dict[str, int] = {}
    for theirs in sources.values():
        uses[theirs] = uses.get(theirs, 0) + 1
    for k in range(max(uses.values(), default=0)):
        state = {theirs: params[names[k]].detach() for theirs, names in by_source.items() if len(names) > k}
        with warnings.catch_warnings():   # one process: DCP says it assumes so, which is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(directory)), no_dist=not dist.is_initialized())
