"""Ops painted low handed to a runtime callable: what ``route_attention`` and
``route_dropouts`` share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from passes._infra import PassResult, visiting
from passes.fx.dtypes import dtype_of
from passes.policy import LOW


def route_low_precision(gm: fx.GraphModule, target: Any, fn: Callable[..., Any],
                        low: torch.dtype, first: str, reason: str) -> PassResult:
    """Point the ``target`` nodes painted low whose first tensor argument (or keyword
    ``first``) is ``low`` at ``fn``, noting ``reason`` in ``meta["amp_reason"]`` and the
    op replaced in ``meta["amp_orig_op"]``.

    Example:
        >>> route_low_precision(gm, aten.dropout.default, amp_dropout, torch.bfloat16,
        ...                     "input", "the runtime draws its mask").modified
        True
    """
    modified = False
    for node in visiting(list(gm.graph.nodes)):
        if node.op == "call_function" and node.target is target \
                and node.meta.get("amp_precision") == LOW and dtype_of(
                    node.args[0] if node.args else node.kwargs.get(first)) == low:
            node.target = fn
            node.meta["amp_orig_op"] = str(target.overloadpacket)
            node.meta["amp_reason"] = f"{node.meta.get('amp_reason', '')}; {reason}"
            modified = True
    return PassResult(gm, modified)
