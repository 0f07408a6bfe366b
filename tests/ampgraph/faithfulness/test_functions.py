"""Faithfulness: a user's ``torch.autograd.Function`` keeps its own forward and backward
(capture/functions.py), whatever its style, arguments and outputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.ampgraph.faithfulness.harness import MLP, Case, check, compiled_whole, inputs, step


class RoundSTE(torch.autograd.Function):
    """Quantization-aware training's straight-through estimator."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


class GradReverse(torch.autograd.Function):
    """Domain-adversarial training's gradient reversal, with a Python float argument."""

    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.lam * g, None


class ClippedSTE(torch.autograd.Function):
    """``ctx.save_for_backward``, and a backward that is not the forward's derivative."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return torch.round(x * scale) / scale

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x.abs() <= 1.0).to(g.dtype), None


class SwishFn(torch.autograd.Function):
    """A hand-written backward equal to autograd's (a memory-saving kernel's pattern)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))


class TopMask(torch.autograd.Function):
    """Two outputs, one not differentiable, arguments with defaults."""

    @staticmethod
    def forward(ctx, x, k=2, scale=1.0):
        idx = x.topk(k, dim=-1).indices
        mask = torch.zeros_like(x).scatter_(-1, idx, 1.0)
        ctx.mark_non_differentiable(mask)
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return x * mask * scale, mask

    @staticmethod
    def backward(ctx, g, _):
        (mask,) = ctx.saved_tensors
        return g * mask * ctx.scale * 2.0, None, None  # a sparse "boost": not the derivative


class SetupContextFn(torch.autograd.Function):
    """The functorch-style Function: forward without ctx, ``setup_context`` apart."""

    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w * 3.0, (g * x).sum(0) * 0.5


class With(nn.Module):
    """An MLP whose hidden activation goes through ``fn``."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.mlp = MLP()
        self.fn = fn

    def forward(self, x):
        return self.mlp.b(self.fn(self.mlp.a(x)))


class SetupContextNet(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        return self.b(SetupContextFn.apply(self.a(x), self.w))


def training(steps: int = 2):
    def scenario(call, model):
        out = []
        for s in range(steps):
            out += step(call, model, inputs(seed=s))
        return out
    return scenario


def in_eval(call, model):
    model.eval()
    with torch.no_grad():
        return [call(inputs())]


CASES = [
    Case("straight-through round between two linears", lambda: With(RoundSTE.apply),
         training(), after=compiled_whole),
    Case("gradient reversal with a float argument",
         lambda: With(lambda h: GradReverse.apply(h, 0.5)), training(), after=compiled_whole),
    Case("save_for_backward and a clipped straight-through estimator",
         lambda: With(lambda h: ClippedSTE.apply(h, 4.0)), training()),
    Case("a hand-written backward equal to autograd's", lambda: With(SwishFn.apply),
         training()),
    Case("two outputs, one non-differentiable, default arguments",
         lambda: With(lambda h: TopMask.apply(h, 3, 0.5)[0]), training()),
    Case("a setup_context Function with a parameter input", SetupContextNet, training()),
    Case("a Function in inference", lambda: With(RoundSTE.apply), in_eval),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_function(case):
    check(case)


def test_explain_names_the_function_and_its_precision():
    import ampgraph

    net = ampgraph.compile(With(RoundSTE.apply), "O2", "bf16")
    net(inputs())
    rows = [r for r in ampgraph.explain(net).nodes if "autograd.Function" in r["op"]]
    assert [r["op"] for r in rows] == ["autograd.Function: RoundSTE.apply"]
    assert rows[0]["precision"] == "fp32" and "its own backward" in rows[0]["reason"]
