"""Graph passes and precision policy for ampgraph.

This package is independent of the public ``ampgraph`` package (a test checks that
``import passes`` never imports it): it holds pure graph transforms over torch.fx and
ONNX graphs, the dialect-free painter and the policy tables.
"""

from __future__ import annotations

from passes._infra import PassError, PassInputError, PassManager, PassResult
from passes.paint import Assignment, Decision, paint
from passes.policy import LEVELS, LevelPolicy, make_policy

__all__ = [
    "LEVELS",
    "Assignment",
    "Decision",
    "LevelPolicy",
    "PassError",
    "PassInputError",
    "PassManager",
    "PassResult",
    "make_policy",
    "paint",
]
