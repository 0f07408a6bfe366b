"""The unfused CPU attention (ampgraph.runtime.cpu.attention) against aten and an fp64 reference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import ampgraph
from ampgraph.runtime.cpu import attention
from ampgraph.runtime.cpu.attention import amp_attention, unfused_pays
from ampgraph.runtime.cpu.dropout import keep_mask
from models import bert_encoder
from passes.fx.costs import node_flops
from tests.helpers import record

BF16 = torch.bfloat16
MIN_SCORES = attention.MIN_UNFUSED_SCORES


@pytest.fixture(autouse=True)
def small_shapes_run_unfused(monkeypatch):
    """These tests' shapes are far below the size where unfused pays (``_many_scores``)."""
    monkeypatch.setattr(attention, "MIN_UNFUSED_SCORES", 0)


def qkv(n=4, h=2, t=16, d=16, s=None, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(n, h, t, d), (n, h, s or t, d), (n, h, s or t, d)]
    return [(torch.randn(sh, generator=g) * 1.5).to(dtype).requires_grad_() for sh in shapes]


def masks(n, t, s):
    additive = torch.zeros(n, 1, 1, s, dtype=BF16)
    additive[:, :, :, s * 3 // 4:] = -10000.0
    boolean = torch.rand(n, 1, t, s, generator=torch.Generator().manual_seed(1)) > 0.3
    boolean[0, 0, 2] = False  # a row with every key masked
    return {"none": (None, False), "additive": (additive, False), "bool": (boolean, False),
            "causal": (None, True)}


def errors(fn, q, k, v, mask, causal, grad):
    """Relative errors of fn's output and q/k/v gradients against fp64 aten."""
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_mask = mask.double() if mask is not None and mask.is_floating_point() else mask
    ref = F.scaled_dot_product_attention(*ref_in, ref_mask, is_causal=causal)
    ref.backward(grad.double())
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v, mask, is_causal=causal)
    out.backward(grad)
    pairs = [(out, ref)] + [(t.grad, r.grad) for t, r in zip((q, k, v), ref_in)]
    return [((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in pairs]


@pytest.mark.parametrize("kind", ["none", "additive", "bool", "causal"])
def test_unfused_attention_is_as_accurate_as_the_fused_kernel(kind):
    q, k, v = qkv()
    mask, causal = masks(4, 16, 16)[kind]
    assert unfused_pays(q, k, v, mask, 0.0, False)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(BF16)

    def fused(*a, **kw):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(*a, **kw)

    assert "ampgraph_attention" in amp_attention(q, k, v, mask, is_causal=causal
                                                 ).grad_fn.name()  # the unfused op ran
    ours = errors(amp_attention, q, k, v, mask, causal, grad)
    theirs = errors(fused, q, k, v, mask, causal, grad)
    for mine, aten_err in zip(ours, theirs):  # output, dq, dk, dv
        assert mine <= 1.5 * aten_err + 1e-3, (ours, theirs)
        assert mine < 2e-2


@pytest.mark.parametrize("chunk", ["heads", "batch entries"])
@pytest.mark.parametrize("kind", ["none", "additive", "bool", "causal", "dropout",
                                  "2-D mask", "per-head mask", "permuted", "3-D"])
def test_chunks_of_heads_give_the_whole_tensors_results_bit_for_bit(kind, chunk, monkeypatch):
    q, k, v = (t.detach() for t in qkv(t=16, d=16, s=24))
    mask, causal = masks(4, 16, 24).get("bool" if kind == "dropout" else kind, (None, False))
    dropout = 0.3 if kind == "dropout" else 0.0
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(BF16)
    if kind == "2-D mask":
        mask = torch.rand(16, 24, generator=torch.Generator().manual_seed(3)) > 0.3
    if kind == "per-head mask":
        mask = torch.randn(1, 2, 16, 24, generator=torch.Generator().manual_seed(3)).to(BF16)
    if kind == "permuted":  # strides of a projection's views, as in a ViT
        q, k, v, grad = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v, grad))
    if kind == "3-D":  # batch and heads in one dim: chunks of the first dim only
        q, k, v, grad = (t.flatten(0, 1) for t in (q, k, v, grad))

    def run():
        torch.manual_seed(5)
        out, p, dropped = torch.ops.ampgraph.attention(q, k, v, mask, causal, 0.25, dropout)
        return (out, p, dropped,
                *torch.ops.ampgraph.attention_backward(grad, q, k, v, p, dropped, 0.25))

    whole = run()
    per_head = 4 * 16 * 24  # bytes of one head's fp32 scores
    monkeypatch.setattr(attention, "CHUNK_BYTES", per_head if chunk == "heads" else 2 * per_head)
    assert len(list(attention._chunks((4, 2, 16, 24)))) == (8 if chunk == "heads" else 4)
    assert len(list(attention._chunks((8, 16, 24)))) == (8 if chunk == "heads" else 4)
    for got, want in zip(run(), whole):
        assert torch.equal(got, want)


@pytest.mark.parametrize("t,s", [(4, 8), (8, 4)])
def test_causal_with_unequal_query_and_key_lengths_is_top_left_aligned(t, s):
    q, k, v = qkv(n=2, h=2, t=t, s=s, d=8)
    assert unfused_pays(q, k, v, None, 0.0, False)
    ours = amp_attention(q, k, v, is_causal=True)
    ref = F.scaled_dot_product_attention(*(x.detach().double() for x in (q, k, v)),
                                         is_causal=True)
    assert "ampgraph_attention" in ours.grad_fn.name()
    assert torch.allclose(ours.double(), ref, atol=2e-2, rtol=2e-2)


def test_rows_with_every_key_masked_give_zeros_and_zero_gradients():
    q, k, v = qkv(n=1, h=1, t=4, d=8)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    mask[0, 0, 1] = False
    out = amp_attention(q, k, v, mask)
    assert torch.equal(out[0, 0, 1], torch.zeros(8, dtype=BF16))
    out.float().sum().backward()
    assert torch.equal(q.grad[0, 0, 1], torch.zeros(8, dtype=BF16))
    assert torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()


def test_nan_inputs_still_reach_the_output():
    q, k, v = qkv(n=1, h=1, t=4, d=8)
    with torch.no_grad():
        q[0, 0, 0, 0] = float("nan")
    assert torch.isnan(amp_attention(q, k, v)[0, 0, 0]).all()


def test_inference_keeps_the_fused_kernel():
    q, k, v = qkv()
    mask = masks(4, 16, 16)["additive"][0]
    with torch.no_grad():
        assert torch.equal(amp_attention(q, k, v, mask), F.scaled_dot_product_attention(
            q, k, v, mask))


@pytest.mark.parametrize("kind", ["additive", "bool", "causal"])
def test_the_custom_ops_pass_opcheck(kind):
    """Fake kernels (strides included: torch.compile checks them), autograd registration
    and schema agree with the real kernels."""
    q, k, v = qkv(n=2, h=2, t=8, d=8)
    mask, causal = masks(2, 8, 8)[kind]
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
               for t in (q, k, v))  # permuted strides, as a projection's views
    torch.library.opcheck(torch.ops.ampgraph.attention.default, (q, k, v, mask, causal, 0.35))
    out, p, dropped = torch.ops.ampgraph.attention(q, k, v, mask, causal, 0.35)
    torch.library.opcheck(torch.ops.ampgraph.attention_backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), p,
                           dropped, 0.35))


def test_too_few_scores_go_to_aten_s_kernels(monkeypatch):
    monkeypatch.setattr(attention, "MIN_UNFUSED_SCORES", MIN_SCORES)
    assert not unfused_pays(*qkv(n=2, h=2, t=12, d=16), None, 0.0, False)  # a tiny HF model
    per_batch = 2 * 16 * 16  # scores of one batch row: 2 heads x 16 queries x 16 keys
    assert unfused_pays(*qkv(n=MIN_SCORES // per_batch), None, 0.0, False)
    assert not unfused_pays(*qkv(n=MIN_SCORES // per_batch - 1), None, 0.0, False)
    # aten's math path with dropout is faster up to twice as many
    assert unfused_pays(*qkv(n=2 * MIN_SCORES // per_batch), None, 0.1, False)
    assert not unfused_pays(*qkv(n=2 * MIN_SCORES // per_batch - 1), None, 0.1, False)


def test_training_runs_unfused_up_to_four_times_the_head_dim_of_keys_and_256_at_most():
    assert unfused_pays(*qkv(t=16, d=16, s=64), None, 0.0, False)
    assert not unfused_pays(*qkv(t=16, d=16, s=65), None, 0.0, False)
    assert unfused_pays(*qkv(n=1, h=1, t=8, d=128, s=256), None, 0.0, False)
    assert not unfused_pays(*qkv(n=1, h=1, t=8, d=128, s=257), None, 0.0, False)
    assert unfused_pays(*qkv(t=8, d=16, s=257), None, 0.1, False)  # dropout: any length


@pytest.mark.parametrize("case", ["more keys than 4x the head dim", "fp16", "fp32",
                                  "mask wants a gradient", "grouped heads without enable_gqa",
                                  "fp32 mask", "no keys"])
def test_other_calls_go_to_aten_unchanged(case):
    q, k, v = qkv(t=16, d=16, s={"more keys than 4x the head dim": 65, "no keys": 0}.get(case),
                  dtype=torch.float16 if case == "fp16" else
                  torch.float32 if case == "fp32" else BF16)
    mask, dropout, gqa = None, 0.0, False
    if case == "mask wants a gradient":
        mask = torch.zeros(4, 1, 1, 16, dtype=BF16, requires_grad=True)
    if case in ("fp32 mask", "no keys"):
        mask = torch.zeros(4, 1, 1, k.shape[-2])
    if case == "grouped heads without enable_gqa":
        k, v = (t.detach()[:, :1].requires_grad_() for t in (k, v))
    assert not unfused_pays(q, k, v, mask, dropout, gqa)
    torch.manual_seed(0)
    ours = amp_attention(q, k, v, mask, dropout, enable_gqa=gqa)
    torch.manual_seed(0)
    ref = F.scaled_dot_product_attention(q, k, v, mask, dropout, enable_gqa=gqa)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_grouped_heads_run_unfused_on_repeated_heads(dropout):
    """enable_gqa (the graph's group_kv_heads takes HF's repeat_kv away): the unfused kernel
    repeats the heads itself, as the graph did: the same outputs and gradients."""
    q, k, v = qkv(h=4)
    k, v = (t.detach()[:, :2].clone().requires_grad_() for t in (k, v))
    mask = masks(4, 16, 16)["bool"][0]
    assert unfused_pays(q, k, v, mask, dropout, True)
    results = []
    for grouped in (True, False):
        for t in (q, k, v):
            t.grad = None
        torch.manual_seed(0)
        keys, values = (k, v) if grouped else (attention._repeat_heads(t, 4) for t in (k, v))
        out = amp_attention(q, keys, values, mask, dropout, enable_gqa=grouped)
        out.float().sum().backward()
        results.append((out, q.grad, k.grad, v.grad))
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    torch.manual_seed(0)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), mask,
                                         enable_gqa=True)
    if not dropout:
        torch.testing.assert_close(results[0][0].float(), ref, rtol=2e-2, atol=2e-2)


def test_o2_routes_bert_attention_and_trains_like_fp32():
    torch.manual_seed(0)
    model = bert_encoder.make_model()  # head dim 16, 16 tokens: unfused
    ids, mask = bert_encoder.example_inputs(4)
    ref = copy.deepcopy(model)
    amp = ampgraph.compile(model, "O2", BF16)
    out, rec = record(lambda: amp(ids, mask))
    assert [d for n, d in rec.calls if n == "attention"] == [[BF16] * 4] * 2  # 2 layers
    (part,) = [c for _, c in amp.amp_parts()[0]]
    targets = [n.target for n in part.gm.graph.nodes if n.op == "call_function"]
    assert amp_attention in targets
    assert torch.ops.aten.scaled_dot_product_attention.default not in targets
    routed = next(n for n in part.gm.graph.nodes if n.target is amp_attention)
    flops = node_flops(routed)
    routed.target = torch.ops.aten.scaled_dot_product_attention.default
    assert flops == node_flops(routed) > 0  # a routed node counts as attention in reports
    routed.target = amp_attention
    ref_out = ref(ids, mask)
    assert (out.float() - ref_out).norm() / ref_out.norm() < 3e-2
    out.float().sum().backward()
    ref_out.sum().backward()
    for (name, p), r in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert (p.grad - r.grad).norm() <= 0.05 * r.grad.norm() + 1e-6, name


def test_a_torch_compile_backend_traces_the_routed_attention():
    """backend= hands the rewritten graph to torch.compile; AOTAutograd traces the custom
    ops through their fake kernels (aot_eager: no C++ compiler needed)."""
    torch.manual_seed(0)
    model = bert_encoder.make_model()
    ids, mask = bert_encoder.example_inputs(4)
    eager = ampgraph.compile(copy.deepcopy(model), "O2", BF16)
    traced = ampgraph.compile(model, "O2", BF16, backend="aot_eager")
    outs = []
    for net in (eager, traced):
        out = net(ids, mask)
        out.float().sum().backward()
        outs.append(out)
    (part,) = [c for _, c in traced.amp_parts()[0]]
    assert amp_attention in [n.target for n in part.gm.graph.nodes]
    assert torch.allclose(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    for p, r in zip(traced.parameters(), eager.parameters()):
        assert (p.grad - r.grad).norm() <= 0.02 * r.grad.norm() + 1e-6


def test_the_routed_function_takes_aten_arguments_by_their_names():
    """Graph nodes may pass any argument by keyword: the names must be aten's."""
    import inspect

    schema = torch.ops.aten.scaled_dot_product_attention.default._schema
    params = inspect.signature(amp_attention).parameters
    assert list(params) == [a.name for a in schema.arguments]
    assert [p.kind == p.KEYWORD_ONLY for p in params.values()] == [
        a.kwarg_only for a in schema.arguments]


# -- dropout: aten's math path, with bf16 matmuls -------------------------------------------


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.detach().double().flatten(), b.detach().double().flatten(),
                                     dim=0))


@pytest.mark.parametrize("keys", [16, 48])  # within and beyond the no-dropout key limit
def test_dropout_runs_unfused_and_matches_aten_s_math_path_given_the_same_mask(keys):
    q, k, v = qkv(t=16, d=16, s=keys)
    mask = masks(4, 16, keys)["bool"][0]
    assert unfused_pays(q, k, v, mask, 0.3, False)
    grad = torch.randn(4, 2, 16, 16, dtype=BF16)
    torch.manual_seed(7)
    ours = amp_attention(q, k, v, mask, 0.3)
    assert "ampgraph_attention" in ours.grad_fn.name()
    got = torch.autograd.grad(ours, (q, k, v), grad)
    torch.manual_seed(7)  # the mask the op drew, handed to aten's fp32 math path
    kept = keep_mask((4, 2, 16, keys), 0.7)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))  # as sdpa's front
    ref = torch.ops.aten._scaled_dot_product_attention_math(
        *(t.float() for t in (q, k, v)), additive, 0.3, dropout_mask=kept)[0]
    want = torch.autograd.grad(ref, (q, k, v), grad.float())
    assert cos(ours, ref) >= 0.999
    assert all(cos(a, b) >= 0.99 for a, b in zip(got, want))
    torch.manual_seed(8)  # another mask: far apart, so the agreement above is the mask's
    assert cos(amp_attention(q, k, v, mask, 0.3), ref) < 0.97


def test_dropout_keeps_one_minus_p_and_scales_the_kept_by_its_inverse():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 64, 32, dtype=BF16) for _ in range(3))
    state = torch.get_rng_state()
    out, p, dropped = torch.ops.ampgraph.attention(q, k, v, None, False, 32 ** -0.5, 0.25)
    assert dropped.dtype == BF16 and dropped.shape == p.shape
    keep = dropped != 0
    torch.set_rng_state(state)  # the runtime's draw, of the scores' shape
    assert torch.equal(keep, keep_mask(p.shape, 0.75))
    assert abs(keep.float().mean().item() - 0.75) < 0.01
    torch.testing.assert_close(dropped, (p.float() * keep / 0.75).to(BF16), rtol=0.01,
                               atol=0)  # p rounded after dropout, once
    torch.testing.assert_close(out, torch.matmul(dropped, v), rtol=0, atol=0)
    _, _, none = torch.ops.ampgraph.attention(q, k, v, None, False, 0.1, 0.0)
    assert none.numel() == 0


def test_inference_with_dropout_also_runs_unfused():
    q, k, v = qkv()
    with torch.no_grad():
        torch.manual_seed(3)
        _, rec = record(lambda: amp_attention(q, k, v, None, 0.2))
    assert "attention" in [name for name, _ in rec.calls]
    assert not unfused_pays(q, k, v, None, 0.0, False, training=False)


def test_o2_bert_training_with_attention_dropout_runs_bf16_matmuls():
    torch.manual_seed(0)
    model = bert_encoder.make_model(dropout=0.1).train()
    ids, mask = bert_encoder.example_inputs(4)
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16")
    out, rec = record(lambda: net(ids, mask))
    out.float().sum().backward()
    names = [name for name, _ in rec.calls]
    assert "attention" in names  # ampgraph::attention, not aten's fp32 math path
    assert all(d[0] == BF16 for name, d in rec.calls if name in ("bmm", "attention"))


@pytest.mark.parametrize("training", [False, True])
def test_a_boolean_mask_that_masks_nothing_is_dropped(training):
    """A captured HF ViT builds an all-true mask from the traced shapes where eager HF passes
    none: the kernel then runs unmasked, with the same values. A mask with one False is
    kept."""
    q, k, v = qkv()
    if not training:
        q, k, v = (t.detach() for t in (q, k, v))
    everything = torch.ones(4, 1, 16, 16, dtype=torch.bool).expand(4, 2, 16, 16)
    one_off = everything.clone()
    one_off[0, 0, 0, 0] = False
    with torch.set_grad_enabled(training):
        out, rec = record(lambda: amp_attention(q, k, v, everything))
        masked_ops = {n for n, _ in rec.calls} & {"where", "masked_fill_", "logical_not"}
        assert not masked_ops
        assert torch.equal(out, amp_attention(q, k, v))
        assert not torch.equal(amp_attention(q, k, v, one_off), out)
        row = torch.ones(16, dtype=torch.bool)  # one key masked, expanded as a captured
        row[3] = False  # model's mask is (stride 0 over batch, heads and queries)
        expanded = row.expand(4, 2, 16, 16)
        assert torch.equal(amp_attention(q, k, v, expanded),
                           amp_attention(q, k, v, expanded.contiguous()))
        assert not torch.equal(amp_attention(q, k, v, expanded), out)


def test_an_expanded_mask_is_checked_on_its_values_once():
    row = torch.tensor([True, False, True])
    unexpanded = attention._unexpanded
    assert unexpanded(row.expand(5, 2, 4, 3)).shape == (3,)
    assert torch.equal(unexpanded(row.expand(5, 2, 4, 3)), row)
    full = torch.ones(2, 3, dtype=torch.bool)
    assert torch.equal(unexpanded(full), full)


@pytest.mark.parametrize("kind,dropout", [("bool", 0.0), ("causal", 0.0), ("none", 0.3)])
def test_a_gradient_penalty_differentiates_the_unfused_attention_twice(kind, dropout):
    """create_graph=True through ``ampgraph::attention`` (its backward then runs as plain
    differentiable ops, with the dropout it drew): second-order gradients agree with aten's
    math path given the same mask."""
    q, k, v = qkv()
    mask, causal = masks(4, 16, 16)[kind]
    assert unfused_pays(q, k, v, mask, dropout, False)

    def aten_math(q, k, v, mask, dropout, is_causal):
        if not dropout:
            with sdpa_kernel([SDPBackend.MATH]):
                return F.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal)
        kept = keep_mask((*q.shape[:-1], k.shape[-2]), 1 - dropout)  # the op's draw
        return torch.ops.aten._scaled_dot_product_attention_math(
            *(t.float() for t in (q, k, v)), mask, dropout, is_causal, dropout_mask=kept)[0]

    second = []
    for fn in (amp_attention, aten_math):
        torch.manual_seed(7)
        out = fn(q, k, v, mask, dropout, is_causal=causal)
        if fn is amp_attention:
            assert "ampgraph_attention" in out.grad_fn.name()
        (gq,) = torch.autograd.grad(out.float().square().sum(), q, create_graph=True)
        second.append(torch.autograd.grad(gq.float().square().sum(), (q, k, v)))
    for a, b in zip(*second):
        assert cos(a, b) >= 0.99
