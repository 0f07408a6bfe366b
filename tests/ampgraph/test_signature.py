"""ampgraph/signature.py: the compiled module's forward has the model's signature."""

from __future__ import annotations

import torch
from torch import nn

import ampgraph
from tests.helpers import Keyworded


def test_forward_keeps_the_models_signature():
    import inspect

    model = Keyworded()
    net = ampgraph.compile(model, "O2", "bf16")
    assert inspect.signature(net.forward) == inspect.signature(model.forward)
    assert list(inspect.signature(net.forward).parameters) == ["input_ids", "mask", "scale"]
    assert net.forward.__func__ is net.forward.__func__  # one function per instance
    x = torch.randn(2, 8)
    torch.testing.assert_close(net(input_ids=x, scale=2.0), net.forward(x, scale=2.0))
    other = ampgraph.compile(nn.Linear(8, 2), "O2", "bf16")
    assert list(inspect.signature(other.forward).parameters) == ["input"]
