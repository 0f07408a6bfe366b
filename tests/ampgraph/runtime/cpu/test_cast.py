"""ampgraph/runtime/cpu/cast.py: a differentiable cast into a given buffer."""

from __future__ import annotations

import torch

from ampgraph.runtime.cpu.cast import CastInto


def test_forward_writes_the_buffer_and_returns_a_view_of_it():
    torch.manual_seed(0)
    w = torch.randn(3, 5, requires_grad=True)
    buffer = torch.full((3, 5), 7.0, dtype=torch.bfloat16)
    out = CastInto.apply(w, buffer)
    assert out.dtype == torch.bfloat16 and out.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer, w.detach().bfloat16(), rtol=0, atol=0)
    assert out.grad_fn is not None and type(out.grad_fn).__name__ == "CastIntoBackward"


def test_backward_gives_the_source_s_dtype_and_strides():
    """A channels-last buffer of an NCHW weight: the gradient keeps the weight's strides."""
    torch.manual_seed(0)
    w = torch.randn(4, 3, 2, 2, requires_grad=True)
    buffer = torch.empty(4, 3, 2, 2, dtype=torch.bfloat16, memory_format=torch.channels_last)
    out = CastInto.apply(w, buffer)
    assert out.is_contiguous(memory_format=torch.channels_last)
    upstream = torch.randn(4, 3, 2, 2).bfloat16().contiguous(memory_format=torch.channels_last)
    out.backward(upstream)
    assert w.grad.dtype == torch.float32 and w.grad.stride() == w.stride()
    torch.testing.assert_close(w.grad, upstream.float(), rtol=0, atol=0)


def test_gradients_flow_through_later_ops_and_accumulate():
    w = torch.ones(2, 2, requires_grad=True)
    for _ in range(2):
        (CastInto.apply(w, torch.empty(2, 2, dtype=torch.float16)) * 3).sum().backward()
    torch.testing.assert_close(w.grad, torch.full((2, 2), 6.0))
