"""fp16 range hazards: out-of-range constants never turn a finite model into NaN."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn

import ampgraph
from passes.fx.dataflow import build_dataflow
from passes.fx.hazards import mark_range_hazards
from passes.fx.prepare import prepare
from tests.passes.fx.helpers import blocks


class MaskedAttention(nn.Module):
    """Hand-written attention with a -1e9 masked_fill (a -inf stand-in)."""

    def __init__(self, d=8, fill=-1e9):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.fill = fill

    def forward(self, x, mask):
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = (q @ k.transpose(-1, -2)) / 8**0.5
        scores = scores.masked_fill(mask, self.fill)
        return torch.softmax(scores, -1) @ v


class AdditiveMaskSDPA(nn.Module):
    """HF-style additive mask with finfo(float32).min fed to SDPA (an allow op)."""

    def __init__(self, d=8):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, keep):
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, -1)
        bias = (1.0 - keep[:, None, None, :].float()) * torch.finfo(torch.float32).min
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)


class TinyEps(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x) * 1e-3
        return h / (h.abs() + 1e-9)  # 1e-9 is 0 in fp16


def compile16(model, level="O2"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return ampgraph.compile(model, level, "fp16")


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_fully_masked_rows_stay_finite_in_fp16(level):
    torch.manual_seed(0)
    model = MaskedAttention().eval()
    x = torch.randn(2, 5, 8)
    mask = torch.zeros(2, 5, 5, dtype=torch.bool)
    mask[0, 2, :] = True  # a fully masked row: fp32 gives a uniform average, no NaN
    mask[1, :, 3:] = True
    with torch.no_grad():
        ref = model(x, mask)
        out = compile16(model, level)(x, mask)
    assert torch.isfinite(ref).all()
    assert torch.isfinite(out).all(), "fp16 must not turn a finite model into NaN"
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_masked_fill_constant_is_reported():
    model = MaskedAttention().eval()
    net = compile16(model)
    x, mask = torch.randn(1, 3, 8), torch.zeros(1, 3, 3, dtype=torch.bool)
    rows = {r["op"]: r for r in ampgraph.explain(net, x, mask).nodes}
    assert rows["aten.masked_fill.Scalar"]["precision"] == "fp32"
    assert "fp16 range" in rows["aten.masked_fill.Scalar"]["reason"]


def test_finfo_min_additive_mask_saturates_into_sdpa():
    torch.manual_seed(0)
    model = AdditiveMaskSDPA().eval()
    x = torch.randn(2, 4, 8)
    keep = torch.ones(2, 4, dtype=torch.long)
    keep[1, 2:] = 0
    with torch.no_grad():
        ref = model(x, keep)
        net = compile16(model)
        out = net(x, keep)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    gm = net._amp_last.gm
    assert any(n.target is torch.ops.aten.clamp.default for n in gm.graph.nodes)


def test_tiny_epsilon_keeps_its_consumer_fp32():
    torch.manual_seed(0)
    model = TinyEps().eval()
    with torch.no_grad():
        model.fc.bias.zero_()
    x = torch.randn(3, 4)
    x[0] = 0.0  # h = 0: fp32 gives 0 / 1e-9 = 0, fp16 without the rule gives 0 / 0 = NaN
    with torch.no_grad():
        out = compile16(model, "O3")(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, model(x), rtol=2e-2, atol=2e-2)


def test_bf16_has_no_range_hazard():
    net = ampgraph.compile(MaskedAttention().eval(), "O3", "bf16")
    rows = ampgraph.explain(net, torch.randn(1, 3, 8), torch.zeros(1, 3, 3, dtype=torch.bool))
    assert all("fp16 range" not in r["reason"] for r in rows.nodes)


def test_norm_epsilon_is_not_a_hazard():
    """Norm kernels add eps in fp32 accumulation: BERT's 1e-12 must not force fp32."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4, eps=1e-12), nn.Linear(4, 4))
    rows = ampgraph.explain(compile16(model, "O3"), torch.randn(2, 4)).nodes
    assert all("fp16 range" not in r["reason"] for r in rows)
    assert {r["precision"] for r in rows if r["op"].startswith("aten.")} == {"fp16"}


def test_range_hazard_scan_leaves_no_garbage_cycles():
    """A recursive closure per node was a reference cycle per node (cycle-collector work)."""
    gm = blocks(20)
    prepare(gm)
    graph = build_dataflow(gm)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        before = gc.get_count()[0]
        mark_range_hazards(graph, gm, torch.float16)
        grown = gc.get_count()[0] - before
    finally:
        if enabled:
            gc.enable()
    assert grown < 50, grown

