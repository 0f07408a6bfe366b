"""The ONNX dialect for users: export, convert to mixed precision, run, validate (docs/onnx.md).

- ``convert``: ``convert_onnx`` (the ONNX pass by level; the automatic mode);
- ``export``: ``export_onnx`` (torch.onnx export of the FP32 model, then ``convert_onnx``);
- ``session``: ``onnx_session`` on the best usable provider, input feeds;
- ``validate``: ``validate_onnx`` and its report.

Example:
    >>> import ampgraph
    >>> ampgraph.export_onnx(model, (x,), "model_fp16.onnx", amp_level="O2")
    >>> sess = ampgraph.onnx_session("model_fp16.onnx")      # CUDA EP when usable
"""

from __future__ import annotations

from ampgraph.onnx.convert import OnnxModelError, convert_onnx, max_ir_version
from ampgraph.onnx.export import export_onnx
from ampgraph.onnx.session import cuda_usable, onnx_session
from ampgraph.onnx.validate import OutputError, ValidationReport, validate_onnx

__all__ = [
    "OnnxModelError",
    "OutputError",
    "ValidationReport",
    "convert_onnx",
    "cuda_usable",
    "export_onnx",
    "max_ir_version",
    "onnx_session",
    "validate_onnx",
]
