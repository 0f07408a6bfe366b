"""ampgraph: graph-level automatic mixed precision (MindSpore-style O0-O3) for PyTorch.

Example:
    >>> import ampgraph
    >>> net = ampgraph.compile(model, amp_level="O2")        # bf16 on CPU / sm_80+
    >>> print(ampgraph.explain(net, example_input))           # what runs in which precision
"""

from __future__ import annotations

from ampgraph.api import compile
from ampgraph.config import AmpConfig
from ampgraph.loss_scale import DynamicLossScaleManager, FixedLossScaleManager, LossScaleManager
from ampgraph.module import AmpModule
from ampgraph.report import PrecisionReport, explain
from ampgraph.train_step import StepOutput, TrainStep, build_train_step

__version__ = "0.1.0"

__all__ = [
    "AmpConfig",
    "AmpModule",
    "DynamicLossScaleManager",
    "FixedLossScaleManager",
    "LossScaleManager",
    "PrecisionReport",
    "StepOutput",
    "TrainStep",
    "build_train_step",
    "compile",
    "explain",
]
