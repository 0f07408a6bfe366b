"""passes/fx/prepare.py: capture checks dropped, in-place activations made functional."""

from __future__ import annotations

import torch
from torch import nn

from passes.fx.nodes import op_key
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


class Checked(nn.Module):
    """Export records a metadata check for ``.to``, and in-place ops on an input and on a
    view stay in place."""

    def forward(self, x, y):
        h = (x * 2).to(torch.float32)
        h[:, :2].relu_()  # in place on a view: the write must reach h
        y.add_(1)  # in place on a graph input: the caller sees it
        return h + y


def test_capture_checks_are_dropped_and_writes_to_inputs_and_views_stay():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    gm = torch.export.export(Checked(), (x, y.clone()), strict=False).module()
    keys = lambda: [op_key(n) for n in gm.graph.nodes if n.op == "call_function"]  # noqa: E731
    assert "aten._assert_tensor_metadata" in keys()
    assert prepare(gm).modified
    assert "aten._assert_tensor_metadata" not in keys()
    assert "aten.relu_" in keys() and "aten.add_.Tensor" in keys()
    assert not prepare(gm).modified, "nothing left to do"
    y1, y2 = y.clone(), y.clone()
    torch.testing.assert_close(gm(x, y1), Checked()(x, y2))
    torch.testing.assert_close(y1, y2)
