"""FX graph -> networkx dataflow graph for the painter (``passes.paint``).

One vertex per node, carrying its ``kind`` (source, compute or nonfloat: :func:`classify`),
the reason, its op key and module; one edge per float input. Sources are graph inputs,
parameters, explicit user casts and factories; nonfloat are int/bool/fp64 values.
"""

from __future__ import annotations

from typing import Any

import networkx as nx
import torch
from torch import fx

from passes._infra import visiting
from passes.fx._torch_internals import input_nodes
from passes.fx.nodes import (
    FLOATS,
    explicit_cast_dtype,
    has_fp64,
    is_float,
    module_info,
    node_inputs,
    op_key,
    target_info,
)
from passes.paint import COMPUTE, NONFLOAT, SOURCE


def classify(node: fx.Node) -> tuple[str, str]:
    """(kind, reason) of a node for the painter."""
    return _classify(node, lambda a: is_float(a.meta.get("val")))


def _classify(node: fx.Node, floats: Any) -> tuple[str, str]:
    """:func:`classify`, with ``floats(node)`` telling whether a node's value is float."""
    op = node.op
    if op == "placeholder":
        if floats(node):
            return SOURCE, "graph input: cast on use"
        return NONFLOAT, "non-float input"
    if op == "get_attr":
        if floats(node):
            return SOURCE, "parameter/buffer: stays fp32 (master weight), cast once per forward"
        return NONFLOAT, "non-float buffer"
    if op != "call_function":
        return NONFLOAT, "not an op"
    meta = node.meta
    if meta.get("amp_inserted"):
        return SOURCE, meta.get("amp_reason", "inserted by ampgraph")
    if has_fp64(meta.get("val")):
        return NONFLOAT, "fp64 is never changed"
    if not floats(node):
        val = meta.get("val")
        if (isinstance(val, torch.Tensor) and val.is_complex()
                and any(floats(a) for a in node.all_input_nodes)):
            return COMPUTE, ""  # float -> complex (view_as_complex, fft): its inputs' casts
        return NONFLOAT, "no floating-point output"
    dtype = explicit_cast_dtype(node)
    if dtype is not None:
        return SOURCE, f"explicit cast to {dtype} in the model: kept"
    for a in node.all_input_nodes:
        if floats(a):
            return COMPUTE, ""
    return SOURCE, "creates a tensor: cast on use"


def build_dataflow(gm: fx.GraphModule) -> nx.DiGraph:
    """The painter's view of ``gm``: one vertex per node, float edges between them; the
    vertices whose values the graph returns are marked ``returned``.

    The graph holds what ``add_node`` for every node in order, then ``add_edge`` for every
    (consumer, float input) in order would give; its adjacency dicts are filled directly in
    one walk over the nodes (no temporaries), which matters on graphs of 10^5 nodes.

    Example:
        >>> g = build_dataflow(torch.export.export(model, args).module())
    """
    g = nx.DiGraph()
    attrs, succ, pred = g._node, g._succ, g._pred
    floats: dict[fx.Node, bool] = {}  # node -> float output, filled in graph order
    modules: dict[int, tuple[Any, tuple[str, tuple[str, ...]]]] = {}  # id(stack) -> info
    ordered = True  # every input met before its consumer (always, in a linted graph)
    fp64 = torch.float64
    for node in visiting(gm.graph.nodes):
        op = node.op
        if op == "output":
            for a in input_nodes(node):
                if a.name in attrs:
                    attrs[a.name]["returned"] = True
            continue
        meta = node.meta
        val = meta.get("val")
        if isinstance(val, torch.Tensor):
            dtype = val.dtype
            is_fl, is_fp64 = dtype in FLOATS, dtype == fp64
        else:
            is_fl, is_fp64 = is_float(val), has_fp64(val)
        floats[node] = is_fl
        inputs = input_nodes(node)  # all_input_nodes without its copy: a dict, same order
        target = node.target
        hit = target_info(target)
        # classify(node), from the float checks above
        if op == "placeholder":
            kind, reason = ((SOURCE, "graph input: cast on use") if is_fl
                            else (NONFLOAT, "non-float input"))
        elif op == "get_attr":
            kind, reason = (
                (SOURCE, "parameter/buffer: stays fp32 (master weight), cast once per forward")
                if is_fl else (NONFLOAT, "non-float buffer"))
        elif op != "call_function":
            kind, reason = NONFLOAT, "not an op"
        elif meta.get("amp_inserted"):
            kind, reason = SOURCE, meta.get("amp_reason", "inserted by ampgraph")
        elif is_fp64:
            kind, reason = NONFLOAT, "fp64 is never changed"
        elif not is_fl:
            kind, reason = NONFLOAT, "no floating-point output"
            if isinstance(val, torch.Tensor) and val.is_complex() and any(
                    floats.get(a, False) for a in inputs):
                kind, reason = COMPUTE, ""  # float -> complex: casts its float inputs
        else:
            cast = explicit_cast_dtype(node) if hit[2] else None
            if cast is not None:
                kind, reason = SOURCE, f"explicit cast to {cast} in the model: kept"
            else:
                kind, reason = SOURCE, "creates a tensor: cast on use"
                for a in inputs:
                    a_fl = floats.get(a)
                    if a_fl is None:
                        a_fl = is_float(a.meta.get("val"))
                    if a_fl:
                        kind, reason = COMPUTE, ""
                        break
        stack = meta.get("nn_module_stack")
        if not stack:
            path, classes = "", ()
        else:
            info = modules.get(id(stack))
            if info is None or info[0] is not stack:
                info = modules[id(stack)] = (stack, module_info(node))
            path, classes = info[1]
        name = node.name
        attrs[name] = {"kind": kind, "reason": reason, "op": hit[1], "module": path,
                       "module_classes": classes}
        succ[name] = {}
        into = pred[name] = {}
        for a in inputs:
            a_fl = floats.get(a)
            if a_fl is None:  # not met yet: an input after its consumer
                ordered = False
            elif a_fl:
                out = succ[a.name]
                if name not in out:  # a repeated input: one edge
                    out[name] = into[a.name] = {}
    if not ordered:
        return _build_dataflow_unordered(gm)
    return g


def _build_dataflow_unordered(gm: fx.GraphModule) -> nx.DiGraph:
    """:func:`build_dataflow` as plain add_node / add_edge calls: the definition the one-walk
    build follows (tests compare the two), used when nodes are not in dataflow order."""
    g = nx.DiGraph()
    for node in visiting(gm.graph.nodes):
        if node.op == "output":
            continue
        kind, reason = classify(node)
        path, classes = module_info(node)
        g.add_node(node.name, kind=kind, reason=reason, op=op_key(node), module=path,
                   module_classes=classes)
    for node in visiting(gm.graph.nodes):
        if node.op == "output":
            for a in node_inputs(node):
                if a.name in g:
                    g.nodes[a.name]["returned"] = True
        if node.name not in g:
            continue
        for a in node_inputs(node):
            if a.name in g and is_float(a.meta.get("val")):
                g.add_edge(a.name, node.name)
    return g
