"""Fault injection over a long training run: NaN/inf in inputs, losses and one layer's gradients.

A tiny MLP (8 -> 16 -> 4) learns a fixed linear map at fp16 O2 with
``DynamicLossScaleManager(init_loss_scale=2**16, scale_window=50)`` for 1,000 steps. A seeded
RNG arms ~5% of the steps, each with one fault: a NaN/inf in the input batch, a NaN/inf
added to the loss, or a NaN/inf gradient returned by a hook on the first layer's weight.

Checked at every step: parameters finite, the step skipped exactly when armed (natural
overflows would be counted apart; there are none at this size), the loss scale finite and
>= 1. At the end: skipped steps == injected faults, and the loss fell by 100x.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampgraph import DynamicLossScaleManager, FixedLossScaleManager, build_train_step

pytestmark = [
    pytest.mark.filterwarnings("ignore:fp16 on a CPU:RuntimeWarning"),
    pytest.mark.usefixtures("one_thread"),
]
STEPS = 1000
FAULT_RATE = 0.05
KINDS = ("input", "loss", "grad")
VALUES = (float("nan"), float("inf"), -float("inf"))




def task(seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """(model, data, targets): a fixed linear map from 8 to 4 features, 64 samples."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 4) * 0.5
    return model, x, y


class Faults:
    """Which steps are armed with which fault; the hooks and wrappers that fire them."""

    def __init__(self, seed: int, steps: int, kinds: tuple[str, ...]) -> None:
        rng = random.Random(seed)
        self.plan = {i: (rng.choice(kinds), rng.choice(VALUES))
                     for i in range(steps) if rng.random() < FAULT_RATE}
        self.step = -1

    def armed(self, kind: str) -> float | None:
        fault = self.plan.get(self.step)
        return fault[1] if fault is not None and fault[0] == kind else None

    def loss_fn(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(out, target)
        value = self.armed("loss")
        return loss if value is None else loss + value  # the gradients stay finite

    def grad_hook(self, grad: torch.Tensor) -> torch.Tensor:
        value = self.armed("grad")
        return grad if value is None else torch.full_like(grad, value)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        value = self.armed("input")
        if value is None:
            return x
        x = x.clone()
        x[random.Random(self.step).randrange(x.shape[0]), 0] = value
        return x


def train(dtype: str, manager, kinds=KINDS, seed: int = 0, steps: int = STEPS) -> dict:
    """Run the faulted training loop; return what happened. Asserts per-step invariants."""
    model, data, targets = task(seed)
    faults = Faults(seed, steps, kinds)
    handle = model[0].weight.register_hook(faults.grad_hook)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step = build_train_step(model, faults.loss_fn, opt, "O2", dtype, loss_scale_manager=manager)
    batches = torch.Generator().manual_seed(seed)
    skipped, natural, scales, losses, flags = 0, 0, [], [], []
    try:
        for i in range(steps):
            faults.step = i
            idx = torch.randint(0, data.shape[0], (8,), generator=batches)
            out = step(faults.inputs(data[idx]), targets[idx])
            injected = i in faults.plan
            scale = out.loss_scale
            scales.append(scale)
            flags.append(bool(out.overflow))
            assert 1.0 <= scale < float("inf"), f"step {i}: loss scale {scale}"
            if out.overflow:
                skipped += 1
                natural += not injected
            else:
                assert not injected, f"step {i}: injected {faults.plan[i]} was not detected"
                losses.append(float(out.loss))
            for name, p in model.named_parameters():
                assert torch.isfinite(p).all(), f"step {i}: {name} is not finite"
    finally:
        handle.remove()
    return {"injected": len(faults.plan), "skipped": skipped, "natural": natural,
            "scales": scales, "losses": losses, "overflows": flags}


def expected_scales(init: float, window: int, overflows: list[bool]) -> list[float]:
    """The scale each step should use: halve on overflow (floor 1), double after ``window``
    clean steps in a row (MindSpore / torch.amp semantics)."""
    scale, clean, out = init, 0, []
    for overflow in overflows:
        out.append(scale)
        if overflow:
            scale, clean = max(scale / 2, 1.0), 0
        else:
            clean += 1
            if clean == window:
                scale, clean = scale * 2, 0
    return out


@pytest.mark.slow
def test_faults_over_1000_fp16_steps():
    run = train("fp16", DynamicLossScaleManager(init_loss_scale=2.0**16, scale_window=50))
    assert run["injected"] >= 30  # ~5% of 1,000 steps, every kind present (seeded)
    assert run["natural"] == 0, "natural overflows on a tiny model at scale 2**16"
    assert run["skipped"] == run["injected"]
    assert run["scales"] == expected_scales(2.0**16, 50, run["overflows"])
    assert min(run["scales"]) == 1.0  # the floor was reached and held, never 0
    first, last = run["losses"][:20], run["losses"][-50:]
    assert sum(last) / len(last) < 0.01 * sum(first) / len(first), "training did not converge"


@pytest.mark.parametrize("kind", KINDS)
def test_each_fault_kind_is_skipped_with_bf16_and_a_fixed_scale(kind):
    """bf16 with an explicit manager: the same guarantees, one fault kind at a time."""
    run = train("bf16", FixedLossScaleManager(128.0), kinds=(kind,), seed=1, steps=300)
    assert run["injected"] > 5
    assert run["skipped"] == run["injected"] and run["natural"] == 0
    assert set(run["scales"]) == {128.0}
    first, last = run["losses"][:20], run["losses"][-30:]
    assert sum(last) / len(last) < 0.1 * sum(first) / len(first)


def test_scale_floor_holds_under_a_fault_storm():
    """Every step faulted: the scale halves down to 1.0 and stays there, never 0."""
    model, data, targets = task()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = DynamicLossScaleManager(init_loss_scale=2.0**16, scale_window=50)
    step = build_train_step(model, lambda o, t: F.mse_loss(o, t) * float("nan"), opt, "O2",
                            "fp16", loss_scale_manager=manager)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(40):
        assert step(data[:8], targets[:8]).overflow
    assert manager.get_loss_scale() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
