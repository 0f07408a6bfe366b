"""passes/fx/no_grad_regions.py: a ``no_grad`` block exported in train mode is inlined with
detached inputs: same values, no gradient through it, no higher-order op left."""

from __future__ import annotations

import torch
from torch import nn

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
