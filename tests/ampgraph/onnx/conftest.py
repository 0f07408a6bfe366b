"""The FP32 exports of the reference models, shared by the ONNX API's tests."""

from __future__ import annotations

import pytest
import torch

from ampgraph.onnx import export_onnx
from tests.ampgraph.onnx.helpers import load_model


@pytest.fixture(scope="module")
def fp32_export(tmp_path_factory):
    """name -> (fp32 ModelProto, example inputs, torch fp32 output); exported once each."""
    cache: dict = {}
    folder = tmp_path_factory.mktemp("onnx_fp32")

    def get(name: str):
        if name not in cache:
            model, args = load_model(name)
            proto = export_onnx(model, args, folder / f"{name}.onnx", amp_level="O0")
            with torch.no_grad():
                ref = model(*args)
            cache[name] = (proto, args, (ref if isinstance(ref, torch.Tensor) else ref[0]).numpy())
        return cache[name]

    return get
