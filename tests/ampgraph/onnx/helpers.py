"""What the ONNX API's tests share: reference models by path, a small hand-built model with
a region that fp16 breaks, value types after shape inference, one onnxruntime run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ampgraph.onnx import onnx_session

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


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    g = inferred.graph
    out = {t.name: t.data_type for t in g.initializer}
    out.update({v.name: v.type.tensor_type.elem_type for v in (*g.input, *g.value_info, *g.output)})
    return out


def run(model, args) -> np.ndarray:
    sess = onnx_session(model, "cpu")
    return sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)})[0]


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
