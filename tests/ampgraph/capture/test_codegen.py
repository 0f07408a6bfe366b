"""ampgraph/capture/codegen.py: the runner calls torch's generated bindings, and every call
it rewrites computes what the graph's overload computed, bit for bit, on real models."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import ampgraph
from ampgraph.capture import codegen
from tests.helpers import MODEL_NAMES, make


def _same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), where
        if a.numel() > 1:
            assert a.stride() == b.stride(), where
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True, msg=where)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), where
        for x, y in zip(a, b):
            _same(x, y, where)
    else:
        assert a == b, where


def _copy(value):
    """A tensor's copy with its strides (an op that writes its input runs twice)."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                               device=value.device).copy_(value.detach())


class BothWays(fx.Interpreter):
    """Runs the graph as it is; each call the runner would make through a binding is made
    that way too, on copies of its inputs from the same RNG state, and compared."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.scratch = fx.Graph()
        self.rewritten: set[str] = set()

    def run_node(self, n: fx.Node):
        if n.op != "call_function":
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        writes = isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
        fresh = (lambda v: fx.node.map_aggregate(v, _copy)) if writes else (lambda v: v)
        node = self.scratch.create_node(n.op, n.target, fresh(args), fresh(kwargs))
        direct = codegen._direct(node)
        rng = torch.get_rng_state()
        out = n.target(*args, **kwargs)
        if direct:
            torch.set_rng_state(rng)
            if node.op == "call_method":
                got = getattr(node.args[0], node.target)(*node.args[1:], **node.kwargs)
            else:
                got = node.target(*node.args, **node.kwargs)
            _same(out, got, n.format_node())
            self.rewritten.add(str(n.target))
        return out


def check_every_call(net: ampgraph.AmpModule, args: tuple, kwargs: dict) -> set[str]:
    """Run ``net``'s last graph both ways on ``(args, kwargs)``; the rewritten ops."""
    gm = net._amp_last.captured.gm
    flat = gm.graph._codegen.process_inputs(tuple(args), dict(kwargs))
    both = BothWays(gm)
    both.run(*flat)
    return both.rewritten


def _compile(model: nn.Module, args: tuple, kwargs: dict, train: bool) -> ampgraph.AmpModule:
    net = ampgraph.compile(model.train(train), amp_level="O2", dtype="bf16")
    with torch.set_grad_enabled(train):
        net(*args, **kwargs)
    assert isinstance(net._amp_last.runner, type(net.forward)), "the direct runner is used"
    return net


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_rewritten_call_of_the_reference_models_matches_its_overload(name, train):
    overrides = {"dropout": 0.1} if name in ("bert_encoder", "gpt_decoder") else {}
    model, inputs = make(name, **overrides)
    net = _compile(model, inputs, {}, train)
    with torch.set_grad_enabled(train):
        assert check_every_call(net, inputs, {})
        if not train:  # the generated code itself, against the graph's (no dropout draws)
            compiled = net._amp_last
            _same(compiled.captured.gm(inputs, {}), compiled.runner(inputs, {}), name)


def _hf_models():
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64)
    return {
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_key_value_heads=2, max_position_embeddings=32, **small)),
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)),
        "bert": lambda: transformers.BertForSequenceClassification(transformers.BertConfig(
            max_position_embeddings=32, **small)),
        "t5": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            decoder_start_token_id=0)),
    }


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "t5"])
def test_every_rewritten_call_of_hf_models_matches_its_overload(name):
    torch.manual_seed(0)
    model = _hf_models()[name]()
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "labels": ids if name != "bert" else torch.tensor([0, 1])}
    if name == "t5":
        kwargs["decoder_input_ids"] = ids
    for train in (False, True):
        net = _compile(model, (), kwargs, train)
        with torch.set_grad_enabled(train):
            rewritten = check_every_call(net, (), kwargs)
        assert "aten.linear.default" not in rewritten  # routed to the weight cache instead
        assert len(rewritten) > 5


def test_the_runner_gives_the_graph_modules_outputs_and_gradients():
    transformers = pytest.importorskip("transformers")
    del transformers
    model = _hf_models()["llama"]().train()
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    net = _compile(model, (), {"input_ids": ids, "labels": ids}, True)
    compiled = net._amp_last
    results = []
    for run in (compiled.runner, compiled.captured.gm):
        model.zero_grad(set_to_none=True)
        out = run((), {"input_ids": ids, "labels": ids})
        out[0].backward()
        results.append((out, [p.grad.clone() for p in model.parameters()]))
    _same(results[1], results[0], "outputs and gradients")


def test_defaults_are_passed_where_a_binding_would_differ():
    # the binding's reduction default is none: the schema's mean must be passed
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    loss = g.call_function(torch.ops.aten.cross_entropy_loss.default, (x, y))
    g.output(loss)
    gm = fx.GraphModule(nn.Module(), g)
    run = codegen.direct_runner(gm)
    assert run is not gm
    logits, labels = torch.randn(6, 4), torch.randint(0, 4, (6,))
    assert run(logits, labels).shape == ()
    _same(gm(logits, labels), run(logits, labels), "cross_entropy_loss")


def test_what_is_left_to_the_overload():
    ops = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")
    kept = [
        g.call_function(ops.zeros.default, ([2],)),  # a factory: Python's default device
        g.call_function(ops.zeros_like.default, (x,), {"device": torch.device("cpu")}),
        g.call_function(ops.slice.Tensor, (x, 0, 0, 1)),  # no binding of its own
        g.call_function(ops.add.Tensor, (), {"self": x, "other": x}),  # binding says input
        g.call_function(ops._to_copy.default, (x,), {"dtype": torch.bfloat16,
                                                    "layout": torch.strided}),
        g.call_function(torch.add, (x, x)),  # not an overload
    ]
    made = [g.call_function(ops.add.Tensor, (x, 1)), g.call_function(ops.view.default, (x, [4])),
            g.call_function(ops._to_copy.default, (x,), {"dtype": torch.bfloat16})]
    g.output((*kept, *made))
    assert [codegen._direct(n) for n in kept] == [False] * len(kept)
    assert [codegen._direct(n) for n in made] == [True] * len(made)
    assert [(n.op, n.target) for n in made] == [
        ("call_function", torch._C._VariableFunctions.add), ("call_method", "view"),
        ("call_method", "to")]
    assert made[2].kwargs == {"dtype": torch.bfloat16, "copy": True}


def test_a_graph_module_with_hooks_runs_through_its_call():
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops.aten.relu.default, (x,)))
    gm = fx.GraphModule(nn.Module(), g)
    gm.register_forward_hook(lambda *a: None)
    assert codegen.direct_runner(gm) is gm


def test_a_graph_transform_reaches_the_runner():
    torch.manual_seed(0)
    net = ampgraph.compile(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), amp_level="O2")
    x = torch.randn(2, 4)
    net(x)

    def negate_output(gm: fx.GraphModule) -> None:
        out = next(iter(gm.graph.find_nodes(op="output")))
        (value,) = out.args[0]
        with gm.graph.inserting_before(out):
            neg = gm.graph.call_function(torch.ops.aten.neg.default, (value,))
        out.args = ((neg,),)
        gm.recompile()

    before = net(x)
    net.add_graph_transform(negate_output)
    torch.testing.assert_close(net(x), -before)


class PythonWrapped(nn.Module):
    """Ops whose ``torch.<name>`` is a Python wrapper, or that FX cannot name, beside a
    deprecated-signature trap (``add.Scalar``'s positional alpha on an int tensor)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y, ids):
        loss = nn.functional.mse_loss(self.fc(x), y)  # broadcast_tensors in the graph
        runs = torch.unique_consecutive(ids)  # a tuple from aten, a tensor from the wrapper
        rows = torch.unique(ids.view(-1, 2), dim=0)  # unique_dim: FX finds no module
        shifted = torch.ops.aten.add.Scalar(ids, 2)
        return loss, torch.block_diag(x, y), runs.float().sum(), rows.float().sum(), shifted


def test_wrapped_unnamed_and_deprecated_signature_ops_run_as_the_graph():
    ops = torch.ops.aten
    assert codegen._binding(ops.broadcast_tensors.default) is None
    assert codegen._binding(ops.unique_consecutive.default) is None
    assert codegen._binding(ops.unique_dim.default) is None
    torch.manual_seed(0)
    model = PythonWrapped()
    args = (torch.randn(8, 4), torch.randn(8, 4), torch.tensor([1, 1, 2, 2, 3, 1]))
    net = _compile(model, args, {}, False)
    compiled = net._amp_last
    _same(compiled.captured.gm(args, {}), compiled.runner(args, {}), "runner vs graph")
    for got, want in zip(net(*args), model(*args)):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
