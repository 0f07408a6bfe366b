"""Products with a weight too large for a whole low-precision copy, a block at a time.

:class:`ampgraph.runtime.cpu.linear.AmpLinear` runs a weight of ``linear.BLOCKED_NUMEL``
elements or more (and a first layer's larger than the scratch) through these: each block
of the fp32 master is cast into a pooled scratch of at most ``SCRATCH_NUMEL`` elements
that feeds the columns (or rows) of the product it makes, so no whole low-precision copy
of the weight, nor of its gradient, exists. ``pooled(shape, dtype, device)`` hands out a
scratch nothing else holds (``WeightCache.pooled``). The values are those of aten's
products on the whole cast weight up to the kernels' summation order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

Pooled = Callable[[tuple, torch.dtype, torch.device], torch.Tensor]
SCRATCH_NUMEL = 1 << 20  # elements of low-precision weight (gradient) per block


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, pooled: Pooled
           ) -> torch.Tensor:
    """``aten.linear(x, w.to(x.dtype), b)`` casting ``w`` a block of rows at a time."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    for r, n, block in _cast_blocks(w, 0, x.dtype, pooled):
        if b is None:
            torch.mm(x2, block.t(), out=out[:, r:r + n])
        else:
            torch.addmm(b[r:r + n], x2, block.t(), out=out[:, r:r + n])
    return out.view(*x.shape[:-1], w.shape[0])


def grad_input(grad: torch.Tensor, w: torch.Tensor, pooled: Pooled) -> torch.Tensor:
    """``grad @ w.to(grad.dtype)`` casting ``w`` a block of columns at a time."""
    out = torch.empty(grad.shape[0], w.shape[1], dtype=grad.dtype, device=grad.device)
    # each block is one pass over grad: a quarter of the columns at least
    # (docs/performance.md#blocked-products)
    wide = max(SCRATCH_NUMEL, -(-w.numel() // 4))
    for c, n, block in _cast_blocks(w, 1, grad.dtype, pooled, wide):
        torch.mm(grad, block, out=out[:, c:c + n])
    return out


def weight_grad(grad: torch.Tensor, x: torch.Tensor, dtype: torch.dtype,
                out: torch.Tensor | None, pooled: Pooled) -> torch.Tensor:
    """``(grad.T @ x).to(dtype)`` into ``out`` (or a new tensor), a block of rows at a time
    through a scratch from the pool the blocked forward uses too: no whole low-precision
    gradient is made."""
    rows = grad.shape[1]
    if out is None:
        out = torch.empty(rows, x.shape[1], dtype=dtype, device=grad.device)
    step = max(1, SCRATCH_NUMEL // max(1, x.shape[1]))
    scratch = pooled((step, x.shape[1]), grad.dtype, grad.device)
    gt = grad.t()
    for r in range(0, rows, step):
        n = min(step, rows - r)
        block = scratch[:n]
        torch.mm(gt[r:r + n], x, out=block)
        out[r:r + n].copy_(block)
    return out


def _cast_blocks(w: torch.Tensor, dim: int, dtype: torch.dtype, pooled: Pooled,
                 numel: int = 0) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(start, n, block)``: the 2-D ``w`` cast to ``dtype`` ``n`` rows (``dim`` 0)
    or columns (``dim`` 1) at a time into a pooled scratch of at most ``numel or
    SCRATCH_NUMEL`` elements (a column block keeps the scratch's row stride)."""
    size, other = w.shape[dim], w.shape[1 - dim]
    step = min(size, max(1, (numel or SCRATCH_NUMEL) // other))
    scratch = pooled((step, other) if dim == 0 else (other, step), dtype, w.device)
    for start in range(0, size, step):
        n = min(step, size - start)
        yield start, n, scratch.narrow(dim, 0, n).copy_(w.narrow(dim, start, n))
