"""ampgraph/capture/functions.py: applications of a user's autograd.Function, through
``apply`` or an ``apply`` bound earlier, are kept out of the graph while export runs; torch
is as it was afterwards."""

from __future__ import annotations

import torch
from torch import nn

from ampgraph.capture.functions import FunctionCall, kept_out, opaque_functions
from ampgraph.capture.opaque import opaque_nodes, release
from ampgraph.capture.watch import watching


class Sign(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.sign(x)

    @staticmethod
    def backward(ctx, g):
        return g


BOUND = Sign.apply  # bound before any export: torch's C++ apply looks up forward


class Model(nn.Module):
    def __init__(self, bound: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bound = bound

    def forward(self, x):
        h = self.fc(x)
        return BOUND(h) if self.bound else Sign.apply(h)


def exported_nodes(model):
    with watching(model, lambda m, call, a, k: call(m, *a, **k)) as watch, opaque_functions():
        gm = torch.export.export(model, (torch.randn(2, 4),), strict=False).module()
    release(watch.emitted)
    return opaque_nodes(gm)


def test_both_doors_into_a_function_are_kept_out():
    for bound in (False, True):
        nodes = exported_nodes(Model(bound))
        assert len(nodes) == 1, f"bound={bound}"


def test_torch_is_as_it_was_after_the_block():
    apply, forward = torch.autograd.Function.__dict__["apply"], Sign.__dict__["forward"]
    with opaque_functions():
        assert torch.autograd.Function.__dict__["apply"] is not apply
        assert Sign.__dict__["forward"] is not forward
        x = torch.randn(3, requires_grad=True)
        Sign.apply(x).sum().backward()  # nothing exported: the Function as it is
        assert torch.equal(x.grad, torch.ones(3))
    assert torch.autograd.Function.__dict__["apply"] is apply
    assert Sign.__dict__["forward"] is forward


def test_torch_functions_are_traced_and_a_call_runs_the_users_backward():
    import torch.utils.checkpoint as ckpt

    assert kept_out(Sign) and not kept_out(ckpt.CheckpointFunction)
    x = torch.randn(3, requires_grad=True)
    call = FunctionCall(Sign, (x,), {})
    assert call.name == "Sign.apply"
    call.run((x,), {}).sum().backward()
    assert torch.equal(x.grad, torch.ones(3)), "the straight-through backward"
