"""Verify pass: every node's float inputs match its assigned precision."""

from __future__ import annotations

import torch
from torch import fx

from passes._infra import PassError, PassResult
from passes.fx.casts import KEEP, _slots, dtype_of, is_amp_cast, required_dtype


def verify(gm: fx.GraphModule, low: torch.dtype) -> PassResult:
    """Raise PassError naming the first node whose inputs disagree with its precision.

    Also runs ``graph.lint()``. Returns ``PassResult(gm, False)``.

    Example:
        >>> verify(gm, torch.bfloat16)
    """
    gm.graph.lint()
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_amp_cast(node):
            continue
        for slot, arg in _slots(node):
            want = required_dtype(node, slot, arg, low)
            have = dtype_of(arg)
            if want is not KEEP and have is not None and have != want:
                raise PassError(
                    "verify", node.name,
                    f"input {slot} ({arg.name}) is {have}, but the node runs in "
                    f"{node.meta.get('amp_precision')} and needs {want}",
                )
    return PassResult(gm, False)
