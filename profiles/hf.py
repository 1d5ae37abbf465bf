"""Hugging Face causal language models as `plan` model specs, built from a config alone.

`plan profile` takes, instead of a model file, a Hugging Face causal-LM config: a built-in
name (`BUILTIN_CONFIGS`), a `config.json`, or a folder holding one. Nothing is downloaded:
the built-in shapes are written out below, and the weights are random (the model class's own
initialisation from the config, deterministic under `torch.manual_seed`).

The real Transformers class is built (`AutoModelForCausalLM.from_config`, attention "sdpa")
and adapted to the layer stack of docs/design.md, one `nn.Sequential`:

  0      `TokenEmbedding` (Llama, Mistral, Qwen2: `embed_tokens`) or
         `TokenPositionEmbedding` (GPT-2: `wte` + `wpe`)
  1..L   the model's own decoder layers, each turned (in place, by a subclass of its class) into
         a module that takes and returns only the hidden states (B, T, C): it computes the
         rotary position embeddings (its own copy of the model's `rotary_emb`) and the causal
         mask (None for plain causal attention, so SDPA runs `is_causal`; an explicit band for
         a sliding window shorter than the sequence) inside its forward
  L+1    `NormHead`: the final norm (`norm`) and `lm_head`

Word embeddings are untied (`tie_word_embeddings = False`): embedding and head are separate
layers with separate weights, so they can live on different pipeline stages (GPT-2's published
config ties them; its adapted form has one more vocab x hidden matrix than the published model).
Dropout probabilities are set to 0: a parallel plan could not reproduce one process's dropout
masks, and the published Llama / Mistral / Qwen2 configs have none. The KV cache is off.

The tensor-parallel plan is the config's `base_model_tp_plan`, translated to the adapted
layers' names: "layers.*.self_attn.q_proj" -> "self_attn.q_proj" (inside a decoder layer),
"embed_tokens" -> "embed_tokens" (inside the embedding layer). Styles: "colwise" and
"rowwise" are kept; "rowwise_rep" (rowwise with a replicated output, which is what the
project's rowwise gives) becomes "rowwise"; every other style ("colwise_rep", "local_*",
"sequence_parallel", "gather", ...) is dropped, which leaves that module replicated: correct,
only not split. The attention of these models views its projections as (B, T, -1, head_dim),
so under tensor parallelism each rank computes with its local heads; the TP degree must divide
the number of key/value heads. GPT-2 (Conv1D projections) has no `base_model_tp_plan`, so its
layers stay replicated under tensor parallelism.

Needs transformers >= 4.48 (attention that views heads as -1, configs with base_model_tp_plan);
tested with 5.24.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import torch
import torch.nn as nn

from .model_file import ModelFileError, ModelSpec, default_loss_fn
from .schema import read_json_document

SOURCE = "hf-config"
DEFAULT_MAX_SEQ_LEN = 4096   # default sequence length: min(this, the config's max_position_embeddings)

# Written out from the published config.json of each model on the Hugging Face Hub (the fields
# that shape the model; "architectures", token ids and "torch_dtype" as published too):
#   llama-3-8b   https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
#   llama-3-70b  https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json
#   mistral-7b   https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
#   qwen2-7b     https://huggingface.co/Qwen/Qwen2-7B/blob/main/config.json
#   gpt2         https://huggingface.co/openai-community/gpt2/blob/main/config.json
BUILTIN_CONFIGS: dict[str, dict] = {
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
    },
    "llama-3-70b": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 8192,
        "initializer_range": 0.02,
        "intermediate_size": 28672,
        "max_position_embeddings": 8192,
        "model_type": "llama",
        "num_attention_heads": 64,
        "num_hidden_layers": 80,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
    },
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 32000,
    },
    "qwen2-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 3584,
        "initializer_range": 0.02,
        "intermediate_size": 18944,
        "max_position_embeddings": 131072,
        "max_window_layers": 28,
        "model_type": "qwen2",
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 152064,
    },
    "gpt2": {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1,
        "bos_token_id": 50256,
        "embd_pdrop": 0.1,
        "eos_token_id": 50256,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": 1024,
        "n_embd": 768,
        "n_head": 12,
        "n_layer": 12,
        "n_positions": 1024,
        "resid_pdrop": 0.1,
        "summary_activation": None,
        "summary_first_dropout": 0.1,
        "summary_proj_to_labels": True,
        "summary_type": "cls_index",
        "summary_use_proj": True,
        "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
        "vocab_size": 50257,
    },
}

# The model types adapted here, and the config fields each needs (published names).
ROPE_FAMILIES = ("llama", "mistral", "qwen2")
REQUIRED_FIELDS = {
    "llama": ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
    "mistral": ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
    "qwen2": ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"),
    "gpt2": ("n_embd", "n_layer", "n_head", "vocab_size"),
}


class HFConfigError(ModelFileError):
    """A Hugging Face config plan cannot use; the message is one sentence with the fix."""


# --------------------------------------------------------------------------------------
# Which argument is a Hugging Face source, and its config
# --------------------------------------------------------------------------------------

def is_hf_source(arg: str) -> bool:
    """A built-in name, a *.json file, or a folder (which should hold config.json). A name that
    is neither a file nor ends in .py counts too, so that a misspelt built-in name is told the
    known ones rather than that a model file is missing."""
    if arg in BUILTIN_CONFIGS:
        return True
    p = Path(arg)
    if p.suffix == ".json" or p.is_dir():
        return True
    return not p.exists() and p.suffix != ".py" and "/" not in arg and "\\" not in arg


def read_config(arg: str) -> tuple[str, dict]:
    """(name, config dict) for a built-in name, a config.json or a folder holding one."""
    if arg in BUILTIN_CONFIGS:
        return arg, json.loads(json.dumps(BUILTIN_CONFIGS[arg]))   # a deep copy
    p = Path(arg)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise HFConfigError(f"folder {arg} holds no config.json; pass a folder with a Hugging Face config.json, the config.json itself, or a built-in name ({', '.join(BUILTIN_CONFIGS)}).")
        p = p / "config.json"
    elif p.suffix != ".json":
        raise HFConfigError(f"{arg!r} is not a built-in model ({', '.join(BUILTIN_CONFIGS)}), a config.json, or a model file; pass one of those.")
    d = read_json_document(p, "config", f"pass the path of a Hugging Face config.json or a built-in name ({', '.join(BUILTIN_CONFIGS)})",
                           "pass a Hugging Face config.json", HFConfigError)
    return str(arg), d


def _transformers():
    try:
        import transformers
    except ImportError:
        raise HFConfigError("Hugging Face models need the transformers package; install it with `pip install -e '.[hf]'`.") from None
    return transformers


def check_config(d: dict, where: str) -> None:
    """The config must be a causal LM of a family adapted here, with the fields that shape it."""
    model_type = d.get("model_type")
    if not isinstance(model_type, str):
        raise HFConfigError(f"config {where} has no 'model_type'; pass the config.json of a Hugging Face causal language model.")
    if model_type not in REQUIRED_FIELDS:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise HFConfigError(f"config {where} is a {model_type!r} model, which is not a causal language model; plan adapts causal LMs of type {', '.join(REQUIRED_FIELDS)}.")
        raise HFConfigError(f"config {where} is a {model_type!r} causal LM, which plan does not adapt yet; it adapts {', '.join(REQUIRED_FIELDS)} (or write a model file, see examples/).")
    missing = [k for k in REQUIRED_FIELDS[model_type] if not isinstance(d.get(k), int) or isinstance(d.get(k), bool) or d.get(k) <= 0]
    if missing:
        raise HFConfigError(f"config {where} lacks {', '.join(repr(k) for k in missing)} (positive integers a {model_type} config must give); add them to the config.")


def make_config(d: dict, where: str = "given"):
    """The transformers config object, set up for training on the adapted layers."""
    transformers = _transformers()
    d = dict(d)
    for k in ("torch_dtype", "dtype", "_name_or_path", "transformers_version"):
        d.pop(k, None)
    try:
        config = transformers.AutoConfig.for_model(**d)
    except Exception as e:  # noqa: BLE001 - whatever Transformers rejects in a config
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise HFConfigError(f"config {where} is not a valid {d.get('model_type')} config ({type(e).__name__}: {first}); fix that field.") from None
    config.tie_word_embeddings = False
    config.use_cache = False
    for k, v in list(config.to_dict().items()):
        if isinstance(v, float) and (k.endswith("dropout") or k.endswith("pdrop")):
            setattr(config, k, 0.0)
    return config


def config_sha256(d: dict, seq_len: int) -> str:
    blob = json.dumps({"config": d, "seq_len": seq_len}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


# --------------------------------------------------------------------------------------
# The adapted layers
# --------------------------------------------------------------------------------------

class TokenEmbedding(nn.Module):
    """Token ids (B, T) -> hidden states (B, T, C)."""

    def __init__(self, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class TokenPositionEmbedding(nn.Module):
    """GPT-2: token plus learned position embedding."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding):
        super().__init__()
        self.wte = wte
        self.wpe = wpe

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.wte(input_ids) + self.wpe(pos)


class NormHead(nn.Module):
    """Final norm and the language-model head: (B, T, C) -> logits (B, T, V)."""

    def __init__(self, norm: nn.Module, lm_head: nn.Linear):
        super().__init__()
        self.norm = norm
        self.lm_head = lm_head

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden_states))


def sliding_window_mask(t: int, window: int, device) -> torch.Tensor:
    """(1, 1, T, T) boolean: query i attends key j when j <= i and i - j < window (HF's rule)."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    return ((j <= i) & (i - j < window))[None, None]


class DecoderLayerAdapter:
    """Mixed in before a Transformers decoder-layer class: forward takes and returns only the
    hidden states and supplies positions, rotary embeddings and the mask itself.

    `_plan_rope`: the layer holds `rotary_emb` and its forward takes position embeddings;
    `_plan_window`: the sliding window of its attention, or None.
    """

    _plan_rope: bool = False
    _plan_window: int | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # Under sequence parallelism the input is this rank's slice of the sequence, and the
        # attention runs on the whole of it (gathered): positions and masks are the whole's.
        t = hidden_states.shape[1] * getattr(self, "sequence_split", 1)
        kwargs = {}
        if self._plan_rope:
            position_ids = torch.arange(t, device=hidden_states.device)[None]
            kwargs["position_ids"] = position_ids
            kwargs["position_embeddings"] = self.rotary_emb(hidden_states, position_ids)
        mask = None
        if self._plan_window is not None and self._plan_window < t:
            mask = sliding_window_mask(t, self._plan_window, hidden_states.device)
        out = super().forward(hidden_states, attention_mask=mask, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def extra_repr(self) -> str:
        return f"sliding_window={self._plan_window}" if self._plan_window is not None else ""


_ADAPTED_CLASSES: dict[type, type] = {}


def adapt_decoder_layer(layer: nn.Module, rotary: nn.Module | None, window: int | None) -> nn.Module:
    """Turn a Transformers decoder layer into a hidden-states-only layer, in place (its
    submodules keep their names: "self_attn.q_proj", ...)."""
    cls = type(layer)
    adapted = _ADAPTED_CLASSES.get(cls)
    if adapted is None:
        adapted = type(f"Plan{cls.__name__}", (DecoderLayerAdapter, cls), {"__module__": __name__})
        _ADAPTED_CLASSES[cls] = adapted
    layer.__class__ = adapted
    layer._plan_rope = rotary is not None
    layer._plan_window = window
    if rotary is not None:
        layer.rotary_emb = rotary
    return layer


def layer_windows(config, model_type: str, n: int) -> list[int | None]:
    """The sliding window of each decoder layer's attention, or None for plain causal attention."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * n
    types = getattr(config, "layer_types", None)
    if types:
        return [window if types[i] == "sliding_attention" else None for i in range(n)]
    return [window] * n if model_type == "mistral" else [None] * n


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights   # transformers 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights    # transformers 4
    return no_init_weights()


def build_hf_model(config) -> nn.Module:
    """The Transformers causal LM from the config, random weights, in torch's default dtype
    (make_config drops the config's torch_dtype)."""
    transformers = _transformers()
    from torch._guards import active_fake_mode
    # Under FakeTensorMode (`plan profile --fake`) values do not exist, so Transformers' weight
    # initialisation is skipped: run there, it corrupts the heap now and then (transformers
    # 5.x with torch 2.13; seen as a segfault or "corrupted double-linked list").
    skip_init = _no_init_weights() if active_fake_mode() is not None else contextlib.nullcontext()
    with skip_init:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")   # default dtype: the config has none
    model.train()
    return model


def adapt(model: nn.Module) -> nn.Sequential:
    """The causal LM as the layer stack of docs/design.md (it takes the model's modules; the model
    itself is not usable afterwards)."""
    config = model.config
    model_type = config.model_type
    base = model.base_model
    if model_type == "gpt2":
        first = TokenPositionEmbedding(base.wte, base.wpe)
        blocks, norm = list(base.h), base.ln_f
        rotaries = [None] * len(blocks)
    else:
        first = TokenEmbedding(base.embed_tokens)
        blocks, norm = list(base.layers), base.norm
        # On the CPU even when the model is built on the meta device (a run that loads its
        # weights): these buffers are computed, not loaded, so they must hold their values.
        with torch.device("cpu"):
            rotaries = [type(base.rotary_emb)(config=config) for _ in blocks]
    windows = layer_windows(config, model_type, len(blocks))
    layers = [adapt_decoder_layer(b, r, w) for b, r, w in zip(blocks, rotaries, windows)]
    return nn.Sequential(first, *layers, NormHead(norm, model.lm_head))


def hf_parameter_names(config) -> dict[str, str]:
    """Each parameter's name in the adapted layer stack -> its name in the Transformers model
    (as save_pretrained writes it): "3.self_attn.q_proj.weight" -> "model.layers.2.self_attn.q_proj.weight".
    Read off the modules themselves (adapt takes the model's own), built on the meta device."""
    with torch.device("meta"), _no_init_weights():
        model = _transformers().AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    return {n: names[id(p)] for n, p in adapt(model).named_parameters()}


# Decoder layers whose only parameters outside the tensor-parallel linears are these two norms
# (what sequence parallelism must run as "sequence" modules: a module with weights that saw a
# slice of the sequence without it would step on part of its gradient).
SEQUENCE_PARALLEL_NORMS = {model_type: ("input_layernorm", "post_attention_layernorm")
                           for model_type in ("llama", "mistral", "qwen2")}
# The vocabulary split over tensor-parallel ranks, as Megatron, torchtitan and the Llama 3 run
# do: the embedding by rows, the head by columns with the loss on its split logits.
VOCABULARY_PARALLEL = {"embed_tokens": "rowwise", "lm_head": "vocab"}


def translate_tp_plan(base_plan: dict | None, model_type: str = "") -> dict[str, str]:
    """The config's base_model_tp_plan in the adapted layers' names and the project's styles;
    for the families of SEQUENCE_PARALLEL_NORMS, with their decoder layers' norms as "sequence"
    modules (Megatron's sequence parallelism, a plan's choice) and the embedding and head split
    by vocabulary (VOCABULARY_PARALLEL)."""
    out = {}
    for key, style in (base_plan or {}).items():
        style = {"rowwise_rep": "rowwise"}.get(style, style)
        if style not in ("colwise", "rowwise"):
            continue   # other styles need comms the project does not do; the module stays replicated
        local = key.split("layers.*.", 1)[1] if key.startswith("layers.*.") else key
        out[local] = style
    if any(key.startswith("layers.*.") for key in (base_plan or {})) and model_type in SEQUENCE_PARALLEL_NORMS:
        out.update({norm: "sequence" for norm in SEQUENCE_PARALLEL_NORMS[model_type]})
        out.update(VOCABULARY_PARALLEL)
    return out


# --------------------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------------------

def load_hf_spec(arg: str, seq_len: int | None = None) -> ModelSpec:
    """The ModelSpec of a built-in name, config.json or folder at `seq_len` tokens per sample
    (default: min(4096, the config's max_position_embeddings))."""
    name, d = read_config(arg)
    where = name if name in BUILTIN_CONFIGS else str(arg)
    _transformers()
    check_config(d, where)
    config = make_config(d, where)
    max_pos = getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_SEQ_LEN
    if seq_len is None:
        seq_len = min(DEFAULT_MAX_SEQ_LEN, max_pos)
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise HFConfigError(f"--seq-len {seq_len!r} is not a positive integer; give the tokens per sample, e.g. 4096.")
    if seq_len > max_pos:
        raise HFConfigError(f"--seq-len {seq_len} is longer than the {max_pos} positions config {where} allows (max_position_embeddings); give at most {max_pos}.")
    vocab = config.vocab_size
    tp_plan = translate_tp_plan(getattr(config, "base_model_tp_plan", None), config.model_type)

    def build_model() -> nn.Sequential:
        return adapt(build_hf_model(config))

    def make_batch(batch_size: int):
        data = torch.randint(0, vocab, (batch_size, seq_len + 1))
        return data[:, :-1].contiguous(), data[:, 1:].contiguous()

    # Tensor parallelism splits attention by heads: its degree must divide both head counts.
    heads = [getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)]
    return ModelSpec(path=str(arg), sha256=config_sha256(d, seq_len), build_model=build_model, make_batch=make_batch,
                     loss_fn=default_loss_fn, tp_plan=tp_plan, source=SOURCE, name=name, seq_len=seq_len,
                     tp_divides=sorted({h for h in heads if isinstance(h, int) and h > 0}),
                     weight_names=lambda: hf_parameter_names(config))
