"""ampgraph/capture/side_effects.py: what a trace changed in the model's Python state is
found, put back, and attributed to the module that owns it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from ampgraph.capture.side_effects import (
    SideEffect,
    StateSnapshot,
    traced_tensor_hooks,
    undone,
    write_effects,
)
from ampgraph.capture.watch import watching

SEEN: list = []


class Keeper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.log: list = []
        self.size = (2, 2)

    def forward(self, x):
        SEEN.append(1)
        return self.fc(x)


def test_container_contents_and_globals_are_compared_and_put_back():
    model = Keeper()
    snap = StateSnapshot(model)
    model.log.append(FakeTensorMode().from_tensor(torch.ones(1)))
    SEEN.append(2)
    model.extra = 1
    effects = {e.where: e for e in snap.effects()}
    assert effects["model.log"].leak and effects["model.log"].owners == (model,)
    assert not effects["model.extra"].leak
    assert any(w.startswith("the global SEEN") for w in effects)
    log = model.log
    snap.restore()
    assert model.log is log and log == [] and "extra" not in model.__dict__
    assert SEEN == [], "the global's contents are back too"


def test_exports_copies_are_not_changes_and_are_undone():
    model = Keeper()
    snap = StateSnapshot(model)
    model.__dict__["size"] = tuple(model.size)  # torch.export's tree_map copies
    model.__dict__["log"] = list(model.log)
    assert snap.effects() == []
    log_copy = model.log
    snap.keep_containers()
    assert model.log is not log_copy


def test_writes_are_effects_of_their_module_unless_the_same_value():
    model = Keeper()
    with watching(model) as watch:
        model.fc.flag = True
        model.size = (2, 2)
    effects = write_effects(watch.writes, {id(model.fc): "model.fc", id(model): "model"})
    assert [e.where for e in effects] == ["model.fc.flag"]


def test_a_fake_run_is_undone_and_a_traced_tensor_hook_names_its_module():
    model = Keeper()
    with undone(model):
        model.log.append(1)
    assert model.log == []
    with watching(model, lambda m, call, a, k: call(m, *a, **k)) as watch, \
            traced_tensor_hooks(), FakeTensorMode() as mode:
        watch.stack.append(model.fc)
        x = mode.from_tensor(torch.ones(2, requires_grad=True))
        with pytest.raises(SideEffect, match="registers a hook on a tensor") as raised:
            x.register_hook(lambda g: g)
    assert raised.value.owner is model.fc
