"""passes.onnx.graph: the model index (roles, names, scopes) and the dataflow DiGraph."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes.onnx.graph import (
    ModelIndex,
    build_dataflow,
    infer_types,
    module_key,
    rounds,
    subgraphs,
)
from tests.passes.onnx.util import F16, F32, init, make, rand, vi

BF16, F64, I64 = TensorProto.BFLOAT16, TensorProto.DOUBLE, TensorProto.INT64


def every_role():
    """One node of each role, and a returned integer value."""
    const = numpy_helper.from_array(np.ones(4, np.float32), "c")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        helper.make_node("Cast", ["h"], ["h32"], name="widen", to=F32),
        helper.make_node("Cast", ["m"], ["m16"], name="narrow", to=F16),
        helper.make_node("Cast", ["m16"], ["m32"], name="after_narrow", to=F32),
        helper.make_node("Cast", ["ids"], ["idf"], name="retarget", to=F32),
        helper.make_node("Constant", [], ["c"], name="const", value=const),
        helper.make_node("RandomNormal", [], ["noise"], name="noise", shape=[2, 4]),
        helper.make_node("Shape", ["m32"], ["shape"], name="shape"),
        helper.make_node("Add", ["m32", "c"], ["a"], name="add"),
        helper.make_node("Sum", ["a", "noise", "idf", "h32"], ["y"], name="sum"),
    ]
    return make(nodes, [vi("x", F32, [2, 4]), vi("h", F16, [2, 4]), vi("ids", I64, [4])],
                [vi("y", F32, [2, 4]), vi("shape", I64, [2])], [init("W", rand(4, 4))])


def test_every_node_gets_the_role_that_tells_the_rewriter_what_to_do():
    index = ModelIndex.build(every_role())
    assert {rec.name: rec.role for rec in index.nodes} == {
        "mm": "compute", "widen": "alias", "narrow": "control",
        "after_narrow": "control",  # a user's Cast chain after a rounding one: as written
        "retarget": "retarget", "const": "const", "noise": "fixed", "shape": "nonfloat",
        "add": "compute", "sum": "compute"}
    values = index.values
    assert (values["x"].origin, values["W"].origin, values["m"].origin) == \
        ("input", "init", "node")
    assert values["m"].producer.name == "mm" and values["W"].tensor.name == "W"
    assert values["ids"].dtype == I64 and values["h"].dtype == F16
    assert index.consumers["m32"] == [(index.nodes[7], 0), (index.nodes[8], 0)]


def test_the_dataflow_has_float_edges_sources_and_returned_producers():
    g = build_dataflow(ModelIndex.build(every_role()))
    assert g.nodes[("value", "x")]["kind"] == "source" and ("value", "W") in g
    assert ("value", "ids") not in g  # an integer input is no vertex
    kinds = {v: d["kind"] for v, d in g.nodes(data=True) if isinstance(v, str)}
    assert kinds["widen"] == "compute" and kinds["narrow"] == "source"
    assert kinds["shape"] == "nonfloat" and kinds["const"] == "source"
    assert g.has_edge(("value", "x"), "mm") and g.has_edge("mm", "narrow")
    assert not g.has_edge(("value", "ids"), "retarget")  # integer edges are left out
    assert g.nodes["sum"].get("returned") and not g.nodes["add"].get("returned")
    assert g.nodes["mm"]["op"] == "MatMul" and g.nodes["mm"]["module"] == module_key("mm")


def test_unnamed_and_duplicate_nodes_get_unique_names_in_place():
    nodes = [helper.make_node("Relu", ["x"], ["a"]),
             helper.make_node("Neg", ["a"], ["b"], name="n"),
             helper.make_node("Abs", ["b"], ["y"], name="n")]
    model = make(nodes, [vi("x", F32, [2])], [vi("y", F32, [2])])
    index = ModelIndex.build(model)
    names = [n.name for n in model.graph.node]
    assert names[0] and names[1] == "n" and names[2] not in ("", "n")
    assert len(set(names)) == 3 and [rec.name for rec in index.nodes] == names
    assert index.fresh("n") not in names  # fresh names avoid every node and value name


def test_a_value_defined_twice_is_refused():
    nodes = [helper.make_node("Relu", ["x"], ["h"], name="a"),
             helper.make_node("Neg", ["x"], ["h"], name="b")]
    graph = helper.make_graph(nodes, "g", [vi("x", F32, [2])], [vi("h", F32, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ValueError, match="'h' is defined twice; ONNX models must be in SSA"):
        ModelIndex.build(model)


def test_subgraphs_are_scopes_whose_nodes_read_outer_values_by_edges():
    then = helper.make_graph([helper.make_node("Relu", ["m"], ["t"], name="then_relu")], "then",
                             [], [vi("t", F32, [2, 4])])
    other = helper.make_graph([helper.make_node("Neg", ["m"], ["e"], name="else_neg")], "else",
                              [], [vi("e", F32, [2, 4])])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
             helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then,
                              else_branch=other)]
    model = make(nodes, [vi("x", F32, [2, 4]), vi("cond", TensorProto.BOOL, [])],
                 [vi("y", F32, [2, 4])], [init("W", rand(4, 4))])
    if_node = model.graph.node[1]
    assert [g.name for g in subgraphs(if_node)] == ["else", "then"]
    assert list(subgraphs(model.graph.node[0])) == []
    index = ModelIndex.build(model)
    assert [s.owner for s in index.scopes] == [None, "if", "if"]
    assert [rec.name for rec in index.nodes] == ["mm", "else_neg", "then_relu", "if"]
    assert {rec.name: rec.role for rec in index.nodes}["if"] == "control"
    g = build_dataflow(index)
    assert g.has_edge("mm", "then_relu") and g.has_edge("mm", "else_neg")
    assert g.nodes["then_relu"].get("returned")  # a branch output: part of the interface


def test_infer_types_types_constants_and_is_strict_when_asked():
    types = infer_types(every_role())
    assert (types["c"], types["m16"], types["shape"], types["W"]) == (F32, F16, I64, F32)
    clash = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"], name="add")], "g",
                              [vi("a", F32, [2]), vi("b", F16, [2])], [vi("y", F32, [2])])
    model = helper.make_model(clash, opset_imports=[helper.make_opsetid("", 17)])
    assert infer_types(model)["b"] == F16  # best effort: the declared types
    with pytest.raises(Exception, match="type"):
        infer_types(model, strict=True)


def test_rounds_and_module_keys():
    assert rounds(F32, F16) and rounds(F16, BF16) and rounds(F64, F32)
    assert not rounds(F16, F32) and not rounds(F32, F64) and not rounds(F16, F16)
    assert not rounds(I64, F16)  # not a float -> float cast
    assert module_key("/layer.0/MatMul") == "/layer\x1f0/MatMul"
