"""Training: the generated mixed-precision train step and the loss-scale managers.

- ``step``: ``build_train_step`` / ``TrainStep`` (the user-facing step);
- ``codegen``: the step's code generator and ``StepOutput``;
- ``loss_scale``: fixed and dynamic loss-scale managers.
"""

from __future__ import annotations

from ampgraph.train.codegen import StepOutput
from ampgraph.train.loss_scale import (
    DynamicLossScaleManager,
    FixedLossScaleManager,
    LossScaleManager,
)
from ampgraph.train.step import TrainStep, build_train_step

__all__ = [
    "DynamicLossScaleManager",
    "FixedLossScaleManager",
    "LossScaleManager",
    "StepOutput",
    "TrainStep",
    "build_train_step",
]
