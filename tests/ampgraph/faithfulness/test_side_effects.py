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


class BiasCache(nn.Module):
    """timm's LeViT attention in eval mode: a bias gathered from a parameter table, cached
    in a dict (``from_input``: the first call's activations cached instead)."""

    def __init__(self, from_input: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.table = nn.Parameter(torch.randn(6, 16) * 0.5)
        self.register_buffer("idx", torch.tensor([0, 2, 4, 1]), persistent=False)
        self.cache: dict = {}
        self.from_input = from_input

    def forward(self, h):
        h = self.fc(h)
        if self.training:
            return h + self.table[self.idx]
        if "bias" not in self.cache:
            self.cache["bias"] = h.detach() if self.from_input else self.table[self.idx]
        return h + self.cache["bias"]


class CacheHolder(Holder):
    def __init__(self, from_input: bool = False) -> None:
        super().__init__("list")
        self.inner = BiasCache(from_input)


class Scratch(MLP):
    """Funnel's attention structure: forward first sets attributes (the sequence length,
    a multiplier), then reads them."""

    def forward(self, x):
        self.rows = x.shape[0]
        self.mult = 1
        h = self.act(self.a(x))
        self.mult = self.mult * 2
        return self.b(h * self.mult / self.rows)


def rows_of(n: int):
    def scenario(call, model):
        out = []
        for s in range(n):
            out += step(call, model, inputs(n=3 + s, seed=s))
        return out + [model.mult]
    return scenario


def evaluated(n: int, what):
    """``n`` inference calls in eval mode (as LeViT caches), then ``what`` of the model."""
    def scenario(call, model):
        model.eval()
        with torch.no_grad():
            out = [call(inputs(seed=s)) for s in range(n)]
        return out + what(model)
    return scenario


def whole(net) -> None:
    assert net._amp_eager is None and net.amp_parts()[1] == []


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
    # the graph gathers the bias from the table on every call: the value the cache holds
    # (docs/faithfulness.md); the user's dict is left as it was, with no fake tensor in it
    Case("a child caching a tensor computed from its parameters (LeViT's bias cache)",
         CacheHolder, evaluated(3, lambda m: [all(type(t) is torch.Tensor
                                                 for t in m.inner.cache.values())]),
         after=whole),
    # written before read on every call: the graph holds it, the rows as a symbolic size
    Case("forward setting attributes before reading them (funnel's seq_len)", Scratch,
         rows_of(3), after=whole),
    Case("a child caching its first activations in a dict", lambda: CacheHolder(True),
         evaluated(3, lambda m: [len(m.inner.cache), type(m.inner.cache["bias"]).__name__]),
         warns="inner could not be captured whole .*inner.cache"),
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


class SizeKept(MLP):
    """Funnel's attention structure: ``self.seq_len = x.size(0)`` on every call, never read."""

    def forward(self, x):
        self.seq_len = x.size(0)
        return super().forward(x)


def test_a_size_forward_keeps_and_never_reads_leaves_the_model_whole_and_is_put_back():
    """The documented difference (docs/faithfulness.md): no symbolic value stays in the
    model, no module leaves the graph, and the attribute keeps its value from before."""
    import ampgraph

    model = SizeKept()
    model.seq_len = None
    net = ampgraph.compile(model, "O2", "bf16")
    for n in (3, 5):
        out = net(inputs(n=n))
        assert out.shape == (n, 4)
    assert model.seq_len is None and net._amp_eager is None and net.amp_parts()[1] == []
