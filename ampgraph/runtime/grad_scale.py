"""Per-layer gradient scaling inside a captured graph (Zhao et al. 2019, arXiv 1910.12385).

``passes/fx/grad_scale.py`` puts a :class:`GradScaleEdge` on every edge where a value leaves
one layer's region for another's. Its forward is the identity (a view); its backward
multiplies the incoming gradient by ``scales[src] / scales[dst]``, so the gradient inside
each region carries that region's own scale. The scale tensors are owned by the loss-scale
manager (``AdaptiveLossScaleManager(per_layer=True)``) and change on the device: no graph
is recaptured when a scale moves. The ratio is applied in fp32 (a 16-bit gradient is widened,
multiplied and rounded back once), so a ratio outside fp16's range does not become inf.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["GradScaleEdge"]


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scales: torch.Tensor, src: int, dst: int
                ) -> torch.Tensor:
        ctx.scales, ctx.src, ctx.dst = scales, src, dst
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        scales = ctx.scales
        ratio = scales[ctx.src] / scales[ctx.dst]
        if grad.dtype == torch.float32:
            return grad * ratio, None, None, None
        return (grad.float() * ratio).to(grad.dtype), None, None, None


class GradScaleEdge:
    """The op on one region-crossing edge: identity forward, gradient x ``s[src]/s[dst]``.

    Args:
        scales: a 1-D fp32 tensor of per-region scales (index 0 is the global region, 1.0).
        src: the region that produced the value (its gradient leaves backward at its scale).
        dst: the region that consumes it (the gradient arrives at this region's scale).

    Example:
        >>> s = torch.tensor([1.0, 8.0])
        >>> x = torch.ones(2, requires_grad=True)
        >>> GradScaleEdge(s, 1, 0).apply(x).sum().backward()
        >>> x.grad.tolist()
        [8.0, 8.0]
    """

    def __init__(self, scales: torch.Tensor, src: int, dst: int) -> None:
        self.scales, self.src, self.dst = scales, src, dst

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` itself in forward; scales its gradient in backward."""
        if not (torch.is_grad_enabled() and x.requires_grad):
            return x
        return _GradScale.apply(x, self.scales, self.src, self.dst)

    def __repr__(self) -> str:
        return f"GradScaleEdge({self.src}->{self.dst})"
