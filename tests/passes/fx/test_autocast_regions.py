"""passes/fx/autocast_regions.py: a ``torch.autocast(enabled=False)`` block (timm's
EfficientViT attention) is inlined, its ops kept fp32 with the reason, and the model is
captured whole; before, insert_casts could not re-run the higher-order op and the model
ran eagerly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampgraph
from passes.fx.autocast_regions import AUTOCAST_OFF, inline_autocast_off_regions

HOP = torch.ops.higher_order.wrap_with_autocast


class AutocastOff(nn.Module):
    """A linear, an fp32 attention-like product with autocast off (nested in a no_grad
    block when ``nested``), a linear."""

    def __init__(self, nested: bool = False):
        super().__init__()
        self.a, self.b, self.nested = nn.Linear(16, 16), nn.Linear(16, 4), nested

    def product(self, h):
        with torch.autocast(device_type=h.device.type, enabled=False):
            q = h.float()
            return (q @ q.transpose(-1, -2)) / 4

    def forward(self, x):
        h = self.a(x)
        if self.nested:
            with torch.no_grad():
                scores = self.product(h)
        else:
            scores = self.product(h)
        return self.b(scores @ h)


def test_the_region_is_inlined_tagged_and_keeps_its_values():
    torch.manual_seed(0)
    model, x = AutocastOff().eval(), torch.randn(2, 5, 16)
    gm = torch.export.export(model, (x,), strict=False).module()
    assert gm.graph.find_nodes(op="call_function", target=HOP), "export records the region"
    assert inline_autocast_off_regions(gm) == 1
    assert not gm.graph.find_nodes(op="call_function", target=HOP)
    assert inline_autocast_off_regions(gm) == 0  # idempotent
    gm.graph.lint()
    tagged = [n.target for n in gm.graph.nodes if n.meta.get("amp_autocast_off")]
    assert torch.ops.aten.matmul.default in tagged
    torch.testing.assert_close(gm(x), model(x))


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("train", [False, True])
def test_o2_captures_whole_and_runs_the_region_fp32(nested, train):
    torch.manual_seed(0)
    model, x = AutocastOff(nested).train(train), torch.randn(2, 5, 16)
    ref = model(x)
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16").train(train)
    out = net(x)
    graphs, eager = net.amp_parts()
    assert not eager and graphs, eager
    rows = [r for r in ampgraph.explain(net, x).nodes if r["op"] == "aten.matmul"]
    assert [r["precision"] for r in rows] == ["fp32", "bf16"], rows  # the region's; the next
    assert rows[0]["reason"] == AUTOCAST_OFF
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    if train:
        out.sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_value_read_inside_and_after_a_no_grad_block_keeps_its_gradient():
    # the region's ``h.float()`` returns ``h`` itself: export reads ``h`` after the block
    # as the region's output, which was the detached copy's (no_grad_regions.py)
    torch.manual_seed(0)
    model, x = AutocastOff(nested=True).train(), torch.randn(2, 5, 16)
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16").train()
    net(x).sum().backward()
    assert model.a.weight.grad is not None
