"""passes.onnx.subgraphs: If/Loop/Scan bodies are painted with the outer graph and read outer
values consistently; walking and renaming across graphs."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from passes.onnx.subgraphs import all_graphs, rename_values
from tests.passes.onnx.util import F16, F32, casts, check, init, make, rand, reads, run, vi

INT64, BOOL = TensorProto.INT64, TensorProto.BOOL


def if_model():
    then = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W1"], ["t"], name="mm_then")],
        "then", [], [vi("t", F32, [2, 8])])
    other = helper.make_graph(
        [helper.make_node("Softmax", ["m0"], ["e"], name="softmax_else", axis=-1)],
        "else", [], [vi("e", F32, [2, 8])])
    nodes = [
        helper.make_node("MatMul", ["x", "W0"], ["m0"], name="mm_main"),
        helper.make_node("If", ["cond"], ["branch"], name="if", then_branch=then,
                         else_branch=other),
        helper.make_node("Add", ["branch", "m0"], ["y"], name="add"),
    ]
    inputs = [vi("x", F32, [2, 8]), vi("cond", BOOL, [])]
    return make(nodes, inputs, [vi("y", F32, [2, 8])], [init("W0", rand(8, 8)),
                                                        init("W1", rand(8, 8))])


@pytest.mark.parametrize("cond", [True, False])
def test_if_branches_share_outer_casts(cond):
    feeds = {"x": rand(2, 8, scale=1.0), "cond": np.array(cond)}
    result = check(if_model(), "O2", feeds=feeds)
    model = result.model
    graphs = {g.name: g for g in all_graphs(model.graph)}
    main, then, other = graphs["g"], graphs["then"], graphs["else"]
    x_casts = [c for c in casts(model) if c.input[0] == "x"]
    assert len(x_casts) == 1 and x_casts[0] in main.node  # placed where x lives, shared
    assert then.node[0].input[0] == x_casts[0].output[0]
    assert reads(model, "mm_then") == [F16, F16]
    assert reads(model, "softmax_else") == [F32]  # reads an fp32 Cast of the outer m0 ...
    m0_cast = next(c for c in casts(model) if c.input[0] == "m0")
    assert m0_cast in main.node  # ... placed in the outer graph after m0's producer
    assert [o.type.tensor_type.elem_type for o in (*then.output, *other.output)] == [F32, F32]


def loop_model():
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["c_in"], ["c_out"], name="cond_body"),
            helper.make_node("MatMul", ["v_in", "W"], ["mm"], name="mm_body"),
            helper.make_node("Tanh", ["mm"], ["v_out"], name="tanh_body"),
        ],
        "body",
        [vi("i", INT64, []), vi("c_in", BOOL, []), vi("v_in", F32, [2, 8])],
        [vi("c_out", BOOL, []), vi("v_out", F32, [2, 8])],
    )
    nodes = [
        helper.make_node("Loop", ["trip", "go", "x"], ["v_final"], name="loop", body=body),
        helper.make_node("MatMul", ["v_final", "W2"], ["y"], name="mm_out"),
    ]
    inits = [init("W", rand(8, 8)), init("W2", rand(8, 8)),
             helper.make_tensor("trip", INT64, [], [3]), helper.make_tensor("go", BOOL, [], [1])]
    return make(nodes, [vi("x", F32, [2, 8])], [vi("y", F32, [2, 8])], inits)


def test_loop_body_is_converted_and_carried_values_keep_their_type():
    result = check(loop_model(), "O2", feeds={"x": rand(2, 8, scale=1.0)})
    model = result.model
    body = {g.name: g for g in all_graphs(model.graph)}["body"]
    assert reads(model, "mm_body") == [F16, F16]
    assert body.input[2].type.tensor_type.elem_type == F32
    assert body.output[1].type.tensor_type.elem_type == F32
    assert next(t for t in model.graph.initializer if t.name == "W").data_type == F16


def test_scan_body_is_converted():
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["x_t", "W"], ["mm"], name="mm_scan"),
            helper.make_node("Add", ["s_in", "mm"], ["s_out"], name="add_scan"),
            helper.make_node("Identity", ["s_out"], ["y_t"], name="id_scan"),
        ],
        "scan_body",
        [vi("s_in", F32, [2, 8]), vi("x_t", F32, [2, 8])],
        [vi("s_out", F32, [2, 8]), vi("y_t", F32, [2, 8])],
    )
    nodes = [helper.make_node("Scan", ["s0", "xs"], ["s_final", "ys"], name="scan", body=body,
                              num_scan_inputs=1)]
    model = make(nodes, [vi("s0", F32, [2, 8]), vi("xs", F32, [3, 2, 8])],
                 [vi("s_final", F32, [2, 8]), vi("ys", F32, [3, 2, 8])], [init("W", rand(8, 8))])
    feeds = {"s0": rand(2, 8), "xs": rand(3, 2, 8)}
    result = check(model, "O2", feeds=feeds)
    assert reads(result.model, "mm_scan") == [F16, F16]
    got, want = run(result.model, feeds), run(model, feeds)
    assert all(g.dtype == np.float32 for g in got) and np.allclose(got[1], want[1], atol=2e-2)



def test_all_graphs_walks_outer_graphs_first():
    assert [g.name for g in all_graphs(if_model().graph)] == ["g", "else", "then"]


def test_rename_values_renames_everywhere_but_the_graph_outputs():
    model = if_model()
    model.graph.value_info.append(vi("m0", F32, [2, 8]))
    rename_values(model, {"m0": "m0_new", "W1": "W1_new"})
    main, other, then = all_graphs(model.graph)
    assert main.node[0].output[0] == "m0_new" and main.node[2].input[1] == "m0_new"
    assert other.node[0].input[0] == "m0_new"  # a subgraph reading the outer value
    assert then.node[0].input[1] == "W1_new" and main.initializer[1].name == "W1_new"
    assert main.value_info[0].name == "m0_new"
    assert [o.name for o in main.output] == ["y"]
    before = model.SerializeToString()
    rename_values(model, {})
    assert model.SerializeToString() == before
