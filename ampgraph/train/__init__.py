"""Training: the generated mixed-precision train step and the loss-scale managers.

- ``step``: ``build_train_step`` / ``TrainStep`` (the user-facing step);
- ``codegen``: the step's code generator; ``step_runtime``: ``StepOutput`` and what the
  generated code calls;
- ``graphs``, ``graph_engines``: the whole step as CUDA graphs (``GraphCapture``), and the
  check of it on any device;
- ``loss_scale``: fixed and dynamic loss-scale managers;
- ``adaptive_scale``: ``AdaptiveLossScaleManager`` (underflow-driven, hysteresis, per layer);
- ``low_precision_weights``: 16-bit weights with Kahan / stochastic-rounding updates.
"""

from __future__ import annotations

from ampgraph.train.adaptive_scale import AdaptiveLossScaleManager
from ampgraph.train.graphs import GraphCapture
from ampgraph.train.loss_scale import (
    DynamicLossScaleManager,
    FixedLossScaleManager,
    LossScaleManager,
)
from ampgraph.train.step import TrainStep, build_train_step
from ampgraph.train.step_runtime import StepOutput

__all__ = [
    "AdaptiveLossScaleManager",
    "DynamicLossScaleManager",
    "FixedLossScaleManager",
    "GraphCapture",
    "LossScaleManager",
    "StepOutput",
    "TrainStep",
    "build_train_step",
]
