"""passes/fx/routing/weight_casts.py: every parameter cast calls the runtime's cast."""

from __future__ import annotations

import copy

import torch

from passes.fx.dtypes import is_amp_cast
from passes.fx.verify import verify
from tests.passes.fx.routing.helpers import Net, cached_cast, rewritten


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
