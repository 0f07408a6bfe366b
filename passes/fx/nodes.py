"""What the FX passes read off a node: op keys, the tensors and float dtypes of a meta value,
module paths, explicit casts, attribute reads and views.

Helpers only (no pass lives here); ``passes.fx.dataflow``, ``passes.fx.prepare`` and the
passes after them share them.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from passes.fx._torch_internals import TORCH_OPS, OpOverload, op_schema

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
SHORT_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
CAST_OPS = ("aten.to", "aten._to_copy", "aten.type_as")


# id(op) -> (op, policy key, is a cast op), for torch ops and operator.getitem only: they
# live as long as the process (torch.ops interns them), so holding one costs nothing and
# keeps its id unique. Other targets (a runtime's bound method holding weights ...) are
# never held.
_OP_KEYS: dict[int, tuple[Any, str, bool]] = {}


def op_key(node: fx.Node) -> str:
    """Policy key of an FX node: ``aten.softmax.int``, ``getitem``, or the function name."""
    t = node.target
    if type(t) is str:  # placeholder, get_attr, call_module, call_method, output
        return t
    hit = _OP_KEYS.get(id(t))
    if hit is not None and hit[0] is t:
        return hit[1]
    return target_info(t)[1]


def target_info(t: Any) -> tuple[Any, str, bool]:
    """(target, policy key, whether the key names a cast op); cached for torch ops.

    Example:
        >>> target_info(torch.ops.aten._to_copy.default)[1:]
        ('aten._to_copy', True)
    """
    hit = _OP_KEYS.get(id(t))
    if hit is None or hit[0] is not t:
        key = t if type(t) is str else _target_key(t)
        hit = (t, key, key.startswith(CAST_OPS))
        if isinstance(t, TORCH_OPS) or t is operator.getitem:
            _OP_KEYS[id(t)] = hit
    return hit


def _target_key(t: Any) -> str:
    if isinstance(t, TORCH_OPS):
        return t.name().replace("::", ".")
    if t is operator.getitem:
        return "getitem"
    return getattr(t, "__name__", str(t))


def tensors(value: Any) -> list[torch.Tensor]:
    """Tensors in a meta value (a tensor, or a tuple/list of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    out: list[torch.Tensor] = []
    if isinstance(value, (tuple, list)):
        for v in value:
            if isinstance(v, torch.Tensor):  # the common case, without a call
                out.append(v)
            else:
                out += tensors(v)
    return out


def is_float(value: Any) -> bool:
    """Whether a meta value holds a fp32/fp16/bf16 tensor."""
    if isinstance(value, torch.Tensor):
        return value.dtype in FLOATS
    if isinstance(value, (tuple, list)):
        return any(is_float(v) for v in value)
    return False


def has_fp64(value: Any) -> bool:
    """Whether a meta value holds an fp64 tensor (never changed by the passes).

    Example:
        >>> has_fp64((torch.zeros(1), torch.zeros(1, dtype=torch.float64)))
        True
    """
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.float64
    if isinstance(value, (tuple, list)):
        return any(has_fp64(v) for v in value)
    return False


def node_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes ``node`` reads, in order, each once (``all_input_nodes`` as a new list).

    Example:
        >>> [a.name for a in node_inputs(add_node)]
        ['x', 'y']
    """
    return [a for a in node.all_input_nodes]


_NO_MODULE = "_empty_nn_module_stack_from_metadata_hook"


def module_info(node: fx.Node) -> tuple[str, tuple[str, ...]]:
    """Innermost module path and the classes of all enclosing modules."""
    stack = node.meta.get("nn_module_stack")
    # torch.export's placeholder for a node traced outside any module is no module
    entries = [e for k, e in (stack or {}).items() if not k.startswith(_NO_MODULE)]
    if not entries:
        return "", ()
    path = entries[-1][0] if isinstance(entries[-1], tuple) else ""
    classes = tuple(str(e[1]) if isinstance(e[1], str) else
                    f"{e[1].__module__}.{e[1].__qualname__}" for e in entries)
    return path, classes


def explicit_cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype a user-written ``.to(dtype)`` asks for, or None."""
    if node.op != "call_function" or not target_info(node.target)[2]:
        return None
    for v in (*node.args[1:], *node.kwargs.values()):
        if isinstance(v, torch.dtype):
            return v
    return None


def is_cast_key(key: str) -> bool:
    """Whether a policy key names a cast op (``aten.to``, ``aten._to_copy``, ``aten.type_as``).

    Example:
        >>> is_cast_key("aten._to_copy")
        True
    """
    return key.startswith(CAST_OPS)


def fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    """What a ``get_attr`` node with ``target`` ("layer.0.weight") reads from ``gm``."""
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` is an aten op whose result aliases its first input (a view, or an
    in-place op's return), so writes through either reach the other."""
    return (node.op == "call_function" and isinstance(node.target, OpOverload)
            and bool(node.args) and isinstance(node.args[0], fx.Node)
            and any(r.alias_info is not None for r in op_schema(node.target).returns))


SDPA_MASK_SLOT = 3  # scaled_dot_product_attention's attn_mask, after query, key and value


def sdpa_mask(node: fx.Node) -> fx.Node | None:
    """The ``attn_mask`` node of a ``scaled_dot_product_attention`` call, positional or
    keyword; None where it has no mask node."""
    if len(node.args) > SDPA_MASK_SLOT:
        mask = node.args[SDPA_MASK_SLOT]
    else:
        mask = node.kwargs.get("attn_mask")
    return mask if isinstance(mask, fx.Node) else None


def set_sdpa_mask(node: fx.Node, mask: fx.Node | None) -> None:
    """Give a ``scaled_dot_product_attention`` call another ``attn_mask`` (or none), in
    the slot its mask was passed in."""
    if len(node.args) > SDPA_MASK_SLOT:
        node.args = (*node.args[:SDPA_MASK_SLOT], mask, *node.args[SDPA_MASK_SLOT + 1:])
    else:
        node.kwargs = {**node.kwargs, "attn_mask": mask}
