"""The training embedding on a large fp32 table whose gradient goes into a buffer kept
between steps: :class:`AmpEmbedding`, behind ``weights.WeightCache.amp_embedding``."""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch


class GradBuffers(Protocol):
    """What :class:`AmpEmbedding` asks of its cache (``weights.WeightCache``)."""

    def keep_grad(self, w: torch.Tensor, shared: bool) -> weakref.ref | None: ...

    def kept_grad(self, ref: weakref.ref | None) -> torch.Tensor | None: ...

    def tied_grad(self, w: torch.Tensor) -> torch.Tensor: ...


class AmpEmbedding(torch.autograd.Function):
    """``aten.embedding(w, ids, padding_idx)`` whose backward sums the rows' gradients into
    ``w``'s kept gradient buffer (zeroed first) when ``WeightCache.keep_grad`` keeps
    one; for a table other nodes use too (``shared``: tied input and output embeddings),
    into a kept table of its own (``WeightCache.tied_grad``) that autograd adds into the
    other nodes' share (a fresh one, as aten's, faults in its pages every step: GPT-2's
    154 MB); else into a fresh table as aten's (``index_add_`` every time, as aten's CPU
    embedding backward: the same sums in the same order).

    Example:
        >>> rows = AmpEmbedding.apply(emb.weight, ids, -1, cache, False)  # doctest: +SKIP
    """

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, ids: torch.Tensor, padding_idx: int,
                cache: GradBuffers, shared: bool) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.w_ref = cache.keep_grad(w, shared)
        ctx.tied = weakref.ref(w) if shared else None
        ctx.padding_idx, ctx.cache, ctx.rows = padding_idx, cache, w.shape[0]
        return torch.embedding(w, ids, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (ids,) = ctx.saved_tensors
        out = ctx.cache.kept_grad(ctx.w_ref)
        tied = ctx.tied() if ctx.tied is not None else None
        if out is None and tied is not None and not torch.is_grad_enabled():
            out = ctx.cache.tied_grad(tied)
        if out is None:
            gw = torch.ops.aten.embedding_dense_backward.default(
                grad, ids, ctx.rows, ctx.padding_idx, False)
            return gw, None, None, None, None
        flat = ids.reshape(-1)
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx >= 0:  # the padding row gets no gradient
            rows = rows.masked_fill((flat == ctx.padding_idx).unsqueeze(1), 0)
        return out.zero_().index_add_(0, flat, rows.to(out.dtype)), None, None, None, None
