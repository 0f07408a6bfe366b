"""``sink_gather_casts``: an embedding gathers from its fp32 table and casts the rows."""

from __future__ import annotations

import torch
from torch import fx

from passes._infra import PassResult, visiting
from passes.fx._torch_internals import size_hint
from passes.fx.dtypes import CAST, dtype_of, is_amp_cast
from passes.fx.nodes import tensors
from passes.policy import FP32

aten = torch.ops.aten


GATHERS = {aten.embedding.default}


def sink_gather_casts(gm: fx.GraphModule, low: torch.dtype) -> PassResult:
    """``embedding(cast(W), ids)`` becomes ``cast(embedding(W, ids))`` when the lookup is
    smaller than the table: a gather does no arithmetic, so the values are the same, but
    only the rows used are cast, and the table's gradient is made in fp32 directly instead
    of in ``low`` and then converted.

    Example:
        >>> sink_gather_casts(gm, torch.bfloat16).modified
        True
    """
    modified = False
    for node in visiting(list(gm.graph.nodes)):
        if node.op != "call_function" or node.target not in GATHERS:
            continue
        cast = node.args[0]
        if not (is_amp_cast(cast) and cast.target is CAST and dtype_of(cast) == low
                and cast.args[0].op == "get_attr" and len(cast.users) == 1):
            continue
        table, out = _numel(cast.args[0]), _numel(node)
        if table is None or out is None or out >= table:
            continue
        node.args = (cast.args[0], *node.args[1:])
        gm.graph.erase_node(cast)
        with gm.graph.inserting_after(node):
            narrow = gm.graph.call_function(CAST, (node,), {"dtype": low})
        node.replace_all_uses_with(narrow, delete_user_cb=lambda u, n=narrow: u is not n)
        narrow.meta.update(amp_cast=True, amp_precision="n/a", val=node.meta.get("val"),
                           amp_dtype=low, amp_reason=f"cast torch.float32 -> {low}")
        if "nn_module_stack" in node.meta:
            narrow.meta["nn_module_stack"] = node.meta["nn_module_stack"]
        node.meta.update(amp_dtype=torch.float32, amp_precision=FP32, amp_reason=(
            f"gathers from the fp32 table ({table} elements) and casts its smaller "
            f"output ({out}): same values, fewer bytes cast"))
        modified = True
    return PassResult(gm, modified)


def _numel(node: fx.Node) -> int | None:
    """Elements of a node's single tensor output at the captured sizes, or None."""
    ts = tensors(node.meta.get("val"))
    if len(ts) != 1:
        return None
    n = 1
    for d in ts[0].shape:
        if not isinstance(d, int):
            try:
                d = size_hint(d)
            except Exception:  # unbacked or hint-less sizes
                return None
        n *= int(d)
    return n
