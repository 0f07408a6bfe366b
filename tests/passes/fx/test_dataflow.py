"""passes/fx/dataflow.py: the painter's dataflow graph, built in one walk."""

from __future__ import annotations

import networkx as nx
import pytest
import torch

from passes.fx.dataflow import _build_dataflow_unordered, build_dataflow
from passes.fx.prepare import prepare
from tests.helpers import make
from tests.passes.fx.helpers import blocks


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
