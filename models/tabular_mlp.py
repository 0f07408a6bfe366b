"""Feed-forward multilayer perceptron for tabular data.

Literature: the classic multilayer perceptron trained by back-propagation (D. E. Rumelhart,
G. E. Hinton and R. J. Williams, "Learning representations by back-propagating errors", Nature
323, 1986), in the modern "Linear -> normalization -> activation -> dropout" block form used by
tabular deep-learning baselines (Y. Gorishniy, I. Rubachev, V. Khrulkov and A. Babenko,
"Revisiting Deep Learning Models for Tabular Data", NeurIPS 2021), with batch normalization
(S. Ioffe and C. Szegedy, ICML 2015) or layer normalization (J. L. Ba, J. R. Kiros and
G. E. Hinton, 2016) and GELU (D. Hendrycks and K. Gimpel, 2016).

Defaults fit the 64-feature, 10-class scikit-learn digits data set::

    x (N, 64) -> [Linear(64->128) -> BatchNorm1d -> GELU -> Dropout] x depth(3) -> Linear(128->10)

Sizes are configurable for benchmarking, e.g.
``make_model(in_features=1024, hidden=4096, depth=2, out_features=1024)``.
``norm`` selects ``"batch"`` (default), ``"layer"`` or ``"none"``. Dropout defaults to 0.0 so
that train-mode outputs are comparable between graph transformations; raise it if wanted.

Mixed-precision features exercised: large GEMMs (Linear), BatchNorm1d running statistics in
train vs. eval mode (or LayerNorm reductions), GELU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

NUM_CLASSES: int = 10
IN_FEATURES: int = 64

DEFAULT_CONFIG: dict[str, Any] = {
    "in_features": IN_FEATURES,
    "hidden": 128,
    "depth": 3,
    "out_features": NUM_CLASSES,
    "norm": "batch",
    "dropout": 0.0,
}


def _config(overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(overrides) - set(DEFAULT_CONFIG))
    if unknown:
        raise TypeError(
            f"unknown option(s) {unknown}; expected a subset of {sorted(DEFAULT_CONFIG)}"
        )
    return {**DEFAULT_CONFIG, **overrides}


def _norm(kind: str, features: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm1d(features)
    if kind == "layer":
        return nn.LayerNorm(features)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"norm must be 'batch', 'layer' or 'none', got {kind!r}")


class MLPBlock(nn.Module):
    """Linear -> norm -> GELU -> Dropout."""

    def __init__(self, in_features: int, out_features: int, norm: str, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.norm = _norm(norm, out_features)
        self.act = nn.GELU()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.act(self.norm(self.linear(x))))


class TabularMLP(nn.Module):
    """Stack of ``depth`` MLP blocks followed by a linear output layer."""

    def __init__(
        self,
        in_features: int = IN_FEATURES,
        hidden: int = 128,
        depth: int = 3,
        out_features: int = NUM_CLASSES,
        norm: str = "batch",
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        widths = [in_features] + [hidden] * depth
        self.blocks = nn.Sequential(
            *(MLPBlock(widths[i], widths[i + 1], norm, dropout) for i in range(depth))
        )
        self.head = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map features ``(N, in_features)`` to outputs ``(N, out_features)``."""
        return self.head(self.blocks(x))


def make_model(**overrides: Any) -> nn.Module:
    """Build an fp32 tabular MLP; keyword overrides are the keys of ``DEFAULT_CONFIG``."""
    return TabularMLP(**_config(overrides))


def example_inputs(batch_size: int = 2, *, seed: int = 0, **overrides: Any) -> tuple[torch.Tensor]:
    """Return ``(features,)`` of shape ``(batch_size, in_features)``.

    Accepts the same overrides as :func:`make_model` (irrelevant ones are ignored) and draws from
    a private generator seeded with ``seed``. BatchNorm1d in train mode needs ``batch_size >= 2``.
    """
    cfg = _config(overrides)
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(batch_size, cfg["in_features"], generator=gen, dtype=torch.float32),)
