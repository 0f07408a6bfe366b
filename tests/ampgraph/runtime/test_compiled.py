"""ampgraph/runtime/compiled.py: the rewritten graph handed to torch.compile. Without gradients the
runtime does its edges (weights' kept copies as inputs, outputs cast back, an output
linear) around a split of the graph; with gradients only the outputs' casts leave. The
values are the whole graph's; compile_options reach torch.compile, checked first."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from torch import fx, nn

import ampgraph
from ampgraph.runtime import CompiledEdges
from ampgraph.runtime.compiled import (
    COMPILE_OPTIONS,
    CompiledRunner,
    parse_compile_options,
    split_edges,
)
from ampgraph.runtime.cpu.runtime import CpuRuntime
from passes.fx.dtypes import CAST, dtype_of, is_amp_cast

BF16 = torch.bfloat16


class Head(nn.Module):
    """Two outputs: a linear's logits (cast back) and a normed hidden state (cast back)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.relu(self.norm(self.fc(x)))
        return self.out(h), h * 2


def compiled(model: nn.Module, x: torch.Tensor, backend: str = "aot_eager", **kwargs):
    """(net, its graph's runner, the whole graph) after one call without gradients."""
    net = ampgraph.compile(model, "O2", BF16, backend=backend, **kwargs)
    with torch.no_grad():
        net(x)
    last = net._amp_last
    return net, last.runner, last.gm


def param_casts(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if is_amp_cast(n) and n.target is CAST
            and n.args[0].op == "get_attr"]


def test_without_gradients_the_weights_are_inputs_and_the_outputs_the_runtimes():
    torch.manual_seed(0)
    net, runner, gm = compiled(Head().eval(), torch.randn(3, 8))
    split, _ = runner.without_grad
    casts = param_casts(gm)
    assert len(casts) == len(split.weights) == 4  # both linears' (the norm reads fp32 ones)
    linears = (net.fc.weight, net.fc.bias, net.out.weight, net.out.bias)
    assert {id(p) for p, _, _ in split.weights} == {id(p) for p in linears}
    assert all(dtype == BF16 and fmt is None for _, dtype, fmt in split.weights)
    # the logits are the runtime's linear on the lifted out.weight and out.bias; the
    # hidden state is cast back by the runtime
    (linear, cast) = split.slots
    assert linear[0] == "linear" and cast == ("cast", 1, torch.float32)
    assert [split.weights[k][0] for k in linear[2:4]] == [net.out.weight, net.out.bias]
    part = split.gm.graph
    part.lint()
    assert not param_casts(split.gm)  # no weight cast left in the compiled code
    assert [n.args[1].name for n in part.nodes if n.target is torch.ops.aten.linear.default
            ] == ["amp_weight_0"]  # fc's; out's linear is the runtime's
    outputs = next(n for n in part.nodes if n.op == "output").args[0]
    assert [dtype_of(n) for n in outputs] == [BF16, BF16]  # cast back after
    placeholders = [n for n in part.nodes if n.op == "placeholder"]
    assert [n.name for n in placeholders[1:]] == [f"amp_weight_{k}" for k in range(4)]
    # with gradients only the casts back leave; the weights' casts stay in the graph
    grad_split, _ = runner.with_grad
    assert grad_split.weights == [] and [s[0] for s in grad_split.slots] == ["cast", "cast"]
    assert len(param_casts(grad_split.gm)) == 4


def test_the_split_computes_the_whole_graphs_values_and_sees_updated_masters():
    torch.manual_seed(0)
    model = Head()
    x = torch.randn(5, 8)
    net, runner, gm = compiled(model, x)  # train mode: dropout-free, the same graph kind
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        with torch.no_grad():
            outs = net(x)
        whole = gm((x,), {})
        for out, ref in zip(outs, whole):
            assert out.dtype == torch.float32
            torch.testing.assert_close(out, ref, rtol=0, atol=0)
        logits, hidden = net(x)  # with gradients: a graph of its own
        (logits.square().mean() + hidden.mean()).backward()
        assert all(p.grad is not None and p.grad.dtype == torch.float32
                   for p in model.parameters())
        opt.step()  # the masters change: the next inference call casts them again
        opt.zero_grad()
    copies = net._amp_runtime.weights
    assert copies.nbytes() > 0  # the inference copies are the runtime's, kept


def test_gradients_through_the_split_are_the_whole_graphs():
    torch.manual_seed(0)
    model = Head()
    ref = copy.deepcopy(model)
    x = torch.randn(5, 8)
    net, runner, _ = compiled(model, x)
    whole_net = ampgraph.compile(ref, "O2", BF16, backend="aot_eager", runtime="aten")
    for m in (net, whole_net):
        logits, hidden = m(x)
        (logits.square().mean() + hidden.mean()).backward()
    assert whole_net._amp_last.runner.with_grad[0] is None  # aten: the whole graph
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7)


def test_a_runtime_without_edges_runs_the_whole_graph():
    torch.manual_seed(0)
    model = Head().eval()
    x = torch.randn(3, 8)
    net, runner, gm = compiled(model, x, runtime="aten")
    assert runner.without_grad[0] is None and runner.with_grad[0] is None
    assert split_edges(gm, CompiledEdges()) is None
    with torch.no_grad():
        for out, ref in zip(net(x), gm((x,), {})):
            torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_keep_io_types_off_leaves_only_the_weights():
    torch.manual_seed(0)
    _, runner, gm = compiled(Head().eval(), torch.randn(3, 8), keep_io_types=False)
    split, _ = runner.without_grad
    assert [s[0] for s in split.slots] == ["out", "out"] and len(split.weights) == 4
    assert split_edges(gm, CompiledEdges(output_cast=CpuRuntime().outputs.cast)) is None


def test_compile_options_reach_torch_compile(monkeypatch):
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append(kwargs)
        return fn  # runs eagerly

    monkeypatch.setattr(torch, "compile", fake_compile)
    torch.manual_seed(0)
    model = Head().eval()
    x = torch.randn(3, 8)
    net = ampgraph.compile(model, "O2", BF16, backend="inductor",
                           compile_options={"mode": "max-autotune", "fullgraph": True})
    with torch.no_grad():
        out, _ = net(x)
    assert calls == [dict(backend="inductor", dynamic=True, mode="max-autotune",
                          fullgraph=True)] * 2  # with and without gradients
    torch.testing.assert_close(out, model(x)[0], rtol=2e-2, atol=2e-2)
    calls.clear()
    ampgraph.compile(Head(), "O2", BF16, backend="inductor",
                     compile_options={"dynamic": None})(x)
    assert [c["dynamic"] for c in calls] == [None, None]


def test_parse_compile_options_takes_torch_compiles_arguments():
    assert COMPILE_OPTIONS == ("mode", "options", "dynamic", "fullgraph")
    assert parse_compile_options(None, None) == {} == parse_compile_options({}, None)
    assert parse_compile_options({"mode": "reduce-overhead"}, "inductor") == {
        "mode": "reduce-overhead"}
    opts = {"options": {"max_autotune": True}, "dynamic": False}
    assert parse_compile_options(opts, "inductor") == opts
    assert parse_compile_options({"dynamic": None, "fullgraph": True}, "aot_eager") == {
        "dynamic": None, "fullgraph": True}


@pytest.mark.parametrize(("options", "backend", "error", "message"), [
    ({"mode": "max-autotune"}, None, ValueError, r"backend is None .* pass backend='inductor'"),
    ({"backend": "eager"}, "inductor", ValueError,
     r"unknown key\(s\) backend \(the backend is ampgraph.compile's own backend= argument\)"),
    ({"mode": "max-autotune", "options": {}}, "inductor", ValueError,
     r"give 'mode' or 'options', not both"),
    ({"mode": "max-autotune"}, "aot_eager", ValueError,
     r"\['mode'\] configures inductor, but backend is 'aot_eager'"),
    ({"options": {"no_such_knob": 1}}, "inductor", ValueError,
     r"unknown inductor option\(s\) no_such_knob: torch._inductor.list_options\(\)"),
    ({"options": ["max_autotune"]}, "inductor", TypeError, r"\['options'\] must be a dict"),
    ({"dynamic": "yes"}, "inductor", TypeError, r"\['dynamic'\] = 'yes': .* True, False or None"),
    ({"fullgraph": None}, "inductor", TypeError, r"\['fullgraph'\] = None: .* True or False"),
    ("max-autotune", "inductor", TypeError, r"compile_options must be a dict"),
])
def test_bad_compile_options_name_the_fix(options, backend, error, message):
    with pytest.raises(error, match=message):
        parse_compile_options(options, backend)


def test_an_unknown_compile_option_fails_at_compile_not_at_the_first_call():
    with pytest.raises(ValueError, match=r"compile_options\['mode'\] = 'turbo': choose one of"):
        ampgraph.compile(Head(), "O2", BF16, backend="inductor", compile_options={"mode": "turbo"})


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                    reason="inductor's CPU code needs a C++ compiler")
def test_inductor_runs_the_split_and_the_whole_graph():
    """The real backend (a tiny graph: seconds): inference on kept copies and training."""
    torch.manual_seed(0)
    model = Head()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    net = ampgraph.compile(model, "O2", BF16, backend="inductor")
    model.eval()
    with torch.no_grad():
        logits, hidden = net(x)
        torch.testing.assert_close(logits, ref.eval()(x)[0], rtol=2e-2, atol=2e-2)
    assert isinstance(net._amp_last.runner, CompiledRunner)
    model.train()
    logits, _ = net(x)
    logits.square().mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
