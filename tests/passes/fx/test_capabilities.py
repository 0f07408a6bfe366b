"""passes/fx/capabilities.py: the device probe (the fusion that consults it:
fusions/test_norm_casts.py)."""

from __future__ import annotations

import torch

from passes.fx.capabilities import mixed_io_supported

aten = torch.ops.aten


def test_probe_refuses_devices_it_cannot_run_on():
    assert mixed_io_supported(aten.batch_norm.default, torch.device("cpu"), torch.bfloat16)
    assert mixed_io_supported(aten.layer_norm.default, torch.device("cpu"), torch.float16)
    assert not mixed_io_supported(aten.batch_norm.default, torch.device("meta"),
                                  torch.bfloat16)
    assert not mixed_io_supported(aten.batch_norm.default, None, torch.bfloat16)


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
