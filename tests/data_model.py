"""A small model whose dataset() writes down every sample it is asked for (tests/test_training.py).

Each read appends the sample's index to $READS_DIR/rank<RANK>.txt when READS_DIR is set.
"""

import os

import torch
import torch.nn as nn

N_SAMPLES = 40   # not a multiple of the global batch (8): epochs wrap inside a step
D_IN, D_HIDDEN, N_CLASSES = 8, 16, 4


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x):                     # (B, d_in) -> (B, d_out)
        return torch.tanh(self.fc(x))


def build_model() -> nn.Sequential:
    return nn.Sequential(Block(D_IN, D_HIDDEN), Block(D_HIDDEN, D_HIDDEN), Block(D_HIDDEN, D_HIDDEN), nn.Linear(D_HIDDEN, N_CLASSES))


def make_batch(batch_size: int):
    return torch.randn(batch_size, D_IN), torch.randint(0, N_CLASSES, (batch_size,))


class Samples:
    """Sample i is fixed by i alone: a seeded input and the class i mod 4."""

    def __len__(self):
        return N_SAMPLES

    def __getitem__(self, i: int):
        if "READS_DIR" in os.environ:
            with open(os.path.join(os.environ["READS_DIR"], f"rank{os.environ.get('RANK', 'none')}.txt"), "a") as f:
                f.write(f"{i}\n")
        x = torch.randn(D_IN, generator=torch.Generator().manual_seed(i))
        return x, torch.tensor(i % N_CLASSES)


def dataset():
    return Samples()
