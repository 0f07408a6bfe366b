"""passes/fx/routing/attention.py: low-precision attention calls the runtime's; nothing is
routed where nothing runs low."""

from __future__ import annotations

import torch

from tests.passes.fx.routing.helpers import (
    ROUTES,
    Net,
    amp_attention,
    amp_linear,
    cached_cast,
    rewritten,
)


def test_nothing_is_routed_where_nothing_runs_low():
    model = Net().eval()
    ids = torch.randint(0, 50, (2, 5))
    gm, result = rewritten(model, ids, torch.bfloat16, level="O0", **ROUTES)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not targets & {amp_linear, amp_attention, cached_cast}
    assert result.casts == 0
    with torch.no_grad():
        torch.testing.assert_close(gm(ids), model(ids))
