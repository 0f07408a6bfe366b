"""Constants: shared initializers, 16-bit range clamping or FP32 consumers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes.onnx import ConstantRangeWarning
from tests.passes.onnx.util import (
    F16,
    F32,
    casts,
    check,
    init,
    make,
    ops,
    rand,
    reads,
    run,
    vi,
)

FEEDS = {"x": rand(2, 8, scale=1.0)}


def _init(model, name):
    return next(t for t in model.graph.initializer if t.name == name)


def test_initializer_shared_by_fp32_and_low_nodes_gets_a_low_copy():
    nodes = [  # BERT's exported graph shares one zero bias between LayerNorm and Add
        helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "b"], ["h"], name="add"),
        helper.make_node("LayerNormalization", ["h", "g", "b"], ["y"], name="ln"),
    ]
    inits = [init("W", rand(8, 8)), init("b", rand(8)), init("g", np.ones(8))]
    model = make(nodes, [vi("x", F32, [2, 8])], [vi("y", F32, [2, 8])], inits)
    result = check(model, "O2", feeds=FEEDS)
    out = result.model
    assert reads(out, "add") == [F16, F16] and reads(out, "ln") == [F32, F32, F32]
    assert _init(out, "b").data_type == F32 and _init(out, "W").data_type == F16
    assert not any(c.input[0] in ("b", "W") for c in casts(out))  # copies, not Casts


def test_mask_beyond_fp16_range_keeps_its_consumer_fp32():
    mask = np.where(np.arange(8) % 2 == 0, -1e9, 0.0)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["scores"], name="mm"),
        helper.make_node("Add", ["scores", "mask"], ["masked"], name="add_mask"),
        helper.make_node("Softmax", ["masked"], ["y"], name="softmax", axis=-1),
    ]
    model = make(nodes, [vi("x", F32, [2, 8])], [vi("y", F32, [2, 8])],
                 [init("W", rand(8, 8)), init("mask", mask)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConstantRangeWarning)  # no clamping happens
        result = check(model, "O2", feeds=FEEDS)
    assert result.precision("add_mask") == "fp32"
    assert "'mask'" in result.assignment["add_mask"].reason  # the reason names the constant
    assert result.precision("mm") == "low"
    assert _init(result.model, "mask").data_type == F32


def test_constant_of_shape_mask_keeps_its_consumer_fp32():
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        helper.make_node("ConstantOfShape", ["shape"], ["big"], name="fill",
                         value=numpy_helper.from_array(np.array([-1e9], np.float32))),
        helper.make_node("MatMul", ["x", "W"], ["scores"], name="mm"),
        helper.make_node("Add", ["scores", "big"], ["y"], name="add"),
    ]
    model = make(nodes, [vi("x", F32, [2, 8])], [vi("y", F32, [2, 8])], [init("W", rand(8, 8))])
    result = check(model, "O3", feeds=FEEDS)
    assert result.precision("add") == "fp32"
    assert reads(result.model, "add") == [F32, F32]


def test_selection_of_out_of_range_constant_is_clamped_with_a_warning():
    nodes = [  # masked_fill(mask, finfo(float32).min) as torch exports it
        helper.make_node("MatMul", ["x", "W"], ["scores"], name="mm"),
        helper.make_node("Where", ["keep", "scores", "neg"], ["masked"], name="where"),
        helper.make_node("Softmax", ["masked"], ["y"], name="softmax", axis=-1),
    ]
    inputs = [vi("x", F32, [2, 8]), vi("keep", TensorProto.BOOL, [2, 8])]
    inits = [init("W", rand(8, 8)), init("neg", np.float32(np.finfo(np.float32).min))]
    model = make(nodes, inputs, [vi("y", F32, [2, 8])], inits)
    feeds = {**FEEDS, "keep": np.arange(16).reshape(2, 8) % 3 > 0}
    with pytest.warns(ConstantRangeWarning, match="'neg'"):
        result = check(model, "O2", feeds=feeds)
    assert result.precision("where") == "low"
    neg = numpy_helper.to_array(_init(result.model, "neg"))
    assert neg.dtype == np.float16 and float(neg) == -65504.0
    assert np.allclose(run(result.model, feeds)[0], run(model, feeds)[0], atol=1e-2)


def test_tiny_epsilon_is_clamped_to_the_smallest_subnormal():
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        helper.make_node("Mul", ["m", "m"], ["sq"], name="sq"),
        helper.make_node("Add", ["sq", "eps"], ["y"], name="add_eps"),
    ]
    model = make(nodes, [vi("x", F32, [2, 8])], [vi("y", F32, [2, 8])],
                 [init("W", rand(8, 8)), init("eps", np.float32(1e-12))])
    with pytest.warns(ConstantRangeWarning, match="'eps'"):
        result = check(model, "O2", feeds=FEEDS)
    assert float(numpy_helper.to_array(_init(result.model, "eps"))) == pytest.approx(2.0**-24)


def test_constant_node_shared_by_fp32_and_low_nodes():
    value = numpy_helper.from_array(rand(8), "c")
    nodes = [
        helper.make_node("Constant", [], ["c"], name="const", value=value),
        helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "c"], ["h"], name="add"),
        helper.make_node("LayerNormalization", ["h", "c", "c"], ["y"], name="ln"),
    ]
    model = make(nodes, [vi("x", F32, [2, 8])], [vi("y", F32, [2, 8])], [init("W", rand(8, 8))])
    result = check(model, "O2", feeds=FEEDS)
    assert reads(result.model, "add") == [F16, F16] and reads(result.model, "ln")[1:] == [F32] * 2
    assert ops(result.model)["Constant"] == 2  # an fp16 copy next to the fp32 one
    assert all(c.input[0] != "c" for c in casts(result.model))


def test_bf16_converts_weights_and_keeps_finfo_min_finite():
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["scores"], name="mm"),
        helper.make_node("Max", ["scores", "floor"], ["y"], name="max"),
    ]
    inits = [init("W", rand(8, 8)), init("floor", np.float32(np.finfo(np.float32).min))]
    model = make(nodes, [vi("x", F32, [2, 8])], [vi("y", F32, [2, 8])], inits)
    with pytest.warns(ConstantRangeWarning):
        result = check(model, "O2", "bf16")
    assert _init(result.model, "W").data_type == TensorProto.BFLOAT16
    assert reads(result.model, "max") == [TensorProto.BFLOAT16] * 2
