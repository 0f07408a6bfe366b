"""``count_casts``: the casts the passes inserted in a graph (an analysis: reads only)."""

from __future__ import annotations

from torch import fx


def count_casts(gm: fx.GraphModule) -> int:
    """The casts the passes inserted in ``gm`` (``meta["amp_cast"]``).

    Example:
        >>> count_casts(gm)
        7
    """
    return sum(1 for n in gm.graph.nodes if n.meta.get("amp_cast"))
