"""ampgraph/train/loss_scale/values.py: the managers' numeric arguments, validated with
errors that say what is allowed."""

from __future__ import annotations

import pytest

from ampgraph.train.loss_scale import DynamicLossScaleManager, FixedLossScaleManager
from ampgraph.train.loss_scale.values import (
    FP32_MAX,
    INT32_MAX,
    factor_value,
    real,
    scale_value,
    window_value,
)


@pytest.mark.parametrize(
    "factory, match",
    [
        (lambda: FixedLossScaleManager(0.5), "loss_scale must be a finite number >= 1"),
        (lambda: FixedLossScaleManager(float("inf")), "loss_scale must be a finite number"),
        (lambda: FixedLossScaleManager("128"), "loss_scale must be a finite number"),
        (lambda: FixedLossScaleManager(None), "loss_scale must be a finite number"),
        (lambda: FixedLossScaleManager(1e39), "fp32 maximum"),
        (lambda: FixedLossScaleManager(8, drop_overflow_update=1), "True or False"),
        (lambda: DynamicLossScaleManager(0), "init_loss_scale must be a finite number >= 1"),
        (lambda: DynamicLossScaleManager(True), "init_loss_scale must be"),
        (lambda: DynamicLossScaleManager(float("nan")), "init_loss_scale must be"),
        (lambda: DynamicLossScaleManager(scale_factor=1), "scale_factor must be a finite number >"),
        (lambda: DynamicLossScaleManager(scale_factor=0.5), "scale_factor must be"),
        (lambda: DynamicLossScaleManager(scale_factor="2"), "scale_factor must be"),
        (lambda: DynamicLossScaleManager(scale_window=0), "scale_window must be an integer >= 1"),
        (lambda: DynamicLossScaleManager(scale_window=2.5), "scale_window must be an integer"),
        (lambda: DynamicLossScaleManager(scale_window=[1]), "scale_window must be an integer"),
    ],
)
def test_invalid_arguments_say_what_is_allowed(factory, match):
    with pytest.raises(ValueError, match=match):
        factory()


def test_real_accepts_finite_real_numbers_only():
    assert real("M", "x", 3, "a number") == 3.0 and isinstance(real("M", "x", 3, "-"), float)
    for bad in (True, "1", None, float("nan"), float("-inf"), 1j):
        with pytest.raises(ValueError, match=r"M: x must be a number"):
            real("M", "x", bad, "a number")


def test_each_value_takes_its_range_and_names_the_owner():
    assert scale_value("M", "loss_scale", 1) == 1.0
    assert scale_value("M", "loss_scale", FP32_MAX) == FP32_MAX
    with pytest.raises(ValueError, match=r"^M: loss_scale must be a finite number >= 1"):
        scale_value("M", "loss_scale", 0.99)
    assert window_value("M", 7.0) == 7 and isinstance(window_value("M", 7.0), int)
    assert window_value("M", INT32_MAX) == INT32_MAX
    with pytest.raises(ValueError, match=r"^M: scale_window must be an integer >= 1"):
        window_value("M", INT32_MAX + 1)
    assert factor_value("M", 1.5) == 1.5
    with pytest.raises(ValueError, match=r"^M: scale_factor must be a finite number > 1"):
        factor_value("M", 1.0)
