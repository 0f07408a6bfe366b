"""Kept buffers for large inference outputs: reused once the caller lets go, never while
it holds one; outputs with a graph, small or off-CPU ones are fresh."""

from __future__ import annotations

import torch
from torch import nn

import ampgraph
import ampgraph.runtime.outputs as outputs
from ampgraph.runtime.outputs import OutputBuffers

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


def test_outputs_with_a_graph_small_or_strided_ones_are_fresh(monkeypatch):
    buffers = OutputBuffers()
    x = torch.randn(4, 8).to(BF16)
    assert buffers.cast(x, torch.float32, "s").dtype == torch.float32
    assert buffers.nbytes() == 0  # below OUTPUT_BYTES
    monkeypatch.setattr(outputs, "OUTPUT_BYTES", 64)
    w = x.clone().requires_grad_()
    y = buffers.cast(w, torch.float32, "s")
    assert y.grad_fn is not None and buffers.nbytes() == 0
    y.sum().backward()
    assert w.grad.dtype == BF16
    t = buffers.cast(x.t(), torch.float32, "s")
    assert t.stride() == x.t().float().stride() and buffers.nbytes() == 0


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
    kept = [b.data_ptr() for slot in net._amp_outputs._kept.values() for b, _ in slot]
    assert again.data_ptr() == ptr and kept == [ptr] and again.dtype == torch.float32
    torch.testing.assert_close(again, expected, rtol=0, atol=0)
    with torch.no_grad():
        held = net(x)  # again is held: another buffer
    assert held.data_ptr() != ptr and net._amp_outputs.nbytes() == 2 * held.numel() * 4
    torch.testing.assert_close(held, expected, rtol=0, atol=0)
    out = net(x)  # with autograd: a fresh output with a graph
    assert out.grad_fn is not None
    net.clear_weight_cache()
    assert net._amp_outputs.nbytes() == 0


def test_buffers_stay_bounded_when_shapes_change(monkeypatch):
    monkeypatch.setattr(outputs, "OUTPUT_BYTES", 64)
    buffers = OutputBuffers()
    for n in range(4, 12):  # a new shape every call (a new sequence length, say)
        out = buffers.cast(torch.randn(n, 8).to(BF16), torch.float32, 0)
    assert len(buffers._kept[0]) == outputs.KEPT_PER_OUTPUT
    assert buffers.nbytes() == (10 + 11) * 8 * 4  # the last two shapes
    del out
