"""A differentiable cast into a buffer the caller provides.

:class:`CastInto` writes ``param`` into ``buffer`` (a working copy kept between steps, or a
kept output buffer) instead of making a fresh tensor whose pages would fault in, and its
backward hands the source a gradient of its own dtype and strides: the buffer's may differ
(a channels-last copy of an NCHW weight). Used by ``weights.WeightCache.cast`` and
``outputs.OutputBuffers.cast``.
"""

from __future__ import annotations

from typing import Any

import torch


class CastInto(torch.autograd.Function):
    """``buffer <- param`` as a differentiable cast; backward converts the gradient to the
    param's dtype and strides (which the buffer's may not have: a channels-last copy).

    Example:
        >>> w = torch.randn(4, 4, requires_grad=True)
        >>> low = CastInto.apply(w, torch.empty(4, 4, dtype=torch.bfloat16))
        >>> low.float().sum().backward(); w.grad.dtype
        torch.float32
    """

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        ctx.dtype, ctx.stride = param.dtype, param.stride()
        buffer.copy_(param)
        return buffer.view_as(buffer)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = torch.empty_strided(grad.shape, ctx.stride, dtype=ctx.dtype, device=grad.device)
        return out.copy_(grad), None
