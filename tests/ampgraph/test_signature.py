"""ampgraph/signature.py: the compiled module's forward has the model's signature."""

from __future__ import annotations

import inspect

import torch
from torch import nn

import ampgraph
from ampgraph.signature import SignedForward, class_forward, signed_forward
from tests.helpers import Keyworded


def test_forward_keeps_the_models_signature():
    import inspect

    model = Keyworded()
    net = ampgraph.compile(model, "O2", "bf16")
    assert inspect.signature(net.forward) == inspect.signature(model.forward)
    assert list(inspect.signature(net.forward).parameters) == ["input_ids", "mask", "scale"]
    assert net.forward.__func__ is net.forward.__func__  # one function per instance
    x = torch.randn(2, 8)
    torch.testing.assert_close(net(input_ids=x, scale=2.0), net.forward(x, scale=2.0))
    other = ampgraph.compile(nn.Linear(8, 2), "O2", "bf16")
    assert list(inspect.signature(other.forward).parameters) == ["input"]


# -- signed_forward and SignedForward, directly -----------------------------------------------


class Documented(nn.Module):
    def forward(self, input_ids, mask=None):
        """Documented forward."""
        return input_ids


def test_signed_forward_has_self_and_the_models_parameters_and_calls_run():
    calls = []
    fn = signed_forward(Documented(), lambda self, *a, **k: calls.append((self, a, k)) or "out")
    assert list(inspect.signature(fn).parameters) == ["self", "input_ids", "mask"]
    assert fn.__doc__ == "Documented forward."
    assert fn("me", 1, mask=2) == "out" and calls == [("me", (1,), {"mask": 2})]


def test_class_forward_has_the_model_classes_signature_and_calls_run():
    calls = []
    fn = class_forward(Documented, lambda self, *a, **k: calls.append((self, a, k)) or "out")
    assert inspect.signature(fn) == inspect.signature(Documented.forward)
    assert list(inspect.signature(fn).parameters) == ["self", "input_ids", "mask"]
    assert fn.__doc__ == "Documented forward."
    assert fn("me", 1, mask=2) == "out" and calls == [("me", (1,), {"mask": 2})]


def test_signed_forward_is_none_for_a_forward_without_a_signature():
    class Unsigned(nn.Module):
        def forward(self, x):
            return x

    Unsigned.forward.__signature__ = "not a signature"  # inspect.signature raises TypeError
    try:
        assert signed_forward(Unsigned(), lambda self, *a: None) is None
        assert class_forward(Unsigned, lambda self, *a: None) is None
    finally:
        del Unsigned.forward.__signature__


class Host:
    def plain(self, x):
        """The plain forward."""
        return ("plain", x)

    forward = SignedForward(plain)


def test_signed_forward_descriptor_binds_the_instances_own_function():
    assert Host.forward is Host.plain and Host.__dict__["forward"].__doc__ == "The plain forward."
    host = Host()
    assert host.forward(1) == ("plain", 1)
    host._amp_forward = lambda self, x: ("own", self, x)
    assert host.forward(2) == ("own", host, 2)
    host.forward = lambda x: ("assigned", x)  # a wrapper set on the instance shadows it
    assert host.forward(3) == ("assigned", 3)
