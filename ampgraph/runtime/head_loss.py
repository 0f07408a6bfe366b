"""The model's head and its cross-entropy as one chunked op: the logits never exist whole.

``passes/fx/fusions/head_loss.py`` hands a graph's last product and the cross-entropy of
its logits to :func:`linear_cross_entropy`. It runs them over chunks of rows (tokens):

- each chunk's product runs in the input's (low) dtype, as the unfused graph's linear;
- its logits go to fp32, where the log-sum-exp and the loss accumulate (as the unfused
  graph's fp32 cross-entropy);
- the gradient of the chunk's logits, ``softmax - target`` (with label smoothing,
  ``ignore_index`` and the mean's divisor), is cast to the low dtype as the unfused
  graph's cast back would, and the input's and the weight's gradients are formed from it
  chunk by chunk: the weight's accumulates in fp32, block of vocabulary rows by block.

So neither the logits nor their gradient exists whole, in any dtype: a chunk is about
``CHUNK_BYTES`` of fp32 logits. With bf16 (or fp32) inputs the gradients are formed in
forward (as Liger-Kernel's fused linear cross-entropy does) and backward multiplies them
by the loss's gradient: only they are kept, no logits. With fp16 inputs the loss's
gradient (the loss scale) must reach the logits' gradient before its cast, or small
values underflow: backward forms the gradients, computing each chunk's logits again
(one more product per chunk, as Cut Cross-Entropy does).

The values are those of the unfused graph up to summation order: the weight's gradient is
summed in fp32 over chunks of 16-bit partial products, where the unfused graph's is one
16-bit product converted to fp32.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CHUNK_BYTES", "GRAD_BLOCK_BYTES", "chunk_rows", "linear_cross_entropy"]

# fp32 logits per chunk. Each chunk's product reads the whole weight, so a chunk much
# smaller than this rereads it often (a 128256 x 512 bf16 head is 125 MiB); one much
# larger keeps that many bytes live (the softmax works in place on them).
CHUNK_BYTES = 32 << 20

# The weight's gradient accumulates in fp32 by blocks of vocabulary rows of this many
# bytes: a chunk's 16-bit partial product is added into it block by block, never whole.
GRAD_BLOCK_BYTES = 8 << 20

_REDUCTIONS = {1: "mean", 2: "sum"}  # aten's enum (0: "none", not fused)


def chunk_rows(rows: int, vocab: int, budget: int = CHUNK_BYTES) -> int:
    """Rows per chunk: the most whose fp32 logits fit ``budget``, a multiple of 8 (at least
    8), at most ``rows``.

    Example:
        >>> chunk_rows(1024, 128256), chunk_rows(1024, 32000), chunk_rows(3, 300)
        (64, 256, 3)
    """
    n = max(8, budget // (4 * max(1, vocab)) // 8 * 8)
    return max(1, min(rows, n))


def linear_cross_entropy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                         target: torch.Tensor, reduction: int = 1, ignore_index: int = -100,
                         label_smoothing: float = 0.0, chunk: int | None = None
                         ) -> torch.Tensor:
    """``cross_entropy(linear(x, w.to(x.dtype), b).float(), target, ...)`` in chunks of
    ``chunk`` rows (default :func:`chunk_rows`), never forming the logits whole.

    Args:
        x: ``[N, d]`` activations in the low dtype (or fp32).
        w: the ``[V, d]`` weight, fp32 (the master) or ``x``'s dtype; b: ``[V]`` or None.
        target: ``[N]`` class indices; ``ignore_index`` rows count for nothing.
        reduction: aten's enum, 1 (mean over the rows not ignored) or 2 (sum).
        label_smoothing: as ``torch.nn.functional.cross_entropy``'s.

    Example:
        >>> x = torch.randn(6, 4).bfloat16(); w = torch.randn(10, 4)
        >>> t = torch.tensor([1, 2, -100, 3, 4, 5])
        >>> ref = torch.nn.functional.cross_entropy((x @ w.bfloat16().t()).float(), t)
        >>> bool(torch.allclose(linear_cross_entropy(x, w, None, t, chunk=4), ref))
        True
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"linear_cross_entropy: reduction must be 1 (mean) or 2 (sum), got "
                         f"{reduction!r}")
    if x.dim() != 2 or target.dim() != 1 or w.dim() != 2:
        raise ValueError(f"linear_cross_entropy takes x [N, d], w [V, d], target [N]; got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(target.shape)}")
    rows = chunk or chunk_rows(x.shape[0], w.shape[0])
    return LinearCrossEntropy.apply(x, w, b, target, reduction, ignore_index,
                                    float(label_smoothing), rows)


class LinearCrossEntropy(torch.autograd.Function):
    """:func:`linear_cross_entropy` with its gradients (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                target: torch.Tensor, reduction: int, ignore_index: int,
                smoothing: float, rows: int) -> torch.Tensor:
        ctx.args = (reduction, ignore_index, smoothing, rows)
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
        needs = ctx.needs_input_grad[:3]
        ctx.deferred = any(needs) and x.dtype == torch.float16
        if ctx.deferred:  # the loss scale must reach the logits' gradient before its cast
            ctx.save_for_backward(x, w, b, target)
            loss, _ = _run(x, w, b, target, ctx.args, (False, False, False), None)
            return loss
        loss, grads = _run(x, w, b, target, ctx.args, needs, None)
        ctx.grads = grads
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.deferred:
            x, w, b, target = ctx.saved_tensors
            _, grads = _run(x, w, b, target, ctx.args, ctx.needs_input_grad[:3], grad)
        else:
            grads, ctx.grads = ctx.grads, None  # a second backward finds none: as freed
            if grads is None:
                raise RuntimeError("linear_cross_entropy: backward through the fused head "
                                   "twice; its gradients were formed once (retain_graph is "
                                   "not supported by the fused head and loss)")
            grads = [None if g is None else g.mul_(grad.to(g.dtype)) if g.dtype.is_floating_point
                     else g for g in grads]
        gx, gw, gb = grads
        dtypes = ctx.dtypes
        return (gx, None if gw is None else gw.to(dtypes[1]),
                None if gb is None else gb.to(dtypes[2]), None, None, None, None, None)


def _run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, target: torch.Tensor,
         args: tuple, needs: tuple, scale: torch.Tensor | None
         ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The loss over every chunk, and the gradients ``needs`` asks for (of x, w, b), the
    logits' gradient multiplied by ``scale`` (None: 1) before its cast to ``x``'s dtype."""
    reduction, ignore_index, smoothing, rows = args
    low = x.dtype
    with torch.no_grad():
        wl = w if w.dtype == low else w.to(low)
        bl = b if b is None or b.dtype == low else b.to(low)
        vocab = w.shape[0]
        valid = target != ignore_index
        safe = torch.where(valid, target, torch.zeros((), dtype=target.dtype, device=target.device))
        count = valid.sum()
        divisor = count.to(torch.float32) if reduction == 1 else None
        factor = torch.ones((), dtype=torch.float32, device=x.device) if scale is None \
            else scale.to(torch.float32)
        if divisor is not None:
            factor = factor / divisor.clamp(min=1)
        need_x, need_w, need_b = needs
        gx = torch.empty_like(x) if need_x else None
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        gb = torch.zeros(vocab, dtype=torch.float32, device=w.device) if need_b else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        block = max(1, GRAD_BLOCK_BYTES // (4 * w.shape[1]))
        for start in range(0, x.shape[0], rows):
            end = min(start + rows, x.shape[0])
            xc, tc, vc = x[start:end], safe[start:end], valid[start:end]
            logits = torch.nn.functional.linear(xc, wl, bl).float()
            lse = torch.logsumexp(logits, 1)
            per_row = lse - logits.gather(1, tc[:, None]).squeeze(1)
            if smoothing:
                per_row = (1 - smoothing) * per_row + smoothing * (lse - logits.mean(1))
            total += torch.where(vc, per_row, 0).sum()
            if not (need_x or need_w or need_b):
                continue
            # d loss / d logits = softmax - (1 - eps) onehot - eps / V, on rows not ignored
            grad = logits.sub_(lse[:, None]).exp_()
            if smoothing:
                grad.sub_(smoothing / vocab)
            grad.scatter_add_(1, tc[:, None], torch.full_like(lse[:, None], smoothing - 1))
            grad.mul_(vc[:, None] * factor)
            grad = grad.to(low)  # the unfused graph's cast back to the product's dtype
            if need_x:
                torch.mm(grad, wl, out=gx[start:end])
            if need_w:  # by blocks of the vocabulary: no whole fp32 partial besides gw
                for v0 in range(0, vocab, block):
                    gw[v0:v0 + block] += torch.mm(grad[:, v0:v0 + block].t(), xc)
            if need_b:
                gb += grad.sum(0)
        loss = total / divisor if divisor is not None else total
    return loss, [gx, gw, gb]
