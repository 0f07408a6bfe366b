"""Kept buffers for large outputs: reused once the caller (or a graph) lets go, never while
one holds it; small or strided ones are fresh."""

from __future__ import annotations

import torch
from torch import nn

import ampgraph
import ampgraph.runtime.cpu.outputs as outputs
from ampgraph.runtime.cpu.outputs import OutputBuffers

BF16 = torch.bfloat16


def test_a_released_output_buffer_is_reused_and_a_held_one_never(monkeypatch):
    monkeypatch.setattr(outputs, "OUTPUT_BYTES", 64)
    buffers = OutputBuffers()
    x = torch.randn(4, 8).to(BF16)
    a = buffers.cast(x, torch.float32, "s")
    torch.testing.assert_close(a, x.float(), rtol=0, atol=0)
    ptr = a.data_ptr()
    b = buffers.cast(x * 2, torch.float32, "s")  # a is held: the second buffer
    assert b.data_ptr() != ptr
    torch.testing.assert_close(a, x.float(), rtol=0, atol=0)  # not overwritten
    del a
    c = buffers.cast(x * 3, torch.float32, "s")  # a's buffer, free again
    assert c.data_ptr() == ptr
    torch.testing.assert_close(c, (x * 3).float(), rtol=0, atol=0)
    torch.testing.assert_close(b, (x * 2).float(), rtol=0, atol=0)
    view = c[1]  # a view holds the storage too
    del c
    d = buffers.cast(x, torch.float32, "s")  # both held (b and the view): a fresh one
    assert d.data_ptr() not in (ptr, b.data_ptr())
    assert view.data_ptr() == ptr + 8 * 4
    assert buffers.cast(x, torch.float32, "other").data_ptr() != d.data_ptr()
    assert buffers.nbytes() == 3 * x.numel() * 4  # two kept for "s", one for "other"
    buffers.clear()
    assert buffers.nbytes() == 0


def test_small_or_strided_outputs_are_fresh(monkeypatch):
    buffers = OutputBuffers()
    x = torch.randn(4, 8).to(BF16)
    assert buffers.cast(x, torch.float32, "s").dtype == torch.float32
    assert buffers.nbytes() == 0  # below OUTPUT_BYTES
    monkeypatch.setattr(outputs, "OUTPUT_BYTES", 64)
    t = buffers.cast(x.t(), torch.float32, "s")
    assert t.stride() == x.t().float().stride() and buffers.nbytes() == 0


def test_an_output_with_a_graph_reuses_a_buffer_its_last_graph_let_go(monkeypatch):
    monkeypatch.setattr(outputs, "OUTPUT_BYTES", 64)
    buffers = OutputBuffers()
    w = torch.randn(4, 8).to(BF16).requires_grad_()
    y = buffers.cast(w * 1, torch.float32, "s")
    ptr = y.data_ptr()
    loss = y.square().sum()  # square saves y: its graph holds the buffer
    del y
    z = buffers.cast(w * 2, torch.float32, "s")
    assert z.data_ptr() != ptr  # not over the output the first graph saved
    loss.backward()
    torch.testing.assert_close(w.grad, (2 * w).detach(), rtol=0.01, atol=0)
    assert w.grad.dtype == BF16
    del loss, z
    again = buffers.cast(w * 3, torch.float32, "s")
    assert again.data_ptr() == ptr  # the graph that saved it is gone
    again.sum().backward()
    assert again.grad_fn is not None


def test_compiled_inference_reuses_its_output_buffer_under_inference_mode(monkeypatch):
    monkeypatch.setattr(outputs, "OUTPUT_BYTES", 256)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 64)).eval()
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(8, 16)
    with torch.inference_mode():
        first = net(x)
        ptr = first.data_ptr()
        expected = first.clone()
        del first
        again = net(x)
    kept = [b.data_ptr() for slot in net._amp_runtime.outputs._kept.values() for b, _ in slot]
    assert again.data_ptr() == ptr and kept == [ptr] and again.dtype == torch.float32
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    with torch.no_grad():
        held = net(x)  # again is held: another buffer
    assert held.data_ptr() != ptr and net._amp_runtime.outputs.nbytes() == 2 * held.numel() * 4
    torch.testing.assert_close(held, expected, rtol=0, atol=0)
    out = net(x)  # with autograd: into a kept buffer too, with a graph
    assert out.grad_fn is not None
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    net.clear_weight_cache()
    assert net._amp_runtime.outputs.nbytes() == 0


def test_buffers_stay_bounded_when_shapes_change(monkeypatch):
    monkeypatch.setattr(outputs, "OUTPUT_BYTES", 64)
    buffers = OutputBuffers()
    for n in range(4, 12):  # a new shape every call (a new sequence length, say)
        out = buffers.cast(torch.randn(n, 8).to(BF16), torch.float32, 0)
    assert len(buffers._kept[0]) == outputs.KEPT_PER_OUTPUT
    assert buffers.nbytes() == (10 + 11) * 8 * 4  # the last two shapes
    del out


def test_a_large_output_linear_goes_into_kept_buffers_with_the_graphs_values(monkeypatch):
    """OutputBuffers.linear (the logits of a graph handed to torch.compile): the linear's
    product rounded to bf16 once, then cast, as linear(...).to(fp32) gives; the product
    and the output in buffers kept per slot, reused once the caller lets go."""
    monkeypatch.setattr(outputs, "OUTPUT_BYTES", 64)
    torch.manual_seed(0)
    buffers = OutputBuffers()
    x, w, b = torch.randn(2, 3, 8).to(BF16), torch.randn(16, 8).to(BF16), torch.randn(16).to(BF16)
    with torch.no_grad():
        held = []
        for bias in (None, b):
            out = buffers.linear(x, w, bias, torch.float32, "logits")
            expected = nn.functional.linear(x, w, bias).float()
            assert out.shape == (2, 3, 16) and out.dtype == torch.float32
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
            held.append(out)
        ptrs = {t.data_ptr() for t in held}
        assert len(ptrs) == 2  # the first was held: the second buffer
        del out, held
        again = buffers.linear(x, w, b, torch.float32, "logits")
        assert again.data_ptr() in ptrs  # released: a kept buffer again
    kept = 2 * 3 * 16
    assert buffers.nbytes() == 2 * kept * 4 + kept * 2  # two outputs, one bf16 product


def test_a_small_strided_or_differentiated_output_linear_is_a_fresh_linear(monkeypatch):
    buffers = OutputBuffers()
    x, w = torch.randn(4, 8).to(BF16), torch.randn(16, 8).to(BF16)
    small = buffers.linear(x, w, None, torch.float32, 0)  # below OUTPUT_BYTES
    torch.testing.assert_close(small, nn.functional.linear(x, w).float(), rtol=0, atol=0)
    monkeypatch.setattr(outputs, "OUTPUT_BYTES", 64)
    strided = buffers.linear(x.t().contiguous().t(), w, None, torch.float32, 0)
    torch.testing.assert_close(strided, small, rtol=0, atol=0)
    w.requires_grad_()
    trained = buffers.linear(x, w, None, torch.float32, 0)
    assert trained.requires_grad
    assert buffers.nbytes() == 0
