"""The loss-scale managers' numeric arguments, validated with errors that name the manager,
the argument and what is allowed."""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

FP32_MAX = float(torch.finfo(torch.float32).max)
INT32_MAX = 2**31 - 1


def real(owner: str, name: str, value: Any, allowed: str) -> float:
    """``value`` as a finite float, or ValueError naming ``owner.name`` and what is allowed.

    Example:
        >>> real("Manager", "hysteresis", 2, "an integer >= 1")
        2.0
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"{owner}: {name} must be {allowed}, got {value!r} ({type(value).__name__})"
        )
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{owner}: {name} must be {allowed}, got {value!r}")
    return number


def scale_value(owner: str, name: str, value: Any) -> float:
    """A loss scale: a finite number from 1 to the fp32 maximum.

    Example:
        >>> scale_value("Manager", "loss_scale", 128)
        128.0
    """
    allowed = f"a finite number >= 1 and <= {FP32_MAX:.3e} (the fp32 maximum)"
    number = real(owner, name, value, allowed)
    if not 1.0 <= number <= FP32_MAX:
        raise ValueError(f"{owner}: {name} must be {allowed}, got {value!r}")
    return number


def window_value(owner: str, value: Any) -> int:
    """``scale_window``: an integer from 1 to the int32 maximum.

    Example:
        >>> window_value("Manager", 2000.0)
        2000
    """
    allowed = f"an integer >= 1 and <= {INT32_MAX} (clean steps before the scale grows)"
    number = real(owner, "scale_window", value, allowed)
    if not number.is_integer() or not 1 <= number <= INT32_MAX:
        raise ValueError(f"{owner}: scale_window must be {allowed}, got {value!r}")
    return int(number)


def factor_value(owner: str, value: Any) -> float:
    """``scale_factor``: a finite number above 1.

    Example:
        >>> factor_value("Manager", 2)
        2.0
    """
    allowed = "a finite number > 1 (the scale is divided by it on overflow)"
    number = real(owner, "scale_factor", value, allowed)
    if not number > 1.0:
        raise ValueError(f"{owner}: scale_factor must be {allowed}, got {value!r}")
    return number
