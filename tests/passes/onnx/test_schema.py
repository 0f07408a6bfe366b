"""passes.onnx.schema: type parameters from op schemas; inputs that must stay FP32 (Resize
roi/scales, Range, GroupNormalization scale/bias) and ops whose schema has no
low-precision version at the model's opset."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from passes.onnx.schema import (
    float_slots,
    low_blocker,
    node_slots,
    plan_node,
    shared_float_inputs,
)
from tests.passes.onnx.util import F16, F32, check, init, make, rand, reads, types, vi

BF16, I64 = TensorProto.BFLOAT16, TensorProto.INT64
IMAGE = {"x": np.random.default_rng(1).standard_normal((1, 2, 4, 4)).astype(np.float32)}


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_resize_scales_and_roi_stay_fp32(level):
    nodes = [
        helper.make_node("Conv", ["x", "W1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Resize", ["c1", "roi", "scales"], ["up"], name="resize",
                         mode="nearest"),
        helper.make_node("Conv", ["up", "W2"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    inits = [init("W1", rand(2, 2, 3, 3)), init("W2", rand(2, 2, 3, 3)),
             init("roi", np.zeros(0)), init("scales", [1.0, 1.0, 2.0, 2.0])]
    model = make(nodes, [vi("x", F32, [1, 2, 4, 4])], [vi("y", F32, [1, 2, 8, 8])], inits)
    result = check(model, level, feeds=IMAGE)
    assert reads(result.model, "resize") == [F16, F32, F32]
    assert result.precision("resize") == "low"


def test_range_stays_fp32_even_at_o3():
    nodes = [
        helper.make_node("Range", ["start", "limit", "delta"], ["r"], name="range"),
        helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "r"], ["y"], name="add"),
    ]
    inits = [init("W", rand(8, 8)), init("start", np.float32(0.0)),
             init("limit", np.float32(0.8)), init("delta", np.float32(0.1))]
    model = make(nodes, [vi("x", F32, [2, 8])], [vi("y", F32, [2, 8])], inits)
    result = check(model, "O3", feeds={"x": rand(2, 8)})
    assert result.precision("range") == "fp32"
    assert reads(result.model, "range") == [F32, F32, F32]
    assert "must stay fp32" in result.assignment["range"].reason


def test_group_normalization_scale_and_bias_stay_fp32_at_o3():
    nodes = [
        helper.make_node("Conv", ["x", "W1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("GroupNormalization", ["c1", "scale", "bias"], ["gn"], name="gn",
                         num_groups=2),
        helper.make_node("Conv", ["gn", "W2"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    inits = [init("W1", rand(4, 2, 3, 3)), init("W2", rand(2, 4, 3, 3)),
             init("scale", np.ones(4)), init("bias", np.zeros(4))]
    model = make(nodes, [vi("x", F32, [1, 2, 4, 4])], [vi("y", F32, [1, 2, 4, 4])], inits,
                 opset=21)
    result = check(model, "O3", feeds=IMAGE)
    assert result.precision("gn") == "fp32" and result.precision("conv1") == "low"
    assert reads(result.model, "gn") == [F32, F32, F32]


def test_bf16_on_an_opset_without_bf16_matmul_keeps_it_fp32():
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
             helper.make_node("Relu", ["m"], ["y"], name="relu")]
    model = make(nodes, [vi("x", F32, [2, 8])], [vi("y", F32, [2, 8])], [init("W", rand(8, 8))],
                 opset=12)
    result = check(model, "O2", "bf16")
    assert result.precision("mm") == "fp32"
    assert "no bfloat16 version" in result.assignment["mm"].reason
    at13 = check(make(nodes, [vi("x", F32, [2, 8])], [vi("y", F32, [2, 8])],
                      [init("W", rand(8, 8))], opset=13), "O2", "bf16")
    assert reads(at13.model, "mm") == [BF16, BF16] and types(at13.model)["y"] == F32


def test_slots_follow_the_schema_and_a_schema_less_op_is_one_shared_type():
    resize = helper.make_node("Resize", ["x", "roi", "s"], ["y"])
    slots = node_slots(resize, 19)
    assert slots.inputs == ("T1", "T2", "tensor(float)") and slots.outputs == ("T1",)
    assert slots.allows("T1", BF16) and slots.allows("T2", F16) and not slots.allows("T2", BF16)
    assert not slots.allows("tensor(float)", F16)
    assert node_slots(helper.make_node("Sum", ["a", "b", "c"], ["y"]), 17).inputs == \
        ("T", "T", "T")  # a variadic tail repeats the last formal
    contrib = node_slots(helper.make_node("FusedMatMul", ["a", "b"], ["y"],
                                          domain="com.microsoft"), 1)
    assert not contrib.known and contrib.inputs == ("*", "*") and contrib.allows("*", BF16)


def test_float_slots_and_the_plan_of_a_node():
    gather = helper.make_node("Gather", ["W", "ids"], ["e"])
    assert float_slots(gather, {"W": F32, "ids": I64, "e": F32}) == ([0], [0])
    resize = helper.make_node("Resize", ["x", "roi", "s"], ["y"])
    t = {"x": F32, "roi": F32, "s": F32, "y": F32}
    assert plan_node(resize, 19, t, F16) == ({0: F16, 1: F32, 2: F32}, {0: F16})
    assert low_blocker(resize, 19, t, F16) is None
    matmul = helper.make_node("MatMul", ["a", "b"], ["y"])
    t = {"a": F32, "b": F32, "y": F32}
    assert plan_node(matmul, 12, t, BF16) == ({0: F32, 1: F32}, {0: F32})  # no bf16 MatMul
    assert plan_node(matmul, 13, t, BF16) == ({0: BF16, 1: BF16}, {0: BF16})
    assert low_blocker(matmul, 12, t, BF16) == \
        "the ONNX schema of MatMul (opset 12) has no bfloat16 version"
    rng = helper.make_node("Range", ["s", "l", "d"], ["r"])
    assert low_blocker(rng, 17, {"s": F32, "l": F32, "d": F32, "r": F32}, F16) == \
        "Range inputs [0, 1, 2] must stay fp32 and share its data type"


def test_float_inputs_sharing_a_type_in_a_non_float_op_must_agree():
    equal = helper.make_node("Equal", ["a", "b"], ["c"])
    assert shared_float_inputs(equal, 17, {"a": F16, "b": F32, "c": TensorProto.BOOL}) == [0, 1]
    where = helper.make_node("Where", ["m", "a", "b"], ["y"])
    assert shared_float_inputs(where, 17, {"m": TensorProto.BOOL, "a": F16, "b": F32}) == [1, 2]
    shape = helper.make_node("Shape", ["a"], ["s"])
    assert shared_float_inputs(shape, 17, {"a": F32, "s": I64}) == []
