"""``route_linears``: a linear casts its own weight and converts its weight gradient."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from passes._infra import PassResult, visiting
from passes.fx.dtypes import CAST, dtype_of, is_amp_cast
from passes.fx.nodes import fetch_attr
from passes.fx.routing.parameter_uses import parameter_uses

aten = torch.ops.aten


def route_linears(gm: fx.GraphModule, linear_fn: Callable[..., Any], low: torch.dtype
                  ) -> PassResult:
    """Replace ``aten.linear(x, cast(w), b)`` by ``linear_fn(x, w, b)`` where ``x`` is
    ``low`` and the cast of parameter ``w`` (routed by :func:`route_weight_casts`) serves only
    this linear: the runtime then fuses the weight cast and the conversion of the weight
    gradient into the linear. Run after ``route_weight_casts``; the cast still happens (it
    stays counted), inside ``linear_fn``.

    A weight that other nodes use too (tied input and output embeddings) is passed with
    ``shared=True``: its gradient is summed from several places.

    Example:
        >>> route_linears(gm, cache.amp_linear, torch.bfloat16)
    """
    uses = parameter_uses(gm)
    modified = False
    for node in visiting(list(gm.graph.nodes)):
        if node.op != "call_function" or node.target is not aten.linear.default \
                or len(node.args) < 2 or node.kwargs:
            continue
        x, w = node.args[0], node.args[1]
        if dtype_of(x) != low or not (is_amp_cast(w) and w.target is not CAST
                                      and w.args[0].op == "get_attr" and len(w.users) == 1):
            continue
        node.target = linear_fn
        node.args = (x, w.args[0], *node.args[2:])
        if uses.get(id(fetch_attr(gm, w.args[0].target)), 0) > 1:
            node.kwargs = {"shared": True}
        node.meta["amp_fused_weight_cast"] = low
        gm.graph.erase_node(w)
        b = node.args[2] if len(node.args) > 2 else None
        if is_amp_cast(b) and b.target is not CAST and b.args[0].op == "get_attr" \
                and len(b.users) == 1:
            node.args = (x, node.args[1], b.args[0], *node.args[3:])
            node.meta["amp_fused_bias_cast"] = low
            gm.graph.erase_node(b)
        node.meta["amp_orig_op"] = "aten.linear"
        node.meta["amp_reason"] = (f"{node.meta.get('amp_reason', '')}; its weight cast and "
                                   "the conversion of its weight gradient are fused into it")
        modified = True
    return PassResult(gm, modified)
