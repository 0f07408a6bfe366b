"""ampgraph/capture/trace.py: one faithful export: side effects of a submodule cut it out of
the graph; of the model itself, raise; a one-time initialisation is kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampgraph.capture.export import ExportRoot
from ampgraph.capture.opaque import opaque_nodes, release
from ampgraph.capture.trace import SideEffect, traced


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x)


class Outer(nn.Module):
    def __init__(self, own: bool = False) -> None:
        super().__init__()
        self.inner = Counting()
        self.head = nn.Linear(4, 2)
        self.own = own
        self.seen: list = []

    def forward(self, x):
        if self.own:
            self.seen.append(x.shape[0])  # a symbolic size into the model's own state
        if not getattr(self, "ready", False):
            self.ready = True  # once
        return self.head(self.inner(x))


def export(model):
    inputs = ((torch.randn(3, 4),), {})
    return traced(model, ExportRoot(model), inputs, "model")


def test_a_counting_submodule_is_cut_and_a_flag_set_once_kept():
    model = Outer()
    ep, watch = export(model)
    assert len(opaque_nodes(ep.module())) == 1, "the counter's module is kept out"
    assert model.inner.calls == 0, "the traces' increments were put back"
    assert model.ready is True, "the first call's initialisation stays, as in eager"
    release(watch.emitted)


def test_the_models_own_side_effect_raises():
    model = Outer(own=True)
    with pytest.raises(SideEffect, match="model.seen"):
        export(model)
    assert model.seen == [] and model.inner.calls == 0
