"""ampgraph/onnx/convert.py: convert_onnx by level, its automatic mode, its errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ampgraph.onnx import OnnxModelError, convert_onnx, max_ir_version, onnx_session, validate_onnx
from passes.onnx import io as pio
from tests.ampgraph.onnx.helpers import (
    F16,
    F32,
    FP32_OPS,
    LOW_OPS,
    MODELS,
    SAFE,
    X,
    run,
    small_model,
    value_types,
)


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


def test_bf16_conversion_of_a_reference_export(fp32_export):
    fp32, _, _ = fp32_export("tabular_mlp")
    model = convert_onnx(fp32, "O2", "bf16")
    types = value_types(model)
    gemms = [n for n in model.graph.node if n.op_type in LOW_OPS]
    assert gemms and all(types[n.input[0]] == TensorProto.BFLOAT16 for n in gemms)
    assert types[model.graph.output[0].name] == F32


def test_converting_again_is_a_no_op_at_the_same_settings_and_refused_at_others():
    once = convert_onnx(small_model(), "o2", node_block_list=SAFE)  # the level in any case
    stamp = {p.key: p.value for p in once.metadata_props}
    assert stamp["ampgraph.amp_level"] == "O2" and stamp["ampgraph.dtype"] == "fp16"
    assert convert_onnx(once, "O2") is once
    with pytest.raises(ValueError, match="already converted by ampgraph at O2 fp16"):
        convert_onnx(once, "O3")


def test_block_lists_and_io_types():
    fp32 = small_model()
    blocked = value_types(convert_onnx(fp32, "O2", op_block_list=["MatMul"],
                                       node_block_list=SAFE))
    node = {n.name: n for n in fp32.graph.node}
    assert blocked[node["mm1"].input[0]] == F32
    low_io = convert_onnx(fp32, "O3", keep_io_types=False, node_block_list=SAFE)
    assert low_io.graph.input[0].type.tensor_type.elem_type == F16
    assert low_io.graph.output[0].type.tensor_type.elem_type == F16


@pytest.mark.parametrize("opset, dtype, match", [(5, "fp16", "opset 5 is too old"),
                                                 (12, "bf16", "bf16 needs opset >= 13")])
def test_old_opsets_are_refused_with_the_upgrade_named(opset, dtype, match):
    model = small_model()
    model.opset_import[0].version = opset
    with pytest.raises(ValueError, match=rf"{match}.*convert_version\(model, 17\)"):
        convert_onnx(model, "O2", dtype)
    assert convert_onnx(model, "O0", dtype).graph.node  # O0 converts nothing: any opset


def test_a_model_without_float_tensors_is_returned_unchanged_with_a_warning():
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["c"], name="add")], "ints",
                              [helper.make_tensor_value_info(n, TensorProto.INT64, [2])
                               for n in ("a", "b")],
                              [helper.make_tensor_value_info("c", TensorProto.INT64, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.warns(UserWarning, match="no float tensors to convert"):
        out = convert_onnx(model, "O2")
    assert [n.op_type for n in out.graph.node] == ["Add"]
