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


def route_output_casts(gm: fx.GraphModule, cast_fn: Callable[..., Any]) -> PassResult:
    """Replace the amp casts that only the output uses by ``cast_fn(x, dtype, slot)``,
    ``slot`` being the output's place among the graph's outputs (the same for every graph
    of a module, so buffers kept per slot stay bounded however many graphs it captures).

    Example:
        >>> route_output_casts(gm, buffers.cast)
    """
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    modified = False
    for i, node in enumerate(output.all_input_nodes):
        if is_amp_cast(node) and node.target is CAST and set(node.users) == {output} \
                and set(node.kwargs) == {"dtype"}:
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(cast_fn, (node.args[0], node.kwargs["dtype"], i))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            modified = True
    return PassResult(gm, modified)
