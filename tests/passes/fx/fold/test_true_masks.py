"""passes/fx/fold/true_masks.py: an attention mask computed from constants and True
everywhere is dropped; any other mask stays."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from passes.fx.fold.true_masks import drop_true_masks
from passes.fx.pipeline import run_amp_passes
from passes.fx.policy import make_policy
from tests.passes.fx.helpers import export

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


class Attend(nn.Module):
    """One attention whose mask is built the way ``kind`` says."""

    def __init__(self, kind: str, n: int = 5):
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.kind = kind
        self.register_buffer("window", torch.ones(n, n, dtype=torch.bool))

    def forward(self, x, keep):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 4).permute(2, 0, 3, 1, 4)
        pos = torch.arange(n)
        if self.kind == "true":  # HF ViT's sdpa_mask: kv_idx >= 0, over the batch
            mask = (pos >= 0)[None, None, None, :].expand(b, 1, n, n)
        elif self.kind == "causal":  # constants too, but not all True
            mask = (pos[None, :] <= pos[:, None])[None, None].expand(b, 1, n, n)
        elif self.kind == "input":
            mask = keep.bool()[:, None, None, :].expand(b, 1, n, n)
        else:  # a buffer: the user may change it between calls
            mask = self.window[None, None].expand(b, 1, n, n)
        return nn.functional.scaled_dot_product_attention(q, k, v, mask)


@pytest.mark.parametrize("kind", ["true", "causal", "input", "buffer"])
def test_only_a_constant_all_true_mask_is_dropped(kind):
    torch.manual_seed(0)
    x, keep = torch.randn(2, 5, 8), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    gm = export(Attend(kind), (x, keep))
    expected = gm(x, keep)
    assert drop_true_masks(gm).modified == (kind == "true")
    (sdpa,) = gm.graph.find_nodes(op="call_function", target=SDPA)
    assert (sdpa.args[3] is None) == (kind == "true")
    gm.graph.lint()
    torch.testing.assert_close(gm(x, keep), expected, rtol=1e-6, atol=1e-6)


def test_the_pipeline_drops_it_and_the_ops_that_built_it():
    torch.manual_seed(0)
    x, keep = torch.randn(2, 5, 8), torch.ones(2, 5, dtype=torch.long)
    gm = export(Attend("true"), (x, keep))
    expected = gm(x, keep)
    run_amp_passes(gm, make_policy("O2"), torch.bfloat16)
    (sdpa,) = gm.graph.find_nodes(op="call_function", target=SDPA)
    assert sdpa.args[3] is None
    targets = {n.target for n in gm.graph.nodes}
    assert not targets & {aten.arange.default, aten.ge.Scalar, aten.where.self}
    torch.testing.assert_close(gm(x, keep), expected, rtol=2e-2, atol=2e-2)
