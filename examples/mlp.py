"""A deep residual MLP classifier as an nn.Sequential.

Layers: an input projection, N_BLOCKS residual blocks (norm, up-projection, GELU,
down-projection), and a classifier head.

    plan profile examples/mlp.py
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

IN_FEATURES = 64   # features per sample
WIDTH = 256        # hidden width
N_BLOCKS = 8       # residual blocks
CLASSES = 10       # output classes


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):                                     # (B, WIDTH)
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def build_model() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(IN_FEATURES, WIDTH),
        *[Block() for _ in range(N_BLOCKS)],
        nn.Linear(WIDTH, CLASSES),
    )


def make_batch(batch_size: int):
    """Random features; the class is the arg-max of the first CLASSES features."""
    x = torch.randn(batch_size, IN_FEATURES)
    return x, x[:, :CLASSES].argmax(dim=1)


# loss_fn is not defined: the default cross-entropy over the last dim applies.

tp_plan = {"fc1": "colwise", "fc2": "rowwise"}
