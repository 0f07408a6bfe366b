"""The model's head and its cross-entropy as one chunked op: the logits never exist whole.

``passes/fx/routing/head_loss.py`` hands a graph's last product and the cross-entropy of
its logits to :func:`linear_cross_entropy`. It runs them over chunks of rows (tokens):

- each chunk's product runs in the input's (low) dtype, as the unfused graph's linear;
- its logits go to fp32 and through aten's own kernels of the unfused graph's
  cross-entropy, in place on the chunk: ``_log_softmax``, then the loss's backward
  (``nll_loss_backward``, ``_log_softmax_backward_data``), so each chunk's
  log-probabilities and logits' gradient are the unfused ones bit for bit (label
  smoothing, ``ignore_index`` and the mean's divisor included);
- the logits' gradient is cast to the low dtype as the unfused graph's cast back would,
  and the input's and the weight's gradients are formed from it chunk by chunk: the
  weight's accumulates in fp32, block of vocabulary rows by block.

So neither the logits nor their gradient exists whole, in any dtype: a chunk is about
``CHUNK_BYTES`` of fp32 logits. With bf16 (or fp32) inputs the gradients are formed in
forward (as Liger-Kernel's fused linear cross-entropy does) and backward multiplies them
by the loss's gradient: only they are kept, no logits. With fp16 inputs the loss's
gradient (the loss scale) must reach the logits' gradient before its cast, or small
values underflow: backward forms the gradients, computing each chunk's logits again
(one more product per chunk, as Cut Cross-Entropy does).

Where nothing else reads the weight (``own_weight``, the graph pass decides) and a step
that releases its gradients owns it (``grad_sinks.py``: ``build_train_step(...,
memory="lean")``), the head is streamed by blocks of vocabulary rows instead
(:class:`StreamedLinearCrossEntropy`): forward takes the loss with an online log-sum-exp,
backward computes each block's logits again and hands the block's weight gradient to the
step, which steps those rows at once. Neither the weight's gradient nor its 16-bit copy
then exists whole (at vocabulary 32000, d 512: 62.5 and 31 MiB); it costs one product more
than the chunked head, and its values are the unfused ones within fp32 rounding (the loss)
and one 16-bit rounding per block (the input's gradient).

The loss and the input's gradient are the unfused graph's bit for bit, whatever the
chunking; so is the weight's gradient when the rows fit one chunk. Over several chunks it
is summed over the chunks' 16-bit partial products, where the unfused graph's is one
16-bit product: in fp32 for an fp32 weight (the master), in the weight's own dtype for a
16-bit one (``master_weights="stochastic"``), whose gradient is 16-bit anyway: half the
bytes, kept from forward to backward, one rounding more per chunk.
"""

from __future__ import annotations

from typing import Any

import torch

from ampgraph.runtime.grad_sinks import GradSink, sink_of

__all__ = ["CHUNK_BYTES", "GRAD_BLOCK_BYTES", "chunk_rows", "linear_cross_entropy",
           "vocab_rows"]

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


def vocab_rows(rows: int, vocab: int, d: int) -> int:
    """Vocabulary rows per block of the streamed head: the most whose fp32 logits for
    ``rows`` rows fit ``CHUNK_BYTES`` and whose fp32 weight gradient fits
    ``GRAD_BLOCK_BYTES``, a multiple of 8 (at least 8), at most ``vocab``.

    Example:
        >>> vocab_rows(1022, 32000, 512), vocab_rows(32768, 128256, 4096)
        (4096, 256)
    """
    n = min(CHUNK_BYTES // (4 * max(1, rows)), GRAD_BLOCK_BYTES // (4 * max(1, d)))
    return max(1, min(vocab, max(8, n // 8 * 8)))


def linear_cross_entropy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                         target: torch.Tensor, reduction: int = 1, ignore_index: int = -100,
                         label_smoothing: float = 0.0, chunk: int | None = None,
                         own_weight: bool = False) -> torch.Tensor:
    """``cross_entropy(linear(x, w.to(x.dtype), b).float(), target, ...)`` in chunks of
    ``chunk`` rows (default :func:`chunk_rows`), never forming the logits whole.

    Args:
        x: ``[N, d]`` activations in the low dtype (or fp32).
        w: the ``[V, d]`` weight, fp32 (the master) or ``x``'s dtype; b: ``[V]`` or None.
        target: ``[N]`` class indices; ``ignore_index`` rows count for nothing.
        reduction: aten's enum, 1 (mean over the rows not ignored) or 2 (sum).
        label_smoothing: as ``torch.nn.functional.cross_entropy``'s.
        own_weight: nothing else reads ``w`` (the graph pass knows): where ``w`` has a
            gradient sink (``grad_sinks.py``: a step that releases its gradients), its
            gradient is handed over by blocks of vocabulary rows, and the head is
            streamed by them (see the module docstring).

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
    sink = sink_of(w) if own_weight and w.requires_grad and w.is_contiguous() \
        and w.dtype in (torch.float32, x.dtype) and torch.is_grad_enabled() else None
    if sink is not None:
        return StreamedLinearCrossEntropy.apply(x, w, b, target, reduction, ignore_index,
                                                float(label_smoothing), sink)
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
    loss's gradient ``scale`` (None: 1) reaching the logits' gradient before its cast to
    ``x``'s dtype.

    Each chunk goes through aten's own kernels, those of the unfused graph's
    ``cross_entropy`` and its backward (``_log_softmax``, ``nll_loss_backward``,
    ``_log_softmax_backward_data``), in place on one fp32 chunk: the log-probabilities and
    the logits' gradient are the unfused ones bit for bit, and so is the loss, summed by
    ``nll_loss`` over each row's picked log-probability.
    """
    reduction, ignore_index, smoothing, rows = args
    low, n, vocab = x.dtype, x.shape[0], w.shape[0]
    need_x, need_w, need_b = needs
    with torch.no_grad():
        wl = w if w.dtype == low else w.to(low)
        bl = b if b is None or b.dtype == low else b.to(low)
        valid, safe, count = _targets(target, ignore_index)
        g = torch.ones((), dtype=torch.float32, device=x.device) if scale is None \
            else scale.to(torch.float32)
        # cross_entropy's label smoothing is (1 - eps) nll + eps / V * smooth, smooth the
        # rows' -sum(log p) (over the rows not ignored, divided by their count for a mean):
        # these are the gradients autograd sends to each term
        g_nll = g * (1 - smoothing) if smoothing else g
        g_row = -(g * (smoothing / vocab) / (count if reduction == 1 else 1)) if smoothing \
            else None
        gx = torch.empty_like(x) if need_x else None
        # fp32 masters: the weight's gradient sums in fp32; 16-bit weights (the
        # ``stochastic`` tier): in their own dtype, half the bytes, alive until backward
        acc = torch.float32 if w.dtype == torch.float32 else w.dtype
        gw = torch.zeros(w.shape, dtype=acc, device=w.device) if need_w else None
        gb = torch.zeros(vocab, dtype=torch.float32, device=w.device) if need_b else None
        picked = torch.empty(n, 1, dtype=torch.float32, device=x.device)  # log p(target)
        sums = torch.empty(n, dtype=torch.float32, device=x.device) if smoothing else None
        block = max(1, GRAD_BLOCK_BYTES // (4 * w.shape[1]))
        for start in range(0, n, rows):
            end = min(start + rows, n)
            xc, tc = x[start:end], target[start:end]
            logp = torch.nn.functional.linear(xc, wl, bl).float()
            torch.ops.aten._log_softmax.out(logp, 1, False, out=logp)
            torch.gather(logp, 1, safe[start:end, None], out=picked[start:end])
            if smoothing:
                torch.sum(logp, 1, out=sums[start:end])
            if not (need_x or need_w or need_b):
                continue
            go = torch.ops.aten.nll_loss_backward(g_nll, logp, tc, None, reduction,
                                                  ignore_index, count.to(torch.float32))
            if smoothing:
                go += torch.where(valid[start:end], g_row, 0)[:, None]
            torch.ops.aten._log_softmax_backward_data.out(go, logp, 1, torch.float32, out=go)
            del logp
            grad = go.to(low)  # the unfused graph's cast back to the product's dtype
            del go
            if need_x:
                torch.mm(grad, wl, out=gx[start:end])
            if need_w:  # by blocks of the vocabulary: no whole fp32 partial besides gw
                for v0 in range(0, vocab, block):
                    gw[v0:v0 + block] += torch.mm(grad[:, v0:v0 + block].t(), xc)
            if need_b:
                gb += grad.sum(0)
        loss = torch.nn.functional.nll_loss(picked, torch.where(valid, 0, ignore_index),
                                            reduction=_REDUCTIONS[reduction],
                                            ignore_index=ignore_index)
        if smoothing:
            smooth = (-sums).masked_fill_(~valid, 0)
            smooth = smooth.sum() / count if reduction == 1 else smooth.sum()
            loss = (1 - smoothing) * loss + smooth * (smoothing / vocab)
    return loss, [gx, gw, gb]


class StreamedLinearCrossEntropy(torch.autograd.Function):
    """:func:`linear_cross_entropy` by blocks of vocabulary rows, its weight's gradient
    handed to the weight's sink block by block (``release_grads=True``): neither the
    weight's gradient nor its 16-bit copy ever exists whole. Forward takes the loss with
    an online log-sum-exp over the blocks (each block's weight cast on its own) and keeps
    each row's log-sum-exp; backward computes each block's logits again (one product more
    than :class:`LinearCrossEntropy`, as Cut Cross-Entropy does), their gradient
    ``softmax - target`` in fp32, cast to the low dtype as the unfused graph's, and from it
    the input's gradient (summed over the blocks in fp32) and the block's weight gradient,
    which the sink steps at once. The values are the unfused graph's within fp32 rounding
    (the log-sum-exp is summed in another order) and, for the input's gradient, one 16-bit
    rounding per block."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                target: torch.Tensor, reduction: int, ignore_index: int,
                smoothing: float, sink: GradSink) -> torch.Tensor:
        ctx.args, ctx.sink = (reduction, ignore_index, smoothing), sink
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
        loss, lse = _streamed_loss(x, w, b, target, ctx.args)
        ctx.save_for_backward(x, w, b, target, lse)
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, w, b, target, lse = ctx.saved_tensors
        gx, gw, gb = _streamed_grads(x, w, b, target, lse, ctx.args,
                                     ctx.needs_input_grad[:3], grad, ctx.sink)
        dtypes = ctx.dtypes
        return (gx, gw, None if gb is None else gb.to(dtypes[2]), None, None, None, None,
                None)


def _targets(target: torch.Tensor, ignore_index: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rows not ignored, the target with 0 in ignored rows, their count)``."""
    valid = target != ignore_index
    return valid, torch.where(valid, target, torch.zeros_like(target)), valid.sum()


def _block_logits(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, v0: int,
                  v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp32 logits [N, v1 - v0], the block's weight in x's dtype)``: the unfused
    graph's product for vocabulary rows ``v0:v1``."""
    wl = w[v0:v1].to(x.dtype)
    bl = None if b is None else b[v0:v1].to(x.dtype)
    return torch.nn.functional.linear(x, wl, bl).float(), wl


def _in_block(target: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows whose target is in v0:v1, [N, 1] its column there, 0 elsewhere)``."""
    here = (target >= v0) & (target < v1)
    return here, torch.where(here, target - v0, torch.zeros_like(target))[:, None]


def _streamed_loss(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                   target: torch.Tensor, args: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss, and each row's fp32 log-sum-exp, by blocks of vocabulary rows."""
    reduction, ignore_index, smoothing = args
    n, vocab = x.shape[0], w.shape[0]
    step = vocab_rows(n, vocab, w.shape[1])
    f32 = dict(dtype=torch.float32, device=x.device)
    with torch.no_grad():
        valid, safe, count = _targets(target, ignore_index)
        top = torch.full((n,), float("-inf"), **f32)  # the running max of each row
        total = torch.zeros(n, **f32)  # the sum of exp(logit - top)
        picked = torch.zeros(n, **f32)  # the target's logit
        sums = torch.zeros(n, **f32) if smoothing else None  # the sum of the logits
        for v0 in range(0, vocab, step):
            v1 = min(vocab, v0 + step)
            logits, _ = _block_logits(x, w, b, v0, v1)
            here, col = _in_block(safe, v0, v1)
            picked += torch.where(here, logits.gather(1, col)[:, 0], 0)
            if smoothing:
                sums += logits.sum(1)
            new = torch.maximum(top, logits.amax(1))
            total.mul_(torch.exp(top - new)).add_(logits.sub_(new[:, None]).exp_().sum(1))
            top = new
            del logits
        lse = top + total.log()
        nll = (lse - picked).masked_fill_(~valid, 0).sum()
        loss = nll / count if reduction == 1 else nll
        if smoothing:  # -sum(log p) over a row: V * lse - sum(logits)
            smooth = (vocab * lse - sums).masked_fill_(~valid, 0).sum()
            smooth = smooth / count if reduction == 1 else smooth
            loss = (1 - smoothing) * loss + smooth * (smoothing / vocab)
    return loss, lse


def _streamed_grads(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                    target: torch.Tensor, lse: torch.Tensor, args: tuple, needs: tuple,
                    grad: torch.Tensor, sink: GradSink
                    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The gradients ``needs`` asks for, by blocks of vocabulary rows; the weight's handed
    to ``sink`` block by block while it accepts (then None is returned for it)."""
    reduction, ignore_index, smoothing = args
    need_x, need_w, need_b = needs
    n, vocab, d = x.shape[0], w.shape[0], w.shape[1]
    step = vocab_rows(n, vocab, d)
    streaming = need_w and sink.accepting()
    with torch.no_grad():
        valid, safe, count = _targets(target, ignore_index)
        # the logits' gradient of a row: coef * (softmax - (1 - eps) onehot - eps / V)
        coef = grad.to(torch.float32) / (count if reduction == 1 else 1)
        coef = torch.where(valid, coef, 0)[:, None]
        gx = torch.zeros(n, d, dtype=torch.float32, device=x.device) if need_x else None
        gw = torch.empty(w.shape, dtype=w.dtype, device=w.device) \
            if need_w and not streaming else None
        gb = torch.empty(vocab, dtype=torch.float32, device=x.device) if need_b else None
        for v0 in range(0, vocab, step):
            v1 = min(vocab, v0 + step)
            logits, wl = _block_logits(x, w, b, v0, v1)
            go = logits.sub_(lse[:, None]).exp_()
            if smoothing:
                go -= smoothing / vocab
            here, col = _in_block(safe, v0, v1)
            go.scatter_add_(1, col, torch.where(here, smoothing - 1.0, 0.0)[:, None]
                            .to(go.dtype))
            low = go.mul_(coef).to(x.dtype)  # the unfused graph's cast back
            del go, logits
            if need_x:
                gx += torch.mm(low, wl)
            if need_w:
                part = torch.mm(low.t(), x).to(w.dtype)
                if streaming:
                    sink.take(w, v0 * d, part.view(-1))
                else:
                    gw[v0:v1] = part
                del part
            if need_b:
                gb[v0:v1] = low.sum(0)
        if streaming:
            sink.finish(w)
    return (None if gx is None else gx.to(x.dtype)), gw, gb
