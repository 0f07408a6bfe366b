"""What the parallel tests share: a small language model (an embedding, two blocks with
their norms, a final norm and a head) and its batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D, VOCAB, SEQ = 32, 64, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def make_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def batch(i: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``i``: random tokens, each labelled by a fixed map."""
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(i))
    return ids, (ids * 5 + 3) % VOCAB


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
