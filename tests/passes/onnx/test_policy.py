"""passes.onnx.policy: the ONNX op table and its FP32 slots, dtypes and limits."""

from __future__ import annotations

from passes.onnx import ONNX_TABLE
from passes.policy import ALLOW, CLEAR, DENY, NORM, make_policy


def test_policy_table_shares_the_fx_vocabulary():
    assert ONNX_TABLE.info("MatMul").cls == ALLOW and ONNX_TABLE.info("Conv").cls == ALLOW
    assert ONNX_TABLE.info("LayerNormalization").group == NORM
    assert ONNX_TABLE.info("Softmax").cls == DENY and ONNX_TABLE.info("Reshape").cls == CLEAR
    assert ONNX_TABLE.info("Sqrt").group == "default"  # INFER
    policy = make_policy("O3", table=ONNX_TABLE, keep_norm_fp32=True)
    assert policy.op_info("BatchNormalization").cls == DENY
