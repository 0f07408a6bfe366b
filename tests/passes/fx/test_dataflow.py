"""passes/fx/dataflow.py: the painter's dataflow graph, built in one walk."""

from __future__ import annotations

import networkx as nx
import pytest
import torch
from torch import nn

from passes.fx.dataflow import _build_dataflow_unordered, build_dataflow, classify
from passes.fx.prepare import prepare
from passes.paint import COMPUTE, NONFLOAT, SOURCE
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


class Kinds(nn.Module):
    """One node of each kind the painter tells apart."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x, ids, y64):
        h = self.fc(x)  # compute
        kept = h.to(torch.float16)  # an explicit cast: a source
        ones = torch.ones(4)  # a factory: a source
        picked = ids + self.steps  # integer: nonfloat
        return h + ones, kept, picked, y64 * 2  # fp64: nonfloat


def test_vertices_carry_kind_reason_op_and_module_and_edges_are_float_only():
    gm = torch.export.export(Kinds(), (torch.randn(2, 4), torch.arange(4),
                                       torch.randn(4, dtype=torch.float64)),
                             strict=False).module()
    g = build_dataflow(gm)
    kinds = {v: (d["kind"], d["reason"]) for v, d in g.nodes(data=True)}
    assert kinds["x"] == (SOURCE, "graph input: cast on use")
    assert kinds["ids"] == (NONFLOAT, "non-float input")
    assert kinds["fc_weight"] == (SOURCE, "parameter/buffer: stays fp32 (master weight), "
                                          "cast once per forward")
    assert kinds["steps"] == (NONFLOAT, "non-float buffer")
    assert kinds["linear"] == (COMPUTE, "")
    assert kinds["ones"] == (SOURCE, "creates a tensor: cast on use")
    assert kinds["to"] == (SOURCE, "explicit cast to torch.float16 in the model: kept")
    assert kinds["mul"] == (NONFLOAT, "fp64 is never changed")
    assert kinds["add"][0] == NONFLOAT and kinds["add"][1] == "no floating-point output"
    assert g.nodes["linear"]["op"] == "aten.linear" and g.nodes["linear"]["module"] == "fc"
    assert g.nodes["linear"]["module_classes"][-1].endswith("Linear")
    assert {v for v, d in g.nodes(data=True) if d.get("returned")} == {
        "add_1", "to", "add", "mul"}
    assert ("x", "linear") in g.edges and ("ids", "add") not in g.edges, "float edges only"
    assert all(classify(n) == kinds[n.name] for n in gm.graph.nodes if n.name in kinds)


def test_a_float_to_complex_op_is_computed_so_its_float_inputs_get_their_casts():
    class Spectral(nn.Module):
        def forward(self, x):
            c = torch.fft.fft(x)  # float -> complex: painted, its input cast to fp32
            return (c * c).real  # complex -> complex: no float data

    gm = torch.export.export(Spectral(), (torch.randn(2, 8),), strict=False).module()
    graph = build_dataflow(gm)
    kinds = {n.name: (graph.nodes[n.name]["kind"], classify(n)[0])
             for n in gm.graph.nodes if n.op == "call_function"}
    fft = next(name for name in kinds if "fft" in name)
    mul = next(name for name in kinds if "mul" in name)
    assert kinds[fft] == (COMPUTE, COMPUTE)
    assert kinds[mul] == (NONFLOAT, NONFLOAT)
