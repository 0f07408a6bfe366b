"""passes/fx/runtime_ops.py: RuntimeOps validates what a runtime hands the passes, and the
pipeline runs exactly the routes it fills."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from passes.fx.pipeline import PipelineState, amp_passes
from passes.fx.policy import make_policy
from passes.fx.runtime_ops import ATEN_ONLY, RuntimeOps


def fn(*args, **kwargs):
    return None


def test_aten_only_fills_nothing():
    assert all(getattr(ATEN_ONLY, f.name) in (None, False, frozenset())
               for f in dataclasses.fields(ATEN_ONLY) if f.name != "group_numel")
    assert ATEN_ONLY.group_numel == 1 << 24
    assert not ATEN_ONLY.routes_weights


@pytest.mark.parametrize("ops, message", [
    (dict(weight_cast=fn, weight_group=fn), "weight_cast and weight_group are exclusive"),
    (dict(linear=fn), "give weight_cast too"),
    (dict(embedding=fn, weight_group=fn), "give weight_cast too"),
    (dict(unrepeated_kv_heads=True, stacked_kv_heads=True),
     "unrepeated_kv_heads and stacked_kv_heads are exclusive"),
])
def test_contradictory_ops_are_refused_naming_the_fix(ops, message):
    with pytest.raises(ValueError, match=message):
        RuntimeOps(**ops)


def test_routes_weights_with_either_weight_route():
    assert RuntimeOps(weight_cast=fn).routes_weights
    assert RuntimeOps(weight_group=fn).routes_weights
    assert not RuntimeOps(attention=fn, dropout=fn, output_cast=fn).routes_weights


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ATEN_ONLY.dropout = fn


@pytest.mark.parametrize("ops, routes", [
    (RuntimeOps(), []),
    (RuntimeOps(weight_group=fn), ["group_weight_casts"]),
    (RuntimeOps(weight_cast=fn, linear=fn), ["route_weight_casts", "route_linears"]),
    (RuntimeOps(weight_cast=fn, embedding=fn), ["route_weight_casts", "route_embeddings"]),
    (RuntimeOps(dropout=fn, output_cast=fn), ["route_dropouts", "route_output_casts"]),
    (RuntimeOps(unrepeated_kv_heads=True), ["group_kv_heads"]),
    (RuntimeOps(stacked_kv_heads=True), ["stack_kv_queries"]),
])
def test_each_field_switches_on_its_pass(ops, routes):
    optional = {"group_kv_heads", "stack_kv_queries", "group_weight_casts",
                "route_weight_casts", "route_linears", "route_embeddings", "route_attention",
                "route_dropouts", "route_output_casts"}
    names = [p.__name__ for p in amp_passes(make_policy("O2"), torch.bfloat16, PipelineState(),
                                            runtime=ops)]
    assert [n for n in names if n in optional] == routes
