"""``route_weight_casts``: parameter casts call the runtime's cast, at their first use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import fx

from passes._infra import PassResult, visiting
from passes.fx.dtypes import is_amp_cast


def route_weight_casts(
    gm: fx.GraphModule, cast_fn: Callable[..., Any], recompile: bool = True
) -> PassResult:
    """Replace ``_to_copy(get_attr, dtype)`` amp casts by ``cast_fn(get_attr, dtype)``
    (passing on a ``memory_format`` the cast has), placed just before the first use.

    After cast insertion every parameter is cast once per forward by ``aten._to_copy``;
    routed, the runtime can keep a persistent low-precision working copy, refreshed only
    when the fp32 master weight changes.

    Example:
        >>> route_weight_casts(gm, cache.cast)
    """
    modified = False
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    for node in visiting(nodes):
        if not is_amp_cast(node) or node.args[0].op != "get_attr" or not node.users:
            continue
        layout = {k: v for k, v in node.kwargs.items() if k == "memory_format"}
        # just before its first use, not hoisted with the others: a cast made in training
        # lives from there until backward, as autocast's (all of them alive from the
        # start would add the later layers' weights to a peak in the middle of forward)
        with gm.graph.inserting_before(min(node.users, key=order.__getitem__)):
            new = gm.graph.call_function(cast_fn, (node.args[0], node.kwargs["dtype"]), layout)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        modified = True
    if modified and recompile:
        gm.recompile()
    return PassResult(gm, modified)
