"""If/Loop/Scan subgraphs: walking all graphs of a model and renaming values across them.

How subgraphs are converted (see ``graph.py`` and ``casts.py``): their nodes are painted
together with the main graph, with edges from the outer-scope values they read. The
interface of a control-flow node keeps its original dtypes (its float inputs, the body's
formal inputs and outputs, and its outputs), so both branches of an If and every Loop
iteration agree on types. A Cast of an outer-scope value is placed in the scope that
produces the value, right after its producer, and shared by every consumer in nested
subgraphs: one Cast per (value, dtype) model-wide.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from onnx import GraphProto, ModelProto

from passes._infra import visiting
from passes.onnx.graph import subgraphs


def all_graphs(graph: GraphProto) -> Iterator[GraphProto]:
    """``graph`` and every subgraph nested in it, outer ones first.

    Example:
        >>> sum(len(g.node) for g in all_graphs(model.graph))
        12
    """
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from all_graphs(sub)


def rename_values(model: ModelProto, mapping: Mapping[str, str]) -> None:
    """Rename values model-wide (node inputs/outputs, initializers, value_info), leaving
    graph output entries alone: used to give a graph output its original name when its
    value now comes from a new Cast.

    Example:
        >>> rename_values(model, {"logits": "logits_fp16", "logits_fp32": "logits"})
    """
    if not mapping:
        return
    for g in all_graphs(model.graph):
        for node in visiting(g.node):
            for i, name in enumerate(node.input):
                if name in mapping:
                    node.input[i] = mapping[name]
            for i, name in enumerate(node.output):
                if name in mapping:
                    node.output[i] = mapping[name]
        for t in g.initializer:
            if t.name in mapping:
                t.name = mapping[t.name]
        for vi in g.value_info:
            if vi.name in mapping:
                vi.name = mapping[vi.name]


__all__ = ["all_graphs", "rename_values"]
