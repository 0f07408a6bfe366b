"""passes/fx/graph.py: the dataflow graph, op keys, meta helpers and prepare."""

from __future__ import annotations

import operator

import networkx as nx
import pytest
import torch
from torch import fx, nn

from passes.fx.graph import (
    _build_dataflow_unordered,
    build_dataflow,
    op_key,
    prepare,
    tensors,
)
from tests.helpers import make
from tests.passes.fx.helpers import blocks, check_pass, in_place_graph


def test_inplace_activation_becomes_functional_and_runs_low():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    gm, _ = check_pass(model, (torch.randn(3, 4),), "O1", torch.bfloat16)
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "aten.relu.default" in ops and "aten.relu_.default" not in ops


def same_graph(a: nx.DiGraph, b: nx.DiGraph) -> None:
    assert list(a.nodes(data=True)) == list(b.nodes(data=True))
    assert list(a.edges) == list(b.edges)
    assert all(list(a.pred[v]) == list(b.pred[v]) for v in a)


@pytest.mark.parametrize("name", ["resnet", "bert_encoder", "gpt_decoder"])
def test_dataflow_graph_is_what_add_node_add_edge_build(name):
    model, inputs = make(name)
    gm = torch.export.export(model.eval(), inputs, strict=False).module()
    prepare(gm)
    same_graph(build_dataflow(gm), _build_dataflow_unordered(gm))


def test_dataflow_graph_of_nodes_out_of_dataflow_order():
    gm = blocks(2)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    nodes[0].prepend(nodes[3])  # a consumer moved before its producers (lint would object)
    same_graph(build_dataflow(gm), _build_dataflow_unordered(gm))


def test_op_key_cache_is_keyed_by_the_target_itself():
    g = fx.Graph()
    x = g.placeholder("x")
    keys = []
    for name in ("first", "second"):
        def fn(v):
            return v
        fn.__name__ = name
        keys.append(op_key(g.call_function(fn, (x,))))
        del fn  # a new function may reuse the id
    assert keys == ["first", "second"]
    assert op_key(x) == "x"


def test_prepare_without_recompile_rewrites_the_graph_alike():
    eager, deferred = in_place_graph(), in_place_graph()
    assert prepare(eager).modified and prepare(deferred, recompile=False).modified
    assert str(deferred.graph) == str(eager.graph)
    in_place = "aten.relu_.default"
    assert in_place in deferred.code and in_place not in eager.code  # forward not regenerated
    deferred.recompile()
    assert deferred.code == eager.code


def test_tensors_flattens_nested_values_in_order():
    a, b, c = torch.zeros(1), torch.ones(1), torch.zeros(2)
    assert [id(t) for t in tensors((a, [b, (None, c)], 3))] == [id(a), id(b), id(c)]
    assert tensors(a)[0] is a and tensors(None) == [] and tensors([1, 2.0]) == []


def test_getitem_key_is_cached_and_stays_getitem():
    g = fx.Graph()
    x = g.placeholder("x")
    item = g.call_function(operator.getitem, (x, 0))
    assert op_key(item) == op_key(item) == "getitem"
