"""Training: the generated mixed-precision train step and the loss-scale managers.

- ``step``: ``build_train_step`` / ``TrainStep`` (the user-facing step);
- ``codegen``: the step's code generator and ``StepOutput``;
- ``loss_scale``: fixed and dynamic loss-scale managers;
- ``adaptive_scale``: ``AdaptiveLossScaleManager`` (underflow-driven, hysteresis, per layer);
- ``low_precision_weights``: 16-bit weights with Kahan / stochastic-rounding updates.
"""

from __future__ import annotations

from ampgraph.train.adaptive_scale import AdaptiveLossScaleManager
from ampgraph.train.codegen import StepOutput
from ampgraph.train.loss_scale import (
    DynamicLossScaleManager,
    FixedLossScaleManager,
    LossScaleManager,
)
from ampgraph.train.step import TrainStep, build_train_step

__all__ = [
    "AdaptiveLossScaleManager",
    "DynamicLossScaleManager",
    "FixedLossScaleManager",
    "LossScaleManager",
    "StepOutput",
    "TrainStep",
    "build_train_step",
]
