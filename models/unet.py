"""Small U-Net for semantic segmentation.

Literature: O. Ronneberger, P. Fischer and T. Brox, "U-Net: Convolutional Networks for
Biomedical Image Segmentation", MICCAI 2015. Batch normalization (S. Ioffe and C. Szegedy,
ICML 2015) after each convolution follows common modern practice.

Default shapes (``base=8``, two down levels)::

    x (N, 3, 32, 32)
    enc1  DoubleConv(3->8)                          -> (N, 8, 32, 32)   skip 1
    down  MaxPool2d(2) + DoubleConv(8->16)          -> (N, 16, 16, 16)  skip 2
    mid   MaxPool2d(2) + DoubleConv(16->32)         -> (N, 32, 8, 8)    bottleneck
    up2   ConvTranspose2d(32->16, 2, stride 2), cat skip 2, DoubleConv(32->16) -> (N, 16, 16, 16)
    up1   ConvTranspose2d(16->8, 2, stride 2),  cat skip 1, DoubleConv(16->8)  -> (N, 8, 32, 32)
    head  Conv2d 1x1 (8->num_classes)               -> (N, 2, 32, 32) per-pixel logits

DoubleConv is (Conv2d 3x3 -> BatchNorm2d -> ReLU) x 2. Unlike the paper's unpadded convolutions
(which need cropping of the skip tensors), 3x3 convolutions use padding 1 so the output has the
input's spatial size; the input size must be divisible by ``2**levels`` (4 by default).

Mixed-precision features exercised: Conv2d + BatchNorm2d, MaxPool2d, ConvTranspose2d, and
``torch.cat`` of skip connections coming from different branches (dtype agreement of concat
inputs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NUM_CLASSES: int = 2
IN_CHANNELS: int = 3
IN_SIZE: int = 32

DEFAULT_CONFIG: dict[str, Any] = {
    "in_channels": IN_CHANNELS,
    "in_size": IN_SIZE,
    "num_classes": NUM_CLASSES,
    "base": 8,
    "levels": 2,
}


def _config(overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(overrides) - set(DEFAULT_CONFIG))
    if unknown:
        raise TypeError(
            f"unknown option(s) {unknown}; expected a subset of {sorted(DEFAULT_CONFIG)}"
        )
    return {**DEFAULT_CONFIG, **overrides}


class DoubleConv(nn.Module):
    """(Conv2d 3x3 -> BatchNorm2d -> ReLU) x 2."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(),
            nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Up(nn.Module):
    """Transposed-conv upsampling, concatenation with the skip tensor, DoubleConv."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_channels, out_channels, kernel_size=2, stride=2)
        self.conv = DoubleConv(2 * out_channels, out_channels)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([skip, self.up(x)], dim=1))


class UNet(nn.Module):
    """U-Net with ``levels`` down/up levels and a bottleneck."""

    def __init__(
        self,
        in_channels: int = IN_CHANNELS,
        in_size: int = IN_SIZE,
        num_classes: int = NUM_CLASSES,
        base: int = 8,
        levels: int = 2,
    ) -> None:
        super().__init__()
        if levels < 1:
            raise ValueError(f"levels must be >= 1, got {levels}")
        if in_size % (2**levels) != 0:
            raise ValueError(f"in_size {in_size} must be divisible by 2**levels = {2**levels}")
        widths = [base * 2**i for i in range(levels + 1)]
        self.inc = DoubleConv(in_channels, widths[0])
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
        self.downs = nn.ModuleList(DoubleConv(widths[i], widths[i + 1]) for i in range(levels))
        self.ups = nn.ModuleList(Up(widths[i + 1], widths[i]) for i in reversed(range(levels)))
        self.head = nn.Conv2d(widths[0], num_classes, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images ``(N, C, H, W)`` to per-pixel logits ``(N, num_classes, H, W)``."""
        x = self.inc(x)
        skips: list[torch.Tensor] = []
        for down in self.downs:
            skips.append(x)
            x = down(self.pool(x))
        for up, skip in zip(self.ups, reversed(skips), strict=True):
            x = up(x, skip)
        return self.head(x)


def make_model(**overrides: Any) -> nn.Module:
    """Build an fp32 U-Net; keyword overrides are the keys of ``DEFAULT_CONFIG``."""
    return UNet(**_config(overrides))


def example_inputs(batch_size: int = 2, *, seed: int = 0, **overrides: Any) -> tuple[torch.Tensor]:
    """Return ``(images,)`` of shape ``(batch_size, in_channels, in_size, in_size)``.

    Accepts the same overrides as :func:`make_model` (irrelevant ones are ignored) and draws from
    a private generator seeded with ``seed``.
    """
    cfg = _config(overrides)
    gen = torch.Generator().manual_seed(seed)
    shape = (batch_size, cfg["in_channels"], cfg["in_size"], cfg["in_size"])
    return (torch.randn(shape, generator=gen, dtype=torch.float32),)
