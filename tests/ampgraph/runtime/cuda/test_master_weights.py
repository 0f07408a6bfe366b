"""The CUDA runtime's weights refreshed once per step (ampgraph.runtime.cuda), run on CPU
tensors by selecting the runtime by name: it uses portable torch ops only."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import ampgraph
import ampgraph.runtime.cuda.runtime as cuda_runtime
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
