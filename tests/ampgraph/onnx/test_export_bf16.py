"""bf16 ONNX that exports and runs low: T5 at opset 17 (whose ConstantOfShape takes no
bf16: it stays fp32 behind a Cast), and a ResNet at the bf16 default opset (22, where Conv
and MaxPool take bf16) or at 20 (where they run fp32, and a warning names them). Each
model passes ONNX's full check and onnxruntime resolves its graph; the CPU provider has
no bf16 kernels, so that is as far as onnxruntime gets here."""

from __future__ import annotations

import warnings
from collections import Counter

import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto

from ampgraph.onnx import export_onnx

tf = pytest.importorskip("transformers")


def precisions(model: onnx.ModelProto) -> Counter:
    """(op type, "bf16" | "fp32") -> count, for every node with a float output."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {v.name: v.type.tensor_type.elem_type for v in (
        *inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input)}
    names = {TensorProto.BFLOAT16: "bf16", TensorProto.FLOAT: "fp32"}
    return Counter((n.op_type, names[types[n.output[0]]]) for n in inferred.graph.node
                   if n.output and types.get(n.output[0]) in names)


def resolves_in_onnxruntime(path) -> None:
    """onnxruntime parses, type-checks and resolves the graph; only the CPU provider's
    missing bf16 kernels may stop the session."""
    try:
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's own exception types are not importable
        assert "NOT_IMPLEMENTED" in str(exc) and "Could not find an implementation" in str(exc)


def export(model, args, path, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        proto = export_onnx(model, args, path, dtype="bf16", **kw)
    onnx.checker.check_model(proto, full_check=True)
    resolves_in_onnxruntime(path)
    return proto, [str(w.message) for w in caught if "opset" in str(w.message)]


@pytest.mark.slow
def test_t5_exports_at_opset_17_with_its_products_in_bf16(tmp_path):
    torch.manual_seed(0)
    t5 = tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)).eval()
    ids = torch.randint(0, 128, (2, 12))
    proto, _ = export(t5, (), tmp_path / "t5.onnx", opset=17,
                      kwargs={"input_ids": ids, "decoder_input_ids": ids})
    assert [o.version for o in proto.opset_import if o.domain == ""] == [17]
    ops = precisions(proto)
    assert ops[("MatMul", "bf16")] >= 40 and ops[("MatMul", "fp32")] == 0
    # ConstantOfShape takes bf16 from opset 20 only: its value stays fp32 and is cast
    assert ops[("ConstantOfShape", "bf16")] == 0 and ops[("ConstantOfShape", "fp32")] >= 1


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    return tf.ResNetForImageClassification(tf.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5)).eval()


@pytest.mark.slow
def test_a_resnet_runs_its_convolutions_and_pooling_in_bf16_at_the_default_opset(
        tmp_path, resnet):
    proto, said = export(resnet, (torch.randn(2, 3, 32, 32),), tmp_path / "resnet.onnx")
    assert [o.version for o in proto.opset_import if o.domain == ""] == [22] and not said
    ops = precisions(proto)
    convs = sum(1 for n in proto.graph.node if n.op_type == "Conv")
    assert convs >= 5 and ops[("Conv", "bf16")] == convs
    assert ops[("MaxPool", "bf16")] == 1 and ops[("Gemm", "bf16")] == 1


@pytest.mark.slow
def test_at_opset_20_the_convolutions_run_fp32_and_a_warning_names_them(tmp_path, resnet):
    proto, said = export(resnet, (torch.randn(2, 3, 32, 32),), tmp_path / "resnet20.onnx",
                         opset=20)
    assert said == ["convert_onnx: opset 20 has no bf16 version of Conv, MaxPool: they run "
                    "fp32 between casts (opset 22 has them; export at that opset to run them "
                    "bf16)"]
    ops = precisions(proto)
    assert ops[("Conv", "bf16")] == 0 and ops[("Conv", "fp32")] >= 5
    assert ops[("Gemm", "bf16")] == 1
