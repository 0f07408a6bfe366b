"""passes/fx/no_grad_regions.py: a ``no_grad`` block exported in train mode is inlined with
detached inputs: same values, no gradient through it, no higher-order op left."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ampgraph
from passes.fx.no_grad_regions import inline_no_grad_regions

HOP = torch.ops.higher_order.wrap_with_set_grad_enabled


class WithNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            angles = (x * 3).sin()  # like HF's rotary embedding
        return self.fc(x) * angles


def test_no_grad_block_is_inlined_with_the_same_values_and_gradients():
    torch.manual_seed(0)
    model = WithNoGrad().train()
    x = torch.randn(2, 4, requires_grad=True)
    gm = torch.export.export(model, (x,), strict=False).module()
    assert gm.graph.find_nodes(op="call_function", target=HOP), "export records the region"
    assert inline_no_grad_regions(gm) == 1
    assert not gm.graph.find_nodes(op="call_function", target=HOP)
    assert inline_no_grad_regions(gm) == 0  # idempotent
    gm.graph.lint()
    out = gm(x)
    (got,) = torch.autograd.grad(out.sum(), x)
    ref_x = x.detach().clone().requires_grad_()
    ref = model(ref_x)
    (want,) = torch.autograd.grad(ref.sum(), ref_x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(got, want)  # nothing flows back through the sin
    assert torch.is_grad_enabled()


class ReadInsideAndAfter(nn.Module):
    """A linear's output ``h`` read inside a no_grad block (as ``h``, or as ``h.float()``,
    which returns ``h`` itself: export then reads ``h`` after the block as the region's
    output) and after it."""

    def __init__(self, float_inside: bool):
        super().__init__()
        self.a, self.b, self.float_inside = nn.Linear(16, 16), nn.Linear(16, 4), float_inside

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            q = h.float() if self.float_inside else h
            s = q @ q.transpose(-1, -2)
        return self.b(s @ h)


@pytest.mark.parametrize("float_inside", [False, True])
def test_a_value_returned_as_itself_keeps_its_gradient_after_inlining(float_inside):
    torch.manual_seed(0)
    model, x = ReadInsideAndAfter(float_inside).train(), torch.randn(2, 5, 16)
    gm = torch.export.export(model, (x,), strict=False).module()
    assert inline_no_grad_regions(gm) == 1
    gm.graph.lint()
    got = torch.autograd.grad(gm(x).sum(), list(gm.parameters()))
    want = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("runtime", [None, "cuda"])  # cuda: its portable ops, on the CPU
@pytest.mark.parametrize("float_inside", [False, True])
def test_o2_gradients_match_fp32_through_a_no_grad_block(float_inside, runtime):
    torch.manual_seed(0)
    model, x = ReadInsideAndAfter(float_inside).train(), torch.randn(2, 5, 16)
    ref = copy.deepcopy(model)
    ref(x).sum().backward()
    kwargs = {} if runtime is None else {"runtime": runtime}
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16", **kwargs).train()
    net(x).sum().backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        cos = torch.cosine_similarity(p.grad.float().flatten(), r.grad.flatten(), dim=0)
        assert cos > 0.999, (name, cos.item())
