"""Linear layers with the weight cast fused in; large ones cast, and their gradients
computed, block by block through a small pooled scratch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ampgraph.runtime.cpu.blocked as blocked
import ampgraph.runtime.cpu.weights as weights
from ampgraph.runtime.cpu.weights import WeightCache
from passes.fx import run_amp_passes
from passes.fx.policy import make_policy
from passes.fx.runtime_ops import RuntimeOps


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = self.fc2(h) + self.fc2(h * 2)  # a weight used twice: one cast, two linears
        return self.fc3(torch.relu(h))


def compiled(model, x, fused):
    gm = torch.export.export(model, (x,), strict=False).module()
    cache = WeightCache()
    run_amp_passes(gm, make_policy("O2"), torch.bfloat16, runtime=RuntimeOps(
        weight_cast=cache.cast, linear=cache.amp_linear if fused else None,
        embedding=cache.amp_embedding if fused else None))
    return gm, cache


def fused_and_plain(model, x):
    """``model`` compiled with the runtime's linears and embeddings, with its cache, and a
    deep copy compiled without them: (fused, cache, plain)."""
    fused, cache = compiled(model, x, True)
    plain, _ = compiled(copy.deepcopy(model), x, False)
    return fused, cache, plain


def blocks(monkeypatch, scratch, at=None):
    """Cast and compute weights of ``at`` (default: ``scratch``) elements or more block by
    block, ``scratch`` elements at a time."""
    monkeypatch.setattr(blocked, "SCRATCH_NUMEL", scratch)
    monkeypatch.setattr(weights, "BLOCKED_NUMEL", scratch if at is None else at)


def paths(monkeypatch, path):
    """Net's linears as ``path``: "aten" (small weights, by default: aten's linear on a fresh
    cast), "whole" (the fused linear on a whole working copy) or "blocked" (2-3 rows a
    block); returns the block size or None."""
    if path == "whole":
        monkeypatch.setattr(weights, "KEPT_COPY_BYTES", 0)
    if path == "blocked":
        blocks(monkeypatch, 40)
        return 40
    return None


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

    monkeypatch.setattr(weights, "BLOCKED_NUMEL", blocked.SCRATCH_NUMEL)  # 2M: blocked

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


def test_training_drops_the_inference_copies(monkeypatch):
    blocks(monkeypatch, 40)  # fc1/fc3 blocked, fc2 cast whole
    model = Net()
    x = torch.randn(3, 16)
    gm, cache = compiled(model, x, True)
    with torch.no_grad():
        gm(x)

    def kinds():
        return sorted(key[0] for _, per in cache._slots.values() for key in per)

    assert kinds().count("infer") == 6  # every weight and bias
    gm(x).sum().backward()
    assert "infer" not in kinds()


class TiedHead(nn.Module):
    """Input and output embeddings sharing one table, as GPT-2's and BERT's do."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(50, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.fc(self.emb(ids))))


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
    shape = list(model.emb.weight.shape)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        with torch.profiler.profile(record_shapes=True) as prof:
            gm(ids).float().square().sum().backward()
        adds = {e.key for e in prof.key_averages(group_by_input_shape=True)
                if e.key in ("aten::add", "aten::add_") and shape in e.input_shapes}
        assert adds == {"aten::add_"}
        plain(ids).float().square().sum().backward()
        ref = dict(plain.named_parameters())["emb.weight"].grad
        torch.testing.assert_close(model.emb.weight.grad, ref, rtol=0, atol=0)


@pytest.mark.parametrize("blocked", [False, True])
def test_a_large_gradient_buffer_is_kept_only_while_the_last_gradient_outlives_forward(
        blocked, monkeypatch):
    """zero_grad after forward: the last gradient lives through forward anyway, so the next
    one reuses its storage. zero_grad before forward: nothing is kept (a kept buffer would
    add a whole gradient to the forward's peak), and without zero_grad the gradients add
    up as autograd's do."""
    monkeypatch.setattr(weights, "KEPT_GRAD_NUMEL", 512)  # fc1 (fc2 is used twice)
    if blocked:
        blocks(monkeypatch, 64, 512)
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(4, 16)
    gm, cache, plain = fused_and_plain(model, x)
    w = model.fc1.weight

    def storages(zero_first, steps=4):
        seen = []
        for _ in range(steps):
            if zero_first:
                model.zero_grad(set_to_none=True)
            loss = gm(x).square().mean()
            if not zero_first:
                model.zero_grad(set_to_none=True)
            loss.backward()
            seen.append(w.grad.untyped_storage().data_ptr())
        return seen

    late = storages(zero_first=False)
    assert late[1] == late[2] == late[3]
    storages(zero_first=True, steps=1)
    assert not any(k[0] == "grad" for k in cache._per_param(w)), "nothing kept"

    model.zero_grad(set_to_none=True)
    for _ in range(3):  # accumulation: the gradient outlives forward and backward
        gm(x).square().mean().backward()
        plain(x).square().mean().backward()
    ref = dict(plain.named_parameters())["fc1.weight"].grad
    torch.testing.assert_close(w.grad, ref, rtol=1e-2, atol=1e-4)


@pytest.mark.parametrize("small", [True, False])
def test_conv_weights_of_a_channels_last_graph_are_cast_channels_last(small, monkeypatch):
    """The convolutions run NHWC: an NCHW 3x3 weight would be copied on every call. The
    cast writes channels-last; the gradient keeps the master's strides (a small weight's
    by AccumulateGrad's copy, a larger one's by the cast's backward); values as aten's."""
    if not small:
        monkeypatch.setattr(weights, "KEPT_COPY_BYTES", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 4))
    x = torch.randn(2, 3, 8, 8)
    gm, cache, plain = fused_and_plain(model, x)
    conv_casts = [n for n in gm.graph.nodes if n.target == cache.cast
                  and n.kwargs.get("memory_format") == torch.channels_last]
    assert sorted(n.args[0].target for n in conv_casts) == ["0.weight", "3.weight"]
    seen = []
    orig = cache.cast

    def spy(p, dtype, memory_format=None):
        out = orig(p, dtype, memory_format)
        if p.dim() == 4:
            seen.append(out.is_contiguous(memory_format=torch.channels_last))
        return out

    for node in conv_casts:
        node.target = spy
    gm.recompile()
    gm(x).square().sum().backward()
    plain(x).square().sum().backward()
    assert seen == [True, True]
    for name, p in dict(plain.named_parameters()).items():
        mine = dict(gm.named_parameters())[name]
        assert mine.grad.stride() == mine.stride(), name
        torch.testing.assert_close(mine.grad, p.grad, rtol=2e-2, atol=1e-3)
    with torch.no_grad():  # inference copies are channels-last too
        torch.testing.assert_close(gm(x), plain(x), rtol=2e-2, atol=1e-2)
    assert seen[-2:] == [True, True]


class Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(50, 16, padding_idx=0), nn.Linear(16, 4)

    def forward(self, ids):
        return self.fc(self.emb(ids))


@pytest.mark.parametrize("kept", [False, True])
def test_routed_embedding_gradients_are_aten_s_and_a_kept_table_reuses_its_buffer(
        kept, monkeypatch):
    """The same sums in the same order as aten's embedding backward (the padding row gets
    none), into a buffer reused across steps where the last gradient outlives forward."""
    if kept:
        monkeypatch.setattr(weights, "KEPT_GRAD_NUMEL", 800)  # the 50x16 table
    torch.manual_seed(0)
    model = Lookup()
    ids = torch.randint(0, 50, (4, 12))
    ids[0, :3] = 0
    gm, cache, plain = fused_and_plain(model, ids)
    assert any(n.target == cache.amp_embedding for n in gm.graph.nodes)
    seen = []
    for _ in range(3):
        loss = gm(ids).float().square().sum()
        model.zero_grad(set_to_none=True)  # after forward: the last gradient outlived it
        loss.backward()
        plain.zero_grad(set_to_none=True)
        plain(ids).float().square().sum().backward()
        ref = dict(plain.named_parameters())["emb.weight"].grad
        torch.testing.assert_close(model.emb.weight.grad, ref, rtol=0, atol=0)
        assert not model.emb.weight.grad[0].any()
        seen.append(model.emb.weight.grad.data_ptr())
    held = any(k[0] == "grad" for k in cache._per_param(model.emb.weight))
    assert held == kept
    if kept:
        assert seen[1] == seen[2]


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


def python_backward_nodes(out):
    """Names of the autograd nodes behind ``out`` that run Python (custom Functions)."""
    seen, todo, names = set(), [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if isinstance(fn, torch.autograd.function.BackwardCFunction):
            names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


@pytest.mark.parametrize("small", [True, False])
def test_small_weights_train_on_aten_s_ops_with_no_python_in_backward(small, monkeypatch):
    """A weight whose copy and gradient would not be kept, and that is not blocked, trains
    as autocast's: a cast and aten's linear / embedding (autograd's backward, no Python)."""
    if not small:
        monkeypatch.setattr(weights, "KEPT_COPY_BYTES", 0)
        monkeypatch.setattr(weights, "KEPT_GRAD_NUMEL", 0)
    torch.manual_seed(0)
    gm, _ = compiled(Lookup(), torch.randint(0, 50, (3, 5)), True)
    net, _ = compiled(Net(), torch.randn(3, 16), True)
    found = python_backward_nodes(gm(torch.randint(0, 50, (3, 5))))
    found |= python_backward_nodes(net(torch.randn(3, 16)))
    # fc2's weight, shared by two linears, is cast once by the cache's cast
    assert found == (set() if small else {"_EmbeddingBackward", "_LinearBackward",
                                          "_CastIntoBackward"})
