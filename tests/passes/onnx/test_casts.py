"""Casts: one per (producer output, dtype), existing Casts retargeted, no round trips."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from tests.passes.onnx.util import (
    F16,
    F32,
    casts,
    check,
    init,
    make,
    rand,
    reads,
    types,
    vi,
)


def fan_out_model():
    """x feeds a LayerNorm and two MatMuls; the LayerNorm feeds two more MatMuls."""
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g", "b"], ["ln"], name="ln", axis=-1),
        helper.make_node("MatMul", ["ln", "W1"], ["m1"], name="m1"),
        helper.make_node("MatMul", ["ln", "W2"], ["m2"], name="m2"),
        helper.make_node("MatMul", ["x", "W3"], ["m3"], name="m3"),
        helper.make_node("MatMul", ["x", "W4"], ["m4"], name="m4"),
        helper.make_node("Add", ["m1", "m2"], ["s"], name="s"),
        helper.make_node("Add", ["m3", "m4"], ["t"], name="t"),
        helper.make_node("Add", ["s", "t"], ["y"], name="y"),
    ]
    inits = [init("g", np.ones(8)), init("b", np.zeros(8))]
    inits += [init(f"W{i}", rand(8, 8)) for i in range(1, 5)]
    return make(nodes, [vi("x", F32, [2, 8])], [vi("y", F32, [2, 8])], inits)


FEEDS = {"x": rand(2, 8, scale=1.0)}


def test_one_cast_per_producer_and_dtype_graph_input_included():
    result = check(fan_out_model(), "O2", feeds=FEEDS)
    model = result.model
    sources = [c.input[0] for c in casts(model)]
    assert len(sources) == 3  # x -> fp16, ln -> fp16, the output back to fp32
    assert sources.count("x") == 1 and sources.count("ln") == 1  # x: 3 readers, ln: 2
    assert reads(model, "ln")[0] == F32  # the fp32 consumer reads x itself
    assert reads(model, "m3")[:2] == [F16, F16] and reads(model, "m1")[:2] == [F16, F16]
    assert types(model)["y"] == F32  # keep_io_types


def test_blocked_node_with_several_consumers_gets_one_cast_per_dtype():
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="blocked"),
        helper.make_node("Neg", ["h"], ["r"], name="neg"),
        helper.make_node("Sigmoid", ["h"], ["s"], name="sig"),
        helper.make_node("Tanh", ["h"], ["t"], name="tanh"),
        helper.make_node("Sum", ["r", "s", "t"], ["y"], name="sum"),
    ]
    model = make(nodes, [vi("x", F32, [2, 8])], [vi("y", F32, [2, 8])], [init("W", rand(8, 8))])
    result = check(model, "O2", feeds=FEEDS, node_block_list=["blocked"])
    assert result.precision("blocked") == "fp32"
    assert [c.input[0] for c in casts(result.model)].count("h") == 1
    assert len(casts(result.model)) == 2  # h -> fp16 and the output back to fp32


def test_no_cast_round_trips_between_fp32_ops():
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["a"], name="mm1"),
        helper.make_node("Softmax", ["a"], ["p"], name="softmax", axis=-1),
        helper.make_node("Log", ["p"], ["lp"], name="log"),
        helper.make_node("MatMul", ["lp", "W2"], ["y"], name="mm2"),
    ]
    inits = [init("W1", rand(8, 8)), init("W2", rand(8, 8))]
    model = make(nodes, [vi("x", F32, [2, 8])], [vi("y", F32, [2, 8])], inits)
    result = check(model, "O2", feeds=FEEDS)
    produced_by_cast = {c.output[0] for c in casts(result.model)}
    assert not any(c.input[0] in produced_by_cast for c in casts(result.model))
    assert len(casts(result.model)) == 4  # x->16, a->32, lp->16, y->32
    assert reads(result.model, "log") == [F32]


def test_original_cast_chains_round_as_written():
    """fp32 -> fp16 -> fp32 written by the user changes values: it is kept (DESIGN: never
    fold fp32 -> low -> fp32); the pass adds only its own two casts."""
    from passes.onnx.casts import INSERTED

    nodes = [
        helper.make_node("Cast", ["x"], ["x16"], name="to16", to=F16),
        helper.make_node("Cast", ["x16"], ["x32"], name="to32", to=F32),
        helper.make_node("Cast", ["x32"], ["x32b"], name="noop", to=F32),
        helper.make_node("MatMul", ["x32b", "W"], ["y"], name="mm"),
        helper.make_node("Shape", ["x32b"], ["shape"], name="shape"),  # reads any dtype
    ]
    outputs = [vi("y", F32, [2, 8]), vi("shape", TensorProto.INT64, [2])]
    model = make(nodes, [vi("x", F32, [2, 8])], outputs, [init("W", rand(8, 8))])
    result = check(model, "O2", feeds=FEEDS)
    inserted = [c for c in casts(result.model) if c.doc_string == INSERTED]
    assert len(inserted) == 2  # one to fp16 for the MatMul, the output back to fp32
    assert {"to16", "to32"} <= {c.name for c in casts(result.model)}
    assert reads(result.model, "mm")[0] == F16


def mask_model(extra_fp32_reader: bool):
    nodes = [
        helper.make_node("Cast", ["mask"], ["maskf"], name="mask_cast", to=F32),
        helper.make_node("MatMul", ["x", "W"], ["scores"], name="mm"),
        helper.make_node("Mul", ["scores", "maskf"], ["y"], name="apply"),
    ]
    outputs = [vi("y", F32, [2, 8])]
    if extra_fp32_reader:
        nodes.append(helper.make_node("Softmax", ["maskf"], ["p"], name="softmax"))
        outputs.append(vi("p", F32, [2, 8]))
    inputs = [vi("x", F32, [2, 8]), vi("mask", TensorProto.INT64, [2, 8])]
    return make(nodes, inputs, outputs, [init("W", rand(8, 8))])


MASK_FEEDS = {"x": FEEDS["x"], "mask": (np.arange(16).reshape(2, 8) % 3 > 0).astype(np.int64)}


def test_existing_cast_to_float_is_retargeted():
    result = check(mask_model(False), "O2", feeds=MASK_FEEDS)
    node = next(c for c in casts(result.model) if c.name == "mask_cast")
    assert node.attribute[0].i == F16 and node.input[0] == "mask"
    assert reads(result.model, "apply") == [F16, F16]
    assert len(casts(result.model)) == 3  # x, retargeted mask cast, output


def test_existing_cast_with_mixed_readers_gets_a_sibling_not_a_chain():
    result = check(mask_model(True), "O2", feeds=MASK_FEEDS)
    from_mask = [c for c in casts(result.model) if c.input[0] == "mask"]
    assert sorted(c.attribute[0].i for c in from_mask) == [F32, F16]
    assert reads(result.model, "softmax") == [F32]


def test_keep_io_types_false_lowers_inputs_and_outputs():
    result = check(fan_out_model(), "O2", feeds=FEEDS, keep_io_types=False)
    t = types(result.model)
    assert t["x"] == F16 and t["y"] == F16
    assert reads(result.model, "ln")[0] == F32  # LayerNorm reads a Cast of the fp16 input


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_fewer_casts_than_onnxconverter_common(level):
    float16 = pytest.importorskip("onnxconverter_common.float16")
    model = fan_out_model()
    ours = check(model, level, feeds=FEEDS).model
    block = ["LayerNormalization"] if level != "O3" else []
    theirs = float16.convert_float_to_float16(model, keep_io_types=True, op_block_list=block)
    assert len(casts(ours)) <= len(casts(theirs))
