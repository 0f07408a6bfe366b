"""Verify pass: every node's float inputs match its assigned precision."""

from __future__ import annotations

import torch
from torch import fx

from passes._infra import PassError, PassResult
from passes.fx.casts import KEEP, _Rules, _slots, dtype_of


def verify(gm: fx.GraphModule, low: torch.dtype) -> PassResult:
    """Raise PassError naming the first node whose inputs disagree with its precision.

    Also runs ``graph.lint()``. Returns ``PassResult(gm, False)``. Each input is checked
    against ``required_dtype`` (the rule cast insertion follows), with its per-node half
    worked out once per node.

    Example:
        >>> verify(gm, torch.bfloat16)
    """
    gm.graph.lint()
    rules = _Rules(low)
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta.get("amp_cast"):
            continue
        rule = rules.of(node)
        if rule.keep_all:  # every input is KEEP
            continue
        want_of = rule.want
        for slot, arg in _slots(node):
            meta = arg.meta
            have = meta["amp_dtype"] if "amp_dtype" in meta else dtype_of(arg)
            if have is None:
                continue
            want = want_of(slot, arg)
            if want is not KEEP and have != want:
                raise PassError(
                    "verify", node.name,
                    f"input {slot} ({arg.name}) is {have}, but the node runs in "
                    f"{node.meta.get('amp_precision')} and needs {want}",
                )
    return PassResult(gm, False)
