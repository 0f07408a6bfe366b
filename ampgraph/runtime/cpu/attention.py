"""Attention for low-precision graphs on the CPU: matmul, fp32 softmax, matmul.

PyTorch runs every CPU ``scaled_dot_product_attention`` through its fused flash kernel,
whose backward is slow on short sequences (docs/performance.md#unfused-chunked-attention).
The fused kernel's advantages are memory
and long rows: with up to four times as many keys as the head dimension, and at most 256,
the probabilities the unfused backward keeps take at most four times the bytes of the output
the fused kernel keeps, and the unfused kernels are faster (see :func:`_short`): they run
a chunk of heads at a time, so the passes over a chunk's scores stay in the cache.
:func:`amp_attention` runs those calls unfused when training, as the op
``ampgraph::attention``, and hands every other call to aten (inference included: the fused
forward is as fast).

With dropout (``dropout_p > 0``, BERT's and GPT-2's default 0.1 in training) aten gives up
the fused kernel and runs its math path, which on the CPU upcasts q, k and v to fp32: both
attention matmuls then run in fp32, at a fifth of bf16's speed, and the fp32 probabilities
and dropout noise are kept for backward. Those calls always run unfused here, with
low-precision matmuls and aten's dropout but for its draw: the mask, of the probabilities'
shape, comes from the default generator through ``dropout.keep_mask`` (the same keep
probability, reproducible under a seed, faster than aten's ``bernoulli_``), and the
kept probabilities are scaled by ``1 / (1 - p)``. Backward keeps the bf16 probabilities
and the bf16 dropped ones that ``v`` was multiplied by (4 bytes per score instead of
aten's 8), so no mask is converted again: its derivative comes through the latter.

The numbers follow the fused kernel's: scores are computed, scaled and masked in fp32 from
the 16-bit ``q`` and ``k``, the softmax is fp32 (rows with every key masked give 0, as
aten's), and the probabilities (with dropout: dropped and scaled) are rounded to the input
dtype once for ``p @ v``. Backward uses the rounded ones forward multiplied ``v`` by; the
products with ``grad`` are bf16 matmuls and the softmax derivative is taken in fp32.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ampgraph.runtime.cpu.dropout import keep_mask, scaled

_sdpa = torch.nn.functional.scaled_dot_product_attention  # its generated binding (C)


def amp_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                  is_causal: bool = False, *, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
    """``aten.scaled_dot_product_attention``, same signature; unfused (the op
    ``ampgraph::attention``) when a gradient is wanted and :func:`unfused_pays` says so
    (without gradients the fused kernel's forward is as fast). A boolean mask on the CPU
    that masks nothing is dropped (the same values)."""
    q, k, v = query, key, value
    if attn_mask is not None and attn_mask.dtype == torch.bool \
            and attn_mask.device.type == "cpu" and not torch.compiler.is_compiling() \
            and bool(_unexpanded(attn_mask).all()):
        # nothing masked: a captured HF model builds its mask from the traced shapes
        # (arange >= 0 for a ViT) where eager HF skips it; the unmasked kernel is faster
        attn_mask = None
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                            or v.requires_grad)
    if not unfused_pays(q, k, v, attn_mask, dropout_p, enable_gqa, training):
        return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                     enable_gqa=enable_gqa)
    if k.shape[-3] != q.shape[-3]:  # grouped heads: the unfused kernel reads them repeated
        k, v = _repeat_heads(k, q.shape[-3]), _repeat_heads(v, q.shape[-3])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.ampgraph.attention(q, k, v, attn_mask, is_causal, scale,
                                        float(dropout_p))[0]


def _unexpanded(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` without its broadcast dimensions (stride 0): the same values, each once. A
    captured model's mask is often one row expanded to every batch entry, head and query;
    reducing the expanded view costs ~1 ms on ViT-B's, its row microseconds.

    Example:
        >>> _unexpanded(torch.ones(4, dtype=torch.bool).expand(8, 3, 4)).shape
        torch.Size([4])
    """
    return mask[tuple(0 if st == 0 and n > 1 else slice(None)
                      for st, n in zip(mask.stride(), mask.shape))]


def unfused_pays(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 attn_mask: torch.Tensor | None, dropout_p: float, enable_gqa: bool,
                 training: bool = True) -> bool:
    """bf16 on the CPU, no batch broadcasting (grouped heads under ``enable_gqa`` are
    repeated for the unfused kernel, as ``repeat_kv`` did), a boolean or bf16 mask that
    needs no gradient and broadcasts to the scores, at least one key, and either dropout
    (aten would run its fp32 math path) or, when training, rows short enough that the
    unfused kernels are faster and their kept probabilities small (:func:`_short`); and
    enough scores for that to pay at all (:func:`_many_scores`)."""
    if not (0 <= dropout_p < 1) or not (dropout_p or training) \
            or not q.dtype == k.dtype == v.dtype == torch.bfloat16 or q.dim() < 3 \
            or not _many_scores(q, k, dropout_p):  # the usual rejections first: cheap
        return False
    tensors = (q, k, v) if attn_mask is None else (q, k, v, attn_mask)
    return (all(t.device.type == "cpu" and t.layout == torch.strided for t in tensors)
            and (q.shape[:-2] == k.shape[:-2] == v.shape[:-2] or enable_gqa and _grouped(q, k, v))
            and 0 < k.shape[-2] and (dropout_p > 0 or _short(k.shape[-2], v.shape[-1]))
            and (attn_mask is None or (
                attn_mask.dtype in (torch.bool, q.dtype) and not attn_mask.requires_grad
                and _fits(attn_mask.shape, (*q.shape[:-1], k.shape[-2])))))


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Grouped-query heads (``enable_gqa``): the same batch dimensions, key and value
    heads alike and dividing the query heads."""
    return (q.dim() == k.dim() == v.dim() and q.shape[:-3] == k.shape[:-3] == v.shape[:-3]
            and k.shape[-3] == v.shape[-3] and q.shape[-3] % max(1, k.shape[-3]) == 0)


def _repeat_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``x`` with each of its heads (dimension -3) repeated in place up to ``heads``: what
    ``enable_gqa`` reads (query head ``i`` uses key head ``i // n``)."""
    n = heads // x.shape[-3]
    return x.unsqueeze(-3).expand(*x.shape[:-2], n, *x.shape[-2:]).reshape(
        *x.shape[:-3], heads, *x.shape[-2:])


def _short(keys: int, head_dim: int) -> bool:
    """Rows short enough that unfused training beats the CPU flash kernel
    (docs/performance.md#unfused-chunked-attention). At most four times the head
    dimension, so the kept probabilities take at most four times the bytes of the output
    the fused kernel keeps."""
    return keys <= min(4 * head_dim, MAX_UNFUSED_KEYS)


MAX_UNFUSED_KEYS = 256


def _many_scores(q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> bool:
    """Enough scores for the unfused kernels' fixed costs (six bf16 matmuls and the op's
    dispatch) to pay; with dropout, twice as many
    (docs/performance.md#unfused-chunked-attention)."""
    scores = q.numel() // max(1, q.shape[-1]) * k.shape[-2]
    return scores >= MIN_UNFUSED_SCORES * (2 if dropout_p > 0 else 1)


MIN_UNFUSED_SCORES = 1 << 15


def _fits(shape: torch.Size, target: tuple) -> bool:
    try:
        return tuple(torch.broadcast_shapes(shape, target)) == tuple(target)
    except RuntimeError:
        return False


# One op per direction, so that profilers and dispatch modes see an attention kernel with
# 16-bit inputs and outputs, not the fp32 arithmetic inside it.
@torch.library.custom_op("ampgraph::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask: torch.Tensor | None, is_causal: bool, scale: float,
               dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dropout(softmax(q k^T * scale + mask)) v, the probabilities rounded to q's dtype,
    and with dropout the dropped and scaled ones that ``v`` was multiplied by, rounded once;
    empty without dropout, where those are the probabilities themselves)."""
    _check_shapes(q, k, v)
    scores = (*q.shape[:-1], k.shape[-2])
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    low = q.new_empty(scores)
    dropped = q.new_empty(scores if dropout_p else (0,))
    # the runtime's draw (dropout.py), once over the whole scores; fp32 noise as aten's
    keep = keep_mask(scores, 1 - dropout_p, q.device) if dropout_p else None
    for at in _chunks(scores):
        p = _probabilities(q[at], k[at], _mask_chunk(attn_mask, at, q.dim()), is_causal, scale)
        low[at] = p
        if keep is not None:
            dropped[at] = p.mul_(scaled(keep[at], dropout_p, torch.float32))
        torch.matmul(dropped[at] if keep is not None else low[at], v[at], out=out[at])
    return out, low, dropped


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The ops take q, k and v with the same batch dims (chunks slice them alike)."""
    torch._check(q.dim() >= 3 and q.shape[:-2] == k.shape[:-2] == v.shape[:-2],
                 lambda: "ampgraph::attention wants q, k, v with the same batch dims")


# Scores are made, and their softmax and its derivative taken, a chunk of heads at a time,
# about this many bytes of fp32 scores each: the chunk's passes over them stay in the
# cache (docs/performance.md#unfused-chunked-attention).
CHUNK_BYTES = 2 << 20


def _chunks(scores: tuple):
    """Index tuples into the leading dims of a ``scores``-shaped tensor, covering them in
    chunks of about ``CHUNK_BYTES`` fp32 scores: ranges of the first dim or, within one of
    its entries, of the second."""
    per_row = max(1, 4 * scores[-1] * scores[-2])
    lead = scores[:-2]
    inner = max(1, math.prod(lead[1:]))
    if per_row * inner <= CHUNK_BYTES or len(lead) < 2:
        step = max(1, CHUNK_BYTES // (per_row * inner))
        for i in range(0, lead[0], step):
            yield (slice(i, i + step),)
        return
    step = max(1, CHUNK_BYTES // (per_row * max(1, math.prod(lead[2:]))))
    for i in range(lead[0]):
        for j in range(0, lead[1], step):
            yield (i, slice(j, j + step))


def _mask_chunk(mask: torch.Tensor | None, at: tuple, dims: int) -> torch.Tensor | None:
    """The part of ``mask`` (broadcasting to ``dims``-dim scores) for the scores at ``at``."""
    if mask is None:
        return None
    mask = mask.view((1,) * (dims - mask.dim()) + mask.shape)
    return mask[tuple(a if n > 1 else slice(None) if isinstance(a, slice) else 0
                      for a, n in zip(at, mask.shape))]


def _probabilities(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None,
                   is_causal: bool, scale: float, graph: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale + mask) in fp32 from the 16-bit ``q`` and ``k``; in place but
    where autograd needs the softmax's output (``graph``: a backward that builds a graph
    differentiates it)."""
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)).mul_(scale)
    if is_causal:  # top-left aligned, as aten
        keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill_(~keep, -math.inf)
    if attn_mask is not None:
        s = s.masked_fill_(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool \
            else s.add_(attn_mask)
    p = torch.softmax(s, -1)
    if attn_mask is not None or is_causal:  # rows with every key masked: 0, as aten
        empty = s.amax(-1, keepdim=True) == -math.inf
        p = p.masked_fill(empty, 0.0) if graph else p.masked_fill_(empty, 0.0)
    return p


@_attention.register_fake
def _(q, k, v, attn_mask, is_causal, scale, dropout_p=0.0):
    scores = (*q.shape[:-1], k.shape[-2])
    return (q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(scores),
            q.new_empty(scores if dropout_p else (0,)))


@torch.library.custom_op("ampgraph::attention_backward", mutates_args=())
def _attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, p: torch.Tensor, dropped: torch.Tensor, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the rounded probabilities ``p`` and the ones ``v`` was multiplied
    by (``dropped``, or ``p`` where it is empty). With ``d`` those and ``dd = grad v^T``,
    the softmax derivative, in fp32, is ``(dd*d - p * rowsum(dd*d)) * scale``: dropout's
    mask and ``1 / (1 - dropout_p)`` enter through ``d`` (``p * dp = dd * d``)."""
    _check_shapes(q, k, v)
    d = dropped if dropped.numel() else p
    dq, dk, dv = (t.new_empty(t.shape) for t in (q, k, v))
    for at in _chunks(p.shape):
        torch.matmul(d[at].transpose(-2, -1), grad[at], out=dv[at])
        t = torch.matmul(grad[at], v[at].transpose(-2, -1)).float().mul_(d[at])
        ds = t.addcmul_(p[at], t.sum(-1, keepdim=True), value=-1).mul_(scale).to(q.dtype)
        torch.matmul(ds, k[at], out=dq[at])
        torch.matmul(ds.transpose(-2, -1), q[at], out=dk[at])
    return dq, dk, dv


@_attention_backward.register_fake
def _(grad, q, k, v, p, dropped, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, attn_mask, is_causal, scale, dropout_p = inputs
    ctx.save_for_backward(q, k, v, output[1], output[2], attn_mask)
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.scale, ctx.dropout_p, ctx.is_causal = scale, dropout_p, is_causal


def _backward(ctx: Any, grad: torch.Tensor, _: Any, __: Any) -> tuple:
    q, k, v, p, dropped, attn_mask = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph (a gradient penalty): differentiable ops
        out = _differentiable(q, k, v, attn_mask, ctx.is_causal, ctx.scale, ctx.dropout_p,
                              dropped)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad, create_graph=True)
    else:
        dq, dk, dv = torch.ops.ampgraph.attention_backward(grad, q, k, v, p, dropped,
                                                           ctx.scale)
    return dq, dk, dv, None, None, None, None


def _differentiable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    attn_mask: torch.Tensor | None, is_causal: bool, scale: float,
                    dropout_p: float, dropped: torch.Tensor) -> torch.Tensor:
    """``ampgraph::attention``'s output as plain differentiable ops, with the dropout it
    drew (kept where ``dropped`` is nonzero: where it is zero but was kept, the probability
    rounds to zero, and its share of the derivative is nil): what a backward that builds a
    graph differentiates."""
    p = _probabilities(q, k, attn_mask, is_causal, scale, graph=True)
    if dropout_p:
        p = p.mul((dropped != 0).to(p.dtype).div_(1 - dropout_p))
    return torch.matmul(p.to(q.dtype), v)


_attention.register_autograd(_backward, setup_context=_setup_context)
