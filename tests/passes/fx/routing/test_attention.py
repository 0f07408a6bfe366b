"""passes/fx/routing/attention.py: low-precision attention calls the runtime's; nothing is
routed where nothing runs low."""

from __future__ import annotations

import torch
from torch import nn

from passes.fx.pipeline import run_amp_passes
from passes.fx.policy import make_policy
from passes.fx.routing.attention import route_attention
from passes.fx.runtime_ops import RuntimeOps
from passes.policy import FP32
from tests.passes.fx.routing.helpers import (
    ROUTES,
    Net,
    amp_attention,
    amp_linear,
    cached_cast,
    rewritten,
)

aten = torch.ops.aten


def test_nothing_is_routed_where_nothing_runs_low():
    model = Net().eval()
    ids = torch.randint(0, 50, (2, 5))
    gm, result = rewritten(model, ids, torch.bfloat16, level="O0", **ROUTES)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not targets & {amp_linear, amp_attention, cached_cast}
    assert result.casts == 0
    with torch.no_grad():
        torch.testing.assert_close(gm(ids), model(ids))


class SelfAttention(nn.Module):
    def forward(self, q):
        return nn.functional.scaled_dot_product_attention(q, q, q)


class Attention(nn.Module):
    """Two attentions on a linear's output, one in a module kept fp32 by an override."""

    def __init__(self):
        super().__init__()
        self.q, self.fast, self.precise = nn.Linear(8, 8), SelfAttention(), SelfAttention()

    def forward(self, x):
        q = self.q(x).unsqueeze(1)
        return self.fast(q), self.precise(q)


def attention_graph(**routes):
    model, x = Attention(), torch.randn(2, 5, 8)
    gm = torch.export.export(model, (x,), strict=False).module()
    policy = make_policy("O2", module_rules=[("precise", FP32, "test")])
    run_amp_passes(gm, policy, torch.bfloat16, runtime=RuntimeOps(**routes))
    return gm, x


def test_route_attention_hands_over_only_low_attention_with_the_same_values():
    gm, x = attention_graph(attention=amp_attention)
    plain, _ = attention_graph()
    plain.load_state_dict(gm.state_dict())
    sdpa = aten.scaled_dot_product_attention.default
    (call,) = [n for n in gm.graph.nodes if n.target is amp_attention]
    assert call.meta["amp_orig_op"] == "aten.scaled_dot_product_attention"
    assert call.meta["amp_reason"].endswith("the runtime picks its kernel for the shapes it "
                                            "meets")
    (kept,) = [n for n in gm.graph.nodes if n.target is sdpa]
    assert kept.meta["amp_precision"] == "fp32"
    assert not route_attention(gm, amp_attention, torch.bfloat16).modified
    gm.graph.lint()
    with torch.no_grad():
        torch.testing.assert_close(gm(x), plain(x), rtol=0, atol=0)
