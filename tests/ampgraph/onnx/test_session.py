"""ampgraph/onnx/session.py: onnx_session on the best usable provider."""

from __future__ import annotations

import pytest

from ampgraph.onnx import cuda_usable, onnx_session
from tests.ampgraph.onnx.helpers import small_model


def test_onnx_session_picks_a_usable_provider(capfd):
    model = small_model()
    sess = onnx_session(model)
    expected = "CUDAExecutionProvider" if cuda_usable() else "CPUExecutionProvider"
    assert sess.get_providers()[0] == expected
    assert capfd.readouterr().err == ""  # no provider-load noise
    assert onnx_session(model, "cpu").get_providers() == ["CPUExecutionProvider"]
    with pytest.raises(ValueError, match="device"):
        onnx_session(model, "tpu")
    if not cuda_usable():
        with pytest.raises(RuntimeError, match="CUDA"):
            onnx_session(model, "cuda")
