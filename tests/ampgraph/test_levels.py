"""Each reference model at each level: record the aten ops actually executed.

matmul/conv get low-precision inputs at O1-O3; batch/layer norm and softmax get fp32
inputs at O1/O2 and low-precision inputs at O3; O0 executes no low-precision op; the
outputs match fp32 (cosine similarity >= 0.999 on the logits).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import ampgraph
from tests.helpers import (
    LOW,
    MATMUL_OPS,
    MODEL_NAMES,
    NORM_OPS,
    SOFTMAX_OPS,
    call,
    cosine,
    first_tensor,
    make,
    record,
)

LEVELS = ("O0", "O1", "O2", "O3")


def _devices():
    yield "cpu"
    yield pytest.param("cuda", marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"),
    ])


def check_level(name: str, level: str, dtype: torch.dtype, device: str, train: bool) -> None:
    model, inputs = make(name)
    model = model.to(device)
    inputs = tuple(t.to(device) for t in inputs)
    reference = copy.deepcopy(model)
    model.train(train)
    reference.train(train)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fp16 on CPU warns: slow but correct
        net = ampgraph.compile(model, amp_level=level, dtype=dtype)
    with torch.no_grad():
        out, rec = record(lambda: call(net, inputs))
        expected = call(reference, inputs)
    got, want = first_tensor(out), first_tensor(expected)
    assert got.dtype == want.dtype == torch.float32, "keep_io_types: outputs come back fp32"
    assert torch.isfinite(got).all()
    # structure: what actually executed
    if level == "O0":
        assert not rec.any_low(), "O0 must execute no low-precision op"
        assert torch.equal(got, want)
        return
    mm = rec.inputs_of(MATMUL_OPS)
    assert mm, "the model runs matrix work"
    for op, dtypes in mm:
        floats = [d for d in dtypes if d.is_floating_point]
        assert all(d == dtype for d in floats[:2]), f"{op} ran with {dtypes} at {level}"
    if level in ("O1", "O2"):  # norms may read low inputs but compute in fp32 (fusions.py)
        fragile = rec.first_input_dtypes(SOFTMAX_OPS) | rec.norm_compute_dtypes()
        assert fragile <= {torch.float32}, f"norm/softmax precision {fragile} at {level}"
    else:
        fragile = rec.first_input_dtypes(NORM_OPS | SOFTMAX_OPS)
        assert fragile <= {dtype}, f"norm/softmax inputs {fragile} at O3"
    # numerics
    assert cosine(got, want) >= 0.999, f"{name} {level}: cosine {cosine(got, want):.5f}"


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_reference_models_bf16_eval(name, level):
    check_level(name, level, torch.bfloat16, "cpu", train=False)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_reference_models_bf16_train_mode(name):
    check_level(name, "O2", torch.bfloat16, "cpu", train=True)


@pytest.mark.parametrize("level", ("O1", "O2", "O3"))
@pytest.mark.parametrize("name", ("lenet5", "tabular_mlp", "bert_encoder"))
def test_reference_models_fp16_cpu(name, level):
    check_level(name, level, torch.float16, "cpu", train=False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_reference_models_cuda(name, level, dtype):
    check_level(name, level, dtype, "cuda", train=False)


def test_low_dtypes_are_16_bit():
    assert set(LOW) == {torch.bfloat16, torch.float16}


class RMSNormNet(torch.nn.Module):
    """Linear -> HF-style RMSNorm (its own fp32 upcast) -> linear; optionally also returns
    the norm's ``variance + eps``."""

    def __init__(self, returns_variance: bool = False):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.weight = torch.nn.Parameter(torch.ones(8))
        self.returns_variance = returns_variance

    def forward(self, x):
        h = self.fc1(x)
        hf = h.to(torch.float32)
        var = hf.pow(2).mean(-1, keepdim=True) + 1e-6
        y = self.fc2(self.weight * (hf * torch.rsqrt(var)).to(h.dtype))
        return (y, var) if self.returns_variance else y


def test_o2_keeps_rmsnorms_eps_add_fp32_between_mean_and_rsqrt():
    x = torch.randn(4, 8)
    torch.manual_seed(0)
    net = ampgraph.compile(RMSNormNet(), amp_level="O2", dtype="bf16")
    rows = {r["name"]: r for r in ampgraph.explain(net, x).nodes}
    assert rows["add"]["precision"] == "fp32" and "between fp32 ops" in rows["add"]["reason"]
    assert [rows[k]["precision"] for k in ("mean", "rsqrt", "mul", "linear_1")] == \
        ["fp32", "fp32", "bf16", "bf16"]
    with torch.no_grad():
        _, rec = record(lambda: net(x))
    assert rec.first_input_dtypes({"add"}) == {torch.float32}
    # returned, the value keeps O2's low dtype (the graph's output dtype with keep_io_types off)
    net = ampgraph.compile(RMSNormNet(returns_variance=True), amp_level="O2", dtype="bf16")
    add = next(r for r in ampgraph.explain(net, x).nodes if r["name"] == "add")
    assert add["precision"] == "bf16"


# -- ops with no 16-bit kernels, and matrix products written otherwise ---------------------


class ComplexRotary(torch.nn.Module):
    """Complex rotary embeddings as DeepSeek-V2 and Llama 4 write them: an explicit upcast
    right before ``view_as_complex`` (which takes no bfloat16)."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.q(x)
        c = torch.view_as_complex(h.float().reshape(*h.shape[:-1], 4, 2))
        c = c * torch.polar(torch.ones(4), torch.arange(4.0))
        return torch.view_as_real(c).flatten(-2)


class Fourier(torch.nn.Module):
    """FNet's token mixing: two FFTs (no bfloat16 kernel) between linears."""

    def __init__(self):
        super().__init__()
        self.fc, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.out(torch.fft.fft(torch.fft.fft(self.fc(x), dim=-1), dim=-2).real)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("make_model", [ComplexRotary, Fourier])
def test_complex_and_fft_ops_run_in_fp32_at_every_level(make_model, level):
    torch.manual_seed(0)
    model = make_model()
    x = torch.randn(3, 5, 8)
    net = ampgraph.compile(model, level, "bf16")
    out = net(x)
    out.square().mean().backward()
    ref = model(x)
    assert cosine(out.detach(), ref.detach()) >= 0.999
    rows = [(r["op"], r["precision"]) for r in ampgraph.explain(net).nodes]
    spectral = [p for op, p in rows if op in ("aten.view_as_complex", "aten.fft_fft")]
    assert "fp32" in spectral and "bf16" not in spectral  # complex -> complex: n/a
    assert ("aten.linear", "bf16") in rows
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


class Products(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(
            torch.randn(8, 8))

    def forward(self, x):
        return torch.linalg.multi_dot([x, self.a, self.b]), torch.linalg.vecdot(x, x @ self.a)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_multi_dot_and_vecdot_run_at_the_level_s_precision(level):
    torch.manual_seed(0)
    model = Products()
    x = torch.randn(4, 8)
    net = ampgraph.compile(model, level, "bf16")
    with torch.no_grad():
        (md, vd), rec = record(lambda: net(x))
        ref_md, ref_vd = model(x)
    rows = {r["op"]: r["precision"] for r in ampgraph.explain(net).nodes}
    assert rows["aten.linalg_multi_dot"] == rows["aten.linalg_vecdot"] == "bf16"
    assert rec.first_input_dtypes(MATMUL_OPS) <= set(LOW) and rec.inputs_of(MATMUL_OPS)
    assert md.dtype == vd.dtype == torch.float32  # outputs come back fp32
    assert cosine(md, ref_md) >= 0.999 and cosine(vd, ref_vd) >= 0.999


def test_o1_train_mode_attention_with_dropout_runs_its_matmuls_in_16_bit():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, attention_probs_dropout_prob=0.5)).train()
    net = ampgraph.compile(model, "O1", "bf16")
    ids = torch.randint(1, 100, (2, 128))  # enough scores for the runtime's own kernel
    (out,), rec = record(lambda: (net(input_ids=ids).last_hidden_state,))
    rows = [(r["op"], r["precision"]) for r in ampgraph.explain(net).nodes]
    assert ("aten.scaled_dot_product_attention", "bf16") in rows
    attention = [d for n, d in rec.inputs_of(MATMUL_OPS) if "attention" in n]
    assert attention and all(set(d[:3]) <= set(LOW) for d in attention)  # with dropout
    out.float().square().mean().backward()
    assert torch.isfinite(model.encoder.layer[0].attention.self.query.weight.grad).all()


class SigmoidRouter(torch.nn.Module):
    """DeepSeek-V3 / MiniMax-style MoE routing: sigmoid scores plus a correction bias, top-2
    of 64 experts per token (the model's own ``.float()`` before the sigmoid)."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(32, 64, bias=False)
        torch.nn.init.normal_(self.gate.weight, std=0.02)  # scores near 0.5, as at init
        self.register_buffer("bias", torch.zeros(64))

    def forward(self, x):
        scores = torch.sigmoid(self.gate(x).float()) + self.bias
        return torch.topk(scores, 2, dim=-1).indices


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_router_picks_the_experts_its_fp32_scores_pick(level):
    """Rule 7 (passes/paint.py): the sigmoid and the add feeding top-k run in fp32 on the
    bf16 linear's logits, as under autocast. With the sigmoid in bf16, top-k picks other
    experts for many tokens (the reference below shows it does)."""
    torch.manual_seed(0)
    model = SigmoidRouter()
    x = torch.randn(512, 32)
    net = ampgraph.compile(model, level, "bf16")
    with torch.no_grad():
        picked = net(x)
        logits = torch.nn.functional.linear(x.bfloat16(), model.gate.weight.bfloat16())
        want = torch.topk(torch.sigmoid(logits.float()) + model.bias, 2, dim=-1).indices
        low = torch.topk(torch.sigmoid(logits) + model.bias.bfloat16(), 2, dim=-1).indices
    assert not torch.equal(low.sort(-1).values, want.sort(-1).values)  # bf16 would differ
    assert torch.equal(picked.sort(-1).values, want.sort(-1).values)
    rows = {r["op"]: (r["precision"], r["reason"]) for r in ampgraph.explain(net).nodes}
    assert rows["aten.linear"][0] == "bf16"
    assert rows["aten.sigmoid"][0] == "fp32" and "feeds the selection" in rows["aten.sigmoid"][1]
