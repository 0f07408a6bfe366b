"""ampgraph/runtime/cpu/packed.py: inference linears on weights packed for oneDNN."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.autograd import forward_ad as fwAD

import ampgraph
from ampgraph.runtime.cpu import packed
from ampgraph.runtime.cpu.activations import ACTIVATIONS
from ampgraph.runtime.cpu.weights import WeightCache

BF16 = torch.bfloat16
needs_onednn_bf16 = pytest.mark.skipif(not packed._runs(BF16),
                                       reason="this CPU's oneDNN does not run bf16")


def packed_entries(cache: WeightCache) -> list[torch.Tensor]:
    return [entry[1] for _, per in cache._slots.values() for tag, entry in per.items()
            if tag[-1] == "packed"]


def aten_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.aten.linear.default(x, w.to(x.dtype), None if b is None else b.to(x.dtype))


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_the_packed_linear_is_aten_s_for_any_rows_after_packing(bias, dtype):
    if not packed._runs(dtype):
        pytest.skip(f"this CPU's oneDNN does not run {dtype}")
    torch.manual_seed(0)
    cache = WeightCache()
    w, b = nn.Parameter(torch.randn(96, 64)), nn.Parameter(torch.randn(96)) if bias else None
    shapes = [(8, 64), (1, 64), (3, 64), (200, 64), (2, 5, 64), (4, 3, 7, 64), (64,)]
    with torch.no_grad():
        for shape in shapes:  # packed on the first call's 8 rows, a hint only
            x = torch.randn(*shape).to(dtype)
            got = cache.amp_linear(x, w, b)
            torch.testing.assert_close(got, aten_linear(x, w, b))
            assert got.shape == (*shape[:-1], 96) and got.dtype == dtype
    (wp,) = packed_entries(cache)  # one packed copy, made once
    assert wp.layout == torch._mkldnn and wp.dtype == dtype


@needs_onednn_bf16
def test_non_contiguous_and_empty_inputs():
    torch.manual_seed(0)
    cache = WeightCache()
    w, b = torch.randn(48, 16), torch.randn(48)
    with torch.no_grad():
        for x in (torch.randn(16, 10).to(BF16).t(), torch.randn(9, 4, 16).to(BF16).transpose(0, 1),
                  torch.randn(0, 16).to(BF16)):
            # aten runs the transposed 3-D input as a bmm: another summation order
            torch.testing.assert_close(cache.amp_linear(x, w, b), aten_linear(x, w, b),
                                       rtol=1.6e-2, atol=1e-2)
    assert packed_entries(cache)


@needs_onednn_bf16
def test_an_update_of_the_master_repacks():
    torch.manual_seed(0)
    cache = WeightCache()
    w = nn.Parameter(torch.randn(32, 16))
    x = torch.randn(4, 16).to(BF16)
    with torch.no_grad():
        before = cache.amp_linear(x, w)
        w.mul_(-2)  # what an optimizer step does: the version counter moves
        after = cache.amp_linear(x, w)
    torch.testing.assert_close(after, aten_linear(x, w, None))
    torch.testing.assert_close(after, -2 * before)
    assert len(packed_entries(cache)) == 1
    cache.drop_inference_copies(w)
    assert packed_entries(cache) == []


@needs_onednn_bf16
def test_cache_size_counts_the_packed_copy():
    cache, w = WeightCache(), torch.randn(128, 64)
    with torch.no_grad():
        cache.amp_linear(torch.randn(4, 64).to(BF16), w)
    assert cache.nbytes() >= 128 * 64 * 2
    del w  # the entry dies with its master
    assert cache.nbytes() == 0


def test_what_is_not_packed_goes_to_aten():
    """An input that records a gradient (a frozen weight, as under LoRA), a weight already
    in the input's dtype, oneDNN switched off and a tensor subclass keep aten's linear."""
    torch.manual_seed(0)
    cache = WeightCache()
    w = torch.randn(32, 16)  # frozen: no requires_grad
    x = torch.randn(4, 16).to(BF16).requires_grad_()
    out = cache.amp_linear(x, w)
    out.float().sum().backward()
    torch.testing.assert_close(x.grad, w.to(BF16).sum(0).expand(4, -1))
    with torch.no_grad():
        cache.amp_linear(x.detach(), w.to(BF16))
        with torch.backends.mkldnn.flags(enabled=False):
            off = cache.amp_linear(x.detach(), w)
    torch.testing.assert_close(off, aten_linear(x.detach(), w, None))
    assert packed_entries(cache) == []

    class Sub(torch.Tensor):
        pass

    assert not packed.usable(x.detach().as_subclass(Sub), w, None)
    assert not packed.usable(x.detach(), torch.randn(32, 8), None)  # shapes that do not match
    with torch.no_grad():  # oneDNN has no primitive for an empty weight: aten's zeros
        for w0 in (torch.randn(0, 16), torch.randn(8, 0)):
            x0 = torch.randn(4, w0.shape[1]).to(BF16)
            torch.testing.assert_close(cache.amp_linear(x0, w0), aten_linear(x0, w0, None))


@needs_onednn_bf16
@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_a_compiled_model_infers_on_packed_weights_and_trains_after(context):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10))
    net = ampgraph.compile(model, amp_level="O2").eval()
    x = torch.randn(8, 64)
    with context():
        got = net(x)
    with torch.no_grad():
        h = nn.functional.gelu(aten_linear(x.to(BF16), model[0].weight, model[0].bias))
        ref = aten_linear(h, model[2].weight, model[2].bias).float()
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    cache = net._amp_runtime.weights
    assert len(packed_entries(cache)) == 2
    net.train()
    net(x).sum().backward()  # training drops the now stale packed copies
    assert packed_entries(cache) == []
    assert all(p.grad is not None for p in model.parameters())
    net.clear_weight_cache()


@needs_onednn_bf16
def test_a_bias_that_trains_on_a_frozen_weight_keeps_its_gradient():
    """BitFit-style: oneDNN's op has no derivative, so such a call goes to aten."""
    torch.manual_seed(0)
    cache = WeightCache()
    w = torch.randn(32, 16)  # frozen
    for b in (nn.Parameter(torch.randn(32)), nn.Parameter(torch.randn(32).to(BF16))):
        cache.amp_linear(torch.randn(4, 16).to(BF16), w, b).float().sum().backward()
        torch.testing.assert_close(b.grad, torch.full_like(b, 4.0))
    assert packed_entries(cache) == []


@needs_onednn_bf16
def test_forward_mode_ad_keeps_its_tangent():
    torch.manual_seed(0)
    cache = WeightCache()
    w = torch.randn(32, 16)
    x, t = torch.randn(4, 16).to(BF16), torch.randn(4, 16).to(BF16)
    want = aten_linear(t, w, None)
    with torch.no_grad(), fwAD.dual_level():
        tangent = fwAD.unpack_dual(cache.amp_linear(fwAD.make_dual(x, t), w)).tangent
    torch.testing.assert_close(tangent, want)
    _, tangent = torch.func.jvp(lambda v: cache.amp_linear(v, w), (x,), (t,))
    torch.testing.assert_close(tangent, want)
    assert packed_entries(cache) == []


@needs_onednn_bf16
def test_torch_compile_traces_aten_s_linear():
    """torch.compile sees plain tensors; it must not trace oneDNN's packed op (inductor
    cannot lower it on a packed weight)."""
    w, x = torch.randn(32, 16), torch.randn(4, 16).to(BF16)
    assert packed.usable(x, w, None)
    traced = torch.compile(lambda v: v + packed.usable(v, w, None), backend="eager",
                           fullgraph=True)
    torch.testing.assert_close(traced(x), x)  # usable was False while tracing


@needs_onednn_bf16
def test_a_frozen_weight_keeps_one_inference_copy():
    """Under LoRA a frozen base weight is linear'd with input gradients in training (the
    plain copy) and without in evaluation (the packed one): never both at once."""
    cache = WeightCache()
    w, x = torch.randn(32, 16), torch.randn(4, 16).to(BF16)

    def copies():
        return sorted(str(tag[-1]) for _, per in cache._slots.values() for tag in per)

    for _ in range(2):
        cache.amp_linear(x.clone().requires_grad_(), w).sum().backward()
        assert copies() == ["None"]
        with torch.no_grad():
            cache.amp_linear(x, w)
        assert copies() == ["packed"]


@needs_onednn_bf16
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu"])
def test_an_activation_runs_in_the_epilogue_as_aten_s_after_the_product(activation):
    """oneDNN applies it to the fp32 accumulator before the one rounding: within one bf16
    rounding of aten's activation on the rounded product (ReLU: equal)."""
    torch.manual_seed(0)
    cache, w, b = WeightCache(), torch.randn(64, 48), torch.randn(64)
    x = torch.randn(2, 7, 48).to(BF16)
    with torch.no_grad():
        got = cache.amp_linear(x, w, b, activation=activation)
        want = ACTIVATIONS[activation](aten_linear(x, w, b))
    assert len(packed_entries(cache)) == 1 and got.dtype == BF16
    if activation == "relu":
        assert torch.equal(got, want)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [True, False])
def test_a_weight_stored_in_by_out_is_packed_transposed_and_trains_as_addmm(bias):
    """transformers' Conv1D: ``addmm(b, x, w)`` with ``w`` [in, out]."""
    torch.manual_seed(0)
    cache = WeightCache()
    w = torch.randn(48, 64, requires_grad=True)
    b = torch.randn(64, requires_grad=True) if bias else None
    x = torch.randn(14, 48).to(BF16)
    want = torch.addmm(b.to(BF16), x, w.to(BF16)) if bias else torch.mm(x, w.to(BF16))
    with torch.no_grad():
        first = cache.amp_linear(x, w, b, transposed=True)  # a cast and addmm
        got = cache.amp_linear(x, w, b, transposed=True)
    assert torch.equal(first, want.detach())
    (wp,) = [entry[1] for _, per in cache._slots.values()
             for tag, entry in per.items() if tag[-1] == "packed_t"]
    torch.testing.assert_close(got, want.detach(), rtol=1e-2, atol=1e-2)
    out = cache.amp_linear(x, w, b, transposed=True)  # training: a cast and addmm, as before
    out.float().square().sum().backward()
    gw = w.grad.clone()
    w.grad = None
    want.float().square().sum().backward()
    assert torch.equal(gw, w.grad)
    assert not [tag for _, per in cache._slots.values() for tag in per if tag[-1] == "packed_t"]


@needs_onednn_bf16
def test_a_transposed_weight_is_packed_when_its_plain_copy_is_used_again():
    """Its reorder costs ~3x a plain weight's: an evaluation after every training step
    casts only; the packed copy is made from the plain one on the next call on an unchanged
    master (no second cast)."""
    cache, w = WeightCache(), nn.Parameter(torch.randn(16, 32))
    x = torch.randn(4, 16).to(BF16)

    def tags():
        return sorted(str(tag[-1]) for _, per in cache._slots.values() for tag in per)

    for _ in range(2):
        with torch.no_grad():
            first = cache.amp_linear(x, w, transposed=True)
            assert tags() == ["None"]
            assert torch.equal(first, torch.mm(x, w.to(BF16)))
            cache.amp_linear(x, w, transposed=True)
            assert tags() == ["packed_t"]
        cache.amp_linear(x, w, transposed=True).float().sum().backward()  # drops both
        assert "packed_t" not in tags()
        with torch.no_grad():
            w.add_(1.0)
