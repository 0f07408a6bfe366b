"""``skip_identity_ops``: the users of an op that returns its input's values read the input.

Traced models keep arithmetic that is the identity for the values it meets:
transformers' mask functions start from ``new_ones((), dtype=bool) & mask``, positions
are ``arange(n) + past_seen_tokens`` with nothing seen yet, and LLaMA's rotary angles are
``cos(x) * attention_scaling`` with a scaling of 1. The eager model runs them too, or
skips the whole mask on the host; in a graph each is a kernel a call (and a kernel in
backward where a gradient flows), for nothing.
"""

from __future__ import annotations

import torch
from torch import fx

from passes._infra import PassResult, visiting
from passes.fx.nodes import is_view, tensors

aten = torch.ops.aten

# op -> the scalar second operand that makes it the identity: exact for every dtype
# (x * 1, x / 1), or, for + and -, for integers and booleans only (-0.0 + 0 is +0.0)
TIMES_ONE = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}
PLUS_ZERO = {aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar}
AND = {aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default}


def skip_identity_ops(gm: fx.GraphModule, recompile: bool = True) -> PassResult:
    """Let the users of ``x * 1``, ``x / 1``, integer ``x + 0`` / ``x - 0`` and
    ``True & x`` (a 0-d boolean ``new_ones``) read ``x``, where the op keeps ``x``'s dtype
    and shape and ``x`` is a fresh value of the graph that nothing else reads (so no
    output, input or parameter comes to share storage with another value). The ops are
    dropped later if nothing else uses them (:func:`drop_dead_ops`).

    Example:
        >>> skip_identity_ops(gm).modified  # transformers' and_masks(...) under export
        True
    """
    modified = False
    for node in visiting(list(gm.graph.nodes)):
        x = _identity_input(node)
        if x is not None and _owned_alone(x) and _same_dtype(node, x):
            node.replace_all_uses_with(x)
            modified = True
    if modified and recompile:
        gm.recompile()
    return PassResult(gm, modified)


def _identity_input(node: fx.Node) -> fx.Node | None:
    """The input whose values ``node`` returns unchanged, or None."""
    if node.op != "call_function" or len(node.args) != 2:
        return None
    a, b = node.args
    if node.target in TIMES_ONE or node.target in PLUS_ZERO:
        if node.kwargs or not isinstance(a, fx.Node) or type(b) not in (int, float):
            return None
        if node.target in TIMES_ONE:
            return a if b == 1 else None
        return a if b == 0 and not _is_float(a) else None
    if node.target in AND and not node.kwargs:
        for one, x in ((a, b), (b, a)):
            if _is_true_scalar(one) and isinstance(x, fx.Node) and _dtype(x) == torch.bool:
                return x
    return None


def _is_true_scalar(node: object) -> bool:
    """A 0-d boolean ``new_ones``: True, broadcast to the other operand's shape."""
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target is aten.new_ones.default and list(node.args[1]) == []
            and node.kwargs.get("dtype") == torch.bool)


def _owned_alone(x: fx.Node) -> bool:
    """Whether ``x`` (through the views it is made by, each read once) is a fresh result
    of an op that only the identity op reads: reading it instead of the op's copy shares
    no storage that was not shared before."""
    while True:
        if len(x.users) != 1 or x.op != "call_function":
            return False
        if not is_view(x):
            return True
        x = x.args[0]


def _same_dtype(node: fx.Node, x: fx.Node) -> bool:
    dtype = _dtype(node)
    return dtype is not None and dtype == _dtype(x)


def _dtype(node: fx.Node) -> torch.dtype | None:
    ts = tensors(node.meta.get("val"))
    return ts[0].dtype if len(ts) == 1 else None


def _is_float(node: fx.Node) -> bool:
    dtype = _dtype(node)
    return dtype is None or dtype.is_floating_point or dtype.is_complex
