"""passes.onnx.verify: a converted model's casts, types and plan are checked."""

from __future__ import annotations

import pytest
from onnx import helper

from passes._infra import PassError
from passes.onnx import convert_model, verify_model
from tests.passes.onnx.util import F16, F32, make, mlp, vi


def test_verify_rejects_round_trips_and_duplicate_casts():
    from passes.onnx.casts import INSERTED

    chain = make([
        helper.make_node("Cast", ["x"], ["a"], name="c1", to=F32, doc_string=INSERTED),
        helper.make_node("Cast", ["a"], ["y"], name="c2", to=F16, doc_string=INSERTED),
    ], [vi("x", F16, [2])], [vi("y", F16, [2])])
    with pytest.raises(PassError, match="round trip"):  # fp16 -> fp32 -> fp16: a waste
        verify_model(chain)
    rounding = make([  # fp32 -> fp16 -> fp32 changes values: a user's rounding is kept
        helper.make_node("Cast", ["x"], ["a"], name="c1", to=F16),
        helper.make_node("Cast", ["a"], ["y"], name="c2", to=F32),
    ], [vi("x", F32, [2])], [vi("y", F32, [2])])
    verify_model(rounding)
    dup = make([
        helper.make_node("Cast", ["x"], ["a"], name="c1", to=F16, doc_string=INSERTED),
        helper.make_node("Cast", ["x"], ["b"], name="c2", to=F16, doc_string=INSERTED),
        helper.make_node("Add", ["a", "b"], ["y"], name="add"),
    ], [vi("x", F32, [2])], [vi("y", F16, [2])])
    with pytest.raises(PassError, match="shared"):
        verify_model(dup)
    with pytest.raises(PassError, match="keep_io_types"):
        verify_model(convert_model(mlp(), "O2").model, io_types={"y": F16})


def test_a_converted_model_passes_and_its_types_come_back():
    result = convert_model(mlp(), "O2")
    types = verify_model(result.model, io_types={"x": F32, "y": F32})
    assert types["x"] == F32 and types["x_fp16"] == F16 and types["W1"] == F16


def test_verify_names_the_node_that_reads_the_wrong_dtype():
    model = convert_model(mlp(), "O2").model
    with pytest.raises(PassError) as info:
        verify_model(model, expected={"ln": {0: F16}})  # the plan said fp16, ln reads fp32
    assert (info.value.pass_name, info.value.node) == ("verify", "ln")
    assert "input 0 ('m_fp32') is FLOAT, the precision plan asked for FLOAT16" in str(info.value)
    verify_model(model, expected={"ln": {0: F32}, "gone": {0: F16}})  # unknown nodes: skipped


def test_verify_reports_checker_and_inference_failures():
    model = convert_model(mlp(), "O2").model
    model.graph.node[1].input[0] = "nowhere"
    with pytest.raises(PassError, match=r"\[verify\]: onnx.checker rejects the converted model"):
        verify_model(model)
    clash = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"], name="add")], "g",
                              [vi("a", F32, [2]), vi("b", F16, [2])], [vi("y", F32, [2])])
    mixed = helper.make_model(clash, opset_imports=[helper.make_opsetid("", 17)])
    mixed.ir_version = 10
    with pytest.raises(PassError, match="shape inference fails on the converted model"):
        verify_model(mixed)


def test_a_users_own_repeated_casts_are_allowed():
    twice = make([
        helper.make_node("Cast", ["x"], ["a"], name="c1", to=F16),
        helper.make_node("Cast", ["x"], ["b"], name="c2", to=F16),
        helper.make_node("Add", ["a", "b"], ["y"], name="add"),
    ], [vi("x", F32, [2])], [vi("y", F16, [2])])
    assert verify_model(twice)["y"] == F16
