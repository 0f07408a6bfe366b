"""ampgraph/capture/own_state.py: what forward keeps for its own use is no side effect (a
cache of values computed from parameters, scratch attributes), and nothing traced stays in
the model; what it computes from its inputs for the user still is one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampgraph.capture.export import ExportRoot
from ampgraph.capture.opaque import opaque_nodes, release
from ampgraph.capture.trace import SideEffect, traced


class Model(nn.Module):
    """One linear and one of the ways forward keeps state for itself."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.table = nn.Parameter(torch.randn(6, 4))
        self.kind = kind
        self.cache: dict = {}

    def forward(self, x):
        h = self.fc(x)
        if self.kind == "parameter cache":  # LeViT's attention_bias_cache
            if "bias" not in self.cache:
                self.cache["bias"] = self.table[:3] * 2
            return h + self.cache["bias"]
        if self.kind == "input cache":
            if "first" not in self.cache:
                self.cache["first"] = h.detach()
            return h + self.cache["first"]
        if self.kind == "scratch":  # funnel's pooling_mult: set, then read back
            self.mult = 1
            self.mult = self.mult * 2
            return h * self.mult
        if self.kind == "size":  # funnel's seq_len: a size of the inputs, never read
            self.rows = x.shape[0]
            return h
        raise ValueError(self.kind)


def export(model):
    inputs = ((torch.randn(3, 4),), {})
    ep, watch = traced(model, ExportRoot(model), inputs, "model")
    release(watch.emitted)
    return ep


def test_a_cache_of_a_value_computed_from_parameters_is_no_side_effect():
    model = Model("parameter cache")
    ep = export(model)
    assert opaque_nodes(ep.module()) == [] and model.cache == {}  # put back, nothing fake


def test_a_cache_of_an_input_is_a_side_effect_of_the_model():
    model = Model("input cache")
    with pytest.raises(SideEffect, match="model.cache"):
        export(model)
    assert model.cache == {}


def test_scratch_state_read_back_is_left_as_eager_leaves_it():
    model = Model("scratch")
    ep = export(model)
    assert opaque_nodes(ep.module()) == [] and model.mult == 2


def test_a_size_forward_never_reads_is_put_back():
    model = Model("size")
    ep = export(model)
    assert opaque_nodes(ep.module()) == [] and "rows" not in model.__dict__
