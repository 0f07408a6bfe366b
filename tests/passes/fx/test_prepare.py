"""passes/fx/prepare.py: capture checks dropped, in-place activations made functional."""

from __future__ import annotations

import torch
from torch import nn

from passes.fx.prepare import prepare
from tests.passes.fx.helpers import check_pass, in_place_graph


def test_inplace_activation_becomes_functional_and_runs_low():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    gm, _ = check_pass(model, (torch.randn(3, 4),), "O1", torch.bfloat16)
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "aten.relu.default" in ops and "aten.relu_.default" not in ops


def test_prepare_without_recompile_rewrites_the_graph_alike():
    eager, deferred = in_place_graph(), in_place_graph()
    assert prepare(eager).modified and prepare(deferred, recompile=False).modified
    assert str(deferred.graph) == str(eager.graph)
    in_place = "aten.relu_.default"
    assert in_place in deferred.code and in_place not in eager.code  # forward not regenerated
    deferred.recompile()
    assert deferred.code == eager.code
