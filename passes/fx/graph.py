"""FX graph -> networkx dataflow graph for the painter, plus graph preparation."""

from __future__ import annotations

import operator
from typing import Any

import networkx as nx
import torch
from torch import fx

from passes._infra import PassResult
from passes.fx._torch_internals import (
    TORCH_OPS,
    OpOverload,
    input_nodes,
    op_schema,
    overload_name,
)
from passes.paint import COMPUTE, NONFLOAT, SOURCE

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
SHORT_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
CAST_OPS = ("aten.to", "aten._to_copy", "aten.type_as")
# Nodes that only check the capture (they assert dtypes we are about to change).
_CHECKS = ("aten._assert_tensor_metadata", "aten._assert_scalar", "aten.sym_constrain_range")


_OPS = TORCH_OPS
# id(op) -> (op, policy key, is a cast op), for torch ops and operator.getitem only: they
# live as long as the process (torch.ops interns them), so holding one costs nothing and
# keeps its id unique. Other targets (a runtime's bound method holding weights ...) are
# never held.
_OP_KEYS: dict[int, tuple[Any, str, bool]] = {}


def op_key(node: fx.Node) -> str:
    """Policy key of an FX node: ``aten.softmax.int``, ``getitem``, or the function name."""
    t = node.target
    if type(t) is str:  # placeholder, get_attr, call_module, call_method, output
        return t
    hit = _OP_KEYS.get(id(t))
    if hit is not None and hit[0] is t:
        return hit[1]
    return _target_info(t)[1]


def _target_info(t: Any) -> tuple[Any, str, bool]:
    """(target, policy key, whether the key names a cast op); cached for torch ops."""
    hit = _OP_KEYS.get(id(t))
    if hit is None or hit[0] is not t:
        key = t if type(t) is str else _target_key(t)
        hit = (t, key, key.startswith(CAST_OPS))
        if isinstance(t, _OPS) or t is operator.getitem:
            _OP_KEYS[id(t)] = hit
    return hit


def _target_key(t: Any) -> str:
    if isinstance(t, _OPS):
        return t.name().replace("::", ".")
    if t is operator.getitem:
        return "getitem"
    return getattr(t, "__name__", str(t))


def tensors(value: Any) -> list[torch.Tensor]:
    """Tensors in a meta value (a tensor, or a tuple/list of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    out: list[torch.Tensor] = []
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):  # the common case, without a call
                out.append(v)
            else:
                out += tensors(v)
    return out


def is_float(value: Any) -> bool:
    """Whether a meta value holds a fp32/fp16/bf16 tensor."""
    if isinstance(value, torch.Tensor):
        return value.dtype in FLOATS
    if isinstance(value, (tuple, list)):
        return any(is_float(v) for v in value)
    return False


def _has_fp64(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.float64
    if isinstance(value, (tuple, list)):
        return any(_has_fp64(v) for v in value)
    return False


def node_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes]


def module_info(node: fx.Node) -> tuple[str, tuple[str, ...]]:
    """Innermost module path and the classes of all enclosing modules."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "", ()
    entries = list(stack.values())
    path = entries[-1][0] if isinstance(entries[-1], tuple) else ""
    classes = tuple(str(e[1]) if isinstance(e[1], str) else
                    f"{e[1].__module__}.{e[1].__qualname__}" for e in entries)
    return path, classes


def explicit_cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype a user-written ``.to(dtype)`` asks for, or None."""
    if node.op != "call_function" or not _target_info(node.target)[2]:
        return None
    for v in (*node.args[1:], *node.kwargs.values()):
        if isinstance(v, torch.dtype):
            return v
    return None


def _is_cast_key(key: str) -> bool:
    return key.startswith(CAST_OPS)


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
    if _has_fp64(meta.get("val")):
        return NONFLOAT, "fp64 is never changed"
    if not floats(node):
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
    for node in gm.graph.nodes:
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
            is_fl, has_fp64 = dtype in FLOATS, dtype == fp64
        else:
            is_fl, has_fp64 = is_float(val), _has_fp64(val)
        floats[node] = is_fl
        inputs = input_nodes(node)  # all_input_nodes without its copy: a dict, same order
        target = node.target
        hit = _OP_KEYS.get(id(target))
        if hit is None or hit[0] is not target:
            hit = _target_info(target)
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
        elif has_fp64:
            kind, reason = NONFLOAT, "fp64 is never changed"
        elif not is_fl:
            kind, reason = NONFLOAT, "no floating-point output"
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
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        kind, reason = classify(node)
        path, classes = module_info(node)
        g.add_node(node.name, kind=kind, reason=reason, op=op_key(node), module=path,
                   module_classes=classes)
    for node in gm.graph.nodes:
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


def prepare(gm: fx.GraphModule, recompile: bool = True) -> PassResult:
    """Drop capture-time checks and make in-place activation ops functional.

    ``relu_(x)`` on an activation becomes ``relu(x)`` with later readers of ``x`` moved
    to the result, so the op can take a cast input. In-place ops on graph inputs,
    buffers or views keep their semantics and run in their operand's dtype.

    ``recompile``: lint the graph and regenerate ``gm.forward`` when it changed (a pipeline
    checks and regenerates once at its end: ``verify`` checks input order).
    """
    modified = False
    graph = gm.graph
    nodes = list(graph.nodes)
    position = None  # node -> index, built at the first in-place op (order never changes)
    for node in nodes:
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


def fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    """What a ``get_attr`` node with ``target`` ("layer.0.weight") reads from ``gm``."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` is an aten op whose result aliases its first input (a view, or an
    in-place op's return), so writes through either reach the other."""
    return (node.op == "call_function" and isinstance(node.target, OpOverload)
            and bool(node.args) and isinstance(node.args[0], fx.Node)
            and any(r.alias_info is not None for r in op_schema(node.target).returns))
