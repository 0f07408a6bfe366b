"""passes.onnx.regions: painted regions and the bisection over them."""

from __future__ import annotations

import pytest

from passes.onnx import convert_model, low_regions
from passes.onnx.regions import bisect_regions
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
