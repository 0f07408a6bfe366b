"""passes/costs.py: the costs record both dialects' analyses return."""

from __future__ import annotations

import dataclasses

import pytest

from passes.costs import GraphCosts


def test_graph_costs_is_a_frozen_record_in_summary_order():
    costs = GraphCosts(100, 50, 8, 4, 8, 30, 40, 10, 20)
    assert [f.name for f in dataclasses.fields(costs)] == [
        "flops", "low_flops", "param_bytes_fp32", "param_bytes_low", "param_bytes_baseline",
        "activation_bytes", "activation_bytes_fp32", "peak_bytes", "peak_bytes_fp32",
        "fp8_flops", "param_bytes_fp8"]
    assert (costs.fp8_flops, costs.param_bytes_fp8) == (0, 0)  # no FP8: the ONNX dialect
    assert (costs.low_flops, costs.peak_bytes_fp32) == (50, 20)
    with pytest.raises(dataclasses.FrozenInstanceError):
        costs.flops = 0
