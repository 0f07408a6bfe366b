"""``route_head_loss``: the model's last product and the cross-entropy of its logits become
one chunked runtime op, so the logits never exist whole (ampgraph's
``runtime/head_loss.py``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from passes._infra import PassResult, visiting
from passes.fx.dtypes import CAST, dtype_of, is_amp_cast
from passes.fx.nodes import SHORT_NAMES, fetch_attr, module_info
from passes.fx.routing.parameter_uses import parameter_uses

aten = torch.ops.aten

HEAD_LOSS_MODES = ("off", "auto", "drop_logits")
_CASTS = (CAST, aten.to.dtype)
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_COPIES = (aten.contiguous.default, aten.clone.default)
_CE_ARGS = ("input", "target", "weight", "reduction", "ignore_index", "label_smoothing")
_CE_DEFAULTS = {"weight": None, "reduction": 1, "ignore_index": -100, "label_smoothing": 0.0}


def route_head_loss(gm: fx.GraphModule, fused_fn: Callable[..., Any], low: torch.dtype,
                    chunk_rows: Callable[[int, int], int], mode: str = "auto") -> PassResult:
    """Replace ``cross_entropy(chain(linear(x, cast(w), b)), target)`` by
    ``fused_fn(chain'(x), w, b, target, reduction=, ignore_index=, label_smoothing=,
    chunk=)``: the product in ``low``, its logits taken to fp32, then views, row slices
    and copies (``chain``) that keep the vocabulary as the last dimension, into an aten
    cross-entropy over a ``[N, V]`` input with a ``[N]`` target, no class weights and a
    mean or sum. ``chain'`` replays the views and slices on ``x`` (its last dimension
    ``d``); ``w`` and ``b`` are the parameters themselves (their casts go if nothing else
    reads them: the runtime casts them and forms their fp32 gradients). ``chunk`` is
    ``chunk_rows(N, V)`` for any ``N``: the most rows a chunk takes.

    Where the logits are read elsewhere too (the graph returns them, as HF's models
    return ``logits`` beside ``loss``), fusing would save nothing: with ``mode="auto"``
    the cross-entropy stays, and its reason says so; with ``mode="drop_logits"`` (the
    train step, which returns only the loss) the graph returns None in their place. The
    fused node's reason names the chunk; ``mode="off"`` does nothing.

    Example:
        >>> route_head_loss(gm, linear_cross_entropy, torch.bfloat16, chunk_rows).modified
        True
    """
    if mode not in HEAD_LOSS_MODES:
        raise ValueError(f"head_loss must be one of {HEAD_LOSS_MODES}, got {mode!r}")
    if mode == "off":
        return PassResult(gm, False)
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    modified = False
    for ce in visiting(list(gm.graph.find_nodes(op="call_function",
                                                 target=aten.cross_entropy_loss.default))):
        found = _match(ce, low)
        if found is None:
            continue
        product, chain, args = found
        logits = [product, *chain]
        returned = [n for n in logits if _returned(n, output, set(chain) | {ce})]
        elsewhere = [u for n in logits for u in n.users
                     if u is not ce and u not in chain and u is not output
                     and not _output_cast(u, output)]
        if elsewhere or (returned and mode != "drop_logits"):
            why = "returned" if not elsewhere else f"read by {elsewhere[0].name}"
            ce.meta["amp_reason"] = (f"{ce.meta.get('amp_reason', '')}; not fused with the "
                                     f"head: its logits are {why} too, so they exist whole "
                                     "anyway (build_train_step drops returned logits)")
            continue
        fused = _fuse(gm, ce, product, chain, args, fused_fn, chunk_rows)
        casts_out = [u for n in logits for u in n.users if _output_cast(u, output)]
        if returned:
            output.args = fx.node.map_arg(output.args, functools.partial(
                _none_if_in, frozenset([*logits, *casts_out])))
        for node in reversed([*logits, *casts_out]):  # users first
            if not node.users:
                _erase_with_casts(gm, node)
        own = _only_reader(gm, fused.args[1])
        fused.update_kwarg("own_weight", own)
        if own:
            fused.meta["amp_reason"] += (
                "; nothing else reads its weight: a step that releases gradients streams it "
                "by blocks of vocabulary rows, each block's gradient stepped as it is formed")
        modified = True
    return PassResult(gm, modified)


def _match(ce: fx.Node, low: torch.dtype) -> tuple[fx.Node, list[fx.Node], dict] | None:
    """``(the product, the chain from it to the cross-entropy, the cross-entropy's
    arguments)`` if ``ce`` can be fused, else None."""
    args = dict(_CE_DEFAULTS, **dict(zip(_CE_ARGS, ce.args)), **ce.kwargs)
    if args["weight"] is not None or args["reduction"] not in (1, 2):
        return None
    logits, target = args["input"], args["target"]
    if _rank(logits) != 2 or _rank(target) != 1 or dtype_of(logits) != torch.float32:
        return None
    chain, node = [], logits
    while isinstance(node, fx.Node) and node.op == "call_function" and _chain_op(node):
        chain.append(node)
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.target is not aten.linear.default or \
            node.kwargs or dtype_of(node) != low or dtype_of(node.args[0]) != low:
        return None
    w = node.args[1]
    if not isinstance(w, fx.Node) or _param(w) is None:
        return None
    chain.reverse()  # from the product to the cross-entropy
    for up, down in zip([node, *chain], [*chain, ce]):  # each reads the one before
        if down.args[0] is not up:
            return None
    return node, chain, args


def _chain_op(node: fx.Node) -> bool:
    """A cast, a view or flatten keeping the last dimension, a slice of another, or a
    copy."""
    t = node.target
    if t in _CASTS or t in _COPIES:
        return True
    if t in _VIEWS:
        shape = node.args[1] if len(node.args) > 1 else None
        in_shape = _shape(node.args[0])
        return isinstance(shape, (list, tuple)) and bool(shape) and in_shape is not None \
            and shape[-1] == in_shape[-1] and isinstance(shape[-1], int)
    rank = _rank(node.args[0])
    if t is aten.slice.Tensor:  # rows taken: not the last dimension
        dim = node.args[1] if len(node.args) > 1 else 0
        return rank is not None and dim % rank != rank - 1
    if t is aten.flatten.using_ints:  # leading dimensions merged: not the last
        end = node.args[2] if len(node.args) > 2 else -1
        return rank is not None and end % rank != rank - 1
    return False


def _fuse(gm: fx.GraphModule, ce: fx.Node, product: fx.Node, chain: list[fx.Node],
          args: dict, fused_fn: Callable[..., Any],
          chunk_rows: Callable[[int, int], int]) -> fx.Node:
    x, w = product.args[0], product.args[1]
    b = (product.args[2:] or (None,))[0]
    graph = gm.graph
    with graph.inserting_before(ce):
        for node in chain:  # the views and slices, replayed on the product's input
            if node.target in _VIEWS:
                shape = list(node.args[1])
                shape[-1] = _shape(x)[-1]
                x = _call(graph, aten.reshape.default, (x, shape), node)
            elif node.target in (aten.slice.Tensor, aten.flatten.using_ints):
                x = _call(graph, node.target, (x, *node.args[1:]), node)
        vocab = _shape(args["input"])[-1]
        chunk = chunk_rows(1 << 62, vocab)  # at most; fewer rows make one chunk
        fused = graph.call_function(fused_fn, (x, _param(w), _param(b) if b is not None
                                               else None, args["target"]), {
            "reduction": args["reduction"], "ignore_index": args["ignore_index"],
            "label_smoothing": args["label_smoothing"], "chunk": chunk})
    fused.meta = dict(ce.meta)
    fused.meta["amp_orig_op"] = "aten.cross_entropy_loss"
    fused.meta["amp_fused_from"] = f"{product.name} (the head's product) and {ce.name}"
    fused.meta["amp_head_product"] = (product.meta.get("val"), product.args[0].meta.get("val"))
    size = f"chunks of {chunk} rows"
    fused.meta["amp_reason"] = (
        f"{ce.meta.get('amp_reason', '')}; fused with the head's product {product.name} "
        f"({module_info(product)[0] or 'the head'}) "
        f"in {size}: the product in {SHORT_NAMES[dtype_of(product)]}, log-sum-exp and loss in "
        "fp32, the gradients formed chunk by chunk; the logits never exist whole")
    ce.replace_all_uses_with(fused)
    graph.erase_node(ce)
    return fused


def _only_reader(gm: fx.GraphModule, w: Any) -> bool:
    """Whether the fused node is the only one that reads the parameter ``w`` (a
    ``get_attr``), under any of its names: then the fused op forms all of its gradient
    (``own_weight``, which lets a step that releases gradients take it by blocks)."""
    return isinstance(w, fx.Node) and w.op == "get_attr" \
        and parameter_uses(gm)[id(fetch_attr(gm, w.target))] == 1  # fused's use alone


def _call(graph: fx.Graph, target: Any, args: tuple, like: fx.Node) -> fx.Node:
    """``target(*args)`` in place of ``like`` on the logits, replayed on the head's input."""
    node = graph.call_function(target, args)
    node.meta = {k: v for k, v in like.meta.items() if k not in ("val", "amp_dtype")}
    node.meta["amp_precision"] = args[0].meta.get("amp_precision", "low")
    node.meta["amp_reason"] = ("the head's input, shaped as its logits were, for the fused "
                               "head and loss")
    x = args[0]
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if val is not None:
        try:
            node.meta["val"] = target(val, *[a.meta.get("val") if isinstance(a, fx.Node)
                                             else a for a in args[1:]])
        except Exception:  # noqa: BLE001 - a value the later passes can do without
            pass
    if isinstance(x, fx.Node) and dtype_of(x) is not None:
        node.meta["amp_dtype"] = dtype_of(x)
    return node


def _param(node: Any) -> fx.Node | None:
    """The parameter a weight or bias operand reads: itself (a ``get_attr``), or the
    parameter a cast the passes inserted casts."""
    if isinstance(node, fx.Node) and node.op == "get_attr":
        return node
    if is_amp_cast(node) and node.target is CAST and isinstance(node.args[0], fx.Node) \
            and node.args[0].op == "get_attr":
        return node.args[0]
    return None


def _none_if_in(dropped: frozenset, node: fx.Node) -> fx.Node | None:
    return None if node in dropped else node


def _erase_with_casts(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase ``node`` and then any parameter cast it read that nothing else reads."""
    inputs = [a for a in node.all_input_nodes if is_amp_cast(a) and a.target is CAST]
    gm.graph.erase_node(node)
    for a in inputs:
        if not a.users:
            gm.graph.erase_node(a)


def _returned(node: fx.Node, output: fx.Node, path: set[fx.Node]) -> bool:
    return any(u is output or _output_cast(u, output) for u in node.users if u not in path)


def _output_cast(node: fx.Node, output: fx.Node) -> bool:
    """A cast the passes inserted that only the output reads (keep_io_types)."""
    return is_amp_cast(node) and set(node.users) == {output}


def _shape(node: Any) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _rank(node: Any) -> int | None:
    shape = _shape(node)
    return None if shape is None else len(shape)

