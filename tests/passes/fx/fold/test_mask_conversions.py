"""passes/fx/fold/mask_conversions.py: a boolean attention mask is made additive once per
graph, with the values and gradients each attention had."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import passes.fx.pipeline as pipeline
from passes._infra import PassResult
from passes.fx.dtypes import dtype_of, is_amp_cast
from passes.fx.policy import make_policy
from passes.fx.runtime_ops import RuntimeOps
from passes.fx.verify import verify
from tests.helpers import record
from tests.passes.fx.helpers import export

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default


class MaskedLayers(nn.Module):
    """Three attention layers reading one boolean padding mask, as HF encoders do."""

    def __init__(self, d: int = 16, heads: int = 2, layers: int = 3):
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.heads = heads

    def forward(self, x, keep):
        b, s, d = x.shape
        mask = keep.bool()[:, None, None, :].expand(b, 1, s, s)
        for qkv in self.qkv:
            q, k, v = qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            x = x + nn.functional.scaled_dot_product_attention(q, k, v, mask).transpose(
                1, 2).reshape(b, s, d)
        return x


def rewritten(monkeypatch, share: bool, dtype=torch.bfloat16):
    if not share:
        monkeypatch.setattr(pipeline, "share_mask_conversions",
                            lambda gm, recompile=True: PassResult(gm, False))
    torch.manual_seed(0)
    x, keep = torch.randn(2, 5, 16), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    gm = export(MaskedLayers(), (x, keep))
    pipeline.run_amp_passes(gm, make_policy("O2"), dtype)
    monkeypatch.undo()
    return gm, (x, keep)


def sdpa_masks(gm):
    return [n.args[3] for n in gm.graph.nodes if n.target is SDPA]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_conversion_serves_every_attention_with_the_same_values(monkeypatch, dtype):
    plain, inputs = rewritten(monkeypatch, False, dtype=dtype)
    gm, _ = rewritten(monkeypatch, True, dtype=dtype)
    assert {dtype_of(m) for m in sdpa_masks(plain)} == {torch.bool}
    (where,) = set(sdpa_masks(gm))
    assert where.target is aten.where.self and dtype_of(where) == dtype
    assert len(sdpa_masks(gm)) == 3
    gm.graph.lint()
    verify(gm, dtype)
    # run: one where (and no scalar_tensor) instead of three conversions of three ops
    xs = [inputs[0].clone().requires_grad_() for _ in range(2)]
    out, rec = record(lambda: gm(xs[0], inputs[1]))
    _, rec_plain = record(lambda: plain(xs[1], inputs[1]))
    count = lambda r, name: sum(n == name for n, _ in r.calls)  # noqa: E731
    assert (count(rec, "where"), count(rec, "scalar_tensor")) == (1, 0)
    assert (count(rec_plain, "where"), count(rec_plain, "scalar_tensor")) == (3, 6)
    expected = plain(xs[1], inputs[1])
    assert torch.equal(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert torch.equal(xs[0].grad, xs[1].grad)
    for p, q in zip(gm.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)
    # a second run finds nothing to convert and adds no casts
    casts = sum(is_amp_cast(n) for n in gm.graph.nodes)
    again = pipeline.run_amp_passes(gm, make_policy("O2"), dtype)
    assert again.casts == casts and set(sdpa_masks(gm)) == {where}
    assert torch.equal(gm(*inputs), plain(*inputs))


def test_a_runtime_that_routes_attention_gets_the_boolean_mask(monkeypatch):
    route = RuntimeOps(attention=lambda *a, **k: None)
    assert "share_mask_conversions" not in [
        p.__name__ for p in pipeline.amp_passes(make_policy("O2"), torch.bfloat16,
                                                pipeline.PipelineState(), runtime=route)]
    assert "share_mask_conversions" in [
        p.__name__ for p in pipeline.amp_passes(make_policy("O2"), torch.bfloat16,
                                                pipeline.PipelineState())]
