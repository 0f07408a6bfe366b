"""Written views: an in-place op that writes a parameter, buffer or graph input through
views of it must write the tensor itself, never a cast copy.

``weight.data.clamp_(-c, c)`` (Gemma 3n's AltUp, in train mode) is captured as
``clamp_(detach(weight))``. Painted as any view, ``detach`` would follow its low-precision
consumer and read a bf16 copy of the weight: the clamp would write the copy and the weight
would stay unclamped. :func:`mark_written_views` forces the views on the path from such a
source to the in-place op, and the op, to keep their original dtype (fp32 for a master
weight), with a reason ``explain`` shows. (An in-place op on an activation is made
functional by ``passes.fx.prepare``; on a view of one it keeps its operand's dtype.)
"""

from __future__ import annotations

import networkx as nx
from torch import fx

from passes._infra import visiting
from passes.fx.nodes import is_view
from passes.fx.rules import mutated_slots, slot_value
from passes.policy import FP32

REASON = ("writes a parameter, buffer or input in place through views of it: runs on the "
          "tensor itself, in its dtype (a cast copy would take the write)")


def written_source_path(node: fx.Node) -> list[fx.Node]:
    """The views from a source (``get_attr`` or ``placeholder``) to the operand ``node`` (an
    in-place op) writes, that operand first; empty when it writes no source.

    Example:
        >>> written_source_path(clamp_node)  # clamp_(detach(weight))
        [detach]
    """
    slots = mutated_slots(node)
    value = slot_value(node, slots[0]) if slots else None
    if not isinstance(value, fx.Node):
        return []
    path = []
    while is_view(value):
        path.append(value)
        value = value.args[0]
    return path if value.op in ("get_attr", "placeholder") else []


def mark_written_views(graph: nx.DiGraph, gm: fx.GraphModule) -> int:
    """Force each in-place op writing a source through views, and those views, to keep
    their dtype in the painter's ``graph``; return how many vertices were forced.

    Example:
        >>> mark_written_views(build_dataflow(gm), gm)  # clamp_(detach(weight))
        2
    """
    attrs = graph.nodes
    forced = 0
    for node in visiting(gm.graph.nodes):
        if node.op != "call_function":
            continue
        path = written_source_path(node)
        for v in (node, *path) if path else ():
            data = attrs[v.name] if v.name in attrs else None
            if data is not None and not data.get("forced"):
                data["forced"] = (FP32, REASON)
                forced += 1
    return forced


__all__ = ["REASON", "mark_written_views", "written_source_path"]
