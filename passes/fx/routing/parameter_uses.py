"""How often a graph reads each parameter: the routes that pass ``shared=True`` ask it."""

from __future__ import annotations

from torch import fx

from passes.fx.nodes import fetch_attr


def parameter_uses(gm: fx.GraphModule) -> dict[int, int]:
    """id(parameter) -> the number of users of the get_attr nodes reading it.

    Example:
        >>> parameter_uses(gm)[id(model.emb.weight)]  # tied input and output embeddings
        2
    """
    uses: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            key = id(fetch_attr(gm, node.target))
            uses[key] = uses.get(key, 0) + len(node.users)
    return uses
