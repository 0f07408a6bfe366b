"""passes.onnx.policy: the ONNX op table and its FP32 slots, dtypes and limits."""

from __future__ import annotations

import ml_dtypes
import numpy as np

import passes.onnx.policy as onnx_policy
from passes.onnx import ONNX_TABLE
from passes.onnx.policy import (
    BFLOAT16,
    DATA_MOVES,
    FLOAT,
    FLOAT16,
    FP32_INPUTS,
    LOW_DTYPES,
    ONNX_GROUPS,
    SATURATING,
    dtype_limits,
)
from passes.policy import ALLOW, CLASSES, CLEAR, DENY, NORM, make_policy


def test_policy_table_shares_the_fx_vocabulary():
    assert ONNX_TABLE.info("MatMul").cls == ALLOW and ONNX_TABLE.info("Conv").cls == ALLOW
    assert ONNX_TABLE.info("LayerNormalization").group == NORM
    assert ONNX_TABLE.info("Softmax").cls == DENY and ONNX_TABLE.info("Reshape").cls == CLEAR
    assert ONNX_TABLE.info("Sqrt").group == "default"  # INFER
    policy = make_policy("O3", table=ONNX_TABLE, keep_norm_fp32=True)
    assert policy.op_info("BatchNormalization").cls == DENY


def test_make_policy_uses_the_onnx_table():
    p = onnx_policy.make_policy("O2", deny_ops=["MatMul"])
    assert p.table is ONNX_TABLE and p.op_info("MatMul").cls == DENY
    assert p.op_info("Softmax").cls == DENY and p.op_info("aten.softmax").cls != DENY


def test_every_group_has_a_reason_and_data_moves_are_clear_ops():
    for g in ONNX_GROUPS:
        assert g.reason and g.cls in CLASSES and g.ops
    assert all(ONNX_TABLE.info(op).cls == CLEAR for op in DATA_MOVES)
    assert all(ONNX_TABLE.info(op).cls == CLEAR for op in SATURATING if op != "Clip")
    assert FP32_INPUTS["Resize"] == (1, 2) and FP32_INPUTS["Range"] == (0, 1, 2)


def test_low_dtypes_and_their_limits():
    assert {LOW_DTYPES[k] for k in ("fp16", "float16", "half")} == {FLOAT16}
    assert {LOW_DTYPES[k] for k in ("bf16", "bfloat16")} == {BFLOAT16}
    assert dtype_limits(FLOAT16) == (65504.0, 2.0**-24)
    bf16 = ml_dtypes.finfo(ml_dtypes.bfloat16)
    assert dtype_limits(BFLOAT16) == (float(bf16.max), float(bf16.smallest_subnormal))
    assert dtype_limits(FLOAT)[0] == float(np.finfo(np.float32).max)
