"""passes/fx/fusions.py: norm cast fusion, channels-last casts, gather casts; same numbers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from passes.fx import run_amp_passes
from passes.fx.dtypes import dtype_of, is_amp_cast
from passes.fx.policy import make_policy
from passes.fx.runtime_ops import RuntimeOps
from tests.helpers import NORM_OPS, record

aten = torch.ops.aten


class ConvBlock(nn.Module):
    """conv -> BN -> relu -> conv -> BN, + residual, relu: the ResNet pattern."""

    def __init__(self, out_fp32: bool = False):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.out_fp32 = out_fp32

    def forward(self, x):
        h = self.conv2(torch.relu(self.bn1(self.conv1(x))))
        if self.out_fp32:  # the norm's output is the model's output: nothing to fuse
            return self.bn2(h)
        return torch.relu(self.bn2(h) + h)


class LnBlock(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, d)
        self.gn = nn.GroupNorm(2, 4)

    def forward(self, x):
        return self.fc2(self.ln(self.fc1(x)))


def passes(model, inputs, fuse, level="O2", low=torch.bfloat16):
    gm = torch.export.export(model, inputs, strict=False).module()
    run_amp_passes(gm, make_policy(level), low, fuse_norms=fuse,
                   runtime=RuntimeOps(unrepeated_kv_heads=fuse))
    return gm


def norm_nodes(gm):
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and n.target in (aten.batch_norm.default,
                                                        aten.layer_norm.default)]


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


def _input_cast(gm):
    return next(n for n in gm.graph.nodes if is_amp_cast(n) and n.args[0].op == "placeholder")


def test_conv_input_cast_writes_channels_last_with_the_same_values():
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.fc = ConvBlock(), nn.Linear(8, 3)

        def forward(self, x):
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.block(x), 1), 1))

    model = Net().eval()
    x = torch.randn(2, 4, 8, 8)
    fused, plain = passes(copy.deepcopy(model), (x,), True), passes(model, (x,), False)
    assert _input_cast(fused).kwargs.get("memory_format") == torch.channels_last
    assert "memory_format" not in _input_cast(plain).kwargs
    torch.testing.assert_close(fused(x), plain(x), rtol=1e-2, atol=1e-2)


def test_no_channels_last_when_a_4d_tensor_is_returned_or_viewed():
    x = torch.randn(2, 4, 8, 8)
    gm = passes(ConvBlock().eval(), (x,), True)  # returns a 4-D tensor
    assert "memory_format" not in _input_cast(gm).kwargs

    class Viewed(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return self.conv(x).view(x.shape[0], -1)

    gm = passes(Viewed(), (x,), True)
    assert "memory_format" not in _input_cast(gm).kwargs
    assert gm(x).shape == (2, 256)


class Emb(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.emb, self.fc = nn.Embedding(vocab, 8), nn.Linear(8, 4)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def test_embedding_gathers_from_the_fp32_table_and_casts_its_smaller_output():
    torch.manual_seed(0)
    model = Emb(100)
    ids = torch.randint(0, 100, (2, 5))
    fused, plain = passes(copy.deepcopy(model), (ids,), True), passes(model, (ids,), False)
    (emb,) = [n for n in fused.graph.nodes if n.target == aten.embedding.default]
    assert emb.args[0].op == "get_attr" and dtype_of(emb) == torch.float32
    assert all(is_amp_cast(u) and dtype_of(u) == torch.bfloat16 for u in emb.users)
    out_f, out_p = fused(ids), plain(ids)
    torch.testing.assert_close(out_f, out_p, rtol=0, atol=0)  # a gather commutes with a cast
    out_f.sum().backward()
    out_p.sum().backward()
    for p, q in zip(fused.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-2, atol=1e-3)
    # a lookup larger than its table keeps casting the table
    small = passes(Emb(3), (torch.randint(0, 3, (4, 5)),), True)
    (emb,) = [n for n in small.graph.nodes if n.target == aten.embedding.default]
    assert is_amp_cast(emb.args[0])


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
