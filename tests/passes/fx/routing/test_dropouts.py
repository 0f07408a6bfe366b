"""passes/fx/routing/dropouts.py: low-precision dropout calls the runtime's; fp32 dropout
keeps aten's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from passes.fx.routing.dropouts import DROPOUT, route_dropouts
from tests.passes.fx.routing.helpers import CALLS, rewritten


def amp_dropout(x, p, train):
    CALLS.append(("dropout", x.dtype))
    return torch.ops.aten.dropout(x, p, train)


class Dropouts(nn.Module):
    """A dropout on a linear's output and one on a softmax's: at O1 the second follows the
    fp32 softmax, at O2 the whole network runs low."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = nn.functional.dropout(self.fc(x), 0.25, training=True)
        return h, nn.functional.dropout(torch.softmax(x, -1), 0.25, training=True)


@pytest.mark.parametrize("level, routed", [("O1", 1), ("O2", 2), ("O0", 0)])
def test_low_dropouts_call_the_runtime_with_the_same_draws(level, routed):
    x = torch.randn(4, 8)
    gm, _ = rewritten(Dropouts(), x, torch.bfloat16, level=level, dropout=amp_dropout)
    plain, _ = rewritten(Dropouts(), x, torch.bfloat16, level=level)
    plain.load_state_dict(gm.state_dict())
    calls = [n for n in gm.graph.nodes if n.target is amp_dropout]
    assert len(calls) == routed
    assert sum(n.target is DROPOUT for n in gm.graph.nodes) == 2 - routed, \
        "a dropout painted fp32 keeps aten's"
    for n in calls:
        assert n.meta["amp_orig_op"] == "aten.dropout"
        assert n.meta["amp_reason"].endswith("the runtime draws its mask (the same keep "
                                             "probability)")
    gm.graph.lint()
    CALLS.clear()
    torch.manual_seed(0)
    got = gm(x)
    torch.manual_seed(0)
    want = plain(x)
    assert CALLS == [("dropout", torch.bfloat16)] * routed
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_route_dropouts_alone_on_a_painted_graph():
    gm, _ = rewritten(Dropouts(), torch.randn(4, 8), torch.bfloat16)
    assert route_dropouts(gm, amp_dropout, torch.bfloat16).modified
    assert not route_dropouts(gm, amp_dropout, torch.bfloat16).modified, "nothing left"
    assert not route_dropouts(rewritten(Dropouts(), torch.randn(4, 8), torch.float16)[0],
                              amp_dropout, torch.bfloat16).modified, "fp16 is not bf16"
