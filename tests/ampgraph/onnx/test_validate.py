"""ampgraph/onnx/validate.py: validate_onnx and its report."""

from __future__ import annotations

import numpy as np
import pytest

from ampgraph.onnx import convert_onnx, onnx_session, validate_onnx
from ampgraph.onnx.validate import OutputError, ValidationReport, compare_output
from tests.ampgraph.onnx.helpers import SAFE, X, small_model


def test_validate_onnx_reports_per_output_errors():
    fp32 = small_model()
    report = validate_onnx(fp32, convert_onnx(fp32, "O2", node_block_list=SAFE), X)
    assert report.passed and report.outputs[0].name == "y" and report.max_rel < 1e-2
    assert report.outputs[0].cosine > 0.999 and "max_abs" in str(report)
    bad = validate_onnx(fp32, convert_onnx(fp32, "O2"), X)  # the rounded constants show
    assert not bad.passed and bad.outputs[0].max_abs > 1.0


def test_compare_output_measures_errors_against_the_reference():
    ref = np.array([1.0, -2.0, 4.0])
    got = compare_output("y", ref, ref + [0.0, 0.01, -0.02], rtol=1e-2, atol=0.0)
    assert got.name == "y" and got.max_abs == pytest.approx(0.02)
    assert got.max_rel == pytest.approx(0.005) and got.passed  # 0.02 <= 1e-2 * 4
    assert got.cosine == pytest.approx(1.0, abs=1e-4)
    assert not compare_output("y", ref, ref + 0.05, rtol=1e-2, atol=0.0).passed
    assert compare_output("y", ref, ref + 0.05, rtol=1e-2, atol=0.02).passed


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf
def test_non_finite_values_pass_only_where_the_reference_has_them():
    ref = np.array([np.inf, np.nan, 1.0])
    same = compare_output("y", ref, ref.copy(), rtol=0.0, atol=0.0)
    assert same.passed and same.max_abs == 0.0
    moved = compare_output("y", ref, np.array([np.inf, np.nan, np.nan]), rtol=1, atol=1)
    assert not moved.passed and moved.max_abs == np.inf
    sign = compare_output("y", ref, np.array([-np.inf, np.nan, 1.0]), rtol=1, atol=1)
    assert not sign.passed


def test_shape_mismatch_and_zero_outputs():
    bad = compare_output("y", np.zeros((2, 3)), np.zeros((3, 2)), rtol=1, atol=1)
    assert not bad.passed and bad.max_abs == np.inf and bad.cosine == 0.0
    zeros = compare_output("y", np.zeros(3), np.zeros(3), rtol=0.0, atol=0.0)
    assert zeros.passed and zeros.cosine == 1.0 and zeros.max_rel == 0.0


def test_the_report_passes_when_every_output_does():
    ok = OutputError("a", 0.001, 0.0005, 0.9999, True)
    bad = OutputError("b", 2.0, 0.5, 0.9, False)
    assert ValidationReport((ok,), 1e-2, 1e-3).passed
    report = ValidationReport((ok, bad), 1e-2, 1e-3)
    assert not report.passed and report.max_rel == 0.5
    lines = str(report).splitlines()
    assert lines[0].split() == ["output", "max_abs", "max_rel", "cosine", "ok"]
    assert lines[1].split()[-1] == "yes" and lines[2].split()[-1] == "NO"
    assert ValidationReport((), 1e-2, 1e-3).max_rel == 0.0


def test_validate_onnx_takes_sessions_and_positional_inputs():
    fp32 = small_model()
    sess = onnx_session(fp32, "cpu")
    report = validate_onnx(sess, fp32, [X["x"]], rtol=0.0, atol=0.0)
    assert report.passed and report.max_rel == 0.0 and (report.rtol, report.atol) == (0.0, 0.0)
