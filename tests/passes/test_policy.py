"""Policy tables are data; lookups, level tables and override validation."""

from __future__ import annotations

import pytest

from passes.policy import (
    ALLOW,
    CLEAR,
    DENY,
    FP32,
    FX_GROUPS,
    FX_TABLE,
    INFER,
    LOW,
    OpGroup,
    OpTable,
    fixed_slots,
    make_policy,
)


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


def test_an_op_in_two_groups_is_rejected():
    with pytest.raises(ValueError, match="two policy groups"):
        OpTable([OpGroup("a", ALLOW, "r", frozenset({"x"})), OpGroup("b", DENY, "r",
                                                                      frozenset({"x"}))])


def test_norm_group_follows_keep_batchnorm_fp32():
    assert make_policy("O2").op_info("aten.batch_norm").cls == DENY
    assert make_policy("O3").op_info("aten.batch_norm").cls == INFER
    kept = make_policy("O3", keep_norm_fp32=True)
    assert kept.base(kept.op_info("aten.batch_norm")) == FP32
    freed = make_policy("O2", keep_norm_fp32=False)
    assert freed.base(freed.op_info("aten.layer_norm")) == LOW


def test_user_op_overrides_are_absolute():
    p = make_policy("O3", deny_ops=["aten.gelu"])
    assert p.base(p.op_info("aten.gelu.default")) == FP32
    p = make_policy("O1", allow_ops=["aten.layer_norm"])
    assert p.base(p.op_info("aten.layer_norm")) == LOW


def test_conflicts_and_unknown_level():
    with pytest.raises(ValueError, match="conflicting"):
        make_policy("O2", allow_ops=["aten.x"], deny_ops=["aten.x"])
    with pytest.raises(ValueError, match="conflicting"):
        make_policy("O2", module_rules=[("a.*", LOW, "custom_allow"), ("a.*", FP32, "x")])
    with pytest.raises(ValueError, match="O0, O1, O2, O3"):
        make_policy("O9")


def test_module_rules_most_specific_wins():
    p = make_policy("O2", module_rules=[("encoder", FP32, "m"), ("encoder.layer.1", LOW, "m")])
    assert p.overrides.module_precision("encoder.layer.0.fc", ())[0] == FP32
    assert p.overrides.module_precision("encoder.layer.1.fc", ())[0] == LOW
    assert p.overrides.module_precision("decoder", ()) is None
    q = make_policy("O2", module_rules=[("class:LayerNorm", FP32, "custom_deny")])
    assert q.overrides.module_precision("x", ("torch.nn.modules.normalization.LayerNorm",))


def test_batch_norm_statistics_are_fixed_slots():
    assert fixed_slots("aten.batch_norm.default") == (1, 2, 3, 4)
    assert fixed_slots("aten.linear") == ()
