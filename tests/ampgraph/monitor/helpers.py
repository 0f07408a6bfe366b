"""What the monitor's tests share: a two-branch model trained by ``build_train_step``, a
hand-written loop that sets gradients without a backward, and the JSON-lines log."""

from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F
from torch import nn

import ampgraph
from ampgraph.monitor import NumericsMonitor
from ampgraph.train.loss_scale import FixedLossScaleManager


class TwoBranch(nn.Module):
    """``big`` gets ordinary gradients; ``small``'s are 1e-6 times smaller (fp16 subnormals)."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(16, 4)
        self.small = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(x) + self.small(x) * 1e-6


def data(i: int, gain: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 16, generator=g) * gain, torch.randn(16, 4, generator=g)


def run(dtype: str, steps: int = 3, overflow_at: int | None = None, **mon_kwargs):
    torch.manual_seed(0)
    model = TwoBranch()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = NumericsMonitor(**{"every": 1, **mon_kwargs})
    manager = FixedLossScaleManager(128.0) if dtype == "fp16" else None
    step = ampgraph.build_train_step(model, F.mse_loss, opt, "O2", dtype,
                                     loss_scale_manager=manager, monitor=mon)
    outs = [step(*data(i, 1e4 if i == overflow_at else 1.0)) for i in range(steps)]
    return mon, outs


def records(log_dir) -> list[dict]:
    with open(log_dir / "numerics.jsonl") as f:
        return [json.loads(line) for line in f]


def fake_loop(mon: NumericsMonitor, model: nn.Module, scales, overflows, grad=1e-2,
              first=1e-7, bad_layer: str | None = None) -> None:
    """A hand-written loop without a real backward: set the (unscaled) gradients, then step.

    Layer "0" gets gradients of magnitude ``first``, the others ``grad``.
    """
    for i, (scale, overflow) in enumerate(zip(scales, overflows)):
        g = torch.Generator().manual_seed(i)
        for name, p in model.named_parameters():
            magnitude = first if name.startswith("0.") else grad
            p.grad = torch.randn(p.shape, generator=g) * magnitude
            if bad_layer and name.startswith(bad_layer):
                p.grad.view(-1)[0] = math.inf
        mon.step(loss_scale=scale, overflow=overflow)


def seq() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def grads(underflow_rate: float = 0.0, overflow_count: int = 0, norm: float = 1.0,
          numel: int = 1000, max_abs: float = 0.1) -> dict:
    """One layer's merged gradient statistics, as a numerics.jsonl record holds them."""
    return {"numel": numel, "norm": norm, "min_abs": 1e-8, "max_abs": max_abs, "mean": 0.0,
            "std": 0.01, "zero_frac": 0.0, "underflow_rate": underflow_rate,
            "overflow_count": overflow_count}


def step_record(step: int, scale: float, layers: dict[str, dict], overflow: bool = False,
                skipped: int = 0) -> dict:
    """A logged step's record: its scale history (this step only) and per-layer grads."""
    return {"kind": "step", "step": step, "loss_scale": scale, "overflow": overflow,
            "skipped_steps": skipped,
            "history": {"step": [step], "loss_scale": [scale], "overflow": [overflow]},
            "layers": {name: {"grads": stats} for name, stats in layers.items()}}
