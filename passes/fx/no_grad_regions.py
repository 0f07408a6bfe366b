"""``no_grad`` regions recorded by torch.export (``wrap_with_set_grad_enabled``) inlined into
the graph with detached inputs, so the AMP passes see plain aten ops."""


from __future__ import annotations

import contextlib
import operator
from typing import Any

import torch
from torch import fx

from passes._infra import visiting


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
        body = getattr(gm, body_node.target)
        inline_no_grad_regions(body)
        if any(n.op in ("get_attr", "call_module") for n in body.graph.nodes):
            continue
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        inputs = node.args[2:]
        if len(placeholders) != len(inputs) or node.kwargs:
            continue
        env: dict[fx.Node, Any] = {}
        lookup = env.__getitem__
        with graph.inserting_before(node):
            for ph, value in zip(placeholders, inputs):
                env[ph] = _detached(graph, value)
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
        if node.users:  # used as a whole (not seen from export): leave the rest alone
            continue
        graph.erase_node(node)
        if not body_node.users:
            graph.erase_node(body_node)
            delattr(gm, body_node.target)
        inlined += 1
    if inlined:
        graph.lint()
        gm.recompile()
    return inlined


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
