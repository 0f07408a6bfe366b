"""passes/fx/routing.py: ops handed to runtime callables; same values, lint and verify hold."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from passes.fx import run_amp_passes, verify
from passes.fx.dtypes import CAST, is_amp_cast
from passes.fx.fold import count_casts
from passes.fx.policy import make_policy
from passes.fx.runtime_ops import RuntimeOps

aten = torch.ops.aten
CALLS: list[str] = []


def cached_cast(param, dtype):
    CALLS.append("cast")
    return param.to(dtype)


def amp_linear(x, w, b=None):
    CALLS.append("linear")
    return aten.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))


def amp_attention(*args, **kwargs):
    CALLS.append("attention")
    return aten.scaled_dot_product_attention(*args, **kwargs)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 3)

    def forward(self, ids):
        h = self.emb(ids)
        q, k = self.q(h).unsqueeze(1), self.k(h).unsqueeze(1)
        a = nn.functional.scaled_dot_product_attention(q, k, k).squeeze(1)
        return self.out(a + h).sum(1)


def rewritten(model, ids, low, level="O2", keep_io_types=True, **routes):
    gm = torch.export.export(model, (ids,), strict=False).module()
    result = run_amp_passes(gm, make_policy(level), low, keep_io_types=keep_io_types,
                            runtime=RuntimeOps(**routes))
    return gm, result


ROUTES = dict(weight_cast=cached_cast, linear=amp_linear, attention=amp_attention)


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


def test_route_weight_casts_alone_routes_every_parameter_cast():
    torch.manual_seed(0)
    model = Net().eval()
    ids = torch.randint(0, 50, (2, 5))
    plain, _ = rewritten(copy.deepcopy(model), ids, torch.bfloat16)
    routed, _ = rewritten(model, ids, torch.bfloat16, weight_cast=cached_cast)
    param_casts = [n for n in plain.graph.nodes
                   if is_amp_cast(n) and n.args[0].op == "get_attr"]
    calls = [n for n in routed.graph.nodes if n.target is cached_cast]
    assert len(calls) == len(param_casts) > 0
    assert all(is_amp_cast(n) and n.args[1] in (torch.bfloat16, torch.float32) for n in calls)
    routed.graph.lint()
    verify(routed, torch.bfloat16)  # the routed casts keep the casts' metadata
    with torch.no_grad():
        torch.testing.assert_close(routed(ids), plain(ids), rtol=0, atol=0)


def test_nothing_is_routed_where_nothing_runs_low():
    model = Net().eval()
    ids = torch.randint(0, 50, (2, 5))
    gm, result = rewritten(model, ids, torch.bfloat16, level="O0", **ROUTES)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not targets & {amp_linear, amp_attention, cached_cast}
    assert result.casts == 0
    with torch.no_grad():
        torch.testing.assert_close(gm(ids), model(ids))


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return y, y.relu() + 1, x.shape[0]  # two cast-back outputs, one not a tensor


def output_cast(x, dtype, slot):
    CALLS.append(("output", slot))
    return x.to(dtype)


@pytest.mark.parametrize("keep_io_types", [True, False])
def test_output_casts_call_the_runtime_with_their_place_among_the_outputs(keep_io_types):
    model = TwoOutputs()
    x = torch.randn(3, 8)
    gm, _ = rewritten(model, x, torch.bfloat16, keep_io_types=keep_io_types,
                      output_cast=output_cast)
    calls = [n for n in gm.graph.nodes if n.target is output_cast]
    if not keep_io_types:  # nothing is cast back: nothing to route
        assert not calls
        return
    assert len(calls) == 2 and sorted(n.args[2] for n in calls) == [0, 1]
    assert all(n.args[1] == torch.float32 for n in calls)
    gm.graph.lint()
    CALLS.clear()
    y, z, n = gm(x)
    assert [c[1] for c in CALLS] == [0, 1] and n == 3
    assert y.dtype == z.dtype == torch.float32
    plain, _ = rewritten(model, x, torch.bfloat16)
    torch.testing.assert_close((y, z), plain(x)[:2], rtol=0, atol=0)
