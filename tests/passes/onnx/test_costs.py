"""passes.onnx.costs: FLOPs and bytes of converted ONNX models, against hand counts."""

from __future__ import annotations

from onnx import TensorProto, helper

from passes.costs import GraphCosts
from passes.onnx import convert_model
from passes.onnx.costs import itemsize, live_peak, model_costs, node_flops, value_shapes
from tests.passes.onnx.util import F32, init, make, mlp, rand, vi


def conv_pair():
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("ConvTranspose", ["c", "Wt"], ["y"], name="ct", strides=[2, 2])]
    return make(nodes, [vi("x", F32, ["N", 3, 8, 8])], [vi("y", F32, ["N", 3, 17, 17])],
                [init("W", rand(8, 3, 3, 3)), init("Wt", rand(8, 3, 3, 3))])


def test_value_shapes_fix_the_inputs_and_leave_unknown_shapes_out():
    model = conv_pair()
    shapes = value_shapes(model, {"x": (1, 3, 8, 8)})
    assert shapes["c"] == (F32, (1, 8, 8, 8)) and shapes["y"] == (F32, (1, 3, 17, 17))
    assert shapes["W"] == (F32, (8, 3, 3, 3))
    assert "c" not in value_shapes(model, {})  # the batch stays symbolic: no size


def test_flops_are_twice_the_multiply_adds():
    model = conv_pair()
    shapes = value_shapes(model, {"x": (1, 3, 8, 8)})
    # Conv: 27 multiply-adds per output point; ConvTranspose: 3 x 3 x 3 per input point
    assert [node_flops(n, shapes) for n in model.graph.node] == [2 * 512 * 27, 2 * 512 * 27]
    gemm = make([helper.make_node("Gemm", ["x", "W"], ["y"], name="gemm", transA=1)],
                [vi("x", F32, [8, 2])], [vi("y", F32, [2, 16])], [init("W", rand(8, 16))])
    shapes = value_shapes(gemm, {})
    assert node_flops(gemm.graph.node[0], shapes) == 2 * (2 * 16) * 8  # A transposed: K = 8
    relu = helper.make_node("Relu", ["x"], ["y"])
    assert node_flops(relu, shapes) == 0


def test_live_peak_frees_each_value_after_its_last_use():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="relu"),
             helper.make_node("Neg", ["a"], ["b"], name="neg"),
             helper.make_node("Add", ["a", "b"], ["y"], name="add")]
    model = make(nodes, [vi("x", F32, [4, 8])], [vi("y", F32, [4, 8])])
    # x is freed after relu; a, b and y are live together at add: 3 x 128 bytes
    assert live_peak(model, value_shapes(model, {})) == 3 * 4 * 8 * 4


def test_costs_of_a_converted_mlp():
    model = mlp()
    costs = model_costs(model, convert_model(model, "O2"), {"x": (4, 8)})
    assert isinstance(costs, GraphCosts)
    assert costs.flops == costs.low_flops == 2 * (2 * 4 * 8 * 8)  # both MatMuls in fp16
    assert costs.param_bytes_fp32 == 2 * 8 * 4  # the LayerNormalization's scale and bias
    assert costs.param_bytes_low == (2 * 64 + 8) * 2  # W1, W2, b1 in fp16
    assert costs.param_bytes_baseline == (2 * 64 + 3 * 8) * 4
    o0 = model_costs(model, convert_model(model, "O0"), {"x": (4, 8)})
    assert o0.low_flops == 0 and o0.activation_bytes == o0.activation_bytes_fp32
    assert costs.activation_bytes < o0.activation_bytes  # fp16 values, two casts included


def test_itemsize():
    assert [itemsize(t) for t in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE,
                                  TensorProto.BFLOAT16, TensorProto.UNDEFINED)] == [4, 2, 8, 2, 4]
