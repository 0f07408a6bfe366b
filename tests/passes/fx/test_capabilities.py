"""passes/fx/capabilities.py: the device probe, and the fusion that consults it."""

from __future__ import annotations

import torch

from passes.fx.capabilities import _mixed_io_supported

aten = torch.ops.aten


def test_probe_refuses_devices_it_cannot_run_on():
    assert _mixed_io_supported(aten.batch_norm.default, torch.device("cpu"), torch.bfloat16)
    assert _mixed_io_supported(aten.layer_norm.default, torch.device("cpu"), torch.float16)
    assert not _mixed_io_supported(aten.batch_norm.default, torch.device("meta"),
                                   torch.bfloat16)
    assert not _mixed_io_supported(aten.batch_norm.default, None, torch.bfloat16)
