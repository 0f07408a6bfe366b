"""ampgraph: graph-level automatic mixed precision (MindSpore-style O0-O3) for PyTorch.

Example:
    >>> import ampgraph
    >>> net = ampgraph.compile(model, amp_level="O2")        # bf16 on CPU / sm_80+
    >>> print(ampgraph.explain(net, example_input))           # what runs in which precision
"""

from __future__ import annotations

from ampgraph.api import compile
from ampgraph.config import AmpConfig
from ampgraph.module import AmpModule
from ampgraph.report import PrecisionReport, explain
from ampgraph.train import (
    AdaptiveLossScaleManager,
    DynamicLossScaleManager,
    FixedLossScaleManager,
    GraphCapture,
    LossScaleManager,
    StepOutput,
    TrainStep,
    build_train_step,
)
from passes.fx.checkpoints import CheckpointWarning
from passes.fx.fp8_recipe import FP8Recipe

__version__ = "0.1.0"

# The ONNX dialect imports onnx/onnxruntime: loaded on first use, so `import ampgraph` stays lean.
_LAZY = {name: "ampgraph.onnx" for name in (
    "OnnxModelError", "ValidationReport", "convert_onnx", "export_onnx", "onnx_session",
    "validate_onnx")}
_LAZY.update(dict.fromkeys(("shard", "save_checkpoint", "load_checkpoint",
                            "compress_ddp_gradients"), "ampgraph.parallel"))
_LAZY["NumericsMonitor"] = "ampgraph.monitor"
_LAZY["NumericsWarning"] = "ampgraph.monitor"


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ampgraph' has no attribute {name!r}")

__all__ = [
    "AdaptiveLossScaleManager",
    "AmpConfig",
    "AmpModule",
    "CheckpointWarning",
    "DynamicLossScaleManager",
    "FP8Recipe",
    "FixedLossScaleManager",
    "GraphCapture",
    "LossScaleManager",
    "NumericsMonitor",
    "NumericsWarning",
    "OnnxModelError",
    "PrecisionReport",
    "StepOutput",
    "TrainStep",
    "ValidationReport",
    "build_train_step",
    "compile",
    "compress_ddp_gradients",
    "convert_onnx",
    "explain",
    "export_onnx",
    "load_checkpoint",
    "onnx_session",
    "save_checkpoint",
    "shard",
    "validate_onnx",
]
