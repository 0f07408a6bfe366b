"""What the CUDA runtime's tests share: an MLP compiled with the CUDA runtime beside a copy
compiled with the CPU runtime (both on CPU tensors)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import ampgraph


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.norm = nn.LayerNorm(32)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        return self.fc3(self.norm(F.gelu(self.fc2(h))))


def pair(make=MLP):
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    return (model, ampgraph.compile(model, "O2", "bf16", runtime="cuda"),
            ref, ampgraph.compile(ref, "O2", "bf16", runtime="cpu"))
