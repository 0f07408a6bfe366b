"""LeNet-5 convolutional network for digit classification.

Literature: Y. LeCun, L. Bottou, Y. Bengio and P. Haffner, "Gradient-based learning applied to
document recognition", Proceedings of the IEEE 86(11), 1998.

Layout (for the default 1x32x32 input, as in the paper)::

    C1 conv5x5 (1->6)  -> act -> S2 avgpool2
    C3 conv5x5 (6->16) -> act -> S4 avgpool2
    adaptive avgpool to 5x5 (identity at 32x32) -> flatten (400)
    C5 linear 400->120 -> act -> F6 linear 120->84 -> act -> output linear 84->10

Modern deviations: ReLU by default (``activation="tanh"`` restores the paper's squashing), plain
average pooling instead of trainable subsampling, and a full C3 connection table. The adaptive
average pool before the classifier keeps the flatten size fixed at 16*5*5, so other input sizes
work too; with ``in_size < 16`` the convolutions use padding 2 so that, e.g., the 8x8 scikit-learn
digits images can be fed directly (``make_model(in_size=8)`` with ``example_inputs(in_size=8)``).

Mixed-precision features exercised: Conv2d, pooling, adaptive pooling, Linear, cross-entropy
style logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NUM_CLASSES: int = 10
IN_CHANNELS: int = 1
IN_SIZE: int = 32

DEFAULT_CONFIG: dict[str, Any] = {
    "in_channels": IN_CHANNELS,
    "in_size": IN_SIZE,
    "num_classes": NUM_CLASSES,
    "c1": 6,
    "c3": 16,
    "f5": 120,
    "f6": 84,
    "activation": "relu",
}


def _config(overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(overrides) - set(DEFAULT_CONFIG))
    if unknown:
        raise TypeError(
            f"unknown option(s) {unknown}; expected a subset of {sorted(DEFAULT_CONFIG)}"
        )
    return {**DEFAULT_CONFIG, **overrides}


def _activation(name: str) -> nn.Module:
    if name == "relu":
        return nn.ReLU()
    if name == "tanh":
        return nn.Tanh()
    raise ValueError(f"activation must be 'relu' or 'tanh', got {name!r}")


class LeNet5(nn.Module):
    """LeNet-5 with a size-agnostic classifier input (adaptive average pool to 5x5)."""

    def __init__(
        self,
        in_channels: int = IN_CHANNELS,
        in_size: int = IN_SIZE,
        num_classes: int = NUM_CLASSES,
        c1: int = 6,
        c3: int = 16,
        f5: int = 120,
        f6: int = 84,
        activation: str = "relu",
    ) -> None:
        super().__init__()
        if in_size < 4:
            raise ValueError(f"in_size must be >= 4, got {in_size}")
        padding = 0 if in_size >= 16 else 2
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, kernel_size=5, padding=padding),
            _activation(activation),
            nn.AvgPool2d(kernel_size=2, stride=2),
            nn.Conv2d(c1, c3, kernel_size=5, padding=padding),
            _activation(activation),
            nn.AvgPool2d(kernel_size=2, stride=2),
            nn.AdaptiveAvgPool2d((5, 5)),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c3 * 5 * 5, f5),
            _activation(activation),
            nn.Linear(f5, f6),
            _activation(activation),
            nn.Linear(f6, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map images ``(N, C, H, W)`` to class logits ``(N, num_classes)``."""
        return self.classifier(self.features(x))


def make_model(**overrides: Any) -> nn.Module:
    """Build an fp32 LeNet-5; keyword overrides are the keys of ``DEFAULT_CONFIG``."""
    return LeNet5(**_config(overrides))


def example_inputs(batch_size: int = 2, *, seed: int = 0, **overrides: Any) -> tuple[torch.Tensor]:
    """Return ``(images,)`` with images of shape ``(batch_size, in_channels, in_size, in_size)``.

    Accepts the same overrides as :func:`make_model` (irrelevant ones are ignored) and draws from
    a private generator seeded with ``seed``, so the result does not depend on global RNG state.
    """
    cfg = _config(overrides)
    gen = torch.Generator().manual_seed(seed)
    shape = (batch_size, cfg["in_channels"], cfg["in_size"], cfg["in_size"])
    return (torch.randn(shape, generator=gen, dtype=torch.float32),)
