"""``fuse_tanh_gelu``: the tanh approximation of GELU written out in elementwise ops becomes
``aten.gelu(x, approximate="tanh")``."""

from __future__ import annotations

import math

import torch
from torch import fx

from passes._infra import PassResult, visiting

aten = torch.ops.aten

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
CUBIC = 0.044715
_MULS = (aten.mul.Tensor, aten.mul.Scalar)
_ADDS = (aten.add.Tensor, aten.add.Scalar)


def fuse_tanh_gelu(gm: fx.GraphModule) -> PassResult:
    """``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))`` (transformers'
    ``NewGELUActivation``, GPT-2's ``gelu_new`` and the models that copied it) becomes one
    ``aten.gelu(x, approximate="tanh")``: the same function, in one kernel instead of eight
    (and their eight backward ops), computed at fp32 inside on a 16-bit input and rounded
    once instead of after every op; its ``pow`` no longer needs fp32 for fp16's range (the
    painter kept it fp32, with a cast on each side). Runs on the captured graph before
    painting, so the painter sees the one op. Every inner op must serve only the next one;
    the constants must match to 1e-6.

    Example:
        >>> fuse_tanh_gelu(gm).modified  # a GPT-2 block
        True
    """
    modified = False
    for tanh in visiting(list(gm.graph.find_nodes(op="call_function",
                                                   target=aten.tanh.default))):
        chain = _match(tanh)
        if chain is None:
            continue
        x, out, inner = chain
        with gm.graph.inserting_before(out):
            gelu = gm.graph.call_function(aten.gelu.default, (x,), {"approximate": "tanh"})
        gelu.meta = dict(out.meta)
        gelu.meta["amp_fused_from"] = "tanh-GELU written out in elementwise ops"
        out.replace_all_uses_with(gelu)
        for node in [out, *inner]:  # users first
            if not node.users:
                gm.graph.erase_node(node)
        modified = True
    return PassResult(gm, modified)


def _match(tanh: fx.Node) -> tuple[fx.Node, fx.Node, list[fx.Node]] | None:
    """``(x, the product that is the GELU, the inner nodes, users first)`` when ``tanh`` is
    the tanh of a tanh-GELU, else None."""
    scaled = _scalar_factor(tanh.args[0], SQRT_2_OVER_PI)
    if scaled is None or not _only_user(tanh.args[0], tanh):
        return None
    inner = scaled  # x + 0.044715 * x**3
    if inner.op != "call_function" or inner.target not in _ADDS or len(inner.args) != 2 \
            or inner.kwargs or not _only_user(inner, tanh.args[0]):
        return None
    for x, cubic in (inner.args, inner.args[::-1]):
        cube = _scalar_factor(cubic, CUBIC) if isinstance(cubic, fx.Node) else None
        if cube is not None and _only_user(cubic, inner) and _is_cube_of(cube, x) \
                and _only_user(cube, cubic):
            break
    else:
        return None
    plus_one = _single_user(tanh)
    if plus_one is None or plus_one.target not in _ADDS or plus_one.kwargs \
            or sorted(map(_kind, plus_one.args)) != ["node", "one"]:
        return None
    out = _single_user(plus_one)
    if out is None or out.target not in _MULS or out.kwargs or len(out.args) != 2:
        return None
    half = out.args[1] if out.args[0] is plus_one else out.args[0]
    if not isinstance(half, fx.Node) or _scalar_factor(half, 0.5) is not x \
            or not _only_user(half, out):
        return None
    return x, out, [plus_one, half, tanh, tanh.args[0], inner, cubic, cube]


def _scalar_factor(node: object, value: float) -> fx.Node | None:
    """``y`` when ``node`` is ``y * value`` or ``value * y`` (to 1e-6)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" \
            or node.target not in _MULS or node.kwargs or len(node.args) != 2:
        return None
    for y, c in (node.args, node.args[::-1]):
        if isinstance(y, fx.Node) and type(c) in (int, float) \
                and math.isclose(c, value, rel_tol=1e-6):
            return y
    return None


def _is_cube_of(node: fx.Node, x: object) -> bool:
    return (node.op == "call_function" and node.target is aten.pow.Tensor_Scalar
            and not node.kwargs and node.args[0] is x and node.args[1] in (3, 3.0))


def _kind(arg: object) -> str:
    if isinstance(arg, fx.Node):
        return "node"
    return "one" if type(arg) in (int, float) and arg == 1 else "other"


def _single_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    if len(users) != 1 or users[0].op != "call_function":
        return None
    return users[0]


def _only_user(node: fx.Node, user: fx.Node) -> bool:
    return list(node.users) == [user]
