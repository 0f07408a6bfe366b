"""passes/fx/fusions/kv_heads.py: repeated key/value heads go to grouped attention, same
outputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.passes.fx.fusions.helpers import passes

aten = torch.ops.aten


class GroupedAttention(nn.Module):
    """Attention of 4 query heads on 2 key/value heads, repeated before SDPA with a mask:
    as HF's ``repeat_kv`` (each head in place), as a tile of all heads (``tile``: not what
    grouped attention reads), keys only (``keys_only``: values have 4 heads), or for one
    query head broadcast against the repeated ones (``one_query_head``)."""

    def __init__(self, how: str = "repeat_kv"):
        super().__init__()
        self.how = how
        self.q, self.k = nn.Linear(32, 32), nn.Linear(32, 16)
        self.v = nn.Linear(32, 32 if how == "keys_only" else 16)

    def repeat(self, x):
        b, h, s, d = x.shape
        if self.how == "tile":
            return x.unsqueeze(1).expand(b, 2, h, s, d).reshape(b, 2 * h, s, d)
        return x.unsqueeze(2).expand(b, h, 2, s, d).reshape(b, h * 2, s, d)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 8).transpose(1, 2)
        if self.how == "one_query_head":
            q = q[:, :1]
        k = self.repeat(self.k(x).view(b, s, 2, 8).transpose(1, 2))
        v = self.v(x).view(b, s, -1, 8).transpose(1, 2)
        if self.how != "keys_only":
            v = self.repeat(v)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _sdpa_nodes(gm):
    return [n for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target)]


def _inputs():
    torch.manual_seed(0)
    mask = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(1)) > 0.3
    return torch.randn(2, 6, 32), mask


@pytest.mark.parametrize("train", [False, True])
def test_repeated_kv_heads_go_to_grouped_attention_with_the_same_outputs(train):
    x, mask = _inputs()
    model = GroupedAttention().train(train)
    reference = copy.deepcopy(model).double()
    reference(x.double(), mask).sum().backward()
    results = {}
    for fuse in (False, True):
        gm = passes(model, (x, mask), fuse)
        (node,) = _sdpa_nodes(gm)
        assert node.kwargs.get("enable_gqa", False) is fuse
        assert any(n.target is aten.expand.default for n in gm.graph.nodes) != fuse
        model.zero_grad()
        out = gm(x, mask)
        out.float().sum().backward()
        errors = [((p.grad.double() - r.grad).norm() / r.grad.norm()).item()
                  for p, r in zip(model.parameters(), reference.parameters()) if p.dim() == 2]
        results[fuse] = (out, errors)
    torch.testing.assert_close(results[True][0], results[False][0], rtol=0, atol=0)
    # the kernel sums a group's key/value gradients before rounding them to bf16, where the
    # repeat's backward summed rounded ones: one rounding fewer, never less accurate
    assert all(f <= r * 1.01 for f, r in zip(results[True][1], results[False][1]))
    assert max(results[True][1]) < 2e-2


@pytest.mark.parametrize("how", ["tile", "keys_only", "one_query_head"])
def test_other_repeats_are_left_alone(how):
    model, inputs = GroupedAttention(how), _inputs()
    gm = passes(model, inputs, True)
    (node,) = _sdpa_nodes(gm)
    assert not node.kwargs.get("enable_gqa", False)
    torch.testing.assert_close(gm(*inputs).float(), model(*inputs), rtol=3e-2, atol=3e-2)
