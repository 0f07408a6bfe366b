"""``route_embeddings``: a lookup on a parameter table picks where its gradient goes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from passes._infra import PassResult, visiting
from passes.fx.nodes import fetch_attr
from passes.fx.routing.parameter_uses import parameter_uses

aten = torch.ops.aten


def route_embeddings(gm: fx.GraphModule, embedding_fn: Callable[..., Any]) -> PassResult:
    """Replace ``aten.embedding(W, ids, padding_idx)`` on a float parameter ``W`` by
    ``embedding_fn(W, ids, padding_idx)``: the runtime picks where the table's gradient
    goes. A table other nodes use too (tied input and output embeddings) is passed with
    ``shared=True``. Lookups that scale gradients by frequency or want sparse gradients
    are left alone.

    Example:
        >>> route_embeddings(gm, cache.amp_embedding)
    """
    uses = parameter_uses(gm)
    modified = False
    for node in visiting(list(gm.graph.nodes)):
        if node.op != "call_function" or node.target is not aten.embedding.default \
                or node.kwargs or any(node.args[3:]) or node.args[0].op != "get_attr":
            continue
        table = fetch_attr(gm, node.args[0].target)
        if not (isinstance(table, torch.Tensor) and table.is_floating_point()):
            continue
        node.target = embedding_fn
        node.args = node.args[:3]
        if uses.get(id(table), 0) > 1:
            node.kwargs = {"shared": True}
        node.meta["amp_orig_op"] = "aten.embedding"
        modified = True
    return PassResult(gm, modified)
