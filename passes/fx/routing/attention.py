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


ATTENTION = aten.scaled_dot_product_attention.default


def route_attention(gm: fx.GraphModule, attention_fn: Callable[..., Any], low: torch.dtype
                    ) -> PassResult:
    """Replace low-precision ``aten.scaled_dot_product_attention`` nodes by
    ``attention_fn`` called with the same arguments (the runtime picks the kernel for the
    shapes it meets).

    Example:
        >>> route_attention(gm, amp_attention, torch.bfloat16)
    """
    return _route_low(gm, ATTENTION, attention_fn, low, "query",
                      "the runtime picks its kernel for the shapes it meets")
