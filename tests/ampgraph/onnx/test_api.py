"""ampgraph's ONNX API: export_onnx, convert_onnx, onnx_session, validate_onnx."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ampgraph.onnx import (
    OnnxModelError,
    convert_onnx,
    cuda_usable,
    export_onnx,
    max_ir_version,
    onnx_session,
    validate_onnx,
)
from passes.onnx import io as pio

ROOT = Path(__file__).resolve().parents[3]
MODELS = ("lenet5", "tabular_mlp", "resnet", "unet", "bert_encoder", "gpt_decoder")
LOW_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")
FP32_OPS = ("BatchNormalization", "LayerNormalization", "Softmax")
F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16


def load_model(name: str):
    """(model in eval mode, example inputs) of models/<name>.py, loaded by path."""
    path = ROOT / "models" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"onnx_api_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.make_model().eval(), module.example_inputs()


@pytest.fixture(scope="module")
def fp32_export(tmp_path_factory):
    """name -> (fp32 ModelProto, example inputs, torch fp32 output); exported once each."""
    cache: dict = {}
    folder = tmp_path_factory.mktemp("onnx_fp32")

    def get(name: str):
        if name not in cache:
            model, args = load_model(name)
            proto = export_onnx(model, args, folder / f"{name}.onnx", amp_level="O0")
            with torch.no_grad():
                ref = model(*args)
            cache[name] = (proto, args, (ref if isinstance(ref, torch.Tensor) else ref[0]).numpy())
        return cache[name]

    return get


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    g = inferred.graph
    out = {t.name: t.data_type for t in g.initializer}
    out.update({v.name: v.type.tensor_type.elem_type for v in (*g.input, *g.value_info, *g.output)})
    return out


def run(model, args) -> np.ndarray:
    sess = onnx_session(model, "cpu")
    return sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)})[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
# gpt_decoder's causal mask is Where(mask, finfo(float32).min, x): clamped exactly, with a warning
@pytest.mark.filterwarnings("ignore::passes.onnx.initializers.ConstantRangeWarning")
def test_reference_model_at_every_level(name, fp32_export):
    fp32, args, ref = fp32_export(name)
    for level in ("O1", "O2", "O3"):
        got = run(convert_onnx(fp32, level), args)
        cosine = float(got.ravel() @ ref.ravel() / np.linalg.norm(got) / np.linalg.norm(ref))
        assert got.dtype == np.float32 and cosine >= 0.999, (level, cosine)
        assert np.abs(got - ref).max() <= 2e-2 * np.abs(ref).max(), level
    o2 = convert_onnx(fp32, "O2")
    types = value_types(o2)
    seen = set()
    for node in o2.graph.node:
        if node.op_type in LOW_OPS:
            assert [types[i] for i in node.input[:2]] == [F16, F16], node.name
        elif node.op_type in FP32_OPS:
            assert types[node.input[0]] == F32, node.name
        seen.add(node.op_type)
    assert seen & set(LOW_OPS)


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


def small_model(ir_version: int = 10) -> onnx.ModelProto:
    """Region 1 (mm1, add) is harmless in fp16. Region 2 (add2, sub) computes
    e + 2049 - 2049.5, whose constants round to 2048 and 2050 in fp16: a visible error even
    on onnxruntime's CPU provider, which computes most fp16 ops in fp32."""
    inits = [numpy_helper.from_array(np.eye(8, dtype=np.float32), "W1"),
             numpy_helper.from_array(np.float32(0.01), "bias"),
             numpy_helper.from_array(np.float32(2049.0), "c1"),
             numpy_helper.from_array(np.float32(2049.5), "c2")]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["a"], name="mm1"),
        helper.make_node("Add", ["a", "bias"], ["b"], name="add"),
        helper.make_node("Exp", ["b"], ["e"], name="exp"),
        helper.make_node("Add", ["e", "c1"], ["q"], name="add2"),
        helper.make_node("Sub", ["q", "c2"], ["y"], name="sub"),
    ]
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", F32, [2, 8])],
                              [helper.make_tensor_value_info("y", F32, [2, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = ir_version
    return model


X = {"x": np.random.default_rng(1).random((2, 8)).astype(np.float32)}
SAFE = ["add2", "sub"]  # node_block_list that avoids the overflow


def test_validate_onnx_reports_per_output_errors():
    fp32 = small_model()
    report = validate_onnx(fp32, convert_onnx(fp32, "O2", node_block_list=SAFE), X)
    assert report.passed and report.outputs[0].name == "y" and report.max_rel < 1e-2
    assert report.outputs[0].cosine > 0.999 and "max_abs" in str(report)
    bad = validate_onnx(fp32, convert_onnx(fp32, "O2"), X)  # the rounded constants show
    assert not bad.passed and bad.outputs[0].max_abs > 1.0


def test_auto_tolerance_keeps_only_the_failing_region_fp32():
    fp32 = small_model()
    model = convert_onnx(fp32, "O2", auto_tolerance=1e-2, auto_inputs=X, auto_device="cpu")
    types = value_types(model)
    node = {n.name: n for n in model.graph.node}
    assert types[node["mm1"].input[0]] == F16  # the harmless region stays low precision
    assert types[node["add2"].input[0]] == F32 and types[node["sub"].input[0]] == F32
    assert validate_onnx(fp32, model, X).passed
    with pytest.raises(ValueError, match="auto_inputs"):
        convert_onnx(fp32, "O2", auto_tolerance=1e-2)


def test_ir_version_is_capped_for_onnxruntime():
    model = small_model(ir_version=onnx.IR_VERSION)
    out = convert_onnx(model, "O2", node_block_list=SAFE)
    assert out.ir_version == min(onnx.IR_VERSION, max_ir_version())
    onnx_session(out, "cpu").run(None, X)


@pytest.mark.parametrize("payload", [b"not an onnx model at all", b"\x08\x07\x12\x00garbage",
                                     b""])
def test_corrupt_input_raises_and_writes_nothing(tmp_path, payload):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(payload)
    out = tmp_path / "out.onnx"
    with pytest.raises(OnnxModelError, match="nothing was written"):
        convert_onnx(bad, output_path=out)
    assert not out.exists() and list(tmp_path.iterdir()) == [bad]


def test_bad_arguments_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        convert_onnx(tmp_path / "missing.onnx")
    with pytest.raises(TypeError, match="ModelProto"):
        convert_onnx(42)
    with pytest.raises(ValueError, match="amp_level"):
        convert_onnx(small_model(), "O5")
    with pytest.raises(ValueError, match="fp16"):
        convert_onnx(small_model(), dtype="int8")
    with pytest.raises(OnnxModelError, match="not an ONNX model"):
        convert_onnx(onnx.ModelProto())


def test_external_data_by_path(tmp_path, monkeypatch):
    w = numpy_helper.from_array(np.random.default_rng(0).random((64, 64), np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "wide",
                              [helper.make_tensor_value_info("x", F32, [2, 64])],
                              [helper.make_tensor_value_info("y", F32, [2, 64])], [w])
    fp32 = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    src = tmp_path / "in" / "model.onnx"
    src.parent.mkdir()
    onnx.save_model(onnx.ModelProto.FromString(fp32.SerializeToString()), str(src),
                    save_as_external_data=True, location="w.bin", size_threshold=0)
    feeds = {"x": np.random.default_rng(1).random((2, 64), np.float32)}
    out = tmp_path / "out" / "model16.onnx"
    converted = convert_onnx(src, output_path=out)
    assert (out.parent / "model16.onnx.data").stat().st_size == 64 * 64 * 2  # fp16 weights
    assert not pio.has_external(converted)  # small: the returned proto is self-contained
    assert validate_onnx(fp32, out, feeds).passed and validate_onnx(fp32, converted, feeds).passed
    monkeypatch.setattr(pio, "EXTERNAL_DATA_BYTES", 16)  # behave as for a > 2 GB model
    big = convert_onnx(src, output_path=tmp_path / "big.onnx")
    assert pio.has_external(big)
    with pytest.raises(ValueError, match="path"):
        onnx_session(big)
    assert validate_onnx(fp32, tmp_path / "big.onnx", feeds).passed


def test_onnx_session_picks_a_usable_provider(capfd):
    model = small_model()
    sess = onnx_session(model)
    expected = "CUDAExecutionProvider" if cuda_usable() else "CPUExecutionProvider"
    assert sess.get_providers()[0] == expected
    assert capfd.readouterr().err == ""  # no provider-load noise
    assert onnx_session(model, "cpu").get_providers() == ["CPUExecutionProvider"]
    with pytest.raises(ValueError, match="device"):
        onnx_session(model, "tpu")
    if not cuda_usable():
        with pytest.raises(RuntimeError, match="CUDA"):
            onnx_session(model, "cuda")


def test_bf16_conversion_of_a_reference_export(fp32_export):
    fp32, _, _ = fp32_export("tabular_mlp")
    model = convert_onnx(fp32, "O2", "bf16")
    types = value_types(model)
    gemms = [n for n in model.graph.node if n.op_type in LOW_OPS]
    assert gemms and all(types[n.input[0]] == TensorProto.BFLOAT16 for n in gemms)
    assert types[model.graph.output[0].name] == F32
