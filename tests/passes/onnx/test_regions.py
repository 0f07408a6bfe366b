"""passes.onnx.regions: painted regions and the bisection over them."""

from __future__ import annotations

import networkx as nx
import pytest

from passes.onnx import convert_model, low_regions
from passes.onnx.regions import bisect_regions
from passes.paint import Decision
from passes.policy import FP32, LOW
from tests.passes.onnx.util import mlp


def test_regions_are_components_of_low_nodes():
    result = convert_model(mlp(), "O2")
    assert low_regions(result.dataflow, result.assignment) == [["mm1", "add1", "relu", "mm2"]]
    o3 = convert_model(mlp(), "O3", op_block_list=["Relu"])
    assert low_regions(o3.dataflow, o3.assignment) == [["mm1", "add1"], ["mm2", "ln", "softmax"]]


def test_bisect_finds_the_needed_regions():
    def error(kept):
        return 0.0 if {2, 5} <= kept else 1.0

    assert bisect_regions(8, error, 0.1) == {2, 5}
    assert bisect_regions(3, lambda kept: 0.0, 0.1) == frozenset()
    with pytest.raises(ValueError, match="cannot be met"):
        bisect_regions(3, lambda kept: 1.0, 0.1)


def test_regions_hold_only_low_compute_nodes_split_by_fp32_ones():
    g = nx.DiGraph()
    g.add_node(("value", "x"), kind="source")
    for v in ("a", "b", "c", "d", "e"):
        g.add_node(v, kind="compute")
    g.add_edges_from([(("value", "x"), "a"), ("a", "b"), ("b", "c"), ("c", "d"), ("d", "e")])
    low, fp32 = Decision(LOW, "r"), Decision(FP32, "r")
    assignment = {("value", "x"): low, "a": low, "b": low, "c": fp32, "d": low, "e": low}
    assert low_regions(g, assignment) == [["a", "b"], ["d", "e"]]
    assert low_regions(g, {**assignment, "c": low}) == [["a", "b", "c", "d", "e"]]
    assert low_regions(g, dict.fromkeys(assignment, fp32)) == []


def test_bisect_keeps_the_fewest_regions_and_asks_few_trials():
    asked = []

    def error(kept):
        asked.append(kept)
        return 0.0 if {1, 6, 7} <= kept else 1.0

    assert bisect_regions(64, error, 0.5) == {1, 6, 7}
    assert len(asked) <= 2 + 3 * 8  # about log2(64) trials per needed region
