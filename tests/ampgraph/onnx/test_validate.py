"""ampgraph/onnx/validate.py: validate_onnx and its report."""

from __future__ import annotations

from ampgraph.onnx import convert_onnx, validate_onnx
from tests.ampgraph.onnx.helpers import SAFE, X, small_model


def test_validate_onnx_reports_per_output_errors():
    fp32 = small_model()
    report = validate_onnx(fp32, convert_onnx(fp32, "O2", node_block_list=SAFE), X)
    assert report.passed and report.outputs[0].name == "y" and report.max_rel < 1e-2
    assert report.outputs[0].cosine > 0.999 and "max_abs" in str(report)
    bad = validate_onnx(fp32, convert_onnx(fp32, "O2"), X)  # the rounded constants show
    assert not bad.passed and bad.outputs[0].max_abs > 1.0
