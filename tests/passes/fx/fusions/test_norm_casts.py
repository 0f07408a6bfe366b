"""passes/fx/fusions/norm_casts.py: the casts around fp32 norms go into the kernel; same
numbers and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import passes.fx.fusions.norm_casts as norm_casts
from passes.fx.dtypes import dtype_of, is_amp_cast
from passes.fx.verify import verify
from tests.helpers import NORM_OPS, record
from tests.passes.fx.fusions.helpers import ConvBlock, LnBlock, norm_nodes, passes

aten = torch.ops.aten


@pytest.mark.parametrize("train", [True, False])
def test_batchnorm_casts_are_fused_with_the_same_numbers_and_gradients(train):
    torch.manual_seed(0)
    model = ConvBlock().train(train)
    x = torch.randn(4, 4, 8, 8)
    fused, plain = passes(copy.deepcopy(model), (x,), True), passes(model, (x,), False)
    casts = lambda gm: sum(is_amp_cast(n) for n in gm.graph.nodes)  # noqa: E731
    assert casts(plain) - casts(fused) == 4, "two casts less around each of the two norms"
    for n in norm_nodes(fused):
        assert dtype_of(n.args[0]) == torch.bfloat16 and dtype_of(n) == torch.bfloat16
        assert dtype_of(n.args[1]) == torch.float32, "weights stay fp32 masters"
        assert n.meta["amp_precision"] == "fp32" and "fused" in n.meta["amp_reason"]
    relu = next(n for n in fused.graph.nodes if n.target == aten.relu.default)
    assert relu.meta["amp_precision"] == "low"
    # the norm computes in fp32: it gets fp32 weights and statistics at run time
    xs = [x.clone().requires_grad_() for _ in range(2)]
    (out_f, rec), out_p = record(lambda: fused(xs[0])), plain(xs[1])
    assert {d[0] for n, d in rec.calls if n in NORM_OPS} == {torch.bfloat16}
    assert rec.norm_compute_dtypes() == {torch.float32}
    torch.testing.assert_close(out_f, out_p, rtol=1e-2, atol=1e-2)
    out_f.square().sum().backward()
    out_p.square().sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=2e-2, atol=2e-2)
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2, msg=name)
    if train:  # running statistics are updated in fp32 exactly alike
        for b, c in zip(fused.buffers(), plain.buffers()):
            torch.testing.assert_close(b, c, rtol=1e-3, atol=1e-4)


def test_layernorm_between_matmuls_is_fused():
    torch.manual_seed(0)
    model = LnBlock()
    x = torch.randn(3, 16)
    fused, plain = passes(copy.deepcopy(model), (x,), True), passes(model, (x,), False)
    (ln,) = norm_nodes(fused)
    assert dtype_of(ln.args[0]) == torch.bfloat16 and "amp_io" in ln.meta
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-2, atol=1e-2)


def test_no_fusion_where_a_use_wants_fp32_or_at_o1_with_fp32_neighbours():
    model = ConvBlock(out_fp32=True).eval()
    x = torch.randn(2, 4, 8, 8)
    gm = passes(model, (x,), True)
    bn1, bn2 = norm_nodes(gm)
    assert "amp_io" in bn1.meta, "bn1 -> relu -> conv: every use wants bf16"
    assert "amp_io" not in bn2.meta and dtype_of(bn2.args[0]) == torch.float32, \
        "bn2 is the output: rounding it to bf16 would lose precision"
    assert dtype_of(bn2) == torch.float32


def test_relu_chain_ending_in_fp32_use_is_not_fused():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)

        def forward(self, x):
            h = torch.relu(self.bn(self.conv(x)))
            return self.conv(x[:, :3] * 0 + h[:, :3]), h.softmax(1)  # softmax is fp32

    gm = passes(M().eval(), (torch.randn(1, 3, 4, 4),), True)
    (bn,) = norm_nodes(gm)
    assert "amp_io" not in bn.meta


def test_hardtanh_fuses_only_with_bounds_exact_in_the_low_dtype():
    class M(nn.Module):
        def __init__(self, lo, hi):
            super().__init__()
            self.fc1, self.ln, self.fc2 = nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4)
            self.lo, self.hi = lo, hi

        def forward(self, x):
            return self.fc2(nn.functional.hardtanh(self.ln(self.fc1(x)), self.lo, self.hi))

    x = torch.randn(2, 4)  # at O1 hardtanh follows the fp32 norm; fc2 is the bf16 use
    assert "amp_io" in norm_nodes(passes(M(0.0, 6.0), (x,), True, "O1"))[0].meta
    assert "amp_io" not in norm_nodes(passes(M(0.0, 6.001), (x,), True, "O1"))[0].meta


class Stem(nn.Module):
    """A ResNet stem: conv -> BN -> relu -> max pool -> conv."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.pool, self.conv2 = nn.MaxPool2d(3, 2, 1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.conv2(self.pool(torch.relu(self.bn(self.conv1(x)))))


@pytest.mark.parametrize("train", [False, True])
def test_max_pool_after_a_norm_runs_low_and_the_norm_is_fused(train):
    """Max pooling commutes with rounding: relu and the pool run in the low dtype on the
    norm's fused output, so nothing between the stem's norm and the next conv is fp32."""
    torch.manual_seed(0)
    model = Stem().train(train)
    x = torch.randn(2, 3, 8, 8)
    gm, plain = passes(copy.deepcopy(model), (x,), True), passes(model, (x,), False)
    (bn,) = norm_nodes(gm)
    assert bn.meta["amp_io"] == torch.bfloat16
    pool = next(n for n in gm.graph.nodes if n.target is aten.max_pool2d.default)
    assert dtype_of(pool) == torch.bfloat16 and dtype_of(pool.args[0]) == torch.bfloat16
    assert pool.meta["amp_precision"] == "low"
    widen = [n for n in gm.graph.nodes if is_amp_cast(n) and dtype_of(n) == torch.float32]
    assert len(widen) == 1 and widen[0].users.keys() == {list(gm.graph.nodes)[-1]}  # output
    plain_pool = next(n for n in plain.graph.nodes if n.target is aten.max_pool2d.default)
    assert dtype_of(plain_pool) == torch.float32  # without fusion the pool ran fp32
    torch.testing.assert_close(gm(x), plain(x), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("supported", [True, False])
def test_norms_are_fused_only_where_the_probe_allows(monkeypatch, supported):
    monkeypatch.setattr(norm_casts, "mixed_io_supported", lambda target, device, low: supported)
    torch.manual_seed(0)
    model = LnBlock().eval()
    x = torch.randn(3, 16)
    gm, plain = passes(copy.deepcopy(model), (x,), True), passes(model, (x,), False)
    (ln,) = norm_nodes(gm)
    assert ("amp_io" in ln.meta) == supported
    assert (dtype_of(ln.args[0]) == torch.bfloat16) == supported
    gm.graph.lint()
    verify(gm, torch.bfloat16)
    torch.testing.assert_close(gm(x), plain(x), rtol=1e-2, atol=1e-2)


class ViewedNorm(nn.Module):
    """A norm whose output reaches the next product through views: GPT-2's ``view(-1, d)``
    and a classifier's ``select`` of the first token."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, d)
        self.d = d

    def forward(self, x):
        h = self.ln(self.fc1(x))
        return self.fc2(h.view(-1, self.d)), self.fc2(h[:, 0])


@pytest.mark.parametrize("train", [False, True])
def test_views_between_the_norm_and_its_low_uses_are_fused_through(train):
    torch.manual_seed(0)
    model = ViewedNorm().train(train)
    x = torch.randn(2, 3, 16)
    gm, plain = passes(copy.deepcopy(model), (x,), True), passes(model, (x,), False)
    (ln,) = norm_nodes(gm)
    assert ln.meta["amp_io"] == torch.bfloat16 and dtype_of(ln.args[0]) == torch.bfloat16
    views = [u for u in ln.users]
    assert {u.target for u in views} == {aten.view.default, aten.select.int}
    assert all(dtype_of(v) == torch.bfloat16 and v.meta["amp_precision"] == "low"
               for v in views)
    casts = lambda g: sum(is_amp_cast(n) for n in g.graph.nodes)  # noqa: E731
    assert casts(plain) - casts(gm) == 3, "the widen before the norm, a narrow after each view"
    gm.graph.lint()
    verify(gm, torch.bfloat16)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = gm(xs[0]), plain(xs[1])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    sum(o.square().sum() for o in outs[0]).backward()
    sum(o.square().sum() for o in outs[1]).backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=2e-2, atol=2e-2)
