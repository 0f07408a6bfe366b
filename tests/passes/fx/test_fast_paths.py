"""The passes' fast paths give what the straightforward versions give.

Large graphs go through shortcuts: a fake-tensor run is remembered by its signature, the
dataflow graph is filled in one walk, the painter sorts only the vertices it needs. Each
test here pins a shortcut to its plain definition.
"""

from __future__ import annotations

import gc

import networkx as nx
import pytest
import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import passes.fx.propagate as casts
from passes.fx.dtypes import dtype_of
from passes.fx.graph import (
    _build_dataflow_unordered,
    build_dataflow,
    op_key,
    prepare,
)
from passes.fx.hazards import mark_range_hazards
from passes.fx.insert_casts import annotate, insert_casts
from passes.paint import paint
from passes.policy import FP32, LOW, make_policy
from tests.helpers import make

D = 8


def blocks(n: int) -> fx.GraphModule:
    """n blocks of linear -> gelu -> layer_norm -> softmax mix (native_layer_norm: 3 outputs)."""

    def f(x, w, b, g):
        for _ in range(n):
            h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b))
            h = torch.nn.functional.layer_norm(h, (D,), g)
            x = x + h * torch.softmax(h, -1)
        return x

    args = (torch.randn(2, D), torch.randn(D, D), torch.randn(D), torch.randn(D))
    return make_fx(f, tracing_mode="fake")(*args)


def dtype_blocks(n: int, fp64: bool = True) -> fx.GraphModule:
    """:func:`blocks` plus ops that name a dtype and, with ``fp64``, an fp64 side path: a
    captured graph with two float dtypes (the general "follows its inputs" rule) or one
    (the single-dtype shortcut)."""

    def f(x, w, b, g, e):
        for _ in range(n):
            h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b))
            h = torch.nn.functional.layer_norm(h, (D,), g)
            side = (h.to(e.dtype) * e).sum(-1, keepdim=True).to(torch.float32)
            total = h.sum(-1, keepdim=True, dtype=torch.float32)  # names its dtype
            x = x + h * torch.softmax(h, -1) + side + total
        return x

    args = (torch.randn(2, D), torch.randn(D, D), torch.randn(D), torch.randn(D),
            torch.randn(D, dtype=torch.float64 if fp64 else torch.float32))
    return make_fx(f, tracing_mode="fake")(*args)


def one_dtype_blocks(n: int) -> fx.GraphModule:
    return dtype_blocks(n, fp64=False)


def meta_of(value):
    if isinstance(value, torch.Tensor):
        return (value.dtype, tuple(value.shape), value.stride(), value.requires_grad)
    if isinstance(value, (tuple, list)):
        return tuple(meta_of(v) for v in value)
    return value


@pytest.mark.parametrize("build", [blocks, dtype_blocks, one_dtype_blocks])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_remembered_runs_agree_with_running_every_op(level, low, build):
    """Repeated multi-output ops take the remembered result: the dtypes of every node, and
    the values of the multi-output ones, are those running every op gives. (Single-output
    ops that follow their inputs only record ``amp_dtype``: their ``val`` keeps the captured
    dtype either way.)"""
    seen = []
    for exact in (False, True):
        gm = build(6)
        prepare(gm)
        annotate(gm, paint(build_dataflow(gm), make_policy(level)))
        insert_casts(gm, low, exact=exact)
        seen.append({n.name: (dtype_of(n), meta_of(n.meta["val"])
                              if isinstance(n.meta.get("val"), tuple) else None)
                     for n in gm.graph.nodes})
    assert seen[0] == seen[1]
    assert sum(isinstance(v[1], tuple) for v in seen[0].values()) == 6


_REAL_RUN = casts._DtypeTracker._run


def count_runs(monkeypatch, gm, level="O2"):
    runs = []
    real = _REAL_RUN

    def run(self, node):
        runs.append(op_key(node))
        return real(self, node)

    monkeypatch.setattr(casts._DtypeTracker, "_run", run)
    prepare(gm)
    annotate(gm, paint(build_dataflow(gm), make_policy(level)))
    insert_casts(gm, torch.bfloat16)
    return runs


def test_norms_reading_their_captured_inputs_are_not_rerun(monkeypatch):
    """At O2 every fp32 layer norm reads a copy widened back to its captured dtype: its
    captured value still holds, so no layer norm runs, however many there are."""
    def kernels(gm):  # getitem has no kernel: it always runs, to pick its element
        return [r for r in count_runs(monkeypatch, gm, "O2") if r != "getitem"]

    assert kernels(blocks(3)) == kernels(blocks(30)) == []


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


def clear_chain(order):
    """w -> t -> expand -> mm, plus softmax -> view -> gelu, vertices added in ``order``."""
    ops = {"w": None, "x": None, "t": "aten.t", "expand": "aten.expand", "mm": "aten.mm",
           "softmax": "aten.softmax", "view": "aten.view", "gelu": "aten.gelu"}
    g = nx.DiGraph()
    for v in order:
        if ops[v] is None:
            g.add_node(v, kind="source")
        else:
            g.add_node(v, kind="compute", op=ops[v])
    g.add_edges_from([("w", "t"), ("t", "expand"), ("expand", "mm"), ("x", "softmax"),
                      ("softmax", "view"), ("view", "gelu")])
    return g


def test_painter_result_does_not_depend_on_vertex_order():
    forward = ["w", "x", "t", "expand", "mm", "softmax", "view", "gelu"]
    a = paint(clear_chain(forward), make_policy("O2"))
    b = paint(clear_chain(forward[::-1]), make_policy("O2"))
    assert a == b
    assert a["t"].precision == a["expand"].precision == LOW
    assert a["view"].precision == FP32


def test_painter_rejects_a_cycle_among_clear_ops():
    g = clear_chain(["w", "x", "t", "expand", "mm", "softmax", "view", "gelu"])
    g.add_edge("expand", "t")
    with pytest.raises(nx.NetworkXUnfeasible):
        paint(g, make_policy("O2"))


def test_range_hazard_scan_leaves_no_garbage_cycles():
    """A recursive closure per node was a reference cycle per node (cycle-collector work)."""
    gm = blocks(20)
    prepare(gm)
    graph = build_dataflow(gm)
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        before = gc.get_count()[0]
        mark_range_hazards(graph, gm, torch.float16)
        grown = gc.get_count()[0] - before
    finally:
        if enabled:
            gc.enable()
    assert grown < 50, grown


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


def test_verify_rejects_a_node_used_before_it_is_defined_or_from_another_graph():
    """verify's own ordering check, in place of graph.lint()."""
    from passes._infra import PassError
    from passes.fx.verify import verify

    def rewritten():
        gm = blocks(2)
        prepare(gm)
        annotate(gm, paint(build_dataflow(gm), make_policy("O2")))
        insert_casts(gm, torch.bfloat16)
        verify(gm, torch.bfloat16)
        return gm

    gm = rewritten()
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    user = next(n for n in nodes if any(a.op == "call_function" for a in n.all_input_nodes))
    nodes[0].prepend(user)
    with pytest.raises(PassError, match="not defined before"):
        verify(gm, torch.bfloat16)
    gm, other = rewritten(), rewritten()
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.args)
    stranger = next(n for n in other.graph.nodes if n.op == "call_function")
    node.args = (stranger, *node.args[1:])
    with pytest.raises(PassError, match="not defined before"):
        verify(gm, torch.bfloat16)
