"""Verify pass: every node's float inputs match its assigned precision."""

from __future__ import annotations

import torch
from torch import fx

from passes._infra import PassError, PassResult, visiting
from passes.fx.dtypes import dtype_of
from passes.fx.rules import KEEP, Rules, input_slots


def verify(gm: fx.GraphModule, low: torch.dtype) -> PassResult:
    """Raise PassError naming the first node whose inputs disagree with its precision.

    Also checks what ``graph.lint()`` checks that a rewrite can break: every input is a
    node of this graph defined before its user (lint's other checks, of names and targets,
    cost as much again on a large graph and concern nodes the passes do not make). Returns
    ``PassResult(gm, False)``. Each input is checked against the rule cast insertion
    follows, with its per-node half worked out once per node.

    Example:
        >>> verify(gm, torch.bfloat16)
    """
    rules = Rules(low)
    seen: set[fx.Node] = set()
    for node in visiting(gm.graph.nodes):
        inputs = node.all_input_nodes
        for arg in inputs:
            if arg not in seen:
                raise PassError("verify", node.name, f"input {arg.name} is not defined before "
                                "it in this graph")
        seen.add(node)
        if node.op != "call_function" or node.meta.get("amp_cast"):
            continue
        rule = rules.of(node)
        if rule.keep_all:  # every input is KEEP
            continue
        if rule.by_node:  # each input once, wherever it is used
            pairs = ((arg.name, arg, rule.want_node(arg)) for arg in inputs)
        else:
            pairs = ((slot, arg, rule.want(slot, arg)) for slot, arg in input_slots(node))
        for slot, arg, want in pairs:
            meta = arg.meta
            have = meta["amp_dtype"] if "amp_dtype" in meta else dtype_of(arg)
            if have is not None and want is not KEEP and have != want:
                raise PassError(
                    "verify", node.name,
                    f"input {slot} ({arg.name}) is {have}, but the node runs in "
                    f"{node.meta.get('amp_precision')} and needs {want}",
                )
    return PassResult(gm, False)
