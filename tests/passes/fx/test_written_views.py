"""passes/fx/written_views.py: an in-place op writing a parameter through views of it
(``weight.data.clamp_``, captured as ``clamp_(detach(weight))``) writes the parameter, not
a cast copy, at every level that casts."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import ampgraph
from passes.fx.written_views import REASON, written_source_path


class ClampsThroughAView(nn.Module):
    def __init__(self):
        super().__init__()
        self.coefs = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        self.coefs.weight.detach()[:, :4].clamp_(-0.1, 0.1)  # two views: detach, slice
        return self.coefs(x) * 2


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_the_views_and_the_write_keep_the_weight_s_dtype(level):
    torch.manual_seed(0)
    model, ref = ClampsThroughAView(), ClampsThroughAView()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(3, 8)
    net = ampgraph.compile(model, amp_level=level, dtype="bf16")
    with torch.no_grad():
        out, expected = net(x), ref(x)
    assert torch.equal(model.coefs.weight, ref.coefs.weight)  # the write reached it
    assert (out.float() - expected).abs().max() < 0.05
    rows = {r["op"]: r for r in ampgraph.explain(net).nodes}
    for op in ("aten.detach", "aten.slice.Tensor", "aten.clamp_"):
        assert (rows[op]["precision"], rows[op]["reason"]) == ("fp32", REASON), op
    assert rows["aten.linear"]["precision"] == "bf16"


def test_no_path_for_an_in_place_op_on_an_activation():
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.relu.default, (x,))
    view = g.call_function(torch.ops.aten.slice.Tensor, (y, 0, 0, 2))
    write = g.call_function(torch.ops.aten.clamp_.default, (view, -1.0, 1.0))
    on_input = g.call_function(torch.ops.aten.mul_.Tensor,
                               (g.call_function(torch.ops.aten.detach.default, (x,)), y))
    assert written_source_path(write) == []
    assert [n.name for n in written_source_path(on_input)] == ["detach_default"]
    assert written_source_path(y) == []
