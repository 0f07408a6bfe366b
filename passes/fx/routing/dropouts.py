"""``route_dropouts``: dropout calls the runtime's, which draws its mask faster."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from passes._infra import PassResult
from passes.fx.routing.low_precision import route_low_precision

aten = torch.ops.aten


DROPOUT = aten.dropout.default


def route_dropouts(gm: fx.GraphModule, dropout_fn: Callable[..., Any], low: torch.dtype
                   ) -> PassResult:
    """Replace low-precision ``aten.dropout`` nodes by ``dropout_fn`` called with the same
    arguments (the runtime draws the mask its own way).

    Example:
        >>> route_dropouts(gm, amp_dropout, torch.bfloat16)
    """
    return route_low_precision(gm, DROPOUT, dropout_fn, low, "input",
                      "the runtime draws its mask (the same keep probability)")
