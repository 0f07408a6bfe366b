"""The training linear on an fp32 master weight, with its cast and gradient conversion
fused in: :class:`AmpLinear`, behind ``weights.WeightCache.amp_linear``.

A weight below ``BLOCKED_NUMEL`` elements is cast whole into a working copy that
``WeightCache`` keeps (or a fresh one, for a weight too small to keep); a larger one, or a
first layer's larger than the scratch whose backward never reads a copy, is cast block by
block on the CPU (``blocked.py``), so no whole low-precision copy of it exists.
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch

from ampgraph.runtime.cpu import blocked

_linear = torch.nn.functional.linear  # aten.linear's generated binding: no OpOverload frame

# Weights of BLOCKED_NUMEL elements or more are cast, and their gradients computed, in
# blocks: no whole low-precision copy of them exists (a 7B model's 32000x4096 head: 262 MB).
# Below it one whole product is faster, and its working copy costs no more than autocast's
# cast, which autocast keeps from forward until backward (docs/performance.md#blocked-products).
BLOCKED_NUMEL = 1 << 26


class LinearCache(Protocol):
    """What :class:`AmpLinear` asks of its cache (``weights.WeightCache``)."""

    def drop_inference_copies(self, *params: torch.Tensor) -> None: ...

    def working_copy(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...

    def keep_grad(self, w: torch.Tensor, shared: bool) -> weakref.ref | None: ...

    def kept_grad(self, ref: weakref.ref | None) -> torch.Tensor | None: ...

    def pooled(self, shape: tuple, dtype: torch.dtype, device: torch.device
               ) -> torch.Tensor: ...


class AmpLinear(torch.autograd.Function):
    """``linear(x, low(w_master), low(b_master))`` with the casts and the conversion of the
    gradients fused in (a bias already in ``x``'s dtype is used as it is).

    A weight below ``BLOCKED_NUMEL`` elements is cast into its working copy (see
    ``WeightCache.working_copy``; unless backward would not read it, see
    :func:`blockable`), which ``aten.linear`` uses and backward keeps; once
    backward has made ``grad_input`` the copy is dead, and ``grad_out.T @ input`` is
    computed into it before its conversion to fp32 (no fresh low-precision gradient). A
    larger one never exists in the low dtype as a whole: forward casts it block of rows by
    block of rows into a small pooled scratch, each block feeding the columns of the output
    it makes; backward saves the fp32 master itself (so autograd checks it is unchanged, as
    for an fp32 linear) and casts it again, block of columns by block of columns, for
    ``grad_out @ w``, and computes ``grad_out.T @ input`` block of rows by block of rows
    into the scratch, each block converted straight into the fp32 gradient. The values are
    those of ``aten.linear`` on the whole cast weight up to the kernels' summation order.
    A backward that builds a graph (``create_graph``, a gradient penalty) computes the
    gradients as plain differentiable ops of the fp32 master instead.

    Example:
        >>> out = AmpLinear.apply(x, fc.weight, fc.bias, cache, False)  # doctest: +SKIP
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                cache: LinearCache, shared: bool) -> torch.Tensor:
        cast_bias = b is not None and b.dtype != x.dtype  # an fp32 master bias: cast here too
        cache.drop_inference_copies(w, *([b] if cast_bias else []))  # stale after the update
        bl = cache.working_copy(b, x.dtype) if cast_bias else b
        ctx.bias_dtype = b.dtype if b is not None else None
        ctx.w_dtype = w.dtype
        ctx.cache = cache
        ctx.blocked = blockable(x, w, ctx.needs_input_grad[0])
        ctx.w_ref = cache.keep_grad(w, shared)
        ctx.master = w  # not saved: an update before backward is allowed, as autocast's
        if ctx.blocked:  # backward reads the master only for grad_input
            ctx.save_for_backward(x, w if ctx.needs_input_grad[0] else None)
            return blocked.linear(x, w, bl, cache.pooled)
        wl = cache.working_copy(w, x.dtype)
        ctx.wl_owned = wl.data_ptr() != w.data_ptr()
        ctx.save_for_backward(x, wl)
        return _linear(x, wl, bl)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, wl = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = gw = gb = None
        grad2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        # create_graph (a gradient penalty differentiates these again): plain ops, and the
        # weight's share through its master, to which the working copy has no graph
        graph = torch.is_grad_enabled()
        in_blocks = ctx.blocked and not graph
        if graph:
            wl = ctx.master.to(grad.dtype)
        if need_x:
            if in_blocks:  # wl is the fp32 master
                gx = blocked.grad_input(grad2, wl, ctx.cache.pooled).view(
                    *grad.shape[:-1], -1)
            else:  # on the 2-D view: matmul would expand wl per batch for a strided grad
                gx = torch.mm(grad2, wl).view(*grad.shape[:-1], -1)
        if need_w:
            out = None if graph else ctx.cache.kept_grad(ctx.w_ref)
            if in_blocks:
                gw = blocked.weight_grad(grad2, x2, ctx.w_dtype, out, ctx.cache.pooled)
            else:  # into the working copy once nothing reads it again, else a fresh tensor
                low = torch.mm(grad2.t(), x2, out=wl) \
                    if not graph and _dead(wl, ctx.wl_owned) else grad2.t().mm(x2)
                gw = low.to(ctx.w_dtype) if out is None else out.copy_(low)
        if need_b and ctx.bias_dtype is not None:
            gb = grad2.sum(0).to(ctx.bias_dtype)  # summed in the low dtype, as aten's
        return gx, gw, gb, None, None


def _dead(wl: torch.Tensor, owned: bool) -> bool:
    """Whether :class:`AmpLinear`'s backward may write the weight gradient over the working
    copy ``wl`` once it has made ``grad_input``: a contiguous copy of the cache's own (not
    the weight itself) that no later backward reads (the graph is not retained). The next
    forward casts into it afresh."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return owned and wl.is_contiguous() and keep_graph is not None and not keep_graph()


def blockable(x: torch.Tensor, w: torch.Tensor, need_x: bool) -> bool:
    """Whether :class:`AmpLinear` runs ``w`` in blocks: a plain 2-D weight, an input with a
    batch dimension, both on the CPU (where fresh or extra weight-sized memory costs page
    faults; a GPU runs one large product faster than many small ones), and either a large
    weight or one larger than the scratch whose backward never reads a copy: the input
    needs no gradient (a network's first layer), so autocast's copy dies after forward,
    and a kept one would be live at the backward's peak (a smaller one would keep a
    pooled scratch its size instead).

    Example:
        >>> blockable(torch.randn(8, 4), torch.randn(2, 4), need_x=True)
        False
    """
    size = w.numel() >= BLOCKED_NUMEL or not need_x and w.numel() > blocked.SCRATCH_NUMEL
    return (size and w.dim() == 2 and x.dim() >= 2
            and w.layout == torch.strided and x.layout == torch.strided
            and w.device.type == "cpu" and x.device.type == "cpu")
