"""Levels, overrides and node naming of the ONNX pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

from passes.onnx import convert_model
from tests.passes.onnx.util import F16, F32, casts, check, init, make, mlp, rand, reads, vi

FEEDS = {"x": rand(2, 8, scale=1.0)}
ROOT = Path(__file__).resolve().parents[3]


def test_o0_changes_nothing():
    model = mlp(("",) * 6)  # unnamed nodes stay unnamed too
    result = convert_model(model, "O0")
    assert result.model == model and not casts(result.model)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("level, low, fp32", [
    ("O1", ["mm1", "add1", "relu", "mm2"], ["ln", "softmax"]),
    ("O2", ["mm1", "add1", "relu", "mm2"], ["ln", "softmax"]),
    ("O3", ["mm1", "add1", "relu", "mm2", "ln", "softmax"], []),
])
def test_levels(level, low, fp32, dtype):
    result = check(mlp(), level, dtype, feeds=FEEDS)
    assert [n for n in low if result.precision(n) != "low"] == []
    assert [n for n in fp32 if result.precision(n) != "fp32"] == []
    for name in low:
        assert F32 not in reads(result.model, name)[:1]
    for name in fp32:
        assert reads(result.model, name)[0] == F32


def test_keep_norm_fp32_false_at_o2():
    result = check(mlp(), "O2", feeds=FEEDS, keep_norm_fp32=False)
    assert result.precision("ln") == "low" and reads(result.model, "ln") == [F16] * 3


def test_op_block_list():
    result = check(mlp(), "O2", feeds=FEEDS, op_block_list=["MatMul"])
    assert result.precision("mm1") == "fp32" and result.precision("mm2") == "fp32"
    assert "custom_deny" in result.assignment["mm1"].reason


def test_node_block_list_matches_names_with_dots_and_globs():
    names = ("/layer.0/MatMul", "/layer.0/Add", "/layer.0/Relu", "/layer.1/MatMul", "ln", "sm")
    result = check(mlp(names), "O2", feeds=FEEDS, node_block_list=["/layer.1/*"])
    assert result.precision("/layer.1/MatMul") == "fp32"
    assert result.precision("/layer.0/MatMul") == "low"
    assert "node_block_list '/layer.1/*'" in result.assignment["/layer.1/MatMul"].reason
    exact = convert_model(mlp(names), "O2", node_block_list=["/layer.0/MatMul"])
    assert exact.precision("/layer.0/MatMul") == "fp32"
    assert exact.precision("/layer.1/MatMul") == "low"


def test_unnamed_nodes_get_names_and_input_is_not_modified():
    model = mlp(("",) * 6)
    before = model.SerializeToString()
    result = convert_model(model, "O2")
    assert model.SerializeToString() == before
    names = [n.name for n in result.model.graph.node]
    assert all(names) and len(set(names)) == len(names)


def test_unknown_dtype_and_level_raise():
    with pytest.raises(ValueError, match="fp16"):
        convert_model(mlp(), "O2", "int8")
    with pytest.raises(ValueError, match="amp_level"):
        convert_model(mlp(), "O4")


def test_passes_onnx_never_imports_ampgraph():
    code = ("import sys, passes.onnx; "
            "assert not [m for m in sys.modules if m.startswith('ampgraph')]")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.mark.parametrize("level, bn", [("O2", F32), ("O3", F16)])
def test_batch_normalization_follows_keep_norm_fp32(level, bn):
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "s", "b", "mu", "var"], ["n"], name="bn"),
        helper.make_node("Relu", ["n"], ["y"], name="relu"),
    ]
    inits = [init("W", rand(2, 2, 3, 3)), init("s", np.ones(2)), init("b", np.zeros(2)),
             init("mu", rand(2)), init("var", np.ones(2))]
    model = make(nodes, [vi("x", F32, [1, 2, 4, 4])], [vi("y", F32, [1, 2, 4, 4])], inits)
    result = check(model, level, feeds={"x": rand(1, 2, 4, 4, scale=1.0)})
    assert reads(result.model, "bn") == [bn] * 5 and reads(result.model, "conv")[0] == F16


def test_o2_keeps_an_infer_op_between_fp32_ops_fp32_unless_returned():
    def model(returned: bool):
        nodes = [helper.make_node("MatMul", ["x", "W1"], ["a"], name="mm"),
                 helper.make_node("Softmax", ["a"], ["s"], name="sm1", axis=-1),
                 helper.make_node("Add", ["s", "c"], ["t"], name="add"),
                 helper.make_node("Softmax", ["t"], ["y"], name="sm2", axis=-1)]
        outputs = [vi("y", F32, [2, 8])] + ([vi("t", F32, [2, 8])] if returned else [])
        return make(nodes, [vi("x", F32, [2, 8])], outputs,
                    [init("W1", rand(8, 8)), init("c", rand(8))])

    result = check(model(False), "O2", feeds=FEEDS)
    assert [result.precision(n) for n in ("mm", "sm1", "add", "sm2")] == \
        ["low", "fp32", "fp32", "fp32"]
    assert "between fp32 ops" in result.assignment["add"].reason
    assert len(casts(result.model)) == 2  # x and mm's output; none around add
    assert check(model(True), "O2", feeds=FEEDS).precision("add") == "low"
