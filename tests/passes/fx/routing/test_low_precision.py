"""passes/fx/routing/low_precision.py: only ops painted low on a low first input are handed
over, their reasons extended; the graph's values are the callable's."""

from __future__ import annotations

import torch
from torch import fx, nn

from passes.fx.routing.low_precision import route_low_precision
from passes.policy import FP32, LOW

aten = torch.ops.aten
RELU = aten.relu.default


def twice_relu(x):
    return aten.relu(x) * 2


def relus(first_by_keyword: bool = False):
    """Four relus: low on bf16, low on fp32, fp32 on bf16, and low on bf16 again (that one's
    input passed by keyword with ``first_by_keyword``)."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["amp_dtype"] = torch.bfloat16
    y = g.placeholder("y")
    y.meta["amp_dtype"] = torch.float32
    nodes = []
    for src, precision in ((x, LOW), (y, LOW), (x, FP32), (x, LOW)):
        n = g.call_function(RELU, (src,))
        n.meta.update(amp_precision=precision, amp_reason="painted")
        nodes.append(n)
    if first_by_keyword:
        nodes[3].args, nodes[3].kwargs = (), {"self": x}
    g.output(tuple(nodes))
    return fx.GraphModule(nn.Module(), g), nodes


def test_only_low_ops_on_a_low_first_input_are_routed():
    gm, (low, on_fp32, painted_fp32, again) = relus()
    assert route_low_precision(gm, RELU, twice_relu, torch.bfloat16, "self", "doubled").modified
    assert [n.target for n in (low, on_fp32, painted_fp32, again)] == \
        [twice_relu, RELU, RELU, twice_relu]
    assert low.meta["amp_orig_op"] == "aten.relu"
    assert low.meta["amp_reason"] == "painted; doubled"
    assert "amp_orig_op" not in on_fp32.meta and on_fp32.meta["amp_reason"] == "painted"
    gm.graph.lint()
    gm.recompile()
    x, y = torch.randn(3).bfloat16(), torch.randn(3)
    out = gm(x, y)
    torch.testing.assert_close(out[0], x.relu() * 2)
    torch.testing.assert_close(out[1], y.relu())
    assert not route_low_precision(gm, RELU, twice_relu, torch.bfloat16, "self", "").modified


def test_the_first_input_may_be_a_keyword():
    gm, nodes = relus(first_by_keyword=True)
    route_low_precision(gm, RELU, twice_relu, torch.bfloat16, "self", "doubled")
    assert nodes[3].target is twice_relu
    gm, nodes = relus(first_by_keyword=True)
    route_low_precision(gm, RELU, twice_relu, torch.bfloat16, "input", "doubled")
    assert nodes[3].target is RELU, "the keyword named is not there: its dtype is unknown"
