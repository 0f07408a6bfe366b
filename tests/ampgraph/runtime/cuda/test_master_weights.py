"""The CUDA runtime's weights refreshed once per step (ampgraph.runtime.cuda), run on CPU
tensors by selecting the runtime by name: it uses portable torch ops only."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

import ampgraph
import ampgraph.runtime.cuda.runtime as cuda_runtime
from ampgraph.runtime import tensors
from ampgraph.runtime.cuda import master_weights
from ampgraph.runtime.cuda.master_weights import MasterCopies, WeightGroup
from models import bert_encoder
from tests.ampgraph.runtime.cuda.helpers import pair


def _groups(net):
    return net._amp_runtime.groups()


def _close(a, b, rel=2e-2):
    """Equal within bf16 rounding: the difference is small against the tensor's norm."""
    return (a - b).norm() <= rel * b.norm() + 1e-6


def test_parameter_casts_become_groups_and_gradients_match_the_cpu_runtime():
    torch.manual_seed(0)
    model = bert_encoder.make_model()
    ref = copy.deepcopy(model)
    net = ampgraph.compile(model, "O2", "bf16", runtime="cuda")
    cpu = ampgraph.compile(ref, "O2", "bf16", runtime="cpu")
    inputs = bert_encoder.example_inputs()
    for m in (net, cpu):
        m(*inputs).float().square().mean().backward()
    assert type(net._amp_runtime).__name__ == "CudaRuntime"
    gm = net.amp_parts()[0][0][1].gm
    calls = [n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "low_copies"]
    assert len(calls) == len(_groups(net)) >= 1
    assert not [n for n in gm.graph.nodes if n.op == "call_function"
                and n.target is torch.ops.aten._to_copy.default
                and n.args[0].op == "get_attr"], "no parameter is cast on its own"
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert p.grad.stride() == p.stride(), name
        assert _close(p.grad, q.grad), name


def test_copies_refresh_only_after_an_update_and_eval_after_train_uses_them():
    model, net, ref, cpu = pair()
    x = torch.randn(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):  # no update between them: cast once
        net(x).sum().backward()
    store = net._amp_runtime.copies
    assert store.refreshes == 1
    opt.step()
    net.eval()
    with torch.no_grad():
        out = net(x)
    assert store.refreshes == 2, "the update made the copies stale"
    with torch.no_grad():
        net(x)
    assert store.refreshes == 2, "eval after eval: nothing changed"
    assert len(store.copies()) == 6, "the eval graph reads the train graph's copies"
    with torch.no_grad():  # the copies are the updated masters, rounded once
        expected = ampgraph.compile(copy.deepcopy(model), "O2", "bf16", runtime="cpu").eval()(x)
    assert torch.equal(out, expected)


def test_gradient_accumulation_over_4_micro_batches():
    model, net, ref, cpu = pair()
    xs = torch.randn(4, 8, 16).unbind()
    for x in xs:
        net(x).square().mean().backward()
        cpu(x).square().mean().backward()
    assert net._amp_runtime.copies.refreshes == 1
    for p, q in zip(model.parameters(), ref.parameters()):
        assert _close(p.grad, q.grad)


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    lambda ps: torch.optim.AdamW(ps, lr=1e-3),
], ids=["sgd", "adamw"])
def test_user_owned_optimizers_train_as_the_cpu_runtime(make_opt):
    model, net, ref, cpu = pair()
    opts = make_opt(list(model.parameters())), make_opt(list(ref.parameters()))
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        for m, opt in zip((net, cpu), opts):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    assert net._amp_runtime.copies.refreshes == 5
    for p, q in zip(model.parameters(), ref.parameters()):
        assert _close(p, q, 1e-2)


def test_a_weight_changed_in_place_by_the_user_is_seen():
    model, net, ref, _ = pair()
    x = torch.randn(8, 16)
    net.eval()

    def fresh():  # the CUDA runtime on the changed weights, with nothing kept from before
        return ampgraph.compile(copy.deepcopy(ref), "O2", "bf16", runtime="cuda").eval()(x)

    with torch.no_grad():
        net(x)
        model.fc1.weight.mul_(2)  # bumps the version counter
        ref.fc1.weight.mul_(2)
        assert torch.equal(net(x), fresh())
        model.fc2.weight.data = model.fc2.weight.data * -1  # new storage, same version
        ref.fc2.weight.data = ref.fc2.weight.data * -1
        assert torch.equal(net(x), fresh())


def test_two_forwards_before_one_backward_with_an_update_between():
    model, net, ref, cpu = pair()
    x = torch.randn(8, 16)
    first = net(x).sum()
    with torch.no_grad():
        model.fc1.weight.add_(1.0)
    second = net(x).sum()  # the first graph's copies are not written over
    (first + second).backward()
    firsts = copy.deepcopy(ref)
    with torch.no_grad():
        ref.fc1.weight.add_(1.0)
    cpu_net = ampgraph.compile(firsts, "O2", "bf16", runtime="cpu")
    cpu_first = cpu_net(x).sum()
    cpu_first.backward()
    cpu(x).sum().backward()
    for p, a, b in zip(model.parameters(), firsts.parameters(), ref.parameters()):
        assert _close(p.grad, a.grad + b.grad)


def test_gradients_are_ready_group_by_group_before_backward_ends(monkeypatch):
    monkeypatch.setattr(cuda_runtime, "GROUP_NUMEL", 600)  # fc1+fc2 > 600: several groups
    model, net, _, _ = pair()
    order = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
    x = torch.randn(8, 16, requires_grad=True)
    x.register_hook(lambda g: order.append("input"))
    net(x).sum().backward()
    assert len(_groups(net)) >= 3
    # the last layer's group is ready while the first layers' backward has yet to run
    assert order.index("fc3.weight") < order.index("fc1.weight") < order.index("input"), order
    assert order.index("fc2.weight") < order.index("fc1.weight"), order


def test_create_graph_backward_differentiates_through_the_group():
    model, net, ref, cpu = pair()
    x = torch.randn(8, 16)
    grads = torch.autograd.grad(net(x).sum(), list(model.parameters()), create_graph=True)
    penalty = sum(g.square().sum() for g in grads)
    penalty.backward()
    grads_ref = torch.autograd.grad(cpu(x).sum(), list(ref.parameters()), create_graph=True)
    sum(g.square().sum() for g in grads_ref).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        if q.grad is not None:
            assert p.grad is not None and _close(p.grad, q.grad, 5e-2)


def test_a_group_alone_refreshes_by_version_and_storage():
    store = MasterCopies()
    group = WeightGroup(((torch.bfloat16, None), (torch.bfloat16, None)), store)
    a, b = torch.randn(3, 4), torch.randn(5)
    first = group.low_copies(a, b)
    assert [t.dtype for t in first] == [torch.bfloat16] * 2 and store.refreshes == 1
    group.low_copies(a, b)
    assert store.refreshes == 1
    b.add_(1)
    again = group.low_copies(a, b)
    assert store.refreshes == 2 and torch.equal(again[1], b.to(torch.bfloat16))
    other = WeightGroup(((torch.bfloat16, None),), store)  # another graph's group: shared
    assert other.low_copies(b)[0].data_ptr() == again[1].data_ptr() and store.refreshes == 2


def _adamw_steps(net, model, n, x):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(n):
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def test_training_steps_refresh_the_same_copies_in_place():
    """Every step's optimizer changes the masters: the refresh writes the kept copies again
    where they are, no new copy (fixed addresses: what a CUDA graph replays)."""
    model, net, _, _ = pair()
    x = torch.randn(8, 16)
    opt = _adamw_steps(net, model, 2, x)
    store = net._amp_runtime.copies
    before = [c.data_ptr() for c in store.copies()]
    refreshes = store.refreshes
    net(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    net(x).square().mean().backward()
    assert store.refreshes == refreshes + 2
    assert [c.data_ptr() for c in store.copies()] == before


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("empty", "empty_strided", "empty_like"):
            self.calls += 1
        return func(*args, **(kwargs or {}))


def test_a_groups_gradients_are_views_of_one_buffer_made_by_one_allocation(monkeypatch):
    monkeypatch.setattr(cuda_runtime, "GROUP_NUMEL", 600)  # several groups
    model, net, ref, cpu = pair()
    x = torch.randn(8, 16)
    loss = net(x).square().mean()
    allocations = _Allocations()
    original = master_weights._GroupCast.backward

    def counted(ctx, *grads):
        with allocations:
            return original(ctx, *grads)

    monkeypatch.setattr(master_weights._GroupCast, "backward", staticmethod(counted))
    loss.backward()
    groups = _groups(net)
    assert len(groups) >= 3 and allocations.calls == len(groups)
    storages = {p.grad.untyped_storage().data_ptr() for n, p in model.named_parameters()
                if not n.startswith("norm")}
    assert len(storages) == len(groups)
    cpu(x).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.stride() == p.stride() and _close(p.grad, q.grad)


def _python_lines_in_groups(net, x):
    """Python lines run in the runtime's files during one forward and backward."""
    files = (master_weights.__file__, tensors.__file__)
    lines = 0

    def tracer(frame, event, arg):
        nonlocal lines
        if frame.f_code.co_filename in files:
            if event == "line":
                lines += 1
            return tracer
        return None

    sys.settrace(tracer)
    try:
        net(x).square().mean().backward()
    finally:
        sys.settrace(None)
    return lines


class _Wide(torch.nn.Module):
    """``n`` linears in one group: the groups' Python must not grow with ``n``."""

    def __init__(self, n):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(n))

    def forward(self, x):
        return sum(layer(x) for layer in self.layers)


@pytest.mark.parametrize("update", [False, True], ids=["unchanged", "updated"])
def test_the_groups_python_does_not_grow_with_the_parameters(update):
    """No Python per parameter in the groups, on a step whose masters did not change
    (accumulation, evaluation) and on one whose optimizer changed them in place."""
    counts = []
    for n in (2, 12):
        torch.manual_seed(0)
        model = _Wide(n)
        net = ampgraph.compile(model, "O2", "bf16", runtime="cuda")
        x = torch.randn(4, 16)
        opt = _adamw_steps(net, model, 2, x)
        if not update:
            net(x).square().mean().backward()  # the masters stay as they are now
        counts.append(_python_lines_in_groups(net, x))
        if update:
            opt.step()
            opt.zero_grad(set_to_none=True)
            counts[-1] = _python_lines_in_groups(net, x)
        assert len(_groups(net)) == 1
    assert counts[0] == counts[1] > 0, counts
