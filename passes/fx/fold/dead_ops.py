"""``drop_dead_ops``: the aten ops the rewrite left unused, removed."""

from __future__ import annotations

from torch import fx

from passes._infra import PassResult
from passes.fx._torch_internals import OpOverload


def drop_dead_ops(gm: fx.GraphModule, recompile: bool = True) -> PassResult:
    """Remove the aten ops nothing uses any more: the model's own casts whose users the
    cast insertion rewired (HF's RMSNorm ``x.to(float32)`` beside a low ``mul`` converted a
    whole activation on every call for nothing), their inputs in turn, and unused
    parameter reads. Ops with side effects or random draws (``Node.is_impure``) and every
    call that is not an aten op stay.

    Example:
        >>> drop_dead_ops(gm).modified
        True
    """
    def keep(node: fx.Node) -> bool:
        if node.op == "get_attr":
            return False
        return (node.op != "call_function" or not isinstance(node.target, OpOverload)
                or node.is_impure())

    modified = gm.graph.eliminate_dead_code(is_impure_node=keep)
    if modified and recompile:
        gm.recompile()
    return PassResult(gm, modified)
