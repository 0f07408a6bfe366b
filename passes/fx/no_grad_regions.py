"""``no_grad`` regions recorded by torch.export (``wrap_with_set_grad_enabled``) inlined into
the graph with detached inputs, so the AMP passes see plain aten ops."""


from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

from passes._infra import visiting

aten = torch.ops.aten

# ops that return their input itself (grad and all, even under no_grad) where they change
# neither dtype, device nor layout and copy nothing: ``h.float()`` of a float ``h``
SELF_RETURNING = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other,
                  aten.type_as.default}


def inline_no_grad_regions(gm: fx.GraphModule) -> int:
    """Inline ``wrap_with_set_grad_enabled(False, body, *inputs)`` calls (a ``no_grad``
    block or ``@torch.no_grad`` forward inside the model, e.g. HF rotary embeddings) into
    ``gm``, each tensor input detached: the body's values and their autograd meaning (no
    gradient flows through it, its outputs do not require grad) are kept, and the AMP
    passes see plain aten ops instead of a higher-order op they cannot re-run. Bodies
    with attributes of their own, and ``set_grad_enabled(True)`` blocks, are left as they
    are. Returns the number of calls inlined.

    The inlined ops are painted like any others, as they are when the model is captured
    under ``torch.no_grad`` (export then records no region at all)."""
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    graph = gm.graph
    inlined = 0
    for node in visiting(list(graph.nodes)):
        if node.op != "call_function" or node.target is not hop or node.args[0] is not False:
            continue
        body_node = node.args[1]
        if getattr(body_node, "op", None) != "get_attr":
            continue
        inline_no_grad_regions(getattr(gm, body_node.target))
        _read_returned_inputs(gm, node, body_node)
        if inline_region(gm, node, body_node, node.args[2:], _detached) is not None:
            inlined += 1
    if inlined:
        graph.lint()
        gm.recompile()
    return inlined


def inline_region(gm: fx.GraphModule, node: fx.Node, body_node: fx.Node, inputs: Any,
                  bind: Callable[[fx.Graph, Any], Any] | None = None) -> list[fx.Node] | None:
    """Copy the ops of the body ``body_node`` names (a higher-order op's region) before
    ``node``, its placeholders bound to ``inputs`` (each through ``bind(graph, input)`` if
    given), point ``node``'s ``getitem`` users at the copies, and erase ``node`` (and the
    body, once nothing else uses it). Returns the copied nodes, or None where the region is
    not inlined: a body with attributes of its own, inputs that do not match, or ``node``
    used as a whole (not seen from export; its copies are then dead code)."""
    graph, body = gm.graph, getattr(gm, body_node.target)
    if any(n.op in ("get_attr", "call_module") for n in body.graph.nodes):
        return None
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs) or node.kwargs:
        return None
    env: dict[fx.Node, Any] = {}
    lookup = env.__getitem__
    with graph.inserting_before(node):
        for ph, value in zip(placeholders, inputs):
            env[ph] = value if bind is None else bind(graph, value)
        result = None
        for inner in body.graph.nodes:
            if inner.op == "placeholder":
                continue
            if inner.op == "output":
                result = fx.map_arg(inner.args[0], lookup)
                break
            env[inner] = graph.node_copy(inner, lookup)
    outs = result if isinstance(result, (tuple, list)) else (result,)
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outs[user.args[1]])
            graph.erase_node(user)
    if node.users:
        return None
    graph.erase_node(node)
    if not body_node.users:
        graph.erase_node(body_node)
        delattr(gm, body_node.target)
    return [n for ph, n in env.items() if ph.op != "placeholder"]


def _read_returned_inputs(gm: fx.GraphModule, node: fx.Node, body_node: fx.Node) -> None:
    """Point the users of ``node``'s outputs that are one of its inputs itself (returned
    through ops that return their input, :data:`SELF_RETURNING`) at that input, not at the
    body's copy of it, made from the detached input. Eager code reads the same tensor
    after the block, gradient and all: torch.export tracks tensors by identity, so after
    ``with no_grad(): q = h.float()`` every later read of ``h`` is the region's output
    ``q``, and through the detached copy ``h`` would get no gradient."""
    body = getattr(gm, body_node.target).graph
    placeholders = [n for n in body.nodes if n.op == "placeholder"]
    outs = body.output_node().args[0]
    if len(placeholders) != len(node.args) - 2 or not isinstance(outs, (tuple, list)):
        return
    for user in list(node.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            continue
        source = outs[user.args[1]]
        while isinstance(source, fx.Node) and _returns_its_input(source):
            source = source.args[0]
        if source in placeholders:
            user.replace_all_uses_with(node.args[2 + placeholders.index(source)])
            node.graph.erase_node(user)


def _returns_its_input(node: fx.Node) -> bool:
    """Whether ``node`` (eagerly) returns its first argument itself: a :data:`SELF_RETURNING`
    op that keeps its dtype, device and layout, copying nothing."""
    if node.op != "call_function" or node.target not in SELF_RETURNING:
        return False
    kwargs = normalize_function(node.target, node.args, node.kwargs,
                                normalize_to_only_use_kwargs=True).kwargs
    if kwargs.get("copy") or kwargs.get("memory_format") not in (None, torch.preserve_format):
        return False
    out, x = node.meta.get("val"), getattr(node.args[0], "meta", {}).get("val")
    return (isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor)
            and (out.dtype, out.device, out.layout) == (x.dtype, x.device, x.layout))


def _detached(graph: fx.Graph, value: Any) -> Any:
    if not isinstance(value, fx.Node):
        return value
    val = value.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return value
    node = graph.call_function(torch.ops.aten.detach.default, (value,))
    node.meta.update({k: v for k, v in value.meta.items() if k in ("nn_module_stack",
                                                                     "stack_trace")})
    fake_mode = getattr(val, "fake_mode", None)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        node.meta["val"] = val.detach()
    return node
