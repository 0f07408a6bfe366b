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


def route_weight_casts(
    gm: fx.GraphModule, cast_fn: Callable[..., Any], recompile: bool = True
) -> PassResult:
    """Replace ``_to_copy(get_attr, dtype)`` amp casts by ``cast_fn(get_attr, dtype)``
    (passing on a ``memory_format`` the cast has), placed just before the first use.

    After cast insertion every parameter is cast once per forward by ``aten._to_copy``;
    routed, the runtime can keep a persistent low-precision working copy, refreshed only
    when the fp32 master weight changes.

    Example:
        >>> route_weight_casts(gm, cache.cast)
    """
    modified = False
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    for node in nodes:
        if not is_amp_cast(node) or node.args[0].op != "get_attr" or not node.users:
            continue
        layout = {k: v for k, v in node.kwargs.items() if k == "memory_format"}
        # just before its first use, not hoisted with the others: a cast made in training
        # lives from there until backward, as autocast's (all of them alive from the
        # start would add the later layers' weights to a peak in the middle of forward)
        with gm.graph.inserting_before(min(node.users, key=order.__getitem__)):
            new = gm.graph.call_function(cast_fn, (node.args[0], node.kwargs["dtype"]), layout)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        modified = True
    if modified and recompile:
        gm.recompile()
    return PassResult(gm, modified)


def route_linears(gm: fx.GraphModule, linear_fn: Callable[..., Any], low: torch.dtype
                  ) -> PassResult:
    """Replace ``aten.linear(x, cast(w), b)`` by ``linear_fn(x, w, b)`` where ``x`` is
    ``low`` and the cast of parameter ``w`` (routed by :func:`route_weight_casts`) serves only
    this linear: the runtime then fuses the weight cast and the conversion of the weight
    gradient into the linear. Run after ``route_weight_casts``; the cast still happens (it
    stays counted), inside ``linear_fn``.

    A weight that other nodes use too (tied input and output embeddings) is passed with
    ``shared=True``: its gradient is summed from several places.

    Example:
        >>> route_linears(gm, cache.amp_linear, torch.bfloat16)
    """
    uses = _param_uses(gm)
    modified = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default \
                or len(node.args) < 2 or node.kwargs:
            continue
        x, w = node.args[0], node.args[1]
        if dtype_of(x) != low or not (is_amp_cast(w) and w.target is not CAST
                                      and w.args[0].op == "get_attr" and len(w.users) == 1):
            continue
        node.target = linear_fn
        node.args = (x, w.args[0], *node.args[2:])
        if uses.get(id(fetch_attr(gm, w.args[0].target)), 0) > 1:
            node.kwargs = {"shared": True}
        node.meta["amp_fused_weight_cast"] = low
        gm.graph.erase_node(w)
        b = node.args[2] if len(node.args) > 2 else None
        if is_amp_cast(b) and b.target is not CAST and b.args[0].op == "get_attr" \
                and len(b.users) == 1:
            node.args = (x, node.args[1], b.args[0], *node.args[3:])
            node.meta["amp_fused_bias_cast"] = low
            gm.graph.erase_node(b)
        node.meta["amp_orig_op"] = "aten.linear"
        node.meta["amp_reason"] = (f"{node.meta.get('amp_reason', '')}; its weight cast and "
                                   "the conversion of its weight gradient are fused into it")
        modified = True
    return PassResult(gm, modified)


def _param_uses(gm: fx.GraphModule) -> dict[int, int]:
    """id(parameter) -> the number of users of the get_attr nodes reading it."""
    uses: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            key = id(fetch_attr(gm, node.target))
            uses[key] = uses.get(key, 0) + len(node.users)
    return uses


def route_embeddings(gm: fx.GraphModule, embedding_fn: Callable[..., Any]) -> PassResult:
    """Replace ``aten.embedding(W, ids, padding_idx)`` on a float parameter ``W`` by
    ``embedding_fn(W, ids, padding_idx)``: the runtime picks where the table's gradient
    goes. A table other nodes use too (tied input and output embeddings) is passed with
    ``shared=True``. Lookups that scale gradients by frequency or want sparse gradients
    are left alone.

    Example:
        >>> route_embeddings(gm, cache.amp_embedding)
    """
    uses = _param_uses(gm)
    modified = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not aten.embedding.default \
                or node.kwargs or any(node.args[3:]) or node.args[0].op != "get_attr":
            continue
        table = fetch_attr(gm, node.args[0].target)
        if not (isinstance(table, torch.Tensor) and table.is_floating_point()):
            continue
        node.target = embedding_fn
        node.args = node.args[:3]
        if uses.get(id(table), 0) > 1:
            node.kwargs = {"shared": True}
        node.meta["amp_orig_op"] = "aten.embedding"
        modified = True
    return PassResult(gm, modified)


ATTENTION = aten.scaled_dot_product_attention.default
DROPOUT = aten.dropout.default


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


def route_dropouts(gm: fx.GraphModule, dropout_fn: Callable[..., Any], low: torch.dtype
                   ) -> PassResult:
    """Replace low-precision ``aten.dropout`` nodes by ``dropout_fn`` called with the same
    arguments (the runtime draws the mask its own way).

    Example:
        >>> route_dropouts(gm, amp_dropout, torch.bfloat16)
    """
    return _route_low(gm, DROPOUT, dropout_fn, low, "input",
                      "the runtime draws its mask (the same keep probability)")


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
