"""FP8Recipe: validated fields and torchao's shape rules, weight (out, in)."""

from __future__ import annotations

import pytest

from passes.fx.fp8_recipe import FP8Recipe, resolve_fp8


@pytest.mark.parametrize("shape, tensorwise, rowwise", [
    ((4096, 4096), True, True),
    ((1024, 4096), True, False),    # rowwise needs out > 1024
    ((4096, 1024), False, False),   # tensorwise: out <= 4096 and in <= 1024
    ((11008, 1024), True, False),   # rowwise needs in > 2048
    ((2048, 4096), True, False),    # rowwise: in <= 4096 and out <= 2048
    ((4096, 11008), True, True),
    ((4100, 4096), False, False),   # not a multiple of 16
])
def test_torchao_thresholds(shape, tensorwise, rowwise):
    assert (FP8Recipe().shape_verdict(*shape) is None) is tensorwise
    assert (FP8Recipe(scaling="rowwise").shape_verdict(*shape) is None) is rowwise


def test_rule_all_keeps_only_the_multiple_of_16_requirement():
    assert FP8Recipe(rule="all").shape_verdict(32, 48) is None
    assert "multiples of 16" in FP8Recipe(rule="all").shape_verdict(32, 50)


def test_fields_are_checked():
    with pytest.raises(ValueError, match="scaling"):
        FP8Recipe(scaling="blockwise")
    with pytest.raises(ValueError, match="weight_grad"):
        FP8Recipe(weight_grad="fp32")
    with pytest.raises(TypeError, match="include"):
        FP8Recipe(include="lm_head")
    assert FP8Recipe(exclude=["a"]).exclude == ("a",)


def test_resolve():
    assert resolve_fp8(None) is resolve_fp8(False) is None
    assert resolve_fp8(True) == FP8Recipe()
    recipe = FP8Recipe(scaling="rowwise")
    assert resolve_fp8(recipe) is recipe
    with pytest.raises(TypeError, match="FP8Recipe"):
        resolve_fp8("tensorwise")
