"""Runtime routing: ops the runtime carries out its own way, called from the rewritten graph.

- :func:`route_weight_casts`: parameter casts call the runtime's cast (in inference a
  working copy refreshed only when the fp32 master weight changes), at their first use.
- :func:`route_linears`: a linear casts its own weight and converts its weight gradient.
- :func:`route_embeddings`: a lookup on a parameter table picks where its gradient goes.
- :func:`route_attention`: attention calls the runtime's implementation, which picks the
  kernel for the shapes it meets.
- :func:`route_dropouts`: dropout calls the runtime's, which draws its mask faster.
- :func:`route_output_casts`: the casts of the outputs back to their dtype call the
  runtime's, which may write into a buffer it keeps.

Each replaces matching nodes by a caller-supplied callable; the numbers are the runtime's
to keep (the cast still happens, inside the callable, and stays counted).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from passes._infra import PassResult
from passes.fx.dtypes import CAST, dtype_of, is_amp_cast
from passes.fx.graph import fetch_attr
from passes.policy import LOW

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
    uses = _param_uses(gm)
    modified = False
    for node in list(gm.graph.nodes):
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
