"""ampgraph/runtime/cpu/weights.py: the WeightCache's inference copies, casts (channels-last
too), kept gradient buffers, and the small weights that train as autocast's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampgraph.runtime.cpu.weights as weights
from tests.ampgraph.runtime.cpu.helpers import (
    Lookup,
    Net,
    blocks,
    compiled,
    fused_and_plain,
)


def test_training_drops_the_inference_copies(monkeypatch):
    blocks(monkeypatch, 40)  # fc1/fc3 blocked, fc2 cast whole
    model = Net()
    x = torch.randn(3, 16)
    gm, cache = compiled(model, x, True)
    with torch.no_grad():
        gm(x)

    def kinds():
        return sorted(key[0] for _, per in cache._slots.values() for key in per)

    assert kinds().count("infer") == 6  # every weight and bias
    gm(x).sum().backward()
    assert "infer" not in kinds()


@pytest.mark.parametrize("blocked", [False, True])
def test_a_large_gradient_buffer_is_kept_only_while_the_last_gradient_outlives_forward(
        blocked, monkeypatch):
    """zero_grad after forward: the last gradient lives through forward anyway, so the next
    one reuses its storage. zero_grad before forward: nothing is kept (a kept buffer would
    add a whole gradient to the forward's peak), and without zero_grad the gradients add
    up as autograd's do."""
    monkeypatch.setattr(weights, "KEPT_GRAD_NUMEL", 512)  # fc1 (fc2 is used twice)
    if blocked:
        blocks(monkeypatch, 64, 512)
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(4, 16)
    gm, cache, plain = fused_and_plain(model, x)
    w = model.fc1.weight

    def storages(zero_first, steps=4):
        seen = []
        for _ in range(steps):
            if zero_first:
                model.zero_grad(set_to_none=True)
            loss = gm(x).square().mean()
            if not zero_first:
                model.zero_grad(set_to_none=True)
            loss.backward()
            seen.append(w.grad.untyped_storage().data_ptr())
        return seen

    late = storages(zero_first=False)
    assert late[1] == late[2] == late[3]
    storages(zero_first=True, steps=1)
    assert not any(k[0] == "grad" for k in cache._per_param(w)), "nothing kept"

    model.zero_grad(set_to_none=True)
    for _ in range(3):  # accumulation: the gradient outlives forward and backward
        gm(x).square().mean().backward()
        plain(x).square().mean().backward()
    ref = dict(plain.named_parameters())["fc1.weight"].grad
    torch.testing.assert_close(w.grad, ref, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("small", [True, False])
def test_conv_weights_of_a_channels_last_graph_are_cast_channels_last(small, monkeypatch):
    """The convolutions run NHWC: an NCHW 3x3 weight would be copied on every call. The
    cast writes channels-last; the gradient keeps the master's strides (a small weight's
    by AccumulateGrad's copy, a larger one's by the cast's backward); values as aten's."""
    if not small:
        monkeypatch.setattr(weights, "KEPT_COPY_BYTES", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 4))
    x = torch.randn(2, 3, 8, 8)
    gm, cache, plain = fused_and_plain(model, x)
    conv_casts = [n for n in gm.graph.nodes if n.target == cache.cast
                  and n.kwargs.get("memory_format") == torch.channels_last]
    assert sorted(n.args[0].target for n in conv_casts) == ["0.weight", "3.weight"]
    seen = []
    orig = cache.cast

    def spy(p, dtype, memory_format=None):
        out = orig(p, dtype, memory_format)
        if p.dim() == 4:
            seen.append(out.is_contiguous(memory_format=torch.channels_last))
        return out

    for node in conv_casts:
        node.target = spy
    gm.recompile()
    gm(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert seen == [True, True]
    for name, p in dict(plain.named_parameters()).items():
        mine = dict(gm.named_parameters())[name]
        assert mine.grad.stride() == mine.stride(), name
        torch.testing.assert_close(mine.grad, p.grad, rtol=2e-2, atol=1e-3)
    with torch.no_grad():  # inference copies are channels-last too
        torch.testing.assert_close(gm(x), plain(x), rtol=2e-2, atol=1e-2)
    assert seen[-2:] == [True, True]


def python_backward_nodes(out):
    """Names of the autograd nodes behind ``out`` that run Python (custom Functions)."""
    seen, todo, names = set(), [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if isinstance(fn, torch.autograd.function.BackwardCFunction):
            names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


@pytest.mark.parametrize("small", [True, False])
def test_small_weights_train_on_aten_s_ops_with_no_python_in_backward(small, monkeypatch):
    """A weight whose copy and gradient would not be kept, and that is not blocked, trains
    as autocast's: a cast and aten's linear / embedding (autograd's backward, no Python)."""
    if not small:
        monkeypatch.setattr(weights, "KEPT_COPY_BYTES", 0)
        monkeypatch.setattr(weights, "KEPT_GRAD_NUMEL", 0)
    torch.manual_seed(0)
    gm, _ = compiled(Lookup(), torch.randint(0, 50, (3, 5)), True)
    net, _ = compiled(Net(), torch.randn(3, 16), True)
    found = python_backward_nodes(gm(torch.randint(0, 50, (3, 5))))
    found |= python_backward_nodes(net(torch.randn(3, 16)))
    # fc2's weight, shared by two linears, is cast once by the cache's cast
    assert found == (set() if small else {"AmpEmbeddingBackward", "AmpLinearBackward",
                                          "CastIntoBackward"})


def test_pooled_scratch_is_handed_out_only_while_nothing_else_holds_it():
    cache = weights.WeightCache()
    a = cache.pooled((4, 4), torch.bfloat16, torch.device("cpu"))
    b = cache.pooled((4, 4), torch.bfloat16, torch.device("cpu"))
    assert a.data_ptr() != b.data_ptr(), "a held scratch is not handed out twice"
    ptr = a.data_ptr()
    del a
    again = cache.pooled((4, 4), torch.bfloat16, torch.device("cpu"))
    assert again.data_ptr() == ptr, "released: reused"
    other = cache.pooled((2, 8), torch.bfloat16, torch.device("cpu"))
    assert other.shape == (2, 8) and cache.nbytes() == 3 * 16 * 2
    cache.clear()
    assert cache.nbytes() == 0
