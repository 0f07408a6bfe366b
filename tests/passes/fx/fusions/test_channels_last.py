"""passes/fx/fusions/channels_last.py: convolution inputs cast straight to channels-last,
same values."""

from __future__ import annotations

import copy

import torch
from torch import nn

from passes.fx.dtypes import is_amp_cast
from tests.passes.fx.fusions.helpers import ConvBlock, passes


def _input_cast(gm):
    return next(n for n in gm.graph.nodes if is_amp_cast(n) and n.args[0].op == "placeholder")


def test_conv_input_cast_writes_channels_last_with_the_same_values():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.fc = ConvBlock(), nn.Linear(8, 3)

        def forward(self, x):
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.block(x), 1), 1))

    model = Net().eval()
    x = torch.randn(2, 4, 8, 8)
    fused, plain = passes(copy.deepcopy(model), (x,), True), passes(model, (x,), False)
    assert _input_cast(fused).kwargs.get("memory_format") == torch.channels_last
    assert "memory_format" not in _input_cast(plain).kwargs
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-2, atol=1e-2)


def test_no_channels_last_when_a_4d_tensor_is_returned_or_viewed():
    x = torch.randn(2, 4, 8, 8)
    gm = passes(ConvBlock().eval(), (x,), True)  # returns a 4-D tensor
    assert "memory_format" not in _input_cast(gm).kwargs

    class Viewed(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return self.conv(x).view(x.shape[0], -1)

    gm = passes(Viewed(), (x,), True)
    assert "memory_format" not in _input_cast(gm).kwargs
    assert gm(x).shape == (2, 256)
