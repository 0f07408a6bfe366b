"""FP8Recipe: validated fields and torchao's shape rules, weight (out, in)."""

from __future__ import annotations

import pytest

from passes.fx.fp8_recipe import FP8Recipe, resolve_fp8

# torchao 0.18, torchao/float8/float8_linear_utils.py, _auto_filter_for_tensorwise and
# _auto_filter_for_rowwise: ``N, K = mod.weight.shape`` (nn.Linear's (out, in)), both
# multiples of 16, then the product stays high precision when any of these holds, each a
# conjunction of (dimension, bound) pairs read as "dimension <= bound".
TORCHAO_KEEPS_16_BIT = {
    "tensorwise": ((("K", 4096), ("N", 1024)),),
    "rowwise": ((("N", 2048),), (("K", 1024),), (("N", 4096), ("K", 2048))),
}


def torchao_converts(scaling: str, weight_shape: tuple[int, int]) -> bool:
    """torchao's auto-filter verdict for an ``nn.Linear`` whose weight has ``weight_shape``."""
    dims = dict(zip("NK", weight_shape))
    if dims["N"] % 16 or dims["K"] % 16:
        return False
    return not any(all(dims[d] <= bound for d, bound in rule)
                   for rule in TORCHAO_KEEPS_16_BIT[scaling])


GRID = (512, 1008, 1024, 1040, 1536, 2048, 2064, 3072, 4096, 4112, 5120, 8192, 11008, 14336)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_verdicts_equal_torchaos_auto_filters_on_a_grid(scaling):
    shapes = [(out, in_) for out in GRID for in_ in GRID] + [(4100, 4096), (4096, 1000)]
    assert len(shapes) >= 100
    recipe = FP8Recipe(scaling=scaling)
    differ = [s for s in shapes if (recipe.shape_verdict(*s) is None) != torchao_converts(
        scaling, s)]
    assert differ == []
    # the grid is not one-sided: both verdicts, and the shapes where in and out swapped
    # would change the verdict, are in it
    verdicts = [torchao_converts(scaling, s) for s in shapes]
    assert any(verdicts) and not all(verdicts)
    assert any(torchao_converts(scaling, (o, i)) != torchao_converts(scaling, (i, o))
               for o, i in shapes)


@pytest.mark.parametrize("shape, tensorwise, rowwise", [
    ((4096, 4096), True, True),
    ((1024, 4096), False, False),   # LLaMA-3-8B k/v: tensorwise in <= 4096 and out <= 1024
    ((4096, 1024), True, False),    # BERT-large intermediate: rowwise needs in > 1024
    ((11008, 4096), True, True),
    ((4096, 2048), True, False),    # rowwise: out <= 4096 and in <= 2048
    ((2048, 11008), True, False),   # rowwise needs out > 2048
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
