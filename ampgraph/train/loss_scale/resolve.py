"""``loss_scale_manager="auto"``: the manager the low dtype needs."""

from __future__ import annotations

from typing import Any

import torch

from ampgraph.train.loss_scale.base import LossScaleManager
from ampgraph.train.loss_scale.dynamic import DynamicLossScaleManager


def resolve_manager(manager: Any, amp_dtype: torch.dtype) -> LossScaleManager | None:
    """``"auto"``: a ``DynamicLossScaleManager()`` for fp16, None for bf16 and O0; an
    explicit manager or None as given.

    Example:
        >>> resolve_manager("auto", torch.bfloat16) is None
        True
    """
    if isinstance(manager, str) and manager == "auto":
        return DynamicLossScaleManager() if amp_dtype == torch.float16 else None
    if manager is None or isinstance(manager, LossScaleManager):
        return manager
    raise ValueError(
        f"loss_scale_manager must be 'auto', None, or a FixedLossScaleManager / "
        f"DynamicLossScaleManager instance, got {manager!r}"
    )
