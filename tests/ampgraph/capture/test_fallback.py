"""ampgraph/capture/fallback.py: models that cannot be exported whole fall back per
submodule (the eager plan), and say so."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import ampgraph
from ampgraph.capture.fallback import EagerPlan, compiled_children
from tests.helpers import MATMUL_OPS, cosine, record


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(torch.relu(self.fc(x)) + x)


class DataDependent(nn.Module):
    """The number of blocks run depends on the input's values: not exportable."""

    def __init__(self, d=16):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            if h.abs().mean() > 10:  # data-dependent Python control flow
                break
            h = block(h)
        return self.head(h)


def test_data_dependent_model_compiles_matches_fp32_and_explain_names_eager_part():
    torch.manual_seed(0)
    model = DataDependent().eval()
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(5, 8)
    with pytest.warns(UserWarning, match="could not be captured whole"):
        with torch.no_grad():
            out, rec = record(lambda: net(x))
    with torch.no_grad():
        ref = model(x)
    assert out.dtype == torch.float32
    assert cosine(out, ref) >= 0.999
    assert {d[0] for _, d in rec.inputs_of(MATMUL_OPS)} == {torch.bfloat16}, \
        "the submodules still run their matmuls in bf16"
    report = ampgraph.explain(net)
    eager = {e.path: e for e in report.eager}
    assert "<root>" in eager and "export failed" in eager["<root>"].reason
    assert "DataDependent" == eager["<root>"].module_type
    modules = {r["module"] for r in report.nodes}
    assert {"embed", "head", "blocks.0.fc", "blocks.2.norm"} <= modules
    assert "EAGER" in str(report)
    # batch size changes and training still work
    net.train()
    y = net(torch.randn(3, 8))
    y.sum().backward()
    assert model.head.weight.grad is not None


class Marked(nn.Identity):
    """What the tests' ``compile_child`` returns: the child and its path."""

    def __init__(self, child: nn.Module, path: str):
        super().__init__()
        self.child, self.path = child, path


def test_the_plan_holds_containers_and_compiles_each_child_with_its_path():
    model = DataDependent()
    model.add_module("unused", None)
    before = dict(model._modules)
    plan = EagerPlan(model, "net", Marked)
    assert plan is not model and [m for m in plan.modules() if m is model] == []
    assert plan.embed.child is model.embed and plan.embed.path == "net.embed"
    assert plan.head.path == "net.head"
    assert isinstance(plan.blocks, nn.ModuleList) and plan.blocks is not model.blocks, \
        "a container without a forward is held, its children compiled"
    assert [b.path for b in plan.blocks] == ["net.blocks.0", "net.blocks.1", "net.blocks.2"]
    assert [b.child for b in plan.blocks] == list(model.blocks)
    assert plan._modules["unused"] is None
    assert model._modules == before and model.blocks[0].fc is model.blocks[0]._modules["fc"], \
        "the model keeps its own children"


def test_a_root_path_names_children_plainly_and_a_leaf_runs_as_it_is():
    plan = EagerPlan(DataDependent(), "", Marked)
    assert plan.embed.path == "embed" and plan.blocks[1].path == "blocks.1"
    leaf = nn.Linear(2, 2)
    alone = EagerPlan(leaf, "", Marked)
    x = torch.randn(3, 2)
    assert not list(alone.children()) and torch.equal(alone(x), leaf(x))


def test_the_plan_runs_the_models_own_code_on_the_model_with_compiled_children():
    """Plain attributes forward sets land on the user's model (a counter, a kept value),
    and its children are the compiled ones only during the call."""

    class Counting(DataDependent):
        calls = 0

        def forward(self, x):
            self.calls += 1
            self.seen = [type(b).__name__ for b in self.blocks]
            return super().forward(x)

    model = Counting()
    plan = EagerPlan(model, "", lambda child, path: Marked(child, path))
    for _ in range(3):
        plan(torch.randn(2, 8))
    assert model.calls == 3 and model.seen == ["Marked"] * 3
    assert [type(b).__name__ for b in model.blocks] == ["Block"] * 3 \
        and type(model.embed) is nn.Linear, "the model's own children are back after the call"


def test_compiled_children_are_the_outermost_of_their_kind():
    plan = EagerPlan(DataDependent(), "", Marked)
    found = compiled_children(plan, Marked)
    assert [m.path for m in found] == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    nested = Marked(nn.Sequential(Marked(nn.Identity(), "inner")), "outer")
    holder = nn.Sequential(nn.Sequential(nested))
    assert compiled_children(holder, Marked) == [nested], "not inside a found one"
    assert compiled_children(nn.Linear(2, 2), Marked) == []


class Positions(nn.Embedding):
    """Takes the input's ``torch.Size`` (as HuggingFace's LED position embeddings do)."""

    def forward(self, shape: torch.Size, offset: int = 0):
        _, seq = shape[:2]
        assert type(shape) is torch.Size, "the child gets the caller's type"
        return super().forward(torch.arange(offset, offset + seq))


class Mix(nn.Module):
    """Takes a tuple and a list of tensors."""

    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, pair: tuple, extra: list):
        return self.fc(pair[0]) + pair[1] * extra[0]


class ShapeTaking(nn.Module):
    """Not exportable whole; its children take a torch.Size, a tuple and a list."""

    def __init__(self, d=16):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.pos = Positions(32, d)
        self.mix = Mix(d)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.embed(x) + self.pos(x.shape[:2])
        if h.abs().mean() > 10:  # data-dependent Python control flow
            h = h / 10
        return self.head(self.mix((h, h), [h]))


def test_children_taking_a_size_a_tuple_and_a_list_are_compiled_on_their_own():
    torch.manual_seed(0)
    model = ShapeTaking().eval()
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(2, 5, 8)
    with pytest.warns(UserWarning, match="could not be captured whole"), torch.no_grad():
        out = net(x)
    with torch.no_grad():
        ref = model(x)
    assert cosine(out, ref) >= 0.99
    eager = {e.path: e.reason for e in ampgraph.explain(net).eager}
    assert list(eager) == ["<root>"], eager
    with torch.no_grad():  # another length: the size's ints are constants of the graph
        assert cosine(net(x[:, :3]), model(x[:, :3])) >= 0.99


class Store(nn.Module):
    """Writes into, or reads from, a mapping torch.export cannot take (as Gemma 3n's
    attention does with transformers' KVSharingDict)."""

    def __init__(self, d, reads: bool):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.reads = reads

    def forward(self, h, shared):
        if self.reads:
            return self.fc(h) + shared["h"]
        shared["h"] = self.fc(h)
        return h


class Sharing(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.first, self.second = Store(d, reads=False), Store(d, reads=True)
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        shared = collections.UserDict()
        h = self.second(self.first(x, shared), shared)
        if h.abs().mean() > 10:  # data-dependent Python control flow
            h = h / 10
        return self.head(h)


def test_a_child_given_an_input_export_cannot_take_runs_its_code_eagerly_and_says_why():
    torch.manual_seed(0)
    model = Sharing().eval()
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(3, 16)
    with pytest.warns(UserWarning, match="could not be captured whole"), torch.no_grad():
        out, rec = record(lambda: net(x))
    with torch.no_grad():
        assert cosine(out, model(x)) >= 0.99
    eager = {e.path: e.reason for e in ampgraph.explain(net).eager}
    assert set(eager) == {"<root>", "first", "second"}
    assert eager["first"].startswith("input not capturable: argument 1 is a collections.UserDict")
    assert {d[0] for _, d in rec.inputs_of(MATMUL_OPS)} == {torch.bfloat16}, \
        "the eager children's own children are compiled"


@pytest.mark.slow  # ~10 s: LED's encoder, layers and attention fall back one by one
def test_hf_led_falls_back_per_submodule_and_its_position_embeddings_are_compiled():
    transformers = pytest.importorskip("transformers")
    config = transformers.LEDConfig(
        vocab_size=100, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_encoder_position_embeddings=64,
        max_decoder_position_embeddings=64, attention_window=4)
    torch.manual_seed(0)
    model = transformers.LEDForConditionalGeneration(config).eval()
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "decoder_input_ids": ids[:, :8]}
    net = ampgraph.compile(model, "O2", "bf16")
    with pytest.warns(UserWarning, match="could not be captured whole"), torch.no_grad():
        out = net(**inputs).logits
    with torch.no_grad():
        ref = model(**inputs).logits
    assert cosine(out, ref) >= 0.99
    eager = {e.path: e.reason for e in ampgraph.explain(net).eager}
    assert "led.encoder" in eager, "the encoder's longformer attention is data-dependent"
    assert "led.encoder.embed_positions" not in eager, "it takes a torch.Size: compiled"


def tiny_ibert(transformers):
    return transformers.IBertModel(transformers.IBertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)).train()  # QuantAct's range statistics


def tiny_longformer(transformers):
    return transformers.LongformerModel(transformers.LongformerConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, attention_window=4)).eval()


@pytest.mark.slow  # 3-6 s each
@pytest.mark.parametrize("build", [tiny_ibert, tiny_longformer])
def test_hf_models_with_data_dependent_guards_fall_back_and_match_fp32(build):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = build(transformers)
    ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    net = ampgraph.compile(model, "O2", "bf16")
    with pytest.warns(UserWarning, match="data-dependent"), torch.no_grad():
        out = net(input_ids=ids).last_hidden_state
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state
    assert cosine(out, ref) >= 0.99
    graphs, eager = net.amp_parts()
    assert eager[0].path == "<root>" and graphs, "the children that can be are compiled"


class Scaled(nn.Module):
    """Box coordinates scaled to a feature map's level: no product, only rounding to lose."""

    def forward(self, boxes):
        return torch.floor(boxes * 0.25 + 0.5)


class Detector(nn.Module):
    """Not exportable whole: keeps the boxes whose score passes, as detectors' box code does."""

    def __init__(self):
        super().__init__()
        self.score = nn.Linear(4, 1)
        with torch.no_grad():  # x0 - x1: about half the boxes pass
            self.score.weight.copy_(torch.tensor([[1.0, -1.0, 0.0, 0.0]]))
            self.score.bias.zero_()
        self.scale = Scaled()

    def forward(self, boxes):
        kept = boxes[self.score(boxes)[:, 0] > 0]  # a data-dependent number of boxes
        return self.scale(kept) if len(kept) else kept


def test_a_fallback_part_without_a_matrix_op_runs_fp32_beside_a_low_linear():
    torch.manual_seed(0)
    model = Detector().eval()
    net = ampgraph.compile(model, "O2", "bf16")
    boxes = torch.rand(64, 4) * 1000 + 1000  # bf16 keeps 8 bits: steps of 8 up here
    with pytest.warns(UserWarning, match="could not be captured whole"), torch.no_grad():
        out, rec = record(lambda: net(boxes))
    with torch.no_grad():
        ref = model(boxes)
    assert torch.equal(out, ref), "the coordinates were rounded to bf16"
    assert {d[0] for _, d in rec.inputs_of(MATMUL_OPS)} == {torch.bfloat16}, \
        "the scoring linear still runs low"
    rows = {r["module"]: r for r in ampgraph.explain(net).nodes if r["op"].startswith("aten.floor")}
    assert rows["scale"]["precision"] == "fp32"
    assert "eager fallback part without a matrix product" in rows["scale"]["reason"]


class ModeDependent(DataDependent):
    """Returns a loss in train mode and outputs in eval mode, as torchvision's detectors."""

    def forward(self, x):
        out = super().forward(x)
        return {"loss": out.square().mean()} if self.training else out


def test_the_eager_code_follows_the_model_switched_after_the_fallback():
    torch.manual_seed(0)
    model = ModeDependent().eval()
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(5, 8)
    with pytest.warns(UserWarning, match="could not be captured whole"), torch.no_grad():
        assert isinstance(net(x), torch.Tensor)
    model.train()  # the user's model, not the compiled module
    out = net(x)
    assert isinstance(out, dict), "the eager plan still ran in eval mode"
    out["loss"].backward()
    assert model.embed.weight.grad is not None
    model.eval()
    with torch.no_grad():
        assert isinstance(net(x), torch.Tensor)
    for nested in (model.blocks, model.blocks[0]):
        nested.train()  # only a part of the model switched: the other parts keep their mode
    with torch.no_grad():
        net(x)
    assert model.blocks[0].training and not model.training and not model.head.training
