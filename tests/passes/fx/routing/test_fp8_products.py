"""route_fp8_products: which products of HF LLaMA, GPT-2 and BERT at realistic widths run
in FP8 (captured on the meta device: shapes only, no weights), and why the others do not."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from ampgraph.capture.export import export_module
from ampgraph.config import AmpConfig
from passes.fx import run_amp_passes
from passes.fx.fp8_recipe import FP8Recipe
from passes.fx.nodes import module_info
from passes.fx.runtime_ops import RuntimeOps

tf = pytest.importorskip("transformers")


def fp8_stub(x, w, b=None, *, transposed=False, scaling="tensorwise", weight_grad="fp8"):
    return torch.nn.functional.linear(x, (w.t() if transposed else w).to(x.dtype), b)


_CAPTURED: dict[int, torch.fx.GraphModule] = {}


def products(model, recipe: FP8Recipe | None = None, **policy) -> dict[str, str]:
    """module path -> "fp8" or the reason a product stays 16-bit, for every eligible
    product of ``model`` (on the meta device) at O2 bf16."""
    if id(model) not in _CAPTURED:
        ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _CAPTURED[id(model)] = export_module(model, (ids,), {}).gm
    gm = copy.deepcopy(_CAPTURED[id(model)])
    config = AmpConfig.create(dtype="bf16", **policy).resolve(torch.device("cpu"))
    run_amp_passes(gm, config.policy(), torch.bfloat16, runtime=RuntimeOps(fp8_linear=fp8_stub),
                   fp8=recipe or FP8Recipe())
    out = {}
    for node in gm.graph.nodes:
        reason = node.meta.get("amp_reason", "")
        if node.target is fp8_stub:
            assert node.meta["amp_precision"] == "fp8" and reason.startswith("FP8 product")
            out[module_info(node)[0]] = "fp8"
        elif "not FP8: " in reason:
            out[module_info(node)[0]] = reason.split("not FP8: ")[1]
        elif node.op == "call_function":
            assert node.meta.get("amp_precision") != "fp8"
    return out


def on_meta(make):
    with torch.device("meta"):
        return make()


@pytest.fixture(scope="module")
def llama():
    return on_meta(lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000)))


def test_llama_8b_width_runs_its_projections_and_mlps_in_fp8(llama):
    chosen = products(llama)
    first, head = chosen.pop("model.layers.0.self_attn.q_proj"), chosen.pop("lm_head")
    assert "first or last" in first and "first or last" in head
    # k/v (out 1024, in 4096): torchao keeps them 16-bit (in <= 4096 and out <= 1024)
    kept = {f"model.layers.{i}.self_attn.{m}" for i in (0, 1) for m in ("k_proj", "v_proj")}
    assert all("below the tensorwise rule" in chosen.pop(p) for p in kept)
    assert set(chosen) == {f"model.layers.{i}.{m}" for i in (0, 1) for m in (
        "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")} | {
        "model.layers.1.self_attn.q_proj"}
    assert set(chosen.values()) == {"fp8"}


def test_rowwise_rule_is_stricter(llama):
    chosen = products(llama, FP8Recipe(scaling="rowwise"))
    # k/v (out 1024, in 4096): out <= 2048 fails the rowwise rule; the rest of the blocks pass
    assert "below the rowwise rule" in chosen["model.layers.1.self_attn.k_proj"]
    assert chosen["model.layers.1.self_attn.o_proj"] == chosen["model.layers.0.mlp.up_proj"] \
        == "fp8"


def test_overrides_by_path_class_and_op(llama):
    chosen = products(llama, FP8Recipe(exclude=("model.layers.1.mlp",),
                                       include=("lm_head",)))
    assert chosen["lm_head"] == "fp8"  # included: runs FP8 although last
    assert all("excluded by the recipe" in chosen[f"model.layers.1.mlp.{m}"]
               for m in ("gate_proj", "up_proj", "down_proj"))
    by_class = products(llama, FP8Recipe(exclude=("class:LlamaAttention",)))
    assert "excluded" in by_class["model.layers.1.self_attn.o_proj"]
    assert by_class["model.layers.1.mlp.up_proj"] == "fp8"
    by_op = products(llama, FP8Recipe(exclude=("aten.linear",)))
    assert "fp8" not in by_op.values()


def test_gpt2_xl_width_conv1d_products(one_thread):
    model = on_meta(lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
        n_embd=1600, n_head=25, n_layer=2, vocab_size=50257, n_positions=64)))
    chosen = products(model)
    assert "first or last" in chosen.pop("transformer.h.0.attn.c_attn")
    assert "first or last" in chosen.pop("lm_head")
    assert chosen == {**{f"transformer.h.{i}.{m}": "fp8" for i in (0, 1)
                         for m in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")},
                      "transformer.h.1.attn.c_attn": "fp8"}


def test_bert_large_width_only_its_mlp_up_projections_pass_the_rule():
    model = on_meta(lambda: tf.BertModel(tf.BertConfig(
        hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
        intermediate_size=4096), add_pooling_layer=False))
    chosen = products(model)
    # intermediate.dense is (out 4096, in 1024): out > 1024 passes torchao's tensorwise rule
    assert {p for p, v in chosen.items() if v == "fp8"} == {
        "encoder.layer.0.intermediate.dense", "encoder.layer.1.intermediate.dense"}
    assert "first or last" in chosen["encoder.layer.0.attention.self.query"]
    assert "first or last" in chosen["encoder.layer.1.output.dense"]
    assert "below the tensorwise rule" in chosen["encoder.layer.0.output.dense"]
    assert "below the tensorwise rule" in chosen["encoder.layer.1.attention.self.query"]


def test_fp32_overrides_win_and_o0_has_no_fp8(llama):
    chosen = products(llama, module_overrides={"model.layers.1.mlp": "fp32"})
    assert "model.layers.1.mlp.up_proj" not in chosen  # fp32: not even eligible
    with pytest.raises(ValueError, match="O0"):
        AmpConfig.create(amp_level="O0", fp8=True)


# -- end to end: compiled, trained, reported -------------------------------------------------

def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128),
                               torch.nn.GELU(), torch.nn.Linear(128, 64), torch.nn.Linear(64, 32))


@pytest.mark.parametrize("runtime", ["cpu", "cuda"])
def test_compiled_fp8_trains_close_to_bf16(runtime, one_thread):
    import ampgraph

    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    model = _mlp()
    bf16 = ampgraph.compile(model, "O2", "bf16", runtime=runtime)
    fp8 = ampgraph.compile(model, "O2", "bf16", runtime=runtime,
                           fp8=ampgraph.FP8Recipe(rule="all"))
    rows = {r["module"]: r["precision"] for r in ampgraph.explain(fp8, x).nodes
            if r["op"] == "aten.linear"}
    assert rows == {"0": "bf16", "2": "fp8", "4": "fp8", "5": "bf16"}  # first, last 16-bit
    grads = []
    for net in (fp8, bf16):
        y = net(x)
        y.square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    rel = (fp8(x) - bf16(x)).norm() / bf16(x).norm()
    assert 1e-3 < rel < 0.06  # FP8's rounding: e4m3 operands (2**-4 relative per element)
    for g8, g16 in zip(*grads):
        assert torch.nn.functional.cosine_similarity(g8.flatten(), g16.flatten(), 0) > 0.99


def test_inspect_shows_fp8_rows(capsys, tmp_path):
    from ampgraph.cli.main import main

    factory = tmp_path / "mlp.py"
    factory.write_text(
        "import torch\n"
        "def make_model():\n"
        "    return torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(3)))\n"
        "def example_inputs():\n"
        "    return (torch.randn(2, 2048),)\n")
    assert main(["inspect", f"{factory}:make_model", "--level", "O2", "--dtype", "bf16",
                 "--fp8", "tensorwise", "--format", "json"]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)["nodes"]
    linears = [(r["module"], r["precision"]) for r in rows if r["op"] == "aten.linear"]
    assert linears == [("0", "bf16"), ("1", "fp8"), ("2", "bf16")]
    assert "passes the rule" in next(r["reason"] for r in rows if r["precision"] == "fp8")


def test_a_forced_product_says_it_was_included_not_that_it_passes_the_rule():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    gm = export_module(model, (torch.randn(4, 64),), {}).gm
    config = AmpConfig.create(dtype="bf16").resolve(torch.device("cpu"))
    run_amp_passes(gm, config.policy(), torch.bfloat16, runtime=RuntimeOps(fp8_linear=fp8_stub),
                   fp8=FP8Recipe(include=("aten.linear",), keep_first_last=False))
    reasons = [n.meta["amp_reason"] for n in gm.graph.nodes if n.target is fp8_stub]
    assert len(reasons) == 2  # (64, 64) fails the rule: only the include runs them FP8
    assert all("included by the recipe ('aten.linear')" in r and "passes the rule" not in r
               for r in reasons)


@pytest.mark.parametrize("runtime", ["cpu", "cuda"])
def test_a_train_step_converts_each_fp8_weight_once_and_never_syncs(runtime, one_thread):
    """Through build_train_step with a fused optimizer: per step, one e4m3 conversion of
    each FP8 weight (two here), none of the 16-bit ones, and no host synchronisation in
    forward and backward (counted over the step's own code; the step syncs once at its
    end to read the overflow flag only with a loss-scale manager, which bf16 has none of)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import ampgraph

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fp8, self.syncs = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._local_scalar_dense.default:
                self.syncs += 1
            if (func is torch.ops.aten._to_copy.default and out.dtype == torch.float8_e4m3fn
                    and tuple(out.shape) in shapes):
                self.fp8 += 1
            return out

    model = _mlp()
    shapes = {(128, 128), (64, 128), (128, 64)}  # the FP8 weights, either layout
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    step = ampgraph.build_train_step(model, lambda y, t: (y - t).square().mean(), opt, "O2",
                                     "bf16", runtime=runtime, fp8=ampgraph.FP8Recipe(rule="all"))
    x, t = torch.randn(16, 64), torch.randn(16, 32)
    step(x, t)  # capture
    for _ in range(3):
        with Count() as count:
            step(x, t)
        assert count.fp8 == 2 and count.syncs == 0, (count.fp8, count.syncs)
