"""group_weight_casts: a graph's parameter casts handed to the runtime in groups.

After cast insertion each parameter that runs low is cast by its own ``aten._to_copy``:
one kernel each in forward, and one conversion of its gradient each in backward (on
BERT-base 411 copies a step, as autocast's). This pass replaces them by one call per
group of parameters, ``group(p1, p2, ...) -> (low1, low2, ...)``, which a runtime can
serve from copies kept between steps, refreshed by one multi-tensor op only when the
masters changed, and whose backward returns the group's fp32 gradients by another.

Groups follow the order of first use and hold up to ``max_numel`` elements (one
parameter larger than that is a group alone), so a group's gradients are ready in the
middle of backward, not at its end: data-parallel communication still overlaps it. Each
group's call sits just before its first use, its copies read right after it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from torch import fx

from passes._infra import PassResult, visiting
from passes.fx.dtypes import is_amp_cast


def group_weight_casts(gm: fx.GraphModule, make_group: Callable[..., Any],
                       max_numel: int = 1 << 24, recompile: bool = True) -> PassResult:
    """Replace the amp casts of ``get_attr`` values by ``make_group(specs)(*values)``
    calls, a group per run of first uses of up to ``max_numel`` elements. ``specs`` holds
    each member's ``(dtype, memory_format)`` (``None``: the master's strides).

    Example:
        >>> group_weight_casts(gm, runtime.weight_group).modified
        True
    """
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    casts = [n for n in nodes if is_amp_cast(n) and n.args[0].op == "get_attr" and n.users]
    if not casts:
        return PassResult(gm, False)
    first_use = {c: min(order[u] for u in c.users) for c in casts}
    casts.sort(key=first_use.__getitem__)
    groups: list[list[fx.Node]] = [[]]
    size = 0
    for cast in casts:
        numel = _numel(cast)
        if groups[-1] and size + numel > max_numel:
            groups.append([])
            size = 0
        groups[-1].append(cast)
        size += numel
    for members in groups:
        first = min((u for c in members for u in c.users), key=order.__getitem__)
        specs = tuple((c.kwargs["dtype"], c.kwargs.get("memory_format")) for c in members)
        with gm.graph.inserting_before(first):
            call = gm.graph.call_function(make_group(specs), tuple(c.args[0] for c in members))
            call.meta["val"] = tuple(c.meta.get("val") for c in members)
            call.meta["amp_cast"] = True
            call.meta["amp_reason"] = f"{len(members)} parameter casts as one group"
        for i, cast in enumerate(visiting(members)):
            with gm.graph.inserting_before(first):
                item = gm.graph.call_function(operator.getitem, (call, i))
            item.meta.update(cast.meta)
            cast.replace_all_uses_with(item)
            gm.graph.erase_node(cast)
    if recompile:
        gm.recompile()
    return PassResult(gm, True)


def _numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    try:
        return int(val.numel())
    except (AttributeError, TypeError, RuntimeError):  # symbolic or missing: count as one
        return 1
