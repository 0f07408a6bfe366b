"""Per-layer loss scaling: gradient-scale ops on the edges between layer regions.

Each node belongs to a region: 0 (the global loss scale) or one layer (a module that owns
parameters directly), numbered by the caller. A node takes the innermost layer in its
``nn_module_stack``; a parameter ``get_attr`` takes its owner's layer; any other node takes
the region of its gradient-carrying inputs when they all agree (so the activation between
two Linear layers stays in the first one's region), else region 0. User inputs carry no
gradient. Wherever a float tensor crosses from region ``a`` to region ``b`` (the graph
output counts as region 0), ``make_edge(a, b)`` returns the callable inserted there
(``ampgraph.runtime.grad_scale.GradScaleEdge.apply``): identity forward, gradient x
``s[a]/s[b]`` in backward. One op per (value, consumer region), before its first use.

The pass only needs ``meta["val"]`` (fake tensors) and ``meta["nn_module_stack"]`` that
``torch.export`` writes; it never imports ampgraph.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx

from passes._infra import PassResult, visiting

__all__ = ["GRAD_SCALE_META", "insert_grad_scales", "node_regions"]

GRAD_SCALE_META = "amp_grad_scale"  # meta key on inserted nodes: (src region, dst region)


def _is_float_tensor(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _stack_region(node: fx.Node, layers: Mapping[str, int]) -> int | None:
    stack = node.meta.get("nn_module_stack") or {}
    found = None
    for entry in stack.values():
        path = entry[0] if isinstance(entry, tuple) else entry
        if path in layers:
            found = layers[path]
    return found


def node_regions(gm: fx.GraphModule, layers: Mapping[str, int]
                 ) -> tuple[dict[fx.Node, int], dict[fx.Node, bool]]:
    """(region of each node, whether it carries a gradient) for ``layers`` (path -> index).

    Example:
        >>> regions, grad = node_regions(gm, {"a": 1, "b": 2})
    """
    region: dict[fx.Node, int] = {}
    grad: dict[fx.Node, bool] = {}
    for node in visiting(gm.graph.nodes):
        if node.op == "placeholder":
            region[node], grad[node] = 0, False
        elif node.op == "get_attr":
            owner = str(node.target).rpartition(".")[0]
            region[node], grad[node] = layers.get(owner, 0), _is_float_tensor(node)
        elif node.op == "output":
            region[node], grad[node] = 0, False
        else:
            ins = [u for u in node.all_input_nodes if grad.get(u, False)]
            grad[node] = bool(ins)
            own = _stack_region(node, layers)
            if own is None:
                seen = {region[u] for u in ins}
                own = seen.pop() if len(seen) == 1 else 0
            region[node] = own
    return region, grad


def insert_grad_scales(
    gm: fx.GraphModule, layers: Mapping[str, int], make_edge: Callable[[int, int], Any]
) -> PassResult:
    """Insert ``make_edge(src, dst)`` ops on the float edges between regions, in place.

    Args:
        gm: a captured (and AMP-rewritten) graph module.
        layers: module path -> region index (>= 1) for each layer with its own scale.
        make_edge: returns the callable to put on an edge from region ``src`` to ``dst``.

    Returns:
        ``PassResult(gm, modified)``; idempotent (edges already scaled are left alone).

    Example:
        >>> insert_grad_scales(gm, {"a": 1}, lambda s, d: GradScaleEdge(t, s, d).apply)
    """
    graph = gm.graph
    if any(GRAD_SCALE_META in n.meta for n in graph.nodes):
        return PassResult(gm, False)
    region, grad = node_regions(gm, layers)
    made: dict[tuple[fx.Node, int], fx.Node] = {}
    modified = False
    for node in visiting(list(graph.nodes)):
        if node.op in ("placeholder", "get_attr"):
            continue
        dst = region[node]
        for u in list(node.all_input_nodes):
            src = region.get(u, 0)
            if src == dst or not grad.get(u, False) or not _is_float_tensor(u):
                continue
            key = (u, dst)
            if key not in made:
                with graph.inserting_before(node):  # the first consumer: after u
                    scaled = graph.call_function(make_edge(src, dst), (u,))
                scaled.meta.update({k: v for k, v in u.meta.items()
                                    if k in ("val", "tensor_meta", "nn_module_stack")})
                scaled.meta[GRAD_SCALE_META] = (src, dst)
                made[key] = scaled
            node.replace_input_with(u, made[key])
            modified = True
    if modified:
        graph.lint()
        gm.recompile()
    return PassResult(gm, modified)
