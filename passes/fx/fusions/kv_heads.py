"""Attention on key/value heads repeated for grouped-query attention (HF's ``repeat_kv``) takes
the unrepeated ones, one of two ways, as the runtime asks:

- ``group_kv_heads``: ``enable_gqa`` (``RuntimeOps.unrepeated_kv_heads``, the CPU's);
- ``stack_kv_queries``: the query heads that share a key/value head stacked as the rows of
  one head, equal head counts, no ``enable_gqa`` (``RuntimeOps.stacked_kv_heads``, CUDA's).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from passes._infra import PassResult, visiting
from passes.fx.nodes import tensors

aten = torch.ops.aten


ATTENTION = aten.scaled_dot_product_attention.default
RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}
# scaled_dot_product_attention's positional slots (scale and enable_gqa are keywords only)
MASK, DROPOUT, CAUSAL = 3, 4, 5


def group_kv_heads(gm: fx.GraphModule) -> PassResult:
    """``sdpa(q, repeat(k, n), repeat(v, n))`` becomes ``sdpa(q, k, v, enable_gqa=True)`` on
    the CPU, ``repeat`` being HF's ``repeat_kv`` (``x[:, :, None].expand(b, h, n, s, d)
    .reshape(b, h * n, s, d)``; a captured HF model passes its mask, and HF repeats the
    heads whenever there is one). The outputs are the same (query head ``i`` reads key head
    ``i // n`` either way; the key and value gradients are summed over each group before
    their one rounding, not after), but the repeated keys and values are never copied
    (docs/performance.md#grouped-query-attention). The pipeline runs it only for a runtime that
    asks for it (``RuntimeOps.unrepeated_kv_heads``: CUDA's kernels run a masked grouped
    attention on cuDNN or the math path; its runtime asks for :func:`stack_kv_queries`).
    (The runtime's unfused kernel repeats the heads itself: ``ampgraph.runtime.cpu.attention``.)

    Example:
        >>> group_kv_heads(gm).modified
        True
    """
    modified = False
    for node in visiting(list(gm.graph.find_nodes(op="call_function", target=ATTENTION))):
        first = node.args[0] if node.args else None
        q = tensors(first.meta.get("val")) if isinstance(first, fx.Node) else ()
        if len(node.args) < 3 or node.kwargs.get("enable_gqa") or not q:
            continue
        key, value = _repeated(node.args[1]), _repeated(node.args[2])
        if key is None or value is None or key[1] != value[1] or len(q[0].shape) != 4 \
                or not statically_known_true(q[0].shape[1] == key[2]):
            continue  # grouped attention needs the query's own heads: no broadcast one
        node.update_arg(1, key[0])
        node.update_arg(2, value[0])
        node.update_kwarg("enable_gqa", True)
        modified = True
    return PassResult(gm, modified)


def _repeated(node: fx.Node) -> tuple[fx.Node, int, Any] | None:
    """``(x, n, heads)`` when ``node`` is ``x`` (4-D) with each head repeated ``n`` times in
    place (unsqueeze at 2, expand that dimension to ``n``, merge it into the ``heads``)."""
    if node.op != "call_function" or node.target not in RESHAPES:
        return None
    expand = node.args[0]
    if expand.op != "call_function" or expand.target is not aten.expand.default:
        return None
    unsqueeze = expand.args[0]
    if unsqueeze.op != "call_function" or unsqueeze.target is not aten.unsqueeze.default \
            or unsqueeze.args[1] not in (2, -3):
        return None
    x = unsqueeze.args[0]
    shapes = [tensors(n.meta.get("val")) for n in (x, expand, node)]
    if not all(len(t) == 1 for t in shapes):
        return None
    xs, es, rs = (t[0].shape for t in shapes)
    n = es[2] if len(es) == 5 else None
    if len(xs) != 4 or len(rs) != 4 or not isinstance(n, int):
        return None
    same = [(es[0], xs[0]), (es[1], xs[1]), (es[3], xs[2]), (es[4], xs[3]),
            (rs[0], xs[0]), (rs[1], xs[1] * n), (rs[2], xs[2]), (rs[3], xs[3])]
    if not all(statically_known_true(a == b) for a, b in same):
        return None
    return x, n, rs[1]


def stack_kv_queries(gm: fx.GraphModule, recompile: bool = True) -> PassResult:
    """``sdpa(q, repeat(k, n), repeat(v, n), mask)`` becomes ``sdpa(stack(q), k, v,
    rows(mask))`` viewed back to ``q``'s heads, ``repeat`` being HF's ``repeat_kv`` (as for
    :func:`group_kv_heads`): the ``n`` query heads of each key/value head are stacked as
    the rows of one head (``[b, h_kv * n, s, d]`` as ``[b, h_kv, n * s, d]``), so the heads
    are equal and every fused CUDA kernel takes it (memory-efficient attention refuses
    unequal head counts, flash a mask: with a mask, ``enable_gqa`` runs on cuDNN or on the
    math path). Each query row attends the same keys with the same mask row as before: the
    mask's rows are repeated once per graph (one copy shared by every attention that reads
    it), a mask of one row or none at all is taken as it is.

    Fires only where nothing else is copied: the stacked query must be a view of ``q``
    (its heads split in two, one half merged with the rows, ``n``-major or row-major as
    ``q``'s strides allow: any query of one key/value head (multi-query attention) or of
    one row (a decoding step), or heads laid out before rows; not HF LLaMA's training
    query, whose rows lie between its heads: stacking it would copy the query and the
    output, as many bytes as the repeats). Left alone: ``is_causal`` (the stacked rows
    would be masked by their stacked index; an explicit mask instead would take flash's
    causal kernel away), dropout (the same distribution, drawn at other positions), a mask
    with its own heads, a query broadcast over heads. The output comes back in the layout
    the kernel gives a query laid out like ``q`` where it can, copied otherwise (a kernel
    writing ``[b, rows, heads, d]``, such as memory-efficient attention with several
    key/value heads: one copy of the output, never more bytes than the repeats it saves).
    Precisions are the painter's: the new nodes are views and one copy of the mask.

    Example:
        >>> stack_kv_queries(gm).modified
        True
    """
    graph = gm.graph
    masks: dict[tuple[fx.Node, str, int], fx.Node] = {}  # one stacked mask a graph
    modified = False
    for node in visiting(list(graph.find_nodes(op="call_function", target=ATTENTION))):
        plan = _stacking(node)
        if plan is None:
            continue
        q, key, value, mask, order, n = plan
        with graph.inserting_before(node):
            stacked = _chain(q, _query_ops(order, n), node, "the query heads of each "
                             "key/value head stacked as its rows (stack_kv_queries)")
            if mask is not None and not _one_row(mask):
                shared = masks.get((mask, order, n))
                if shared is None:
                    shared = masks[(mask, order, n)] = _chain(
                        mask, _mask_ops(order, n, _val(mask).dim()), mask,
                        f"the rows of {mask.name} repeated once for every attention on "
                        "stacked query heads (stack_kv_queries)")
                mask = shared
        args = [stacked, key, value, mask, *node.args[MASK + 1:]]
        kwargs = {k: v for k, v in node.kwargs.items() if k != "attn_mask"}
        users = list(node.users)
        node.args, node.kwargs = tuple(args), kwargs
        node.meta["val"] = _apply(_val(node), _query_ops(order, n))
        with graph.inserting_before(node.next):  # in order (inserting_after reverses)
            back = _chain(node, _output_ops(order, n), node, "the stacked attention rows "
                          "viewed back as the query's heads (stack_kv_queries)")
        for user in users:
            user.replace_input_with(node, back)
        modified = True
    if modified and recompile:
        gm.recompile()
    return PassResult(gm, modified)


def _stacking(node: fx.Node) -> tuple | None:
    """``(q, k, v, mask, order, n)`` where ``node`` can take stacked queries (see
    :func:`stack_kv_queries`), ``order`` being ``"ns"`` (``n``-major rows) or ``"sn"``."""
    if len(node.args) < 3 or node.kwargs.get("enable_gqa") \
            or _slot(node, DROPOUT, "dropout_p", 0.0) != 0.0 \
            or _slot(node, CAUSAL, "is_causal", False) is not False:
        return None
    q, mask = node.args[0], _slot(node, MASK, "attn_mask", None)
    qv = _val(q)
    if qv is None or qv.dim() != 4 or getattr(qv, "fake_mode", None) is None \
            or (mask is not None and _val(mask) is None):
        return None
    key, value = _repeated(node.args[1]), _repeated(node.args[2])
    if key is None or value is None or key[1] != value[1] or key[1] < 2 \
            or not statically_known_true(qv.shape[1] == key[2]):
        return None
    n, (_, _, rows, _), (_, head_stride, row_stride, _) = key[1], qv.shape, qv.stride()
    if mask is not None:
        mv = _val(mask)
        heads = mv.shape[-3] if mv.dim() >= 3 else 1
        if mv.dim() > 4 or not statically_known_true(heads == 1) or not (_one_row(mask) or (
                statically_known_true(mv.shape[-2] == rows) and hasattr(mv, "fake_mode"))):
            return None  # (a mask to repeat is repeated on fake tensors)
    if statically_known_true(rows == 1) or statically_known_true(
            head_stride == rows * row_stride):
        order = "ns"  # a head's rows follow one another: the n heads' rows merge
    elif statically_known_true(row_stride == n * head_stride):
        order = "sn"  # the n heads of a row follow one another: they merge with the rows
    else:
        return None
    return q, key[0], value[0], mask, order, n


def _slot(node: fx.Node, index: int, name: str, default: Any) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _val(node: Any) -> torch.Tensor | None:
    ts = tensors(node.meta.get("val")) if isinstance(node, fx.Node) else ()
    return ts[0] if len(ts) == 1 else None


def _one_row(mask: fx.Node) -> bool:
    """Whether the mask has one row for every query (it broadcasts over stacked rows)."""
    mv = _val(mask)
    return mv.dim() < 2 or statically_known_true(mv.shape[-2] == 1)


# The rewrites as (op, arguments after the input) chains, sizes static or -1 (no symbols).


def _query_ops(order: str, n: int) -> list[tuple]:
    """``[b, h_kv * n, s, d]`` -> ``[b, h_kv, n * s, d]`` (rows ``n``-major or row-major)."""
    swap = [] if order == "ns" else [(aten.transpose.int, 2, 3)]
    return [(aten.unflatten.int, 1, [-1, n]), *swap, (aten.flatten.using_ints, 2, 3)]


def _output_ops(order: str, n: int) -> list[tuple]:
    """``[b, h_kv, n * s, d]`` -> ``[b, h_kv * n, s, d]``, through ``[b, s, h, d]``: a view
    where the kernel wrote the stacked rows like the query's, else one copy, laid out as a
    kernel writing ``[b, rows, heads, d]`` lays out the unstacked output."""
    split, perm = ([n, -1], [0, 3, 1, 2, 4]) if order == "ns" else ([-1, n], [0, 2, 1, 3, 4])
    return [(aten.unflatten.int, 2, split), (aten.permute.default, perm),
            (aten.flatten.using_ints, 2, 3), (aten.transpose.int, 1, 2)]


def _mask_ops(order: str, n: int, dim: int) -> list[tuple]:
    """A mask's rows (dimension -2) repeated ``n`` times in the stacked rows' order."""
    at = dim - 2 if order == "ns" else dim - 1  # the new dimension: before or after the rows
    sizes = [-1] * (dim + 1)
    sizes[at] = n
    return [(aten.unsqueeze.default, at), (aten.expand.default, sizes),
            (aten.flatten.using_ints, dim - 2, dim - 1)]


def _apply(val: torch.Tensor, ops: list[tuple]) -> torch.Tensor:
    with val.fake_mode:
        for op, *args in ops:
            val = op(val, *args)
    return val


def _chain(src: fx.Node, ops: list[tuple], like: fx.Node, reason: str) -> fx.Node:
    """``ops`` applied to ``src`` as new nodes (their values on fake tensors), each with
    ``src``'s dtypes and ``like``'s precision and module path; the last one."""
    graph, node, val = src.graph, src, _val(src)
    for op, *args in ops:
        node = graph.call_function(op, (node, *args))
        with val.fake_mode:
            val = op(val, *args)
        node.meta.update(
            val=val, amp_inserted=True, amp_reason=reason,
            amp_precision=like.meta.get("amp_precision", "n/a"))
        for k in ("amp_dtype", "amp_orig_dtype"):
            if k in src.meta:
                node.meta[k] = src.meta[k]
        if "nn_module_stack" in like.meta:
            node.meta["nn_module_stack"] = like.meta["nn_module_stack"]
    return node
