"""``prepare``: the first pass, making a captured graph ready for the rewrite.

It drops the capture-time checks (they assert the dtypes the passes are about to change)
and makes in-place activation ops functional, so they can take a cast input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from passes._infra import PassResult, visiting
from passes.fx._torch_internals import OpOverload, op_schema, overload_name
from passes.fx.nodes import is_view, op_key

# Nodes that only check the capture (they assert dtypes we are about to change).
_CHECKS = ("aten._assert_tensor_metadata", "aten._assert_scalar", "aten.sym_constrain_range")


def prepare(gm: fx.GraphModule, recompile: bool = True) -> PassResult:
    """Drop capture-time checks and make in-place activation ops functional.

    ``relu_(x)`` on an activation becomes ``relu(x)`` with later readers of ``x`` moved
    to the result, so the op can take a cast input. In-place ops on graph inputs,
    buffers or views keep their semantics and run in their operand's dtype.

    ``recompile``: lint the graph and regenerate ``gm.forward`` when it changed (a pipeline
    checks and regenerates once at its end: ``verify`` checks input order).

    Example:
        >>> prepare(gm).modified  # a graph with ``relu_`` on an activation
        True
    """
    modified = False
    graph = gm.graph
    nodes = list(graph.nodes)
    position = None  # node -> index, built at the first in-place op (order never changes)
    for node in visiting(nodes):
        if node.op != "call_function":
            continue
        key = op_key(node)
        if key.startswith(_CHECKS) and not node.users:
            graph.erase_node(node)
            modified = True
            continue
        functional = _functional_variant(node)
        if functional is None:
            continue
        if position is None:
            position = {n: i for i, n in enumerate(nodes)}
        target = node.args[0]
        here = position[node]
        later = [u for u in target.users if u is not node and position.get(u, -1) > here]
        node.target = functional
        for u in later:
            u.replace_input_with(target, node)
        modified = True
    if modified and recompile:
        graph.lint()
        gm.recompile()
    return PassResult(gm, modified)


def _functional_variant(node: fx.Node) -> Any:
    t = node.target
    if not isinstance(t, OpOverload) or not op_schema(t).is_mutable:
        return None
    args = op_schema(t).arguments
    written = [i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
    if written != [0] or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    src = node.args[0]
    if src.op != "call_function" or not isinstance(src.target, OpOverload):
        return None
    if is_view(src):
        return None  # the operand is a view of something else: keep the mutation
    name = op_schema(t).name.split("::")[1]
    if not name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    overload = getattr(packet, overload_name(t), None) if packet is not None else None
    return overload
