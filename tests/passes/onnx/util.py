"""Helpers for the ONNX pass tests: build small graphs, convert, check three ways.

``check`` does what every pass test needs: structure (returns the converted model and
the dtypes every node reads, via shape inference), invariants (verify pass, onnx.checker
with full shape inference, idempotence) and numerics (onnxruntime against the FP32 model
with an fp16-sized tolerance; bf16 is checked structurally only, onnxruntime's CPU provider
lacks bf16 kernels).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import ModelProto, TensorProto, helper, numpy_helper

from passes.onnx import ConversionResult, convert_model
from passes.onnx.subgraphs import all_graphs

F32, F16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
RNG = np.random.default_rng(0)


def vi(name: str, dtype: int = F32, shape: Sequence | None = None):
    return helper.make_tensor_value_info(name, dtype, shape)


def init(name: str, array) -> TensorProto:
    return numpy_helper.from_array(np.asarray(array, dtype=np.float32), name)


def rand(*shape: int, scale: float = 0.5) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def make(nodes, inputs, outputs, inits=(), *, opset: int = 17, name: str = "g") -> ModelProto:
    """A model at IR 10 (loadable by the pinned onnxruntime) with the given opset."""
    graph = helper.make_graph(list(nodes), name, list(inputs), list(outputs), list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def types(model: ModelProto) -> dict[str, int]:
    """Dtype of every value, through ONNX shape inference (strict)."""
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    out: dict[str, int] = {}
    for g in all_graphs(inferred.graph):
        for v in (*g.input, *g.value_info, *g.output):
            if v.type.tensor_type.elem_type:
                out[v.name] = v.type.tensor_type.elem_type
        for t in g.initializer:
            out[t.name] = t.data_type
    return out


def reads(model: ModelProto, node_name: str) -> list[int]:
    """Dtypes of the inputs of the node called ``node_name``."""
    t = types(model)
    node = next(n for g in all_graphs(model.graph) for n in g.node if n.name == node_name)
    return [t.get(i, 0) for i in node.input if i]


def ops(model: ModelProto) -> Counter:
    return Counter(n.op_type for g in all_graphs(model.graph) for n in g.node)


def casts(model: ModelProto) -> list[onnx.NodeProto]:
    return [n for g in all_graphs(model.graph) for n in g.node if n.op_type == "Cast"]


def run(model: ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])
    wanted = {i.name: i.type for i in sess.get_inputs()}
    cast = {k: v.astype(np.float16) if wanted.get(k) == "tensor(float16)" else v
            for k, v in feeds.items() if k in wanted}
    return sess.run(None, cast)


def check(
    fp32: ModelProto,
    level: str = "O2",
    dtype: str = "fp16",
    feeds: Mapping[str, np.ndarray] | None = None,
    *,
    rtol: float = 2e-2,
    **kw,
) -> ConversionResult:
    """Convert, then check invariants, idempotence and (fp16) numerics; return the result."""
    result = convert_model(fp32, level, dtype, **kw)
    model = result.model
    onnx.checker.check_model(model, full_check=True)
    types(model)  # strict inference: every type parameter bound once
    again = convert_model(model, level, dtype, **kw).model
    assert ops(again) == ops(model), f"not idempotent: {ops(model)} -> {ops(again)}"
    if feeds is not None and dtype == "fp16":
        for want, got in zip(run(fp32, feeds), run(model, feeds)):
            got = np.asarray(got, np.float32)
            assert np.isfinite(got).all()
            scale = max(float(np.abs(want).max()), 1e-6)
            assert float(np.abs(got - want).max()) <= rtol * scale, (got, want)
    return result


def mlp(names=("mm1", "add1", "relu", "mm2", "ln", "softmax")) -> ModelProto:
    """MatMul, Add, Relu, MatMul, LayerNormalization, Softmax on a (2, 8) input."""
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["a"], name=names[0]),
        helper.make_node("Add", ["a", "b1"], ["h"], name=names[1]),
        helper.make_node("Relu", ["h"], ["r"], name=names[2]),
        helper.make_node("MatMul", ["r", "W2"], ["m"], name=names[3]),
        helper.make_node("LayerNormalization", ["m", "g", "b"], ["n"], name=names[4]),
        helper.make_node("Softmax", ["n"], ["y"], name=names[5], axis=-1),
    ]
    inits = [init("W1", rand(8, 8)), init("b1", rand(8)), init("W2", rand(8, 8)),
             init("g", np.ones(8)), init("b", np.zeros(8))]
    return make(nodes, [vi("x", F32, [2, 8])], [vi("y", F32, [2, 8])], inits)
