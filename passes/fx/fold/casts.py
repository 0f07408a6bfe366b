"""``fold_casts``: cast chains after cast insertion folded where the values allow."""

from __future__ import annotations

from torch import fx

from passes._infra import PassResult, visiting
from passes.fx.dtypes import CAST, dtype_of, is_amp_cast, is_widening


def fold_casts(gm: fx.GraphModule, recompile: bool = True) -> PassResult:
    """Fold cast chains: casts to the producer's own dtype vanish, ``low -> fp32 -> low``
    becomes the original low value. ``fp32 -> low -> fp32`` is kept: it changes values.

    Example:
        >>> fold_casts(gm).modified
        True
    """
    modified = False
    graph = gm.graph
    # the casts, in graph order (cast insertion makes them all aten._to_copy, which the
    # graph's own op index finds): the only nodes either walk below acts on
    casts = [n for n in graph.find_nodes(op="call_function", target=CAST)
             if n.meta.get("amp_cast")]
    kept = []
    for node in visiting(casts):
        src = node.args[0]
        target = node.kwargs["dtype"]
        if dtype_of(src) == target:
            node.replace_all_uses_with(src)
            graph.erase_node(node)
            modified = True
        elif is_amp_cast(src) and dtype_of(src.args[0]) == target and is_widening(
            target, dtype_of(src)
        ):
            node.replace_all_uses_with(src.args[0])
            graph.erase_node(node)
            modified = True
        else:
            kept.append(node)
    for node in visiting(kept):
        if not node.users:
            graph.erase_node(node)
            modified = True
    if modified and recompile:
        gm.recompile()
    return PassResult(gm, modified)
