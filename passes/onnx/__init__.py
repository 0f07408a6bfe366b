"""The ONNX dialect of the mixed-precision pass.

``convert_model`` runs the pipeline on an in-memory ModelProto, as named passes
(``convert``): index the model and its subgraphs (``graph``), paint with the shared painter
and the ONNX op table (``policy``), keep consumers of out-of-range constants in FP32
(``initializers``), insert shared Casts, convert initializers and retarget Casts
(``casts``), and verify (``verify``). ``costs`` measures a converted model.
"""

from __future__ import annotations

from passes.onnx.convert import ConversionResult, convert_model
from passes.onnx.graph import ModelIndex, build_dataflow
from passes.onnx.initializers import ConstantRangeWarning
from passes.onnx.policy import FP32_INPUTS, LOW_DTYPES, ONNX_GROUPS, ONNX_TABLE
from passes.onnx.regions import low_regions
from passes.onnx.verify import verify_model

__all__ = [
    "FP32_INPUTS",
    "LOW_DTYPES",
    "ONNX_GROUPS",
    "ONNX_TABLE",
    "ConstantRangeWarning",
    "ConversionResult",
    "ModelIndex",
    "build_dataflow",
    "convert_model",
    "low_regions",
    "verify_model",
]
