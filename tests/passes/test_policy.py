"""passes/policy.py: op tables, level tables and override validation (with the FX table)."""

from __future__ import annotations

import pytest

from passes.fx.policy import make_policy
from passes.policy import (
    ALLOW,
    CLEAR,
    DENY,
    FP32,
    INFER,
    LOW,
    OpGroup,
    OpInfo,
    OpTable,
    key_candidates,
    op_group,
)
from passes.policy import make_policy as make_dialect_policy


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


def test_module_rules_of_a_module_compiled_on_its_own_name_the_whole_model():
    p = make_policy("O2", module_rules=[("encoder.layer.1", FP32, "m")]).under("encoder")
    assert p.overrides.module_precision("layer.1.fc", ())[0] == FP32  # encoder.layer.1.fc
    assert p.overrides.module_precision("layer.0.fc", ()) is None
    assert p.under("encoder.layer.1").overrides.module_precision("fc", ())[0] == FP32


def test_a_policy_takes_the_dialect_table_it_is_given():
    table = OpTable([OpGroup("mine", DENY, "because", frozenset({"Foo"}))])
    p = make_dialect_policy("O2", table=table)
    assert p.table is table and p.op_info("Foo") == OpInfo(DENY, "mine", "because")
    assert p.op_info("aten.linear").cls == INFER  # not in this table: the default class
    with pytest.raises(TypeError):
        make_dialect_policy("O2")  # no dialect's table by default


def test_key_candidates_most_specific_first():
    assert key_candidates("aten.relu_.default") == ["aten.relu_.default", "aten.relu_", "aten.relu"]
    assert key_candidates("aten.softmax.int") == ["aten.softmax.int", "aten.softmax"]
    assert key_candidates("aten.__and__.Tensor") == ["aten.__and__.Tensor", "aten.__and__"]
    assert key_candidates("Softmax") == ["Softmax"]
    assert op_group("g", CLEAR, "r", " a  b ").ops == frozenset({"a", "b"})
