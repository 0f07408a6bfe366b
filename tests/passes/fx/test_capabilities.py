"""passes/fx/capabilities.py: the device probe, and the fusion that consults it."""

from __future__ import annotations

import copy

import pytest
import torch

import passes.fx.fusions.norm_casts as norm_casts
from passes.fx import verify
from passes.fx.capabilities import mixed_io_supported
from passes.fx.dtypes import dtype_of
from tests.passes.fx.fusions.helpers import LnBlock, norm_nodes, passes

aten = torch.ops.aten


def test_probe_refuses_devices_it_cannot_run_on():
    assert mixed_io_supported(aten.batch_norm.default, torch.device("cpu"), torch.bfloat16)
    assert mixed_io_supported(aten.layer_norm.default, torch.device("cpu"), torch.float16)
    assert not mixed_io_supported(aten.batch_norm.default, torch.device("meta"),
                                   torch.bfloat16)
    assert not mixed_io_supported(aten.batch_norm.default, None, torch.bfloat16)


@pytest.mark.parametrize("supported", [True, False])
def test_norms_are_fused_only_where_the_probe_allows(monkeypatch, supported):
    monkeypatch.setattr(norm_casts, "mixed_io_supported", lambda target, device, low: supported)
    torch.manual_seed(0)
    model = LnBlock().eval()
    x = torch.randn(3, 16)
    gm, plain = passes(copy.deepcopy(model), (x,), True), passes(model, (x,), False)
    (ln,) = norm_nodes(gm)
    assert ("amp_io" in ln.meta) == supported
    assert (dtype_of(ln.args[0]) == torch.bfloat16) == supported
    gm.graph.lint()
    verify(gm, torch.bfloat16)
    torch.testing.assert_close(gm(x), plain(x), rtol=1e-2, atol=1e-2)


def test_the_probe_runs_once_per_op_device_and_dtype_and_matches_the_kernel():
    args = (aten.group_norm.default, torch.device("cpu"), torch.bfloat16)
    first = mixed_io_supported(*args)
    hits = mixed_io_supported.cache_info().hits
    assert mixed_io_supported(*args) == first
    assert mixed_io_supported.cache_info().hits == hits + 1
    x = torch.randn(2, 4, 3, dtype=torch.bfloat16)
    try:
        y = aten.group_norm(x, 2, torch.ones(4), torch.zeros(4), 1e-5)
        runs = y.dtype == torch.bfloat16
    except RuntimeError:
        runs = False
    assert not first or runs, "the probe said yes: the kernel takes the mix"
