"""passes/fx/fusions/kv_heads.py: repeated key/value heads go to grouped attention
(``group_kv_heads``) or to attention on stacked query heads (``stack_kv_queries``), same
outputs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from passes.fx.fusions.kv_heads import RESHAPES, stack_kv_queries
from passes.fx.runtime_ops import RuntimeOps
from passes.fx.verify import verify
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


# ------------------------------------------------------------------ stack_kv_queries


class TwoAttentions(nn.Module):
    """Two attention layers of 4 query heads on ``kv`` key/value heads (HF's ``repeat_kv``)
    reading one mask; the query laid out ``[b, s, h, d]`` as HF's (``bshd``) or made
    contiguous (``bhsd``)."""

    def __init__(self, kv: int = 1, layout: str = "bshd", causal: bool = False,
                 dropout: float = 0.0):
        super().__init__()
        self.kv, self.layout, self.causal, self.dropout = kv, layout, causal, dropout
        self.q = nn.ModuleList(nn.Linear(32, 32) for _ in range(2))
        self.k = nn.ModuleList(nn.Linear(32, 8 * kv) for _ in range(2))
        self.v = nn.ModuleList(nn.Linear(32, 8 * kv) for _ in range(2))

    def forward(self, x, mask=None):
        b, s, _ = x.shape
        n = 4 // self.kv
        for q, k, v in zip(self.q, self.k, self.v):
            query = q(x).view(b, s, 4, 8).transpose(1, 2)
            if self.layout == "bhsd":
                query = query.contiguous()
            key, value = (f(x).view(b, s, self.kv, 8).transpose(1, 2) for f in (k, v))
            key, value = (t[:, :, None].expand(b, self.kv, n, s, 8).reshape(b, 4, s, 8)
                          for t in (key, value))
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, is_causal=self.causal,
                dropout_p=self.dropout if self.training else 0.0)
            x = x + out.transpose(1, 2).reshape(b, s, 32)
        return x


def _mask(kind: str, b: int = 2, s: int = 6):
    g = torch.Generator().manual_seed(1)
    if kind == "none":
        return None
    if kind == "float":  # additive, no batch dimension
        return torch.randn(1, s, s, generator=g)
    shape = {"rows": (b, 1, s, s), "one_row": (b, 1, 1, s), "2d": (s, s),
             "per_head": (b, 4, s, s)}[kind]
    mask = torch.rand(*shape, generator=g) > 0.3
    mask[..., 0] = True  # no row without a key
    return mask


def _stacked(gm):
    """(attention nodes taking unrepeated keys, mask expansions)."""
    nodes = _sdpa_nodes(gm)
    unrepeated = [n for n in nodes if n.args[1].target not in RESHAPES]
    expansions = [n for n in gm.graph.nodes if n.target is aten.expand.default]
    return unrepeated, expansions


def _run(gm, x, mask):
    x = x.clone().requires_grad_()
    out = gm(x, mask)
    out.float().square().sum().backward()
    return out, x.grad, {k: p.grad for k, p in gm.named_parameters()}


STACKED = [  # (kv heads, query layout, mask)
    (1, "bshd", "rows"), (1, "bshd", "one_row"), (1, "bshd", "none"), (1, "bshd", "2d"),
    (1, "bhsd", "rows"), (1, "bhsd", "float"), (2, "bhsd", "rows"), (2, "bhsd", "one_row"),
]


@pytest.mark.parametrize("kv, layout, mask_kind", STACKED)
def test_stacked_queries_take_unrepeated_heads_with_one_mask_copy_and_same_values(
        kv, layout, mask_kind):
    torch.manual_seed(0)
    model, x, mask = TwoAttentions(kv, layout), torch.randn(2, 6, 32), _mask(mask_kind)
    ref = torch.export.export(model, (x, mask), strict=False).module()
    gm = torch.export.export(model, (x, mask), strict=False).module()
    assert stack_kv_queries(gm).modified
    gm.graph.lint()
    gm.graph.eliminate_dead_code()  # the repeats (the pipeline's drop_dead_ops)
    unrepeated, expansions = _stacked(gm)
    assert len(unrepeated) == 2
    # the mask's rows repeated once for both layers; a mask of one row taken as it is
    assert len(expansions) == (1 if mask_kind in ("rows", "2d", "float") else 0)
    assert all(n.args[0].target is aten.flatten.using_ints for n in unrepeated)
    assert not stack_kv_queries(gm).modified  # idempotent
    out, dx, grads = _run(gm, x, mask)
    out_ref, dx_ref, grads_ref = _run(ref, x, mask)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv, layout, mask_kind", [STACKED[0], STACKED[6]])
def test_stacked_queries_in_the_bf16_pipeline_keep_precisions_and_match_fp64(
        kv, layout, mask_kind):
    torch.manual_seed(0)
    model, x, mask = TwoAttentions(kv, layout), torch.randn(2, 6, 32), _mask(mask_kind)
    reference = copy.deepcopy(model).double()
    xd = x.double().requires_grad_()
    reference(xd, mask).square().sum().backward()
    errors = {}
    for stack in (False, True):
        gm = passes(model, (x, mask), True, runtime=RuntimeOps(stacked_kv_heads=stack))
        verify(gm, torch.bfloat16)
        nodes = _sdpa_nodes(gm)
        assert all(n.meta["amp_precision"] == "low" for n in nodes)
        assert len(_stacked(gm)[0]) == (2 if stack else 0)
        model.zero_grad()
        out, dx, _ = _run(gm, x, mask)
        assert out.dtype == torch.float32  # keep_io_types
        errors[stack] = [((out.double() - reference(xd, mask)).norm()
                          / reference(xd, mask).norm()).item(),
                         ((dx.double() - xd.grad).norm() / xd.grad.norm()).item()]
        errors[stack] += [((p.grad.double() - r.grad).norm() / r.grad.norm()).item()
                          for p, r in zip(model.parameters(), reference.parameters())
                          if p.dim() == 2]
    # bf16 tolerance; the stacked kernel sums a group's key/value gradients before their
    # one rounding, where the repeat's backward summed rounded ones
    assert max(errors[True]) < 2e-2
    assert all(a <= b * 1.1 + 1e-3 for a, b in zip(errors[True], errors[False]))


@pytest.mark.parametrize("why, model, mask_kind", [
    ("rows between heads: stacking would copy", TwoAttentions(2, "bshd"), "rows"),
    ("a mask per head", TwoAttentions(1, "bshd"), "per_head"),
    ("is_causal", TwoAttentions(1, "bshd", causal=True), "none"),
    ("dropout", TwoAttentions(1, "bshd", dropout=0.1).train(), "rows"),
])
def test_stacking_leaves_alone_what_it_cannot_stack_as_views(why, model, mask_kind):
    x, mask = torch.randn(2, 6, 32), _mask(mask_kind)
    gm = torch.export.export(model, (x, mask), strict=False).module()
    assert not stack_kv_queries(gm).modified, why
    assert _stacked(gm)[0] == []


def test_grouped_and_stacked_heads_are_exclusive():
    with pytest.raises(ValueError, match="exclusive"):
        RuntimeOps(unrepeated_kv_heads=True, stacked_kv_heads=True)


# ------------------------------------------------------------------ HF LLaMA, CUDA runtime


def _llama(kv: int, train: bool):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv, max_position_embeddings=64)).train(train)


def _compiled_sdpa(net):
    return [n for graphs in net._amp_graphs.values() for c in graphs
            for n in _sdpa_nodes(c.gm)]


def test_hf_llama_multi_query_trains_on_stacked_queries_like_the_aten_runtime():
    import ampgraph

    model = _llama(kv=1, train=True)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    reference = copy.deepcopy(model)
    reference(input_ids=ids, labels=ids).loss.backward()
    results = {}
    for runtime in ("aten", "cuda"):
        m = copy.deepcopy(model)
        net = ampgraph.compile(m, "O2", "bf16", runtime=runtime)
        out = net(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
        out.loss.backward()
        stacked = [n for n in _compiled_sdpa(net) if n.args[1].target not in RESHAPES]
        assert len(stacked) == (2 if runtime == "cuda" else 0)
        errors = [((p.grad - r.grad).norm() / r.grad.norm()).item()
                  for p, r in zip(m.parameters(), reference.parameters())]
        results[runtime] = (out.logits, errors)
    torch.testing.assert_close(results["cuda"][0], results["aten"][0], rtol=0, atol=0)
    assert max(results["cuda"][1]) < 3e-2
    assert all(c <= a * 1.1 + 1e-3 for c, a in zip(results["cuda"][1], results["aten"][1]))


def test_hf_llama_grouped_decodes_on_stacked_queries_like_the_aten_runtime():
    """Four query heads over two key/value heads: the training graph's query (rows between
    heads) is left alone; a decoding step's query (one row) is stacked."""
    import ampgraph

    model = _llama(kv=2, train=False)
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                  do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)
    outs, stacked = {}, {}
    for runtime in ("aten", "cuda"):
        net = ampgraph.compile(model, "O2", "bf16", runtime=runtime)
        outs[runtime] = net.generate(**kwargs)
        stacked[runtime] = [n.args[0].meta["val"].shape[2] for n in _compiled_sdpa(net)
                            if n.args[1].target not in RESHAPES]
    assert stacked == {"aten": [], "cuda": [2, 2]}  # the decode graph: 2 heads' one row each
    assert torch.equal(outs["cuda"].sequences, outs["aten"].sequences)
    for a, c in zip(outs["aten"].logits, outs["cuda"].logits):
        torch.testing.assert_close(c, a, rtol=0, atol=0)
