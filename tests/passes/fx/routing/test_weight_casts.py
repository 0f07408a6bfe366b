"""passes/fx/routing.py: ops handed to runtime callables; same values, lint and verify hold."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from passes.fx import run_amp_passes, verify
from passes.fx.dtypes import CAST, is_amp_cast
from passes.fx.fold import count_casts
from passes.fx.runtime_ops import RuntimeOps
from passes.policy import make_policy

aten = torch.ops.aten


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
