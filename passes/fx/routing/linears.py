"""``route_linears``: a linear casts its own weight and converts its weight gradient, and
applies the activation that reads its output."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import fx

from passes._infra import PassResult, visiting
from passes.fx.dtypes import CAST, dtype_of, is_amp_cast
from passes.fx.nodes import fetch_attr
from passes.fx.routing.parameter_uses import parameter_uses

aten = torch.ops.aten

_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def route_linears(gm: fx.GraphModule, linear_fn: Callable[..., Any], low: torch.dtype,
                  activations: Collection[str] = ()) -> PassResult:
    """Replace ``aten.linear(x, cast(w), b)`` by ``linear_fn(x, w, b)`` where ``x`` is
    ``low`` and the cast of parameter ``w`` (routed by :func:`route_weight_casts`) serves only
    this linear: the runtime then fuses the weight cast and the conversion of the weight
    gradient into the linear. ``aten.addmm(b, x, cast(w))`` on a 2-D ``x`` (transformers'
    ``Conv1D``, its weight stored ``[in, out]``) becomes ``linear_fn(x, w, b,
    transposed=True)``. Run after ``route_weight_casts``; the cast still happens (it stays
    counted), inside ``linear_fn``.

    A weight that other nodes use too (tied input and output embeddings) is passed with
    ``shared=True``: its gradient is summed from several places. An activation named in
    ``activations`` (keys of :data:`ACTIVATIONS`) that is the only reader of the output, or
    of a view of it, in the same dtype, is applied by ``linear_fn`` (``activation=``): the
    runtime may run it in the product's epilogue. Its node goes; the report still shows it
    (``meta["amp_absorbed"]``).

    Example:
        >>> route_linears(gm, cache.amp_linear, torch.bfloat16, {"gelu"})
    """
    uses = parameter_uses(gm)
    modified = False
    for node in visiting(list(gm.graph.nodes)):
        operands = _operands(node, low)
        if operands is None:
            continue
        x, w, b, transposed = operands
        node.target = linear_fn
        node.args = (x, w.args[0], b)
        node.kwargs = {"transposed": True} if transposed else {}
        if uses.get(id(fetch_attr(gm, w.args[0].target)), 0) > 1:
            node.update_kwarg("shared", True)
        node.meta["amp_fused_weight_cast"] = low
        gm.graph.erase_node(w)
        if _routed_cast(b):
            node.update_arg(2, b.args[0])
            node.meta["amp_fused_bias_cast"] = low
            gm.graph.erase_node(b)
        node.meta["amp_orig_op"] = "aten.linear"  # what it runs (on a [in, out] weight)
        node.meta["amp_reason"] = (f"{node.meta.get('amp_reason', '')}; its weight cast and "
                                   "the conversion of its weight gradient are fused into it")
        _absorb_activation(gm, node, activations)
        modified = True
    return PassResult(gm, modified)


def _routed_cast(node: object) -> bool:
    """Whether ``node`` is a routed cast of a parameter that serves one node only."""
    return (is_amp_cast(node) and node.target is not CAST and node.args[0].op == "get_attr"
            and len(node.users) == 1)


def product_operands(node: fx.Node) -> tuple[fx.Node, Any, Any, bool] | None:
    """``(x, w, b, transposed)`` of ``aten.linear(x, w, b)``, or of ``aten.addmm(b, x, w)``
    on a 2-D ``x`` and ``w`` (transformers' ``Conv1D``, ``w`` stored ``[in, out]``:
    ``transposed``), else None. (The FP8 products' pass takes the same products.)"""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is aten.linear.default and len(node.args) >= 2:
        return node.args[0], node.args[1], (node.args[2:] or (None,))[0], False
    if node.target is aten.addmm.default and len(node.args) == 3:
        b, x, w = node.args
        if len(getattr(_val(w), "shape", ())) == 2 == len(getattr(_val(x), "shape", ())):
            return x, w, b, True
    return None


def _operands(node: fx.Node, low: torch.dtype
              ) -> tuple[fx.Node, fx.Node, Any, bool] | None:
    """``(x, the weight's cast, the bias, transposed)`` of a linear or ``Conv1D`` product
    to route, else None."""
    operands = product_operands(node)
    if operands is None or dtype_of(operands[0]) != low or not _routed_cast(operands[1]):
        return None
    return operands


def _val(node: object) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


# aten's activation -> its name for the runtime's linear (``activation=``)
ACTIVATIONS = {(aten.relu.default, None): "relu", (aten.gelu.default, "none"): "gelu",
               (aten.gelu.default, "tanh"): "gelu_tanh", (aten.silu.default, None): "silu"}


def _absorb_activation(gm: fx.GraphModule, node: fx.Node, names: Collection[str]) -> None:
    """Hand the routed linear ``node`` the activation that alone reads its output (directly
    or through one view: an elementwise op commutes with it), if ``names`` has it."""
    users = list(node.users)
    view = users[0] if len(users) == 1 and users[0].target in _VIEWS else None
    readers = list(view.users) if view is not None else users
    if len(readers) != 1 or readers[0].op != "call_function":
        return
    act = readers[0]
    approximate = act.kwargs.get("approximate", "none") if act.target is aten.gelu.default \
        else None
    name = ACTIVATIONS.get((act.target, approximate))
    if name not in names or len(act.args) != 1 or set(act.kwargs) - {"approximate"} \
            or dtype_of(act) != dtype_of(node):
        return
    act.replace_all_uses_with(view if view is not None else node)
    node.update_kwarg("activation", name)
    node.meta["amp_reason"] += f"; it applies its {name} itself (in inference, in the product)"
    node.meta.setdefault("amp_absorbed", []).append(act)
    gm.graph.erase_node(act)
