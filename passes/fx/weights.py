"""Route parameter casts through a caller-supplied cached cast.

After cast insertion every parameter is cast once per forward by ``aten._to_copy``. This
pass replaces those nodes by ``cast_fn(param, dtype)`` so the runtime can keep a persistent
low-precision working copy, refreshed only when the fp32 master weight changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import fx

from passes._infra import PassResult
from passes.fx.dtypes import is_amp_cast


def route_weight_casts(
    gm: fx.GraphModule, cast_fn: Callable[..., Any], recompile: bool = True
) -> PassResult:
    """Replace ``_to_copy(get_attr, dtype)`` amp casts by ``cast_fn(get_attr, dtype)``.

    Example:
        >>> route_weight_casts(gm, cache.cast)
    """
    modified = False
    for node in list(gm.graph.nodes):
        if not is_amp_cast(node) or node.args[0].op != "get_attr":
            continue
        with gm.graph.inserting_after(node):
            new = gm.graph.call_function(cast_fn, (node.args[0], node.kwargs["dtype"]))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        modified = True
    if modified and recompile:
        gm.recompile()
    return PassResult(gm, modified)
