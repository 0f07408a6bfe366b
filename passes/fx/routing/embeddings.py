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


def route_embeddings(gm: fx.GraphModule, embedding_fn: Callable[..., Any]) -> PassResult:
    """Replace ``aten.embedding(W, ids, padding_idx)`` on a float parameter ``W`` by
    ``embedding_fn(W, ids, padding_idx)``: the runtime picks where the table's gradient
    goes. A table other nodes use too (tied input and output embeddings) is passed with
    ``shared=True``. Lookups that scale gradients by frequency or want sparse gradients
    are left alone.

    Example:
        >>> route_embeddings(gm, cache.amp_embedding)
    """
    uses = _param_uses(gm)
    modified = False
    for node in list(gm.graph.nodes):
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
