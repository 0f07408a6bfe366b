"""Small CIFAR-style residual network.

Literature: K. He, X. Zhang, S. Ren and J. Sun, "Deep Residual Learning for Image Recognition",
CVPR 2016 (the CIFAR-10 variant of Section 4.2: a 3x3 stem, stages of BasicBlocks whose width
doubles and resolution halves at each stage, global average pooling and a linear classifier).
Batch normalization: S. Ioffe and C. Szegedy, ICML 2015.

Default shapes (``width=16``, ``num_stages=3``, ``depth=1`` block per stage)::

    x (N, 3, 32, 32)
    stem   conv3x3(3->16) + BN + ReLU          -> (N, 16, 32, 32)
    stage1 BasicBlock(16->16)                  -> (N, 16, 32, 32)
    stage2 BasicBlock(16->32, stride 2, 1x1)   -> (N, 32, 16, 16)
    stage3 BasicBlock(32->64, stride 2, 1x1)   -> (N, 64, 8, 8)
    global average pool + Linear(64->10)       -> (N, 10)

The first block of every stage after the first downsamples with stride 2 and uses a projection
shortcut (1x1 conv + BN, "option B" of the paper). ``depth`` is the number of blocks per stage
(the paper's ``n``; total layers ``6n+2`` for three stages).

Mixed-precision features exercised: Conv2d + BatchNorm2d (train-mode batch statistics and eval
running statistics), residual additions, global average pooling.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NUM_CLASSES: int = 10
IN_CHANNELS: int = 3
IN_SIZE: int = 32

DEFAULT_CONFIG: dict[str, Any] = {
    "in_channels": IN_CHANNELS,
    "in_size": IN_SIZE,
    "num_classes": NUM_CLASSES,
    "width": 16,
    "depth": 1,
    "num_stages": 3,
}


def _config(overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(overrides) - set(DEFAULT_CONFIG))
    if unknown:
        raise TypeError(
            f"unknown option(s) {unknown}; expected a subset of {sorted(DEFAULT_CONFIG)}"
        )
    return {**DEFAULT_CONFIG, **overrides}


class BasicBlock(nn.Module):
    """Two 3x3 conv + BN layers with an identity or 1x1-projection shortcut."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(
            in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False
        )
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR-style ResNet built from BasicBlocks."""

    def __init__(
        self,
        in_channels: int = IN_CHANNELS,
        in_size: int = IN_SIZE,
        num_classes: int = NUM_CLASSES,
        width: int = 16,
        depth: int = 1,
        num_stages: int = 3,
    ) -> None:
        super().__init__()
        if depth < 1 or num_stages < 1:
            raise ValueError(f"depth and num_stages must be >= 1, got {depth}, {num_stages}")
        del in_size  # any spatial size works thanks to global average pooling
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        stages: list[nn.Module] = []
        channels = width
        for stage in range(num_stages):
            out_channels = width * 2**stage
            blocks: list[nn.Module] = []
            for i in range(depth):
                stride = 2 if (stage > 0 and i == 0) else 1
                blocks.append(BasicBlock(channels, out_channels, stride))
                channels = out_channels
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images ``(N, C, H, W)`` to class logits ``(N, num_classes)``."""
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def make_model(**overrides: Any) -> nn.Module:
    """Build an fp32 ResNet; keyword overrides are the keys of ``DEFAULT_CONFIG``."""
    return ResNet(**_config(overrides))


def example_inputs(batch_size: int = 2, *, seed: int = 0, **overrides: Any) -> tuple[torch.Tensor]:
    """Return ``(images,)`` of shape ``(batch_size, in_channels, in_size, in_size)``.

    Accepts the same overrides as :func:`make_model` (irrelevant ones are ignored) and draws from
    a private generator seeded with ``seed``.
    """
    cfg = _config(overrides)
    gen = torch.Generator().manual_seed(seed)
    shape = (batch_size, cfg["in_channels"], cfg["in_size"], cfg["in_size"])
    return (torch.randn(shape, generator=gen, dtype=torch.float32),)
