"""FX graph -> networkx dataflow graph for the painter, plus graph preparation."""

from __future__ import annotations

import operator
from typing import Any

import networkx as nx
import torch
from torch import fx

from passes._infra import PassResult
from passes.paint import COMPUTE, NONFLOAT, SOURCE

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
CAST_OPS = ("aten.to", "aten._to_copy", "aten.type_as")
# Nodes that only check the capture (they assert dtypes we are about to change).
_CHECKS = ("aten._assert_tensor_metadata", "aten._assert_scalar", "aten.sym_constrain_range")


def op_key(node: fx.Node) -> str:
    """Policy key of an FX node: ``aten.softmax.int``, ``getitem``, or the function name."""
    t = node.target
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return t.name().replace("::", ".")
    if t is operator.getitem:
        return "getitem"
    return getattr(t, "__name__", str(t))


def tensors(value: Any) -> list[torch.Tensor]:
    """Tensors in a meta value (a tensor, or a tuple/list of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    return []


def is_float(value: Any) -> bool:
    return any(t.dtype in FLOATS for t in tensors(value))


def node_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes]


def module_info(node: fx.Node) -> tuple[str, tuple[str, ...]]:
    """Innermost module path and the classes of all enclosing modules."""
    stack = node.meta.get("nn_module_stack") or {}
    entries = list(stack.values())
    if not entries:
        return "", ()
    path = entries[-1][0] if isinstance(entries[-1], tuple) else ""
    classes = tuple(str(e[1]) if isinstance(e[1], str) else
                    f"{e[1].__module__}.{e[1].__qualname__}" for e in entries)
    return path, classes


def explicit_cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype a user-written ``.to(dtype)`` asks for, or None."""
    if node.op != "call_function" or not op_key(node).startswith(CAST_OPS):
        return None
    for v in (*node.args[1:], *node.kwargs.values()):
        if isinstance(v, torch.dtype):
            return v
    return None


def classify(node: fx.Node) -> tuple[str, str]:
    """(kind, reason) of a node for the painter."""
    val = node.meta.get("val")
    if node.op == "placeholder":
        if is_float(val):
            return SOURCE, "graph input: cast on use"
        return NONFLOAT, "non-float input"
    if node.op == "get_attr":
        if is_float(val):
            return SOURCE, "parameter/buffer: stays fp32 (master weight), cast once per forward"
        return NONFLOAT, "non-float buffer"
    if node.op != "call_function":
        return NONFLOAT, "not an op"
    if node.meta.get("amp_inserted"):
        return SOURCE, node.meta.get("amp_reason", "inserted by ampgraph")
    if any(t.dtype == torch.float64 for t in tensors(val)):
        return NONFLOAT, "fp64 is never changed"
    if not is_float(val):
        return NONFLOAT, "no floating-point output"
    dtype = explicit_cast_dtype(node)
    if dtype is not None:
        return SOURCE, f"explicit cast to {dtype} in the model: kept"
    if not any(is_float(a.meta.get("val")) for a in node_inputs(node)):
        return SOURCE, "creates a tensor: cast on use"
    return COMPUTE, ""


def build_dataflow(gm: fx.GraphModule) -> nx.DiGraph:
    """The painter's view of ``gm``: one vertex per node, float edges between them.

    Example:
        >>> g = build_dataflow(torch.export.export(model, args).module())
    """
    g = nx.DiGraph()
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        kind, reason = classify(node)
        path, classes = module_info(node)
        g.add_node(node.name, kind=kind, reason=reason, op=op_key(node), module=path,
                   module_classes=classes)
    for node in gm.graph.nodes:
        if node.name not in g:
            continue
        for a in node_inputs(node):
            if a.name in g and is_float(a.meta.get("val")):
                g.add_edge(a.name, node.name)
    return g


def prepare(gm: fx.GraphModule) -> PassResult:
    """Drop capture-time checks and make in-place activation ops functional.

    ``relu_(x)`` on an activation becomes ``relu(x)`` with later readers of ``x`` moved
    to the result, so the op can take a cast input. In-place ops on graph inputs,
    buffers or views keep their semantics and run in their operand's dtype.
    """
    modified = False
    graph = gm.graph
    for node in list(graph.nodes):
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
        target = node.args[0]
        later = [u for u in target.users if u is not node and _after(u, node)]
        node.target = functional
        for u in later:
            u.replace_input_with(target, node)
        modified = True
    if modified:
        graph.lint()
        gm.recompile()
    return PassResult(gm, modified)


def _after(a: fx.Node, b: fx.Node) -> bool:
    n = b.next
    while n.op != "root":
        if n is a:
            return True
        n = n.next
    return False


def _functional_variant(node: fx.Node) -> Any:
    t = node.target
    if not isinstance(t, torch._ops.OpOverload) or not t._schema.is_mutable:
        return None
    args = t._schema.arguments
    written = [i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
    if written != [0] or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    src = node.args[0]
    if src.op != "call_function" or not isinstance(src.target, torch._ops.OpOverload):
        return None
    if any(r.alias_info is not None for r in src.target._schema.returns):
        return None  # the operand is a view of something else: keep the mutation
    name = t._schema.name.split("::")[1]
    if not name.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    overload = getattr(packet, t._overloadname, None) if packet is not None else None
    return overload
