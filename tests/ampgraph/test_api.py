"""ampgraph.compile: the user-visible contract."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import ampgraph
from tests.helpers import cosine, make


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x, scale: float = 1.0):
        return self.fc2(torch.relu(self.norm(self.fc1(x)))) * scale


def test_parameters_shared_and_fp32_state_dict_same_keys():
    model = Tiny()
    net = ampgraph.compile(model, "O2", "bf16")
    assert [id(p) for p in net.parameters()] == [id(p) for p in model.parameters()]
    assert list(net.state_dict()) == list(model.state_dict())
    net(torch.randn(3, 8))
    assert all(v.dtype == torch.float32 for v in net.state_dict().values())
    # an optimizer built on the user's model trains through the compiled one
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    w = model.fc1.weight.detach().clone()
    net(torch.randn(3, 8)).sum().backward()
    assert model.fc1.weight.grad is not None and model.fc1.weight.grad.dtype == torch.float32
    opt.step()
    assert not torch.equal(w, model.fc1.weight)
    # load_state_dict through the compiled module reaches the user's model
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    net.load_state_dict(sd)
    assert torch.count_nonzero(model.fc1.weight) == 0


def test_new_batch_sizes_and_sequence_lengths_reuse_or_recapture():
    model, (ids, mask) = make("bert_encoder")
    model.eval()
    net = ampgraph.compile(model, "O2", "bf16")
    for n, seq in ((2, 16), (5, 16), (3, 9), (7, 24)):
        ids = torch.randint(1, 100, (n, seq))
        mask = torch.ones(n, seq, dtype=torch.long)
        with torch.no_grad():
            out, ref = net(ids, mask), model(ids, mask)
        assert out.shape == ref.shape and cosine(out, ref) > 0.999
    graphs = sum(len(v) for v in net._amp_graphs.values())
    assert graphs <= 2, f"dynamic batch and sequence should not recapture each time ({graphs})"


def test_train_eval_switching_recaptures_per_mode():
    model, (x,) = make("resnet")
    net = ampgraph.compile(model, "O2", "bf16")
    net.train()
    before = model.bn1.running_mean.clone() if hasattr(model, "bn1") else None
    net(x)
    running = [b for n, b in model.named_buffers() if n.endswith("running_mean")][0]
    assert not torch.equal(running, torch.zeros_like(running)), "BN stats update in train mode"
    net.eval()
    assert not model.training
    snapshot = running.clone()
    with torch.no_grad():
        net(x)
    assert torch.equal(snapshot, running), "eval mode does not touch running stats"
    assert {k[0] for k in net._amp_graphs} == {True, False}
    del before


def test_keyword_inputs_and_non_tensor_arguments():
    model = Tiny()
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(2, 8)
    torch.testing.assert_close(net(x=x, scale=2.0), model(x=x, scale=2.0), rtol=0.05, atol=0.05)
    torch.testing.assert_close(net(x, scale=0.5), model(x, scale=0.5), rtol=0.05, atol=0.05)


def test_keep_io_types_false_returns_low_precision():
    net = ampgraph.compile(Tiny(), "O3", "bf16", keep_io_types=False)
    assert net(torch.randn(2, 8)).dtype == torch.bfloat16


def test_tied_weights_cast_once():
    model, (ids,) = make("gpt_decoder")
    net = ampgraph.compile(model, "O2", "bf16")
    net(ids)
    gm = net._amp_last.gm
    tied = model.tok_emb.weight if hasattr(model, "tok_emb") else None
    casts_of = [n for n in gm.graph.nodes if n.meta.get("amp_cast") and n.args[0].op == "get_attr"]
    targets = [n.args[0].target for n in casts_of]
    assert len(targets) == len(set(targets))
    if tied is not None:
        tied_casts = [t for t in targets if gm.get_parameter(t) is tied]
        assert len(tied_casts) <= 1


def test_compiling_twice_is_a_no_op_or_rejected():
    net = ampgraph.compile(Tiny(), "O2", "bf16")
    assert ampgraph.compile(net, "O2", "bf16") is net
    with pytest.raises(ValueError, match="already compiled"):
        ampgraph.compile(net, "O3", "bf16")


def test_threads_get_the_same_results_as_sequential_calls():
    model = Tiny().eval()
    net = ampgraph.compile(model, "O2", "bf16")
    xs = [torch.randn(3, 8) for _ in range(8)]
    with torch.no_grad():
        expected = [net(x) for x in xs]
    net2 = ampgraph.compile(Tiny().eval(), "O2", "bf16")
    net2.load_state_dict(model.state_dict())
    results = [None] * len(xs)

    def work(i):
        with torch.no_grad():
            results[i] = net2(xs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r, e in zip(results, expected):
        torch.testing.assert_close(r, e)


def test_model_moved_after_compile_follows():
    model = Tiny()
    net = ampgraph.compile(model, "O2", "bf16")
    net.to(torch.float32)  # .to() reaches the shared parameters
    assert model.fc1.weight.dtype == torch.float32
    assert net.fc1 is model.fc1, "attribute access reaches the user's submodules"


def test_inference_weight_cache_follows_every_weight_update():
    model = Tiny().eval()
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(4, 8)
    with torch.no_grad():
        first = net(x)
        assert torch.equal(net(x), first)
        assert net._amp_runtime.weights.nbytes() > 0, "inference keeps low-precision working copies"
        model.fc2.weight.mul_(2)  # in-place update: version counter moves
        second = net(x)
        torch.testing.assert_close(second, model(x), rtol=0.05, atol=0.05)
        assert not torch.equal(second, first)
        sd = {k: v * 0.5 for k, v in model.state_dict().items()}
        net.load_state_dict(sd)
        torch.testing.assert_close(net(x), model(x), rtol=0.05, atol=0.05)
        model.fc1.weight.data.zero_()  # bypasses version counters: documented escape hatch
        net.clear_weight_cache()
        torch.testing.assert_close(net(x), model(x), rtol=0.05, atol=0.05)
    # training never reads a cached copy and gradients reach the fp32 masters
    net.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(3):
        out = net(x)
        torch.testing.assert_close(out, model(x), rtol=0.05, atol=0.05)
        opt.zero_grad()
        out.square().mean().backward()
        assert model.fc2.weight.grad.dtype == torch.float32
        opt.step()


def test_deepcopy_of_compiled_module_is_independent():
    import copy

    model = Tiny()
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(2, 8)
    net(x)
    clone = copy.deepcopy(net)
    assert clone.amp_config == net.amp_config
    assert clone.fc1.weight is not model.fc1.weight
    torch.testing.assert_close(clone(x), net(x))


def test_training_working_copies_are_reused_and_never_overwritten_while_in_use(monkeypatch):
    import ampgraph.runtime.cpu.weights as weights

    monkeypatch.setattr(weights, "KEPT_COPY_BYTES", 0)  # kept however small
    model = Tiny()
    reference = __import__("copy").deepcopy(model)
    net = ampgraph.compile(model, "O2", "bf16")
    # inputs that need gradients: fc1's backward reads its working copy (a first layer's
    # would be cast block by block and kept nowhere)
    x1, x2 = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    # two forwards before one backward: the first graph's saved weights must survive
    loss = net(x1).square().sum() + net(x2).square().sum()
    loss.backward()
    net_ref = ampgraph.compile(reference, "O2", "bf16")
    net_ref(x1).square().sum().backward()
    net_ref(x2).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-2, atol=1e-3)
    # steady state: the same buffer is written every step (no fresh allocation)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ptrs = set()
    for _ in range(3):
        opt.zero_grad()
        out = net(x1)
        cached = net._amp_runtime.weights._slots[id(model.fc1.weight)][1][("train", torch.bfloat16)]
        ptrs.add(cached[0].data_ptr())
        out.sum().backward()
        opt.step()
    assert len(ptrs) == 1


def test_gradients_accumulate_over_backwards_as_autograd_s_own():
    torch.manual_seed(0)
    model = Tiny()
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(3, 8)
    # accumulation without zero_grad: g + g + g rounds exactly like 3 * g
    model.zero_grad(set_to_none=True)
    net(x).square().sum().backward()
    once = [p.grad.clone() for p in model.parameters()]
    for _ in range(2):
        net(x).square().sum().backward()
    for p, g in zip(model.parameters(), once):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, 3 * g, rtol=0, atol=0)


def test_mode_follows_the_users_model_as_well_as_the_compiled_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(16, 8)
    net(x)  # a train-mode graph, updating the running statistics
    model.eval()  # switched on the user's model, not on net
    assert not net.training
    stats = model[1].running_mean.clone()
    with torch.no_grad():
        out = net(x)
        want = model(x)
    assert torch.equal(model[1].running_mean, stats), "eval: running statistics untouched"
    assert not model.training and not model[1].training, "running net kept eval mode"
    torch.testing.assert_close(out, want, rtol=0.05, atol=0.05)
    net.train()
    assert model.training and model[1].training


def test_compile_options_go_with_a_backend_and_are_checked_at_compile():
    net = ampgraph.compile(Tiny(), "O2", "bf16", backend="inductor",
                           compile_options={"mode": "max-autotune-no-cudagraphs"})
    assert net.amp_config.compile_options == {"mode": "max-autotune-no-cudagraphs"}
    assert net.amp_resolved.compile_options == net.amp_config.compile_options
    with pytest.raises(ValueError, match=r"backend is None .* pass backend='inductor' too"):
        ampgraph.compile(Tiny(), "O2", "bf16", compile_options={"mode": "max-autotune"})
