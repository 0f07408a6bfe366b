"""ampgraph/runtime/grad_scale.py: GradScaleEdge, identity forward, scaled gradient."""

from __future__ import annotations

import torch

from ampgraph.runtime.grad_scale import GradScaleEdge


def test_forward_is_a_view_and_backward_scales_by_src_over_dst():
    scales = torch.tensor([1.0, 8.0, 2.0])
    x = torch.randn(4, requires_grad=True)
    y = GradScaleEdge(scales, 1, 2).apply(x)
    assert y._base is x and torch.equal(y, x)
    y.backward(torch.ones(4))
    assert x.grad.tolist() == [4.0] * 4  # 8 / 2


def test_the_ratio_is_read_when_backward_runs():
    scales = torch.tensor([1.0, 8.0])
    x = torch.ones(2, requires_grad=True)
    y = GradScaleEdge(scales, 0, 1).apply(x)
    scales[1] = 0.5  # the manager moved the scale on the device after forward
    y.sum().backward()
    assert x.grad.tolist() == [2.0, 2.0]


def test_a_16_bit_gradient_is_scaled_in_fp32_and_rounded_once():
    scales = torch.tensor([1.0, 2.0**20, 1.0])  # a ratio beyond fp16's 65504
    x = torch.ones(3, dtype=torch.float16, requires_grad=True)
    GradScaleEdge(scales, 1, 0).apply(x).backward(torch.full((3,), 2.0**-12, dtype=torch.float16))
    assert x.grad.dtype == torch.float16 and x.grad.tolist() == [256.0] * 3


def test_nothing_is_recorded_without_a_gradient_to_scale():
    edge = GradScaleEdge(torch.tensor([1.0, 4.0]), 1, 0)
    plain = torch.ones(2)
    assert edge.apply(plain) is plain
    leaf = torch.ones(2, requires_grad=True)
    with torch.no_grad():
        assert edge.apply(leaf) is leaf
    assert repr(edge) == "GradScaleEdge(1->0)"
