"""Attention for low-precision graphs on the CPU: matmul, fp32 softmax, matmul.

PyTorch runs every CPU ``scaled_dot_product_attention`` through its fused flash kernel,
whose backward is slow on short sequences on our CPUs: 12.6 ms against 1.5 ms unfused at
16 x 8 heads x 64 tokens x 64 measured alone (bf16, 2 threads); ~9 ms per layer inside a
BERT-style training step, a quarter of the step. The fused kernel's advantages are memory
and long rows: with up to twice as many keys as the head dimension, and at most 192, the
probabilities the unfused backward keeps take at most twice the bytes of the output the
fused kernel keeps, and the unfused kernels are faster (see :func:`_short`).
:func:`amp_attention` runs those calls unfused when training, as the op
``ampgraph::attention``, and hands every other call to aten (inference included: the fused
forward is as fast).

With dropout (``dropout_p > 0``, BERT's and GPT-2's default 0.1 in training) aten gives up
the fused kernel and runs its math path, which on the CPU upcasts q, k and v to fp32: both
attention matmuls then run in fp32, at a fifth of bf16's speed, and the fp32 probabilities
and dropout noise are kept for backward. Those calls always run unfused here, with
low-precision matmuls and the same dropout as aten's math path: the noise is drawn by
``bernoulli_(1 - p)`` on an fp32 tensor of the probabilities' shape from the default
generator, as aten draws it, so under the same seed the same positions are dropped, and the
kept ones are scaled by ``1 / (1 - p)``. Backward keeps the bf16 probabilities and the bf16
dropped ones that ``v`` was multiplied by (4 bytes per score instead of aten's 8), so no
mask is converted again: its derivative comes through the latter.

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

aten = torch.ops.aten


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
            and bool(attn_mask.all()):
        # nothing masked: a captured HF model builds its mask from the traced shapes
        # (arange >= 0 for a ViT) where eager HF skips it; the unmasked kernel is faster
        attn_mask = None
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                            or v.requires_grad)
    if not unfused_pays(q, k, v, attn_mask, dropout_p, enable_gqa, training):
        return aten.scaled_dot_product_attention.default(
            q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.ampgraph.attention(q, k, v, attn_mask, is_causal, scale,
                                        float(dropout_p))[0]


def unfused_pays(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 attn_mask: torch.Tensor | None, dropout_p: float, enable_gqa: bool,
                 training: bool = True) -> bool:
    """bf16 on the CPU, no grouped heads or batch broadcasting, a boolean or bf16 mask that
    needs no gradient and broadcasts to the scores, at least one key, and either dropout
    (aten would run its fp32 math path) or, when training, rows short enough that the
    unfused kernels are faster and their kept probabilities small (:func:`_short`)."""
    if not (0 <= dropout_p < 1) or not (dropout_p or training):
        return False
    tensors = (q, k, v) if attn_mask is None else (q, k, v, attn_mask)
    return (all(t.device.type == "cpu" and t.layout == torch.strided for t in tensors)
            and q.dtype == k.dtype == v.dtype == torch.bfloat16
            and not enable_gqa and q.dim() >= 3
            and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
            and 0 < k.shape[-2] and (dropout_p > 0 or _short(k.shape[-2], v.shape[-1]))
            and (attn_mask is None or (
                attn_mask.dtype in (torch.bool, q.dtype) and not attn_mask.requires_grad
                and _fits(attn_mask.shape, (*q.shape[:-1], k.shape[-2])))))


def _short(keys: int, head_dim: int) -> bool:
    """Rows short enough that unfused training beats the CPU flash kernel (forward and
    backward, bf16, 2 threads; ms fused / unfused): 128 keys of 64 dims 8.6 / 4.0 (causal),
    160 of 80 26.4 / 14.0, 192 of 64 11.6 / 7.6; but 197 of 64 25.5 / 28.3, 256 of 64
    12.4 / 20.2 and 256 of 128 26.1 / 35.9. At most twice the head dimension, so the kept
    probabilities take at most twice the bytes of the output the fused kernel keeps."""
    return keys <= min(2 * head_dim, MAX_UNFUSED_KEYS)


MAX_UNFUSED_KEYS = 192


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
    p = _probabilities(q, k, attn_mask, is_causal, scale)
    low = p.to(q.dtype)
    if not dropout_p:
        return torch.matmul(low, v), low, q.new_empty((0,))
    noise = torch.empty_like(p).bernoulli_(1 - dropout_p)  # aten's draw, same generator
    dropped = p.mul_(noise.div_(1 - dropout_p)).to(q.dtype)
    return torch.matmul(dropped, v), low, dropped


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
    d = dropped if dropped.numel() else p
    dv = torch.matmul(d.transpose(-2, -1), grad)
    t = torch.matmul(grad, v.transpose(-2, -1)).float().mul_(d)
    ds = t.addcmul_(p, t.sum(-1, keepdim=True), value=-1).mul_(scale).to(q.dtype)
    return torch.matmul(ds, k), torch.matmul(ds.transpose(-2, -1), q), dv


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
