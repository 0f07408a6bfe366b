"""ampgraph/report.py: explain and the PrecisionReport."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampgraph


def test_explain_with_inputs_on_eager_model_keeps_buffers():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner(x) if x.sum() > -1e9 else x

    w = Wrapper().train()
    net = ampgraph.compile(w, "O2", "bf16")
    stats = model[1].running_mean.clone()
    with pytest.warns(UserWarning):
        report = ampgraph.explain(net, torch.randn(4, 4))
    assert torch.equal(stats, model[1].running_mean), "explain must not update running stats"
    assert report.eager and any(r["op"] == "aten.linear" for r in report.nodes)


def test_explain_needs_a_compiled_module_and_inputs():
    with pytest.raises(TypeError, match="ampgraph.compile"):
        ampgraph.explain(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="example inputs"):
        ampgraph.explain(ampgraph.compile(nn.Linear(2, 2)))
