"""ampgraph/runtime/head_loss.py: the chunked head and cross-entropy equals the unfused
product, fp32 cast and cross-entropy, loss and gradients, whatever the chunking."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ampgraph.runtime.head_loss import chunk_rows, linear_cross_entropy


def unfused(x, w, b, target, reduction, ignore_index, smoothing):
    low = x.dtype
    logits = F.linear(x, w.to(low), None if b is None else b.to(low)).float()
    return F.cross_entropy(logits, target, reduction=reduction, ignore_index=ignore_index,
                           label_smoothing=smoothing)


def both(low, reduction, smoothing, bias, chunk, scale=1.0, n=37, d=16, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(n, d, generator=g).to(low)
    w0 = torch.randn(vocab, d, generator=g) * 0.3
    b0 = torch.randn(vocab, generator=g) if bias else None
    target = torch.randint(0, vocab, (n,), generator=g)
    target[::5] = -7  # ignored rows, a non-default ignore_index
    out = []
    for fused in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        b = None if b0 is None else b0.clone().requires_grad_()
        if fused:
            loss = linear_cross_entropy(x, w, b, target, {"mean": 1, "sum": 2}[reduction], -7,
                                        smoothing, chunk=chunk)
        else:
            loss = unfused(x, w, b, target, reduction, -7, smoothing)
        (loss * scale).backward()
        out.append((loss.detach(), x.grad.float(), w.grad, None if b is None else b.grad))
    return out


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
def test_loss_and_gradients_equal_the_unfused_ops(low, reduction, smoothing, bias):
    ref, fused = both(low, reduction, smoothing, bias, chunk=8)
    # aten's own kernels on each chunk: the loss and x's gradient bit for bit
    assert torch.equal(fused[0], ref[0]) and torch.equal(fused[1], ref[1])
    # the weight's and bias's: fp32 sums of per-chunk 16-bit partials, one 16-bit sum unfused
    tol = 1e-2 if low == torch.bfloat16 else 2e-3
    assert rel(fused[2], ref[2]) < tol
    if bias:
        assert rel(fused[3], ref[3]) < tol


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_in_one_chunk_every_gradient_is_the_unfused_one_bit_for_bit(low, smoothing):
    ref, fused = both(low, "mean", smoothing, True, chunk=37)
    assert all(torch.equal(a, b) for a, b in zip(fused, ref))


def test_chunks_of_any_size_give_the_same_loss_and_input_gradient():
    ref = both(torch.bfloat16, "mean", 0.0, False, chunk=37)[1]  # one chunk
    for chunk in (1, 5, 8, 36, 100):
        fused = both(torch.bfloat16, "mean", 0.0, False, chunk=chunk)[1]
        assert torch.equal(fused[0], ref[0]) and torch.equal(fused[1], ref[1])


def test_fp16_gradients_take_the_loss_scale_before_their_cast():
    # 1 / (rows x 2^24) underflows fp16 unless the scale reaches it first, as unfused
    ref, fused = both(torch.float16, "mean", 0.0, False, chunk=8, scale=2.0**16, n=64,
                      vocab=4000)
    assert rel(fused[1], ref[1]) < 1e-3 and rel(fused[2], ref[2]) < 2e-3
    assert torch.equal(fused[1] != 0, ref[1] != 0)  # nothing flushed to zero


def test_every_row_ignored_gives_the_unfused_nan_mean_and_zero_gradients():
    x = torch.randn(4, 8).bfloat16().requires_grad_()
    w = torch.randn(10, 8, requires_grad=True)
    target = torch.full((4,), -100)
    loss = linear_cross_entropy(x, w, None, target)
    ref = unfused(x.detach(), w.detach(), None, target, "mean", -100, 0.0)
    assert torch.isnan(loss) and torch.isnan(ref)
    loss.backward()
    assert not x.grad.any() and not w.grad.any()


def test_without_gradients_no_gradient_is_formed():
    x, w = torch.randn(6, 8).bfloat16(), torch.randn(10, 8)
    target = torch.tensor([1, 2, 3, 4, 5, 6])
    with torch.no_grad():
        loss = linear_cross_entropy(x.requires_grad_(), w.requires_grad_(), None, target)
    assert not loss.requires_grad
    assert torch.allclose(loss, unfused(x.detach(), w.detach(), None, target, "mean", -100, 0.0))


def test_a_second_backward_raises_rather_than_reusing_freed_gradients():
    x = torch.randn(4, 8).bfloat16().requires_grad_()
    w = torch.randn(10, 8, requires_grad=True)
    loss = linear_cross_entropy(x, w, None, torch.tensor([1, 2, 3, 4]))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


def test_bad_arguments_are_refused():
    x, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(x, w, None, t, reduction=0)
    with pytest.raises(ValueError, match=r"x \[N, d\]"):
        linear_cross_entropy(x[None], w, None, t)


def test_chunk_rows_keeps_a_chunk_of_logits_near_its_budget():
    assert chunk_rows(1024, 128256) == 64 and chunk_rows(1024, 32000) == 256
    assert chunk_rows(3, 300) == 3 and chunk_rows(10**6, 10**9) == 8
    assert chunk_rows(1024, 128256, budget=1 << 20) == 8


def test_the_weight_gradient_summed_by_blocks_of_the_vocabulary_is_the_same(monkeypatch):
    import ampgraph.runtime.head_loss as head_loss

    whole = both(torch.bfloat16, "mean", 0.0, True, chunk=8)[1]
    monkeypatch.setattr(head_loss, "GRAD_BLOCK_BYTES", 4 * 16 * 7)  # 7 vocabulary rows
    blocks = both(torch.bfloat16, "mean", 0.0, True, chunk=8)[1]
    assert all(torch.equal(a, b) for a, b in zip(whole, blocks))


def test_a_sixteen_bit_weight_has_its_gradient_summed_in_its_own_dtype():
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(64, 16, generator=g).bfloat16()
    w0 = (torch.randn(50, 16, generator=g) * 0.3).bfloat16()
    target = torch.randint(0, 50, (64,), generator=g)
    grads = []
    for chunk in (64, 8):  # one chunk (the unfused values), eight
        w = w0.clone().requires_grad_()
        linear_cross_entropy(x0, w, None, target, chunk=chunk).backward()
        grads.append(w.grad)
    w = w0.clone().requires_grad_()
    unfused(x0, w, None, target, "mean", -100, 0.0).backward()
    assert all(gr.dtype == torch.bfloat16 for gr in grads)
    assert torch.equal(grads[0], w.grad)
    assert rel(grads[1].float(), w.grad.float()) < 1e-2


class RecordingSink:
    """A gradient sink (grad_sinks.py) that writes each part it takes into ``grad``."""

    def __init__(self, w, accepting=True):
        self.w, self.open, self.finished = w, accepting, 0
        self.grad = torch.full_like(w, float("nan"))
        self.parts = []

    def accepting(self):
        return self.open

    def take(self, p, start, grad):
        assert p is self.w and grad.dtype == p.dtype
        self.grad.view(-1)[start:start + grad.numel()] = grad
        self.parts.append((start, grad.numel()))

    def finish(self, p):
        self.finished += 1


def streamed(low, reduction, smoothing, bias, accepting=True, n=37, d=16, vocab=50, seed=0,
             block_rows=8):
    """The unfused values, and the fused head's with a sink on its weight (blocks of
    ``block_rows`` vocabulary rows), as ``both`` gives them."""
    import ampgraph.runtime.head_loss as head_loss
    from ampgraph.runtime.grad_sinks import register_sink, unregister_sink

    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(n, d, generator=g).to(low)
    w0 = torch.randn(vocab, d, generator=g) * 0.3
    b0 = torch.randn(vocab, generator=g) if bias else None
    target = torch.randint(0, vocab, (n,), generator=g)
    target[::5] = -7
    red = {"mean": 1, "sum": 2}[reduction]
    out, sinks = [], []
    for fused in (False, True):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        b = None if b0 is None else b0.clone().requires_grad_()
        if fused:
            sink = RecordingSink(w, accepting)
            register_sink(w, sink)
            budget = head_loss.GRAD_BLOCK_BYTES
            head_loss.GRAD_BLOCK_BYTES = 4 * d * block_rows
            try:
                loss = linear_cross_entropy(x, w, b, target, red, -7, smoothing, own_weight=True)
                loss.backward()
            finally:
                head_loss.GRAD_BLOCK_BYTES = budget
                unregister_sink(w, sink)
            sinks.append(sink)
            gw = sink.grad if accepting else w.grad
            assert accepting == (w.grad is None)
        else:
            loss = unfused(x, w, b, target, reduction, -7, smoothing)
            loss.backward()
            gw = w.grad
        out.append((loss.detach(), x.grad.float(), gw, None if b is None else b.grad))
    return out, sinks[0]


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
def test_a_weight_with_a_sink_takes_its_gradient_by_blocks_of_the_vocabulary(
        low, reduction, smoothing, bias):
    (ref, fused), sink = streamed(low, reduction, smoothing, bias)
    # an online log-sum-exp over the blocks: the loss within fp32 rounding
    assert torch.allclose(fused[0], ref[0], rtol=1e-5, atol=0)
    # seven blocks of 8 rows (the last 2), each taken once, covering the weight
    assert sink.finished == 1 and sorted(sink.parts) == [(i * 8 * 16, min(8, 50 - i * 8) * 16)
                                                         for i in range(7)]
    tol = 1e-2 if low == torch.bfloat16 else 2e-3  # one 16-bit rounding per block (x's)
    assert rel(fused[1], ref[1]) < tol and rel(fused[2], ref[2]) < tol
    if bias:
        assert rel(fused[3], ref[3]) < tol


def test_a_sink_not_accepting_gets_nothing_and_the_gradient_is_returned_whole():
    (ref, fused), sink = streamed(torch.bfloat16, "mean", 0.0, False, accepting=False)
    assert sink.parts == [] and sink.finished == 0
    assert rel(fused[2], ref[2]) < 1e-2 and rel(fused[1], ref[1]) < 1e-2


def test_the_streamed_head_never_makes_a_tensor_the_weights_size():
    from torch.utils._python_dispatch import TorchDispatchMode

    import ampgraph.runtime.head_loss as head_loss
    from ampgraph.runtime.grad_sinks import register_sink, unregister_sink

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(r.alias_info is not None for r in func._schema.returns):
                return out  # a view, or an op's out= argument: nothing made
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.most = max(self.most, t.numel())
            return out

    # 37 x 16 inputs, a 200 x 16 weight: its gradient and 16-bit copy are 3200 elements,
    # the logits 7400; the streamed head's blocks of 8 rows make 37 x 8 logits
    x = torch.randn(37, 16).bfloat16().requires_grad_()
    w = torch.randn(200, 16, requires_grad=True)
    target = torch.randint(0, 200, (37,))
    for with_sink in (False, True):
        sink = RecordingSink(w)
        if with_sink:
            register_sink(w, sink)
        budget, head_loss.GRAD_BLOCK_BYTES = head_loss.GRAD_BLOCK_BYTES, 4 * 16 * 8
        try:
            with Largest() as mode:
                linear_cross_entropy(x, w, None, target, own_weight=True).backward()
        finally:
            head_loss.GRAD_BLOCK_BYTES = budget
            unregister_sink(w, sink)
        if with_sink:
            assert mode.most < 37 * 16 * 2 and sink.finished == 1 and w.grad is None
        else:  # not streamed: the whole gradient and 16-bit copy (and here one chunk)
            assert mode.most >= w.numel() and sink.parts == []
            w.grad = None


def test_every_row_ignored_streamed_gives_the_nan_mean_and_zero_gradients():
    from ampgraph.runtime.grad_sinks import register_sink, unregister_sink

    x = torch.randn(4, 8).bfloat16().requires_grad_()
    w = torch.randn(10, 8, requires_grad=True)
    sink = RecordingSink(w)
    register_sink(w, sink)
    try:
        loss = linear_cross_entropy(x, w, None, torch.full((4,), -100), own_weight=True)
        loss.backward()
    finally:
        unregister_sink(w, sink)
    assert torch.isnan(loss) and not x.grad.any() and not sink.grad.any()
