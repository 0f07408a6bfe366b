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


def _route_low(gm: fx.GraphModule, target: Any, fn: Callable[..., Any], low: torch.dtype,
               first: str, reason: str) -> PassResult:
    """Point the ``target`` nodes painted low whose first tensor argument (or keyword
    ``first``) is ``low`` at ``fn``, noting ``reason``."""
    modified = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is target \
                and node.meta.get("amp_precision") == LOW and dtype_of(
                    node.args[0] if node.args else node.kwargs.get(first)) == low:
            node.target = fn
            node.meta["amp_orig_op"] = str(target.overloadpacket)
            node.meta["amp_reason"] = f"{node.meta.get('amp_reason', '')}; {reason}"
            modified = True
    return PassResult(gm, modified)
