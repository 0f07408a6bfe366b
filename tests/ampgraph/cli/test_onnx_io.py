"""ampgraph/cli/onnx_io.py: ONNX files for inspect/convert: shapes, feeds, rows, view."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ampgraph.cli.analysis import summary_numbers
from ampgraph.cli.onnx_io import (
    convert,
    graph_inputs,
    input_shapes,
    load,
    onnx_rows,
    onnx_stats,
    onnx_view,
    random_feeds,
)
from ampgraph.cli.target import CliError
from passes.onnx.costs import model_costs


def small_model() -> onnx.ModelProto:
    """x (batch, 4), ids (3,) int64 -> MatMul -> Softmax; W an initializer."""
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
             helper.make_node("Softmax", ["h"], ["y"], name="sm", axis=-1)]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [3]),
         helper.make_tensor_value_info("W", TensorProto.FLOAT, [4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    return model


def test_graph_inputs_and_their_shapes():
    model = small_model()
    assert [vi.name for vi in graph_inputs(model)] == ["x", "ids"]  # W is an initializer
    assert input_shapes(model, []) == {"x": (1, 4), "ids": (3,)}  # symbolic dims: 1
    assert input_shapes(model, [(8, 4), (3,)]) == {"x": (8, 4), "ids": (3,)}
    with pytest.raises(CliError, match=r"1 --input-shape for a model with 2 inputs \(x, ids\)"):
        input_shapes(model, [(8, 4)])


def test_random_feeds_follow_the_input_types_and_the_seed():
    model = small_model()
    feeds = random_feeds(model, [(5, 4), (3,)], int_high=3)
    assert feeds["x"].dtype == np.float32 and feeds["x"].shape == (5, 4)
    assert feeds["ids"].dtype == np.int64 and set(feeds["ids"].tolist()) <= {0, 1, 2}
    again = random_feeds(model, [(5, 4), (3,)], int_high=3)
    assert np.array_equal(feeds["x"], again["x"])  # seeded


def test_load_and_convert_errors_are_cli_errors(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(CliError, match="not a readable ONNX model"):
        load(str(bad))
    with pytest.raises(CliError, match="amp_level"):
        convert(small_model(), "O7", "fp16")
    good = tmp_path / "good.onnx"
    onnx.save(small_model(), str(good))
    assert [n.name for n in load(str(good)).graph.node] == ["mm", "sm"]


def test_stats_rows_and_view_of_a_conversion():
    model = small_model()
    result = convert(model, "O2", "fp16")
    fixed = input_shapes(model, [(2, 4), (3,)])
    stats = onnx_stats(model, result, fixed)
    assert stats == summary_numbers(model_costs(model, result, fixed))
    assert stats["matmul_conv_flops"] == 2 * 2 * 4 * 4 and stats["low_flops_share"] == 1.0
    rows = {r["name"]: r for r in onnx_rows(model, result, "fp16")}
    assert rows["mm"]["precision"] == "fp16" and rows["sm"]["precision"] == "fp32"
    assert rows["W"]["op"] == "initializer" and rows["W"]["precision"] == "fp16"
    assert "stored in fp16" in rows["W"]["reason"]
    assert rows["x"] == {"name": "x", "op": "input", "module": "", "precision": "fp32",
                         "reason": rows["x"]["reason"], "flops": 0}
    assert rows["mm"]["flops"] == 0  # no shapes given
    sized = {r["name"]: r["flops"] for r in onnx_rows(model, result, "fp16", fixed)}
    assert sized["mm"] == stats["matmul_conv_flops"] and sized["sm"] == 0
    view = onnx_view(result, "fp16")
    casts = [n for n in view.nodes if n.kind == "cast"]
    assert len(casts) == result.casts == 2  # x to fp16, h back to fp32
    assert {n.id for n in view.nodes if n.kind == "input"} == {"input:x", "input:ids"}
    ids = {n.id for n in view.nodes}
    assert all(a in ids and b in ids for a, b in view.edges)
    assert ("sm", "output:y") in view.edges
