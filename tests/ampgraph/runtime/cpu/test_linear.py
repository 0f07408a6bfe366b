"""ampgraph/runtime/cpu/linear.py: linear layers with the weight cast fused in; large
ones cast, and their gradients computed, block by block through a small pooled scratch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampgraph.runtime.cpu.blocked as blocked
import ampgraph.runtime.cpu.linear as linear
import ampgraph.runtime.cpu.weights as weights
from tests.ampgraph.runtime.cpu.helpers import (
    Net,
    TiedHead,
    blocks,
    compiled,
    fused_and_plain,
    paths,
    tied_step,
)


@pytest.mark.parametrize("path", ["aten", "whole", "blocked"])
def test_routed_linears_give_the_same_outputs_and_gradients_as_aten_linear(path, monkeypatch):
    block = paths(monkeypatch, path)
    torch.manual_seed(0)
    for shape in ((5, 16), (2, 3, 16)):  # 2-D and batched inputs
        model = Net()
        x = torch.randn(*shape)
        fused, cache, plain = fused_and_plain(model, x)
        targets = [n.target for n in fused.graph.nodes if n.op == "call_function"]
        assert targets.count(cache.amp_linear) == 2, "fc1 and fc3; fc2's cast is shared"
        assert targets.count(torch.ops.aten.linear.default) == 2
        routed = [n for n in fused.graph.nodes if n.target == cache.amp_linear]
        assert all(n.args[1].op == n.args[2].op == "get_attr" for n in routed), \
            "weight and bias casts happen inside the linear"
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_a, out_b = fused(xa), plain(xb)
        torch.testing.assert_close(out_a, out_b, rtol=0, atol=0)
        out_a.square().sum().backward()
        out_b.square().sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad)
        for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
            assert p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad, q.grad, msg=name)  # same bf16 roundings
        if block is not None:  # blocks of rows (forward, weight gradient), of columns
            # (dx: a quarter of the weight's columns at least)
            assert {k[0] for k in cache._scratch} == {(2, 16), (32, 4), (1, 32), (8, 8)}
            assert not any(key[0] == "train" and t.shape == (32, 16)
                           for _, per in cache._slots.values() for key, (t, _) in per.items()), \
                "a blocked weight has no whole working copy"


def test_working_copies_and_scratch_are_reused_across_steps(monkeypatch):
    blocks(monkeypatch, 64)  # fc1 and fc3 blocked, fc2 cast whole
    monkeypatch.setattr(weights, "KEPT_COPY_BYTES", 0)  # fc2's copy is kept, however small
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(4, 16)
    gm, cache = compiled(model, x, True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        gm(x).square().mean().backward()
        opt.step()
        seen.append(({k: [b.data_ptr() for b, _ in pool] for k, pool in cache._scratch.items()},
                     sorted(t.data_ptr() for t in cache.train_copies())))
    assert seen[1] == seen[2] == seen[3], "steady state: no new working copies or scratch"
    assert seen[3][1], "fc2's weight has a working copy"
    assert all(len(pool) == 1 for pool in cache._scratch.values())


def test_two_forwards_then_one_backward_with_routed_linears():
    torch.manual_seed(0)
    model = Net()
    x1, x2 = torch.randn(3, 16), torch.randn(3, 16)
    gm, _, ref = fused_and_plain(model, x1)
    (gm(x1).square().sum() + gm(x2).square().sum()).backward()
    (ref(x1).square().sum() + ref(x2).square().sum()).backward()
    for p, q in zip(gm.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_the_weight_gradient_is_made_in_the_dead_working_copy_unless_the_graph_is_retained(
        monkeypatch):
    monkeypatch.setattr(weights, "KEPT_COPY_BYTES", 0)  # fc1's and fc3's copies are kept
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(3, 16)
    gm, cache, ref = fused_and_plain(model, x)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss_a, loss_b = gm(xa).square().sum(), ref(xb).square().sum()
    for _ in range(2):  # the second backward reads the working copies again
        loss_a.backward(retain_graph=True)
        loss_b.backward(retain_graph=True)
        torch.testing.assert_close(xa.grad, xb.grad)
        for p, q in zip(gm.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    copies = {t.shape: t for t in cache.train_copies() if t.dim() == 2}
    torch.testing.assert_close(copies[(8, 32)], model.fc3.weight.bfloat16(), rtol=0, atol=0)
    del loss_a  # frees the retained graph and its hold on the copies
    for p in model.parameters():
        p.grad = None
    gm(xa).square().sum().backward()  # not retained: the copies hold the bf16 gradients
    copies = {t.shape: t for t in cache.train_copies() if t.dim() == 2}
    for fc in (model.fc1, model.fc3):
        torch.testing.assert_close(copies[tuple(fc.weight.shape)].float(), fc.weight.grad,
                                   rtol=0, atol=0)


def test_a_first_layer_keeps_no_working_copy_that_backward_would_not_read(monkeypatch):
    """An input without gradient (a network's first layer): backward needs no ``grad @ w``,
    so the weight is cast block by block in forward and no whole copy outlives it (as
    autocast's dies after forward); the gradients are aten's."""
    monkeypatch.setattr(weights, "KEPT_COPY_BYTES", 0)  # every whole copy would be kept
    monkeypatch.setattr(blocked, "SCRATCH_NUMEL", 64)  # fc1 (512) in blocks of 4 rows
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(3, 16)
    gm, cache, ref = fused_and_plain(model, x)
    for _ in range(2):  # the second step reuses the buffers
        for m in (gm, ref):
            m.zero_grad(set_to_none=True)
            m(x).square().sum().backward()
        for p, q in zip(gm.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    shapes = {tuple(t.shape) for t in cache.train_copies()}
    assert (32, 16) not in shapes and (8, 32) in shapes, shapes  # fc1 none, fc3 kept
    assert ((4, 16), torch.bfloat16, x.device) in cache._scratch
    monkeypatch.setattr(blocked, "SCRATCH_NUMEL", 512)  # fc1 in one block: a copy is kept
    gm(x).sum().backward()
    assert (32, 16) in {tuple(t.shape) for t in cache.train_copies()}
    cache.clear()
    monkeypatch.setattr(blocked, "SCRATCH_NUMEL", 64)
    gm(x.clone().requires_grad_()).sum().backward()  # needs grad @ w: a whole copy again
    assert (32, 16) in {tuple(t.shape) for t in cache.train_copies()}


def test_blocked_linear_checks_the_master_is_unchanged_before_backward(monkeypatch):
    blocks(monkeypatch, 40)
    model = Net()
    x = torch.randn(3, 16)
    gm, _ = compiled(model, x, True)
    loss = gm(x).square().sum()
    with torch.no_grad():
        model.fc3.weight.add_(1.0)  # an update between forward and backward, as for fp32
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_large_linear_keeps_no_whole_low_precision_copy_of_its_weight(monkeypatch):
    """Peak live tensors of a steady-state step, counted from before the first step (so
    buffers kept between steps count): the fp32 gradient plus less than a bf16 copy."""
    import time

    monkeypatch.setattr(linear, "BLOCKED_NUMEL", blocked.SCRATCH_NUMEL)  # 2M: blocked

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 8))
    x = torch.randn(8, 1024)
    gm, _ = compiled(model, x, True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        for step in range(3):
            if step == 2:
                t_last = time.time_ns()
            model.zero_grad(set_to_none=True)
            gm(x).square().mean().backward()
    live = peak = 0
    for t, n in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                       if e.name() == "[memory]"):
        live += n
        if t >= t_last:
            peak = max(peak, live)
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    weight_low_bytes = 2048 * 1024 * 2
    assert grad_bytes < peak < grad_bytes + weight_low_bytes, (peak, grad_bytes)


@pytest.mark.parametrize("blocked", [False, True])
def test_a_tied_weight_sums_its_two_gradients_in_place(blocked, monkeypatch):
    """The head's gradient arrives first: it must be a tensor nothing else holds, so that
    autograd adds the embedding's into it in place (the buffer a blocked weight's gradient
    goes into, kept by the cache, would cost an out-of-place, table-sized add every step)."""
    if blocked:
        blocks(monkeypatch, 200)
    torch.manual_seed(0)
    model, ids = TiedHead(), torch.randint(0, 50, (4, 8))
    gm, cache, plain = fused_and_plain(model, ids)
    (head,) = [n for n in gm.graph.nodes if n.target == cache.amp_linear
               and n.args[1].target == "head.weight"]
    assert head.kwargs == {"shared": True}
    for _ in range(3):
        tied_step(model, gm, plain, ids)


def test_a_backward_that_creates_a_graph_keeps_the_working_copy(monkeypatch):
    """create_graph=True with retain_graph=False: backward runs with gradients on, where
    a product into the working copy (``out=``) could not be differentiated."""
    monkeypatch.setattr(weights, "KEPT_COPY_BYTES", 0)
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(3, 16)
    gm, _, ref = fused_and_plain(model, x)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ga,) = torch.autograd.grad(gm(xa).square().sum(), xa, create_graph=True,
                                retain_graph=False)
    (gb,) = torch.autograd.grad(ref(xb).square().sum(), xb, create_graph=True,
                                retain_graph=False)
    torch.testing.assert_close(ga, gb)


@pytest.mark.parametrize("path", ["aten", "whole", "blocked"])
def test_a_gradient_penalty_reaches_the_weights_through_routed_linears(path, monkeypatch):
    """d/dw of |d loss / dx|^2 (WGAN-GP, input-gradient regularisers): with create_graph the
    linear's gradients are ops of the fp32 master, as aten's linear on a cast weight."""
    paths(monkeypatch, path)
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(3, 16)
    gm, _, ref = fused_and_plain(model, x)
    for m in (gm, ref):
        xm = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(m(xm).square().sum(), xm, create_graph=True)
        g.square().sum().backward()
    for (name, p), q in zip(gm.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2, msg=name)


def test_blockable_needs_a_large_plain_2d_weight_and_a_batched_cpu_input(monkeypatch):
    monkeypatch.setattr(linear, "BLOCKED_NUMEL", 64)
    monkeypatch.setattr(blocked, "SCRATCH_NUMEL", 16)
    x, w = torch.randn(3, 8), torch.randn(8, 8)
    assert linear.blockable(x, w, need_x=True)
    assert not linear.blockable(x, torch.randn(4, 8), need_x=True), "below BLOCKED_NUMEL"
    assert linear.blockable(x, torch.randn(4, 8), need_x=False), \
        "a first layer's weight larger than the scratch: no copy kept for backward"
    assert not linear.blockable(x, torch.randn(2, 8), need_x=False), "within the scratch"
    assert not linear.blockable(torch.randn(8), w, need_x=True), "no batch dimension"
    assert not linear.blockable(x, w.to_sparse(), need_x=True), "not strided"
    assert not linear.blockable(x.to("meta"), w.to("meta"), need_x=True), "not on the CPU"


class ChannelsMlp(nn.Module):
    """ConvNeXt's block shape: a linear over the channels of an NCHW map permuted to NHWC,
    permuted back, so the linear's output gradient arrives strided."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def test_a_strided_output_gradient_takes_one_product_not_a_weight_expanded_per_row(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(weights, "KEPT_COPY_BYTES", 0)  # the fused linear, whole copy
    torch.manual_seed(0)
    x = torch.randn(2, 8, 3, 5)
    fused, cache, plain = fused_and_plain(ChannelsMlp(), x)
    assert any(n.target == cache.amp_linear for n in fused.graph.nodes)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = fused(xa)
    grad = torch.randn(out.shape[::-1]).permute(3, 2, 1, 0)  # strided, as a permute's
    with Ops() as ops:
        out.backward(grad)
    plain(xb).backward(grad)
    assert torch.ops.aten.bmm.default not in ops.seen
    torch.testing.assert_close(xa.grad, xb.grad)
    for p, q in zip(fused.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
