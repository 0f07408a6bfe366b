"""Levels, overrides and node naming of the ONNX pass; its passes, named in failures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import helper

import passes.onnx.casts as pcasts
import passes.onnx.convert as pconvert
import passes.onnx.graph as pgraph
from passes._infra import PassError, PassInputError
from passes.onnx import convert_model
from passes.onnx.convert import ConvertState, onnx_passes
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


def test_the_passes_in_order():
    def names(level):
        return [p.__name__ for p in onnx_passes(level, F16, ConvertState())]

    assert names("O2") == ["index_model", "build_dataflow", "mark_low_blockers", "fit_ranges",
                           "insert_casts", "attach_data", "verify"]
    assert names("O0") == ["index_model", "build_dataflow", "mark_low_blockers", "paint",
                           "attach_data"]
    unchecked = onnx_passes("O3", F16, ConvertState(), check=False)
    assert [p.__name__ for p in unchecked][-1] == "attach_data"


def test_a_failing_pass_is_named_with_the_node_it_was_working_on(monkeypatch):
    def broken(node, opset, types, low):
        if node.name == "mm2":
            raise KeyError("no schema")
        return None

    monkeypatch.setattr(pconvert, "low_blocker", broken)
    with pytest.raises(PassError) as info:
        convert_model(mlp(), "O2")
    err = info.value
    assert (err.pass_name, err.node) == ("mark_low_blockers", "mm2")
    assert str(err) == "[mark_low_blockers] at node 'mm2': KeyError: 'no schema'"
    assert isinstance(err.__cause__, KeyError) and not isinstance(err, ValueError)


def test_a_pass_failing_inside_the_range_rounds_is_named_not_its_round(monkeypatch):
    def broken(*args):
        raise RuntimeError("bounds unreadable")

    monkeypatch.setattr(pconvert, "unsafe_range_consumers", broken)
    with pytest.raises(PassError) as info:
        convert_model(mlp(), "O1")
    assert (info.value.pass_name, info.value.node) == ("keep_ranges_fp32", None)
    assert str(info.value) == "[keep_ranges_fp32]: RuntimeError: bounds unreadable"


def test_a_verify_failure_keeps_the_node_verify_names(monkeypatch):
    monkeypatch.setattr(pconvert, "_expected", lambda requests: {"relu": {0: F32}})
    with pytest.raises(PassError) as info:
        convert_model(mlp(), "O2")
    assert (info.value.pass_name, info.value.node) == ("verify", "relu")
    assert "the precision plan asked for FLOAT" in str(info.value)
    assert convert_model(mlp(), "O2", check=False).precision("relu") == "low"


def test_a_model_a_pass_cannot_take_is_a_value_error_naming_the_pass_and_node():
    nodes = [helper.make_node("Relu", ["x"], ["h"], name="first"),
             helper.make_node("Neg", ["x"], ["h"], name="second")]  # "h" defined twice
    graph = helper.make_graph(nodes, "g", [vi("x", F32, [2])], [vi("h", F32, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ValueError) as info:
        convert_model(model, "O2")
    err = info.value
    assert isinstance(err, PassInputError)
    assert (err.pass_name, err.node) == ("index_model", "second")
    assert str(err).startswith("[index_model] at node 'second': value 'h' is defined twice")


@pytest.mark.parametrize("module, attr, pass_name", [
    (pgraph, "module_key", "build_dataflow"),  # called per node by build_dataflow
    (pcasts, "plan_node", "collect_requests"),  # per compute node, inside the range rounds
])
def test_each_pass_names_the_node_its_loop_is_at(monkeypatch, module, attr, pass_name):
    real = getattr(module, attr)

    def broken(first, *args):
        if getattr(first, "name", first) == "mm2":
            raise KeyError("broken")
        return real(first, *args)

    monkeypatch.setattr(module, attr, broken)
    with pytest.raises(PassError) as info:
        convert_model(mlp(), "O2")
    assert (info.value.pass_name, info.value.node) == (pass_name, "mm2")
    assert str(info.value) == f"[{pass_name}] at node 'mm2': KeyError: 'broken'"


def test_a_failure_inside_a_subgraph_names_the_subgraph_s_node():
    body = helper.make_graph([helper.make_node("Neg", ["x"], ["h"], name="in_branch")],
                             "then", [], [vi("h", F32, [2])])  # "h" is defined outside too
    other = helper.make_graph([helper.make_node("Relu", ["x"], ["e"], name="other")],
                              "else", [], [vi("e", F32, [2])])
    nodes = [helper.make_node("Relu", ["x"], ["h"], name="outer"),
             helper.make_node("If", ["c"], ["y"], name="if", then_branch=body,
                              else_branch=other)]
    graph = helper.make_graph(nodes, "g", [vi("x", F32, [2]), vi("c", 9, [])],
                              [vi("y", F32, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(PassInputError) as info:
        convert_model(model, "O2")
    assert (info.value.pass_name, info.value.node) == ("index_model", "in_branch")
