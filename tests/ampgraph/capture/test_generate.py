"""ampgraph/capture/generate.py: methods that call ``self(...)`` run on a stand-in of the
model whose forward is the compiled module (test_hf_decoders.py runs HF's own generate)."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

import ampgraph
from ampgraph.capture.generate import (
    ROUTE_KEY,
    ROUTED_METHODS,
    call_routed,
    route_method,
    routed_class,
)


class Looping(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Looping's own forward."""
        return torch.tanh(self.fc(x)) * scale

    def generate(self, x: torch.Tensor, steps: int = 2) -> tuple:
        self.last_steps = steps  # a plain attribute the method sets on its object
        for _ in range(steps):
            x = self(x)
        return self.forward(x, scale=2.0), isinstance(self, Looping), type(self).__name__

    def helper(self) -> str:
        return "not routed"


class Derived(Looping):
    def generate(self, x: torch.Tensor, steps: int = 2) -> tuple:
        return super().generate(x, steps + 1)


def recording_route(model):
    calls = []

    def route(*args, **kwargs):
        calls.append((args, kwargs))
        return model.forward(*args, **kwargs) + 1  # tells the route from the model's forward

    return route, calls


def test_every_self_call_inside_the_method_goes_through_the_route():
    torch.manual_seed(0)
    model = Looping()
    route, calls = recording_route(model)
    x = torch.randn(2, 4)
    out, is_looping, name = call_routed(route, model, "generate", x, steps=3)
    assert len(calls) == 4, "three self(...) and one self.forward(...)"
    assert calls[-1][1] == {"scale": 2.0}
    expected = x
    for _ in range(3):
        expected = model(expected) + 1
    torch.testing.assert_close(out, model(expected, scale=2.0) + 1)
    assert is_looping and name == "Looping", "isinstance and the class name hold"


def test_attributes_the_method_sets_reach_the_model_and_the_route_does_not():
    model = Looping()
    route, _ = recording_route(model)
    call_routed(route, model, "generate", torch.randn(1, 4), steps=1)
    assert model.last_steps == 1
    assert ROUTE_KEY not in model.__dict__


def test_attributes_are_copied_back_when_the_method_raises():
    model = Looping()

    def failing(*args, **kwargs):
        raise RuntimeError("route failed")

    with pytest.raises(RuntimeError, match="route failed"):
        call_routed(failing, model, "generate", torch.randn(1, 4), steps=5)
    assert model.last_steps == 5 and ROUTE_KEY not in model.__dict__


def test_super_calls_in_a_subclass_still_route():
    model = Derived()
    route, calls = recording_route(model)
    _, is_looping, name = call_routed(route, model, "generate", torch.randn(1, 4))
    assert len(calls) == 4 and is_looping and name == "Derived"


def test_the_routed_class_is_made_once_per_class_and_keeps_forward_s_signature():
    routed = routed_class(Looping)
    assert routed_class(Looping) is routed and routed_class(Derived) is not routed
    assert issubclass(routed, Looping)
    assert (routed.__name__, routed.__qualname__, routed.__module__) == (
        Looping.__name__, Looping.__qualname__, Looping.__module__)
    assert inspect.signature(routed.forward) == inspect.signature(Looping.forward)
    assert routed.forward.__doc__ == "Looping's own forward."


def test_route_method_routes_only_the_model_s_own_routed_methods():
    model = Looping()
    route, calls = recording_route(model)
    assert "generate" in ROUTED_METHODS
    assert route_method(route, model, "helper", model.helper) == model.helper
    other = Looping()  # a generate bound to another object is returned as it is
    assert route_method(route, model, "generate", other.generate) == other.generate
    assert route_method(route, model, "fc", model.fc) is model.fc
    routed = route_method(route, model, "generate", model.generate)
    routed(torch.randn(1, 4), steps=1)
    assert len(calls) == 2


def test_a_compiled_module_s_generate_runs_its_graphs():
    torch.manual_seed(0)
    model = Looping().eval()
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16")
    seen = []
    real = net._select  # what forward asks for its graph

    def spy(args, kwargs):
        compiled = real(args, kwargs)
        seen.append(compiled)
        return compiled

    net._select = spy
    x = torch.randn(2, 4)
    with torch.no_grad():
        out, is_looping, _ = net.generate(x, steps=2)
        ref, _, _ = model.generate(x, steps=2)
    assert len(seen) == 3 and all(c is not None for c in seen)
    assert is_looping and model.last_steps == 2
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    assert net.helper() == "not routed"
