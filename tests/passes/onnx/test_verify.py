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
