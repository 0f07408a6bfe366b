"""Comparing two ONNX models' outputs on the same inputs: ``validate_onnx``.

Example:
    >>> print(validate_onnx("fp32.onnx", "fp16.onnx", {"x": x}))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ampgraph.onnx.session import feeds_for, session_for


@dataclass(frozen=True)
class OutputError:
    """Errors of one output: max abs, max abs / max |reference|, cosine (``report.outputs``)."""

    name: str
    max_abs: float
    max_rel: float
    cosine: float
    passed: bool


@dataclass(frozen=True)
class ValidationReport:
    """Per-output comparison of a candidate model against a reference.

    An output passes when ``max_abs <= atol + rtol * max|reference|`` and is finite.

    Example:
        >>> print(validate_onnx("fp32.onnx", "fp16.onnx", {"x": x}))
        output                       max_abs     max_rel    cosine  ok
        logits                        0.0021     0.00043  0.999999  yes
    """

    outputs: tuple[OutputError, ...]
    rtol: float
    atol: float

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    @property
    def max_rel(self) -> float:
        return max((o.max_rel for o in self.outputs), default=0.0)

    def __str__(self) -> str:
        rows = [f"{'output':<24}{'max_abs':>12}{'max_rel':>12}{'cosine':>10}  ok"]
        rows += [f"{o.name:<24}{o.max_abs:>12.3g}{o.max_rel:>12.3g}{o.cosine:>10.6f}  "
                 f"{'yes' if o.passed else 'NO'}" for o in self.outputs]
        return "\n".join(rows)


def validate_onnx(
    reference: Any, candidate: Any, inputs: Any, *, rtol: float = 1e-2, atol: float = 1e-3,
    device: str = "auto",
) -> ValidationReport:
    """Run two models on the same inputs and compare every output.

    Args:
        reference, candidate: ModelProto, path or InferenceSession.
        inputs: dict name->array, a sequence in input order, or one array (numpy or torch);
            each is cast to the dtype the session declares (fp16 inputs included).
        rtol, atol: tolerance of the pass/fail verdict (fp16-sized defaults).
        device: provider for models not given as sessions.

    Example:
        >>> report = validate_onnx("fp32.onnx", "fp16.onnx", {"x": x})
        >>> report.passed, report.max_rel
        (True, 0.0012)
    """
    ref, cand = (session_for(m, device) for m in (reference, candidate))
    expected = ref.run(None, feeds_for(ref, inputs))
    got = cand.run(None, feeds_for(cand, inputs))
    names = [o.name for o in ref.get_outputs()]
    return ValidationReport(tuple(compare_output(n, r, c, rtol, atol)
                                  for n, r, c in zip(names, expected, got)), rtol, atol)


def compare_output(name: str, ref: np.ndarray, got: np.ndarray, rtol: float,
                   atol: float) -> OutputError:
    """One output's errors against its reference (inf/NaN must sit where the reference has
    them)."""
    r, c = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    if r.shape != c.shape:
        return OutputError(name, float("inf"), float("inf"), 0.0, False)
    both = np.isfinite(r) & np.isfinite(c)
    same = ~np.isfinite(r) & ((c == r) | (np.isnan(c) & np.isnan(r)))  # inf/nan where ref has
    diff = np.abs(c - r)[both]
    max_abs = float("inf") if not (both | same).all() else float(diff.max(initial=0.0))
    scale = float(np.abs(r[np.isfinite(r)]).max(initial=0.0))
    denom = float(np.linalg.norm(r[both]) * np.linalg.norm(c[both]))
    cosine = float(r[both] @ c[both] / denom) if denom > 0 else float(max_abs == 0)
    max_rel = max_abs / scale if scale > 0 else max_abs
    return OutputError(name, max_abs, max_rel, cosine, bool(max_abs <= atol + rtol * scale))


__all__ = ["OutputError", "ValidationReport", "compare_output", "validate_onnx"]
