"""ampgraph/onnx/export.py: export_onnx halves the file and keeps the batch dynamic; keyword
inputs (HF models), dynamic batch and sequence, and the TorchScript exporter as a fallback
when the dynamo exporter fails."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ampgraph.onnx import export_onnx, max_ir_version, onnx_session
from tests.ampgraph.onnx.helpers import load_model


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def bert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, num_labels=3)).eval()


def gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False)).eval()


@pytest.mark.slow
def test_export_onnx_halves_the_file_and_keeps_the_batch_dynamic(tmp_path, fp32_export):
    model, args = load_model("tabular_mlp")
    fp32_file = tmp_path / "mlp32.onnx"
    export_onnx(model, args, fp32_file, amp_level="O0")
    out = export_onnx(model, args, tmp_path / "mlp16.onnx")
    assert (tmp_path / "mlp16.onnx").stat().st_size < 0.6 * fp32_file.stat().st_size
    assert out.ir_version <= max_ir_version()
    assert out.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # symbolic batch
    sess = onnx_session(tmp_path / "mlp16.onnx")
    x = torch.randn(5, args[0].shape[1])
    got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        want = model(x).numpy()
    assert got.shape[0] == 5 and np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
    static = export_onnx(model, args, tmp_path / "static.onnx", dynamic_batch=False)
    assert static.graph.input[0].type.tensor_type.shape.dim[0].dim_value == args[0].shape[0]


def tokens(n: int, seq: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(n * 100 + seq)
    mask = torch.ones(n, seq, dtype=torch.long)
    mask[0, seq - 2:] = 0
    return {"input_ids": torch.randint(1, 100, (n, seq), generator=g), "attention_mask": mask}


def check(model, path, feeds_at, output: str) -> None:
    session = onnx_session(str(path), device="cpu")
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask"]
    for n, seq in [(2, 8), (3, 13)]:  # batch and sequence stay dynamic
        inputs = feeds_at(n, seq)
        (got, *_) = session.run(None, {k: v.numpy() for k, v in inputs.items()})
        with torch.no_grad():
            ref = getattr(model(**inputs), output).numpy()
        assert got.shape == ref.shape and cosine(got, ref) >= 0.99


@pytest.mark.parametrize("make, output", [(bert, "logits"), (gpt2, "logits")])
def test_keyword_inputs_with_dynamic_batch_and_sequence(tmp_path, make, output):
    model = make()
    path = tmp_path / "model.onnx"
    export_onnx(model, (), path, amp_level="O2", dtype="fp16", kwargs=tokens(2, 8))
    check(model, path, tokens, output)


def test_dynamo_failure_falls_back_to_torchscript_with_a_warning(tmp_path, monkeypatch):
    model = bert()
    real = torch.onnx.export

    def dynamo_breaks(*args, **kwargs):
        if kwargs.get("dynamo", True):
            raise RuntimeError("decomposition failed (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", dynamo_breaks)
    path = tmp_path / "model.onnx"
    with pytest.warns(UserWarning, match=r"dynamo exporter failed \(RuntimeError: "
                                         r"decomposition failed \(injected\)\); exported with "
                                         r"the TorchScript exporter"):
        export_onnx(model, (), path, kwargs=tokens(2, 8))
    check(model, path, tokens, "logits")


def test_both_exporters_failing_names_both_causes(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("dynamo" if kwargs.get("dynamo", True) else "torchscript")

    monkeypatch.setattr(torch.onnx, "export", broken)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match=(
            r"dynamo exporter failed \(RuntimeError: dynamo\) and so did the TorchScript "
            r"exporter \(RuntimeError: torchscript\)")):
        export_onnx(bert(), (), tmp_path / "m.onnx", kwargs=tokens(2, 8))
    assert not (tmp_path / "m.onnx").exists()


def t5():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
        num_heads=4)).eval()


def seq2seq(n: int, source: int, target: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(source * 100 + target)
    return {"input_ids": torch.randint(1, 100, (n, source), generator=g),
            "attention_mask": torch.ones(n, source, dtype=torch.long),
            "decoder_input_ids": torch.randint(1, 100, (n, target), generator=g)}


@pytest.mark.parametrize("exporter", ["torchscript", "auto"])
def test_t5_with_source_and_target_of_other_lengths_through_the_fallback_exporter(
        tmp_path, exporter):
    """Source and target lengths are separate axes (one name per input), and the returned
    cache (EncoderDecoderCache) exports as tensors, so the TorchScript exporter takes T5."""
    model = t5()
    path = tmp_path / "t5.onnx"
    export_onnx(model, (), path, amp_level="O2", dtype="fp16", kwargs=seq2seq(2, 7, 5),
                exporter=exporter)
    session = onnx_session(str(path), device="cpu")
    shapes = {i.name: i.shape for i in session.get_inputs()}
    assert shapes["input_ids"][1] != shapes["decoder_input_ids"][1]
    assert [o.name for o in session.get_outputs()][0] == "logits"
    for source, target in [(9, 4), (3, 11)]:
        inputs = seq2seq(2, source, target)
        (got, *_) = session.run(None, {k: v.numpy() for k, v in inputs.items()})
        with torch.no_grad():
            ref = model(**inputs).logits.numpy()
        assert got.shape == ref.shape and cosine(got, ref) >= 0.99


def test_dynamic_axes_name_each_input_s_axes(tmp_path):
    path = tmp_path / "model.onnx"
    export_onnx(bert(), (), path, kwargs=tokens(2, 8), exporter="torchscript",
                dynamic_axes={"input_ids": {0: "n", 1: "tokens"}, "attention_mask": {0: "n"}})
    shapes = {i.name: i.shape for i in onnx_session(str(path), device="cpu").get_inputs()}
    assert shapes == {"input_ids": ["n", "tokens"], "attention_mask": ["n", 8]}
    with pytest.raises(ValueError, match=r"dynamic_axes names inputs the model does not take: "
                                         r"\['input_idz'\]"):
        export_onnx(bert(), (), path, kwargs=tokens(2, 8), dynamic_axes={"input_idz": {0: "n"}})


def test_the_exported_model_is_run_once_on_its_example_inputs(tmp_path, monkeypatch):
    import ampgraph.onnx.session as session_module

    def broken(model, device):
        raise RuntimeError("Got invalid dimensions (injected)")

    monkeypatch.setattr(session_module, "session_for", broken)
    with pytest.raises(RuntimeError, match=r"does not run on its example inputs in "
                                           r"onnxruntime: RuntimeError: Got invalid"):
        export_onnx(bert(), (), tmp_path / "m.onnx", kwargs=tokens(2, 8))
    export_onnx(bert(), (), tmp_path / "m.onnx", kwargs=tokens(2, 8), check=False)
    assert (tmp_path / "m.onnx").exists()


@pytest.mark.slow  # torch.onnx's dynamo exporter: seconds even for one Linear
def test_a_module_in_training_mode_is_exported_in_eval_mode_and_left_as_it_was(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Dropout(0.5)).train()
    x = torch.randn(3, 6)
    proto = export_onnx(model, x, tmp_path / "m.onnx")  # one tensor: the args tuple is made
    assert model.training and (tmp_path / "m.onnx").exists()
    assert "Dropout" not in [n.op_type for n in proto.graph.node]  # exported in eval mode
    stamp = {p.key: p.value for p in proto.metadata_props}
    assert stamp["ampgraph.amp_level"] == "O2"
    sess = onnx_session(tmp_path / "m.onnx", device="cpu")
    (got,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        want = model.eval()(x).numpy()
    assert got.dtype == np.float32 and np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
