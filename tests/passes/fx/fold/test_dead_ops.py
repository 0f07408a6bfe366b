"""passes/fx/fold/dead_ops.py: ops the rewrite left unused are dropped, random draws stay."""

from __future__ import annotations

import torch
from torch import nn

from passes.fx.fold.dead_ops import drop_dead_ops
from passes.fx.pipeline import run_amp_passes
from passes.fx.policy import make_policy
from tests.passes.fx.helpers import export


class RMSNormThenLinear(nn.Module):
    """HF's LlamaRMSNorm: ``x.to(float32)`` normalised, then ``weight * h.to(x.dtype)``; in
    an fp32 model that last cast is to fp32, and O2's low ``mul`` reads the low value."""

    def __init__(self):
        super().__init__()
        self.weight, self.fc = nn.Parameter(torch.ones(16)), nn.Linear(16, 16)

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = self.weight * h.to(x.dtype)
        return torch.nn.functional.dropout(self.fc(h), 0.5, training=True)


def test_ops_the_rewrite_left_unused_are_dropped_but_random_draws_stay():
    model, x = RMSNormThenLinear(), torch.randn(2, 5, 16)
    gm = export(model, (x,))
    run_amp_passes(gm, make_policy("O2"), torch.bfloat16)
    dead = [n for n in gm.graph.nodes if not n.users and n.op == "call_function"]
    assert dead == [], "the model's cast to fp32 beside the low mul is gone"
    g = gm.graph
    (drop,) = [n for n in g.nodes if "dropout" in str(n.target)]
    with g.inserting_after(drop):  # an unused draw and an unused pure op
        unused_draw = g.call_function(torch.ops.aten.rand.default, ([3],), {})
        g.call_function(torch.ops.aten.relu.default, (drop,), {})
    assert drop_dead_ops(gm).modified
    assert unused_draw in g.nodes, "a random draw keeps its place in the RNG stream"
    assert sum(1 for n in g.nodes if n.target == torch.ops.aten.relu.default) == 0
