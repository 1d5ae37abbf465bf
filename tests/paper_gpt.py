"""A GPT layer built to Korthikanti et al. 2022's assumptions ("Reducing Activation
Recomputation in Large Transformer Models", section 4.1), for tests/test_profiler.py.

16-bit activations (bf16), attention written out (Q K^T, softmax, dropout, times V: the
scores materialised, no fused kernel), dropout with 1-byte masks after the attention
softmax, the output projection and the MLP, a 4h MLP with GeLU, pre-norm LayerNorms. The
layer takes and returns hidden states of (B, S, H); separate Q, K and V projections so that
tensor parallelism splits them by heads (Megatron's fused QKV is split the same way).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ_LEN = 64     # s
HIDDEN = 64      # h
HEADS = 4        # a
DROPOUT = 0.1


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(HIDDEN, HIDDEN)
        self.k = nn.Linear(HIDDEN, HIDDEN)
        self.v = nn.Linear(HIDDEN, HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):                                            # (B, S, H)
        b, s, _ = x.shape
        d = HIDDEN // HEADS
        q = self.q(x).view(b, s, -1, d).transpose(1, 2)              # (B, a, S, d); -1: this rank's heads
        k = self.k(x).view(b, s, -1, d).transpose(1, 2)
        v = self.v(x).view(b, s, -1, d).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * d ** -0.5               # (B, a, S, S)
        probs = F.dropout(torch.softmax(scores, dim=-1), DROPOUT, self.training)
        y = (probs @ v).transpose(1, 2).reshape(b, s, -1)             # (B, S, H)
        return F.dropout(self.proj(y), DROPOUT, self.training)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.proj = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        return F.dropout(self.proj(F.gelu(self.fc(x))), DROPOUT, self.training)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def build_model() -> nn.Sequential:
    return nn.Sequential(Layer(), Layer())


def make_batch(batch_size: int):
    return torch.randn(batch_size, SEQ_LEN, HIDDEN), torch.randn(batch_size, SEQ_LEN, HIDDEN)


def loss_fn(output, targets):
    return F.mse_loss(output, targets)


tp_plan = {"ln1": "sequence", "ln2": "sequence", "attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.proj": "rowwise",
           "mlp.fc": "colwise", "mlp.proj": "rowwise"}
tp_divides = [HEADS]
