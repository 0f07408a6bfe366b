"""``route_output_casts``: the casts of the outputs back to their dtype call the runtime's,
which may write into a buffer it keeps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import fx

from passes._infra import PassResult, visiting
from passes.fx.dtypes import CAST, is_amp_cast


def route_output_casts(gm: fx.GraphModule, cast_fn: Callable[..., Any]) -> PassResult:
    """Replace the amp casts that only the output uses by ``cast_fn(x, dtype, slot)``,
    ``slot`` being the output's place among the graph's outputs (the same for every graph
    of a module, so buffers kept per slot stay bounded however many graphs it captures).

    Example:
        >>> route_output_casts(gm, buffers.cast)
    """
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    modified = False
    for i, node in enumerate(visiting(output.all_input_nodes)):
        if is_amp_cast(node) and node.target is CAST and set(node.users) == {output} \
                and set(node.kwargs) == {"dtype"}:
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(cast_fn, (node.args[0], node.kwargs["dtype"], i))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            modified = True
    return PassResult(gm, modified)
