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


def test_nothing_is_routed_where_nothing_runs_low():
    model = Net().eval()
    ids = torch.randint(0, 50, (2, 5))
    gm, result = rewritten(model, ids, torch.bfloat16, level="O0", **ROUTES)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert not targets & {amp_linear, amp_attention, cached_cast}
    assert result.casts == 0
    with torch.no_grad():
        torch.testing.assert_close(gm(ids), model(ids))
