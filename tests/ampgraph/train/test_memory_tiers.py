"""ampgraph/train/memory_tiers.py: build_train_step(memory=...) sets the tiers' options, and
refuses a contradiction."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampgraph
from ampgraph.train.memory_tiers import MEMORY_TIERS, resolve_memory


def test_each_tier_sets_the_masters_and_the_release():
    assert resolve_memory(None, "kahan", True) == ("kahan", True)
    assert resolve_memory("default", "fp32", False) == ("fp32", False)
    assert resolve_memory("lean", "fp32", False) == ("fp32", True)
    assert resolve_memory("leanest", "stochastic", True) == ("stochastic", True)
    with pytest.raises(ValueError, match="master_weights='kahan' was given"):
        resolve_memory("leanest", "kahan", False)
    with pytest.raises(ValueError, match="release_grads=True was given"):
        resolve_memory("default", "fp32", True)
    with pytest.raises(ValueError, match="memory must be one of"):
        resolve_memory("small", "fp32", False)


@pytest.mark.parametrize("memory", list(MEMORY_TIERS))
def test_the_step_of_each_tier_trains(memory):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = ampgraph.build_train_step(model, F.cross_entropy, opt, "O2", "bf16", memory=memory)
    x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
    losses = [float(step(x, y).loss) for _ in range(20)]
    assert losses[-1] < losses[0]
    assert (step.released is not None) == (memory != "default")
    low = memory == "leanest"
    assert (model[0].weight.dtype == torch.bfloat16) == low
    assert model[1].weight.dtype == torch.float32  # norm parameters stay fp32
