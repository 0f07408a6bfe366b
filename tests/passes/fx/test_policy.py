"""passes/fx/policy.py: the FX op groups are data; lookups and fixed slots."""

from __future__ import annotations

import pytest

from passes.fx.policy import FX_GROUPS, FX_TABLE, fixed_slots, make_policy
from passes.policy import ALLOW, CLEAR, DENY, FP32, FP32_ONLY, INFER, LOW


@pytest.mark.parametrize("key, cls", [
    ("aten.linear", ALLOW), ("aten.conv2d.default", ALLOW), ("aten.softmax.int", DENY),
    ("aten.layer_norm", DENY), ("aten.view.default", CLEAR), ("aten.relu_", CLEAR),
    ("aten.gelu", INFER), ("aten.some_new_op", INFER), ("aten.sum.dim_IntList", DENY),
    ("aten.scaled_dot_product_attention", ALLOW), ("getitem", CLEAR),
])
def test_lookup(key, cls):
    assert FX_TABLE.info(key).cls == cls


def test_every_group_has_a_reason_and_a_known_class():
    for g in FX_GROUPS:
        assert g.reason and g.cls in (ALLOW, INFER, DENY, CLEAR) and g.ops


def test_batch_norm_statistics_are_fixed_slots():
    assert fixed_slots("aten.batch_norm.default") == (1, 2, 3, 4)
    assert fixed_slots("aten.linear") == ()



def test_make_policy_uses_the_fx_table():
    p = make_policy("O2", deny_ops=["aten.gelu"])
    assert p.table is FX_TABLE and p.level == "O2"
    assert p.op_info("aten.softmax.int").cls == DENY and p.op_info("aten.gelu").cls == DENY
    assert p.op_info("Softmax").cls == INFER  # an ONNX key means nothing here


@pytest.mark.parametrize("key", ["aten.view_as_complex.default", "aten.fft_fft.default",
                                 "aten.fft_rfft", "aten._fft_r2c", "aten.stft"])
def test_ops_with_no_16_bit_kernels_are_fp32_at_every_level_but_o0(key):
    for level in ("O1", "O2", "O3"):
        policy = make_policy(level)
        info = policy.op_info(key)
        assert (info.cls, info.group, policy.base(info)) == (DENY, FP32_ONLY, FP32)
    assert make_policy("O3").base(make_policy("O3").op_info("aten.softmax.int")) == LOW
