"""Faithfulness: Python side effects of forward happen on every call as in eager, with real
tensors, and no fake tensor or symbolic value reaches the user's objects
(capture/side_effects.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.ampgraph.faithfulness.harness import MLP, Case, check, inputs, step

LOG: list = []


class Logging(nn.Module):
    """A child keeping its activations, counting its calls, keeping a value as a float."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.kind = kind
        self.log: list = []
        self.calls = 0
        self.last = None

    def forward(self, h):
        h = self.fc(h)
        if self.kind == "list":
            self.log.append(h.detach())
        elif self.kind == "counter":
            self.calls += 1
        elif self.kind == "item":
            self.last = h.float().abs().mean().item()
        elif self.kind == "global":
            LOG.append(h.detach())
        return h


class Holder(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.inner = Logging(kind)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.inner(self.a(x))))


class RootLog(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.log: list = []

    def forward(self, x):
        h = self.act(self.a(x))
        self.log.append(h.detach())
        return self.b(h)


class LazyInit(MLP):
    """A flag set on the first call only (as transformers' lazy hook installation)."""

    def forward(self, x):
        if not getattr(self, "ready", False):
            self.ready = True
        return super().forward(x)


def calls(n: int, what):
    def scenario(call, model):
        LOG.clear()
        out = []
        for s in range(n):
            out += step(call, model, inputs(seed=s))
        return out + what(model)
    return scenario


def inner_log(model):
    log = model.inner.log
    return [len(log), [type(t).__name__ for t in log], *log]


CASES = [
    Case("a child appending its activations to a list", lambda: Holder("list"),
         calls(3, inner_log), warns="inner could not be captured whole .*inner.log"),
    Case("a child counting its calls", lambda: Holder("counter"),
         calls(3, lambda m: [m.inner.calls]), warns="inner.calls"),
    Case("a child keeping .item() in an attribute", lambda: Holder("item"),
         calls(3, lambda m: [type(m.inner.last).__name__, round(m.inner.last, 1)]),
         warns="inner.last"),
    Case("a child appending to a global list", lambda: Holder("global"),
         calls(3, lambda m: [len(LOG), [type(t).__name__ for t in LOG]]),
         warns="the global LOG"),
    Case("the model appending to its own list", RootLog,
         calls(3, lambda m: [len(m.log), [type(t).__name__ for t in m.log]]),
         warns="model.log"),
    Case("a flag set on the first call only", LazyInit,
         calls(3, lambda m: [m.ready]), after=lambda net: None),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_side_effect(case):
    check(case)


def test_a_lazy_flag_is_kept_and_the_model_compiled_whole():
    import ampgraph

    model = LazyInit()
    net = ampgraph.compile(model, "O2", "bf16")
    net(inputs())
    assert model.ready is True and net._amp_eager is None and net.amp_parts()[1] == []


def test_the_users_list_object_stays_the_users():
    """torch.export puts module attributes back as copies: the list the user holds must
    still be the one forward appends to."""
    import ampgraph

    model = Holder("list")
    log = model.inner.log
    net = ampgraph.compile(model, "O2", "bf16")
    with pytest.warns(UserWarning, match="inner.log"):
        for _ in range(2):
            net(inputs())
    assert model.inner.log is log and len(log) == 2
    assert all(type(t) is torch.Tensor for t in log)
