"""ampgraph/capture/guards.py: the state a graph read, checked per call; what changed, said
where; like tensors taken without a new capture; recaptures bounded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampgraph.capture.guards import StateGuards
from ampgraph.capture.watch import watching


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.0)
        self.temperature = 1.0
        self.options = {"scale": 2.0}
        self.config = type("Config", (), {})()
        self.config.flag = False

    def forward(self, x):
        out = self.drop(self.fc(x)) * self.options["scale"] / self.temperature
        return -out if self.config.flag else out


def guarded(model: nn.Module | None = None) -> tuple[nn.Module, StateGuards]:
    model = model or Model()
    with watching(model) as watch:
        model(torch.randn(2, 4))
    return model, StateGuards(model, watch)


def test_the_captured_state_passes_and_each_change_is_named():
    model, guards = guarded()
    assert guards.check() and guards.changes() == [] and len(guards) > 10
    model.temperature = 4.0
    assert not guards.check()
    assert [str(c) for c in guards.changes()] == ["model.temperature: 1.0 -> 4.0"]
    model.temperature = 1.0
    assert guards.check()


@pytest.mark.parametrize("change, where", [
    (lambda m: m.options.__setitem__("scale", 3.0), "model.options"),
    (lambda m: setattr(m.config, "flag", True), "model.config.flag"),
    (lambda m: setattr(m, "fc", nn.Linear(4, 4)), "model.fc"),
    (lambda m: m.fc.register_forward_hook(lambda *a: None), "model.fc forward hooks"),
    (lambda m: m.drop.train(False), "model.drop.training"),
    (lambda m: m.fc.double(), "model.fc.weight"),
])
def test_state_forward_depends_on(change, where):
    model, guards = guarded()
    change(model)
    assert not guards.check()
    assert any(c.where.startswith(where) for c in guards.changes()), guards.changes()


def test_state_forward_does_not_read_is_not_guarded():
    """What forward never read cannot make its graph stale: no capture again for it."""
    model, guards = guarded()
    model.fc.train(False)  # Linear's forward reads no training flag
    model.unused = 3
    model.config.unread = "x"  # a config is compared whole: see the next assert
    assert not guards.check() and [c.where for c in guards.changes()] == [
        "model.config.unread"]
    del model.config.unread
    assert guards.check()


def test_a_global_flag_is_guarded():
    _, guards = guarded()
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert not guards.check()
        assert "torch.get_default_dtype()" in str(guards.changes()[0])
    finally:
        torch.set_default_dtype(dtype)
    assert guards.check()


def test_like_tensors_are_taken_other_ones_are_not():
    model, guards = guarded()
    model.fc.weight = nn.Parameter(torch.zeros(4, 4))
    (change,) = guards.changes()
    assert change.rebindable and change.where == "model.fc.weight"
    assert guards.take(lambda: True) and guards.check(), "taken: the new weight is captured"
    assert not guards.take(lambda: False) or guards.check()
    model.fc.weight = nn.Parameter(torch.zeros(4, 5))
    assert not guards.check() and not guards.changes()[0].rebindable
    assert not guards.take(lambda: True)


def test_an_equal_value_assigned_again_is_taken():
    model, guards = guarded()
    model.temperature = float("1.0")  # a new float object, equal
    model.__dict__["temperature"] = 1.0 + 0.0
    assert guards.changes() == [] and guards.take(lambda: True) and guards.check()
