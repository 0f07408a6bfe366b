"""ampgraph/onnx/session.py: onnx_session on the best usable provider."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ampgraph.onnx import cuda_usable, onnx_session
from ampgraph.onnx.session import feeds_for, session_for
from tests.ampgraph.onnx.helpers import X, small_model


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


def test_feeds_take_a_dict_a_sequence_or_one_array_cast_to_the_declared_dtype():
    sess = onnx_session(small_model(), "cpu")
    x = np.arange(16, dtype=np.float64).reshape(2, 8)
    for inputs in ({"x": x, "unused": 1}, [x], (x,), x, torch.from_numpy(x)):
        feeds = feeds_for(sess, inputs)
        assert list(feeds) == ["x"] and feeds["x"].dtype == np.float32
        assert np.array_equal(feeds["x"], x.astype(np.float32))
    assert feeds_for(sess, {}) == {}
    grad = torch.ones(2, 8, requires_grad=True)
    assert feeds_for(sess, grad)["x"].dtype == np.float32  # detached for numpy


def test_session_for_passes_a_session_through():
    sess = onnx_session(small_model(), "cpu")
    assert session_for(sess, "cpu") is sess
    made = session_for(small_model(), "cpu")
    assert made is not sess and made.get_providers() == ["CPUExecutionProvider"]
    assert made.run(None, feeds_for(made, X))[0].shape == (2, 8)


def test_session_kwargs_reach_onnxruntime(tmp_path):
    import onnxruntime as ort

    path = tmp_path / "small.onnx"
    path.write_bytes(small_model().SerializeToString())
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    for source in (path, str(path), path.read_bytes()):
        sess = onnx_session(source, "cpu", sess_options=options)
        assert sess.get_session_options().graph_optimization_level == \
            ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        assert sess.get_session_options().log_severity_level == 3  # no provider noise
