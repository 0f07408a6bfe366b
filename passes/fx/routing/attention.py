"""``route_attention``: attention calls the runtime's implementation, which picks the kernel
for the shapes it meets."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from passes._infra import PassResult
from passes.fx.routing.low_precision import route_low_precision

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
    return route_low_precision(gm, ATTENTION, attention_fn, low, "query",
                      "the runtime picks its kernel for the shapes it meets")
