"""A nanoGPT-style decoder written as an nn.Sequential, the shape `plan` works with.

Layers: token + position embedding, N_LAYER pre-norm blocks (causal self-attention and an
MLP, each with a residual), then the final norm + language-model head. Every child of the
Sequential is one layer: the unit of checkpointing, offload and pipeline splitting.

    plan profile examples/gpt.py
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 512      # tokens in the vocabulary
SEQ_LEN = 64     # tokens per sample
D_MODEL = 128    # width of the residual stream
N_HEAD = 4       # attention heads (head dim = D_MODEL // N_HEAD)
N_LAYER = 4      # transformer blocks


class Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(SEQ_LEN, D_MODEL)

    def forward(self, idx):                                   # (B, T) token ids
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        return self.tok(idx) + self.pos(pos)                  # (B, T, C)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        # Separate q, k, v projections so tensor parallelism can split them by heads.
        self.q = nn.Linear(D_MODEL, D_MODEL)
        self.k = nn.Linear(D_MODEL, D_MODEL)
        self.v = nn.Linear(D_MODEL, D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x):                                     # (B, T, C)
        b, t, _ = x.shape
        hd = D_MODEL // N_HEAD
        # view(b, t, -1, hd): under tensor parallelism each rank holds only its heads.
        q = self.q(x).view(b, t, -1, hd).transpose(1, 2)       # (B, H, T, hd)
        k = self.k(x).view(b, t, -1, hd).transpose(1, 2)
        v = self.v(x).view(b, t, -1, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, -1)                # (B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_MODEL, 4 * D_MODEL)
        self.proj = nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.mlp = MLP()

    def forward(self, x):                                     # (B, T, C)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.lm_head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, x):                                     # (B, T, C)
        return self.lm_head(self.ln_f(x))                     # (B, T, VOCAB)


def build_model() -> nn.Sequential:
    return nn.Sequential(Embedding(), *[Block() for _ in range(N_LAYER)], Head())


def make_batch(batch_size: int):
    """Random token sequences; the target is the next token."""
    data = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1))
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# Tensor parallelism splits attention by heads, so its degree must divide the head count.
tp_divides = [N_HEAD]

# Megatron-style tensor parallelism inside each block: q, k, v and fc split by output
# features (heads), proj split by input features; one all-reduce after each proj. With
# sequence parallelism (a plan's choice) the norms run on slices of the sequence instead, and
# the all-reduces become an all-gather before each region and a reduce-scatter after it. The
# head is split by vocabulary and the loss computed on its split logits ("vocab").
tp_plan = {
    "ln1": "sequence",
    "ln2": "sequence",
    "attn.q": "colwise",
    "attn.k": "colwise",
    "attn.v": "colwise",
    "attn.proj": "rowwise",
    "mlp.fc": "colwise",
    "mlp.proj": "rowwise",
    "lm_head": "vocab",
}
