"""ampgraph/runtime/cpu/activations.py: the activations a runtime linear applies, aten's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ampgraph.runtime.cpu.activations import ACTIVATIONS, activate
from ampgraph.runtime.cpu.packed import EPILOGUES
from passes.fx.routing.linears import ACTIVATIONS as ROUTED


@pytest.mark.parametrize("name,want", [
    ("relu", torch.relu), ("gelu", F.gelu), ("silu", F.silu),
    ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))])
def test_each_is_aten_s_op(name, want):
    x = torch.randn(5, 7)
    assert torch.equal(activate(x, name), want(x))


def test_none_returns_the_output_itself():
    x = torch.randn(3)
    assert activate(x, None) is x


def test_every_name_the_passes_route_has_an_op_and_an_epilogue():
    assert set(ROUTED.values()) == set(ACTIVATIONS) == set(EPILOGUES) - {None}
