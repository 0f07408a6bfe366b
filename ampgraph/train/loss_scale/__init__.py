"""Loss-scale managers with MindSpore's names and defaults, kept on the device.

- ``base``: ``LossScaleManager``, the interface (a 0-dim fp32 scale on the device, optional
  hooks), ``overflow_flag`` and ``unscale_by_device``;
- ``values``: the managers' numeric arguments, validated;
- ``fixed``: ``FixedLossScaleManager``, a constant scale;
- ``dynamic``: ``DynamicLossScaleManager``, back off on overflow, grow after clean steps;
- ``resolve``: ``resolve_manager``, what ``loss_scale_manager="auto"`` means.

``AdaptiveLossScaleManager`` (underflow-driven) lives in ``ampgraph/train/adaptive_scale.py``.
"""

from __future__ import annotations

from ampgraph.train.loss_scale.base import LossScaleManager, overflow_flag, unscale_by_device
from ampgraph.train.loss_scale.dynamic import DynamicLossScaleManager
from ampgraph.train.loss_scale.fixed import FixedLossScaleManager
from ampgraph.train.loss_scale.resolve import resolve_manager

__all__ = [
    "DynamicLossScaleManager",
    "FixedLossScaleManager",
    "LossScaleManager",
    "overflow_flag",
    "resolve_manager",
    "unscale_by_device",
]
