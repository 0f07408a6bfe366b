"""``group_kv_heads``: attention on key/value heads repeated for grouped-query attention takes
the unrepeated ones (``enable_gqa``)."""

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


def group_kv_heads(gm: fx.GraphModule) -> PassResult:
    """``sdpa(q, repeat(k, n), repeat(v, n))`` becomes ``sdpa(q, k, v, enable_gqa=True)`` on
    the CPU, ``repeat`` being HF's ``repeat_kv`` (``x[:, :, None].expand(b, h, n, s, d)
    .reshape(b, h * n, s, d)``; a captured HF model passes its mask, and HF repeats the
    heads whenever there is one). The outputs are the same (query head ``i`` reads key head
    ``i // n`` either way; the key and value gradients are summed over each group before
    their one rounding, not after), but the repeated keys and values are never copied
    (docs/performance.md#grouped-query-attention). The pipeline runs it only for a runtime that
    asks for it (``RuntimeOps.unrepeated_kv_heads``: CUDA's kernels run a masked grouped
    attention on the math path). (The runtime's unfused kernel repeats the
    heads itself: ``ampgraph.runtime.cpu.attention``.)

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
