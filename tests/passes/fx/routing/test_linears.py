"""passes/fx/routing/linears.py: linears (with the weight casts and attention routed too)
call the runtime with the same values."""

from __future__ import annotations

import copy

import pytest
import torch

from passes.fx.dtypes import CAST
from passes.fx.fold.cast_count import count_casts
from tests.passes.fx.routing.helpers import (
    CALLS,
    ROUTES,
    Net,
    amp_attention,
    amp_linear,
    cached_cast,
    rewritten,
)

aten = torch.ops.aten


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_routed_graph_calls_the_runtime_with_the_same_values(low):
    torch.manual_seed(0)
    model = Net().eval()
    ids = torch.randint(0, 50, (2, 5))
    plain, plain_result = rewritten(copy.deepcopy(model), ids, low)
    routed, result = rewritten(model, ids, low, **ROUTES)
    # structure: every routed op calls its runtime callable; no parameter _to_copy is left
    targets = [n.target for n in routed.graph.nodes if n.op == "call_function"]
    assert targets.count(amp_linear) == 3 and targets.count(amp_attention) == 1
    assert aten.linear.default not in targets
    assert not any(n.target is CAST and n.args[0].op == "get_attr"
                   for n in routed.graph.nodes)
    origs = {n.meta.get("amp_orig_op") for n in routed.graph.nodes}
    assert {"aten.linear", "aten.scaled_dot_product_attention"} <= origs
    linears = [n for n in routed.graph.nodes if n.target is amp_linear]
    assert all(n.meta["amp_fused_weight_cast"] == low for n in linears)
    assert all(n.args[1].op == "get_attr" for n in linears), "the fp32 master weight"
    # the casts still happen (inside the callables) and stay counted
    assert result.casts == plain_result.casts == count_casts(plain)
    # invariants (verify ran before the routing: routed linears take fp32 masters)
    routed.graph.lint()
    # numerics: the same values as the unrouted graph
    CALLS.clear()
    with torch.no_grad():
        got, want = routed(ids), plain(ids)
    assert {"linear", "attention"} <= set(CALLS)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


ACTS = {None: lambda t: t, "gelu": torch.nn.functional.gelu, "relu": torch.relu,
        "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}


def recording_linear(x, w, b=None, shared=False, activation=None, transposed=False):
    CALLS.append(("linear", activation, transposed))
    wl = w.to(x.dtype)
    out = aten.linear(x, wl.t() if transposed else wl, None if b is None else b.to(x.dtype))
    return ACTS[activation](out)


class Conv1DMlp(torch.nn.Module):
    """transformers' Conv1D (``addmm(b, x, w)`` on a weight stored [in, out]) read through a
    view by a tanh-GELU, then a linear whose output a ReLU reads (or, ``shared_output``,
    the model's output too)."""

    def __init__(self, shared_output: bool = False):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(8, 16) * 0.3)
        self.b1 = torch.nn.Parameter(torch.randn(16) * 0.1)
        self.fc2, self.fc3 = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
        self.shared_output = shared_output

    def forward(self, x):
        h = torch.addmm(self.b1, x.reshape(-1, 8), self.w1).view(*x.shape[:-1], 16)
        h2 = self.fc2(torch.nn.functional.gelu(h, approximate="tanh"))
        y = self.fc3(torch.relu(h2))
        return (y, h2) if self.shared_output else y


def _linear_calls(gm):
    return [n for n in gm.graph.nodes if n.target is recording_linear]


def test_conv1d_products_route_transposed_and_activations_go_into_the_linear():
    torch.manual_seed(0)
    model = Conv1DMlp()
    x = torch.randn(2, 5, 8)
    plain, _ = rewritten(copy.deepcopy(model), x, torch.bfloat16)
    routed, _ = rewritten(model, x, torch.bfloat16, weight_cast=cached_cast,
                          linear=recording_linear,
                          linear_activations=frozenset({"gelu_tanh", "relu"}))
    calls = _linear_calls(routed)
    assert [(n.kwargs.get("activation"), n.kwargs.get("transposed", False)) for n in calls] \
        == [("gelu_tanh", True), ("relu", False), (None, False)]
    targets = {n.target for n in routed.graph.nodes}
    assert not {aten.gelu.default, aten.relu.default, aten.addmm.default} & targets
    assert [n.target for n in calls[0].meta["amp_absorbed"]] == [aten.gelu.default]
    assert "applies its gelu_tanh itself" in calls[0].meta["amp_reason"]
    routed.graph.lint()
    with torch.no_grad():
        got, want = routed(x), plain(x)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # addmm vs linear kernels


def test_an_activation_stays_where_another_node_reads_the_output_or_it_is_not_offered():
    model = Conv1DMlp(shared_output=True)
    x = torch.randn(2, 5, 8)
    routed, _ = rewritten(model, x, torch.bfloat16, weight_cast=cached_cast,
                          linear=recording_linear,
                          linear_activations=frozenset({"relu"}))  # no gelu_tanh
    calls = _linear_calls(routed)
    assert [n.kwargs.get("activation") for n in calls] == [None, None, None]
    targets = [n.target for n in routed.graph.nodes]
    assert aten.gelu.default in targets and aten.relu.default in targets
