"""ampgraph/cli/inspect.py: the Inspection of a PyTorch model or an ONNX file, at one level
and with --diff at another."""

from __future__ import annotations

import argparse

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from ampgraph.cli.inspect import inspect_module, inspect_target
from ampgraph.cli.target import CliError, Target


def args(**kw) -> argparse.Namespace:
    base = dict(level="O2", diff=None, dtype=None, train=False, debug=False, input_shape=[])
    return argparse.Namespace(**{**base, **kw})


def mlp() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Softmax(-1))
    return model, (torch.randn(2, 8),)


def test_inspect_module_reports_precisions_casts_and_shapes():
    model, inputs = mlp()
    insp = inspect_module("t.py:mlp", model, inputs, "O2", "bf16", train=False)
    assert (insp.target, insp.kind, insp.level, insp.dtype) == ("t.py:mlp", "torch", "O2",
                                                                  "bf16")
    ops = {r["op"]: r["precision"] for r in insp.nodes}
    assert ops["aten.linear"] == "bf16" and ops["aten.softmax.int"] == "fp32"
    summary = insp.summary
    assert summary["mode"] == "eval" and summary["input_shapes"] == [[2, 8]]
    assert summary["nodes"] == len(insp.nodes) and summary["casts"] == insp.casts > 0
    assert summary["eager_modules"] == [] and insp.view.nodes


def test_inspect_module_in_train_mode_and_a_bad_level():
    model, inputs = mlp()
    insp = inspect_module("t", model, inputs, "O1", "bf16", train=True)
    assert insp.summary["mode"] == "train" and model.training
    with pytest.raises(CliError, match="O7"):
        inspect_module("t", model, inputs, "O7", "bf16", train=False)


def test_inspect_target_compares_two_levels_of_a_model():
    model, inputs = mlp()
    base, other = inspect_target(Target("t.py:mlp", "factory", "t.py", "mlp"),
                                 args(level="O2", diff="O0", dtype="bf16"), (model, inputs))
    assert base.level == "O2" and other.level == "O0" and other.dtype == "fp32"
    assert {r["precision"] for r in other.nodes} == {"fp32"}
    single, none = inspect_target(Target("t", "factory", "t.py", "mlp"), args(dtype="bf16"),
                                  (model, inputs))
    assert none is None and single.level == "O2"


def test_inspect_target_converts_an_onnx_file_per_level(tmp_path):
    w = numpy_helper.from_array(np.ones((8, 4), np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
         helper.make_node("Softmax", ["h"], ["y"], name="softmax", axis=-1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [w])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                ir_version=8), str(path))
    base, other = inspect_target(Target(str(path), "onnx", str(path)),
                                 args(level="O2", diff="O0", input_shape=[(3, 8)]), None)
    assert (base.kind, base.dtype, other.dtype) == ("onnx", "fp16", "fp32")
    precision = {r["name"]: r["precision"] for r in base.nodes}
    assert precision["mm"] == "fp16" and precision["softmax"] == "fp32"
    assert base.summary["input_shapes"] == [[3, 8]]
    assert base.casts > 0 and other.casts == 0
