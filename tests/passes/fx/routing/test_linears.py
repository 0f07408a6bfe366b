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
