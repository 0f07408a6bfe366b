"""``route_fp8_products``: the matrix products that pay in FP8 call the runtime's FP8
product (``RuntimeOps.fp8_linear``); every other product keeps the level's 16-bit dtype.

Eligible: a product of an activation in the low dtype and a parameter's weight (its cast
inserted by the passes): ``aten.linear(x, cast(w), b)``, or ``aten.addmm(b, x, cast(w))`` on
a 2-D ``x`` (transformers' ``Conv1D``, its weight stored ``[in, out]``). Products of two
activations (attention's), embeddings, norms and softmax are never eligible. An eligible
product runs in FP8 unless, in this order of precedence:

1. the recipe's ``exclude`` names it (op, ``class:Name`` or module path);
2. the recipe's ``include`` names it (then it runs FP8 if its dimensions allow);
3. it is the graph's first or last eligible product, or reaches an output through views
   and casts only (the head), with ``keep_first_last``;
4. its weight's shape fails the recipe's cost rule (:meth:`FP8Recipe.shape_verdict`).

The routed node takes the fp32 master weight (its 16-bit cast goes when nothing else reads
it: the runtime makes the FP8 copy once per step) and keeps its 16-bit output. Every
eligible node's ``amp_reason`` says why it runs or does not run FP8, and a routed node's
``amp_precision`` is ``"fp8"``: ``explain`` shows both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from passes._infra import PassResult, visiting
from passes.fx.dtypes import CAST, dtype_of, is_amp_cast
from passes.fx.fp8_recipe import FP8Recipe
from passes.fx.nodes import module_info, op_key
from passes.fx.routing.linears import product_operands
from passes.policy import module_match

aten = torch.ops.aten

_PASS_THROUGH = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, CAST,
                 aten.clone.default)


def route_fp8_products(gm: fx.GraphModule, fp8_linear: Callable[..., Any], low: torch.dtype,
                       recipe: FP8Recipe, prefix: str = "") -> PassResult:
    """Route the products ``recipe`` chooses to ``fp8_linear(x, w, b, transposed=,
    scaling=, weight_grad=)``; ``prefix``: the compiled module's path in the model the
    recipe's patterns name. Run after the casts are inserted and before the weight casts
    are routed or grouped.

    Example:
        >>> route_fp8_products(gm, runtime.fp8.linear, torch.bfloat16, FP8Recipe())
    """
    products = [(node, ops) for node in gm.graph.nodes
                if (ops := eligible_operands(node, low)) is not None]
    ends = {products[0][0], products[-1][0]} if products else set()
    modified = False
    for node, (x, w_cast, b, transposed) in visiting(products):
        weight = w_cast.args[0]
        out_f, in_f = _weight_shape(w_cast, transposed)
        why = _kept_why(node, recipe, prefix, out_f, in_f, node in ends)
        if why is not None:
            node.meta["amp_reason"] = f"{node.meta.get('amp_reason', '')}; not FP8: {why}"
            continue
        # the reason first: it reads the op's name, which the retargeting replaces
        node.meta["amp_reason"] = (f"FP8 product ({recipe.describe()}): weight "
                                   f"({out_f}, {in_f}) {_chosen_why(node, recipe, prefix)}")
        node.target = fp8_linear
        node.args = (x, weight, _master(gm, b))
        node.kwargs = {"transposed": transposed, "scaling": recipe.scaling,
                       "weight_grad": recipe.weight_grad}
        node.meta["amp_orig_op"] = "aten.linear"
        node.meta["amp_precision"] = "fp8"
        for cast in (w_cast, b):
            if is_amp_cast(cast) and not cast.users:
                gm.graph.erase_node(cast)
        modified = True
    return PassResult(gm, modified)


def eligible_operands(node: fx.Node, low: torch.dtype
                      ) -> tuple[fx.Node, fx.Node, Any, bool] | None:
    """``(x, the weight's cast, the bias, transposed)`` of a product of a ``low``
    activation and a parameter's weight (its cast not routed yet), else None."""
    operands = product_operands(node)
    if operands is None:
        return None
    x, w = operands[:2]
    if not (is_amp_cast(w) and w.target is CAST and isinstance(w.args[0], fx.Node)
            and w.args[0].op == "get_attr" and dtype_of(x) == low == dtype_of(w)
            and len(_shape(w)) == 2):
        return None
    return operands


def _kept_why(node: fx.Node, recipe: FP8Recipe, prefix: str, out_f: int, in_f: int,
              end: bool) -> str | None:
    named = _named(node, recipe.exclude, prefix)
    if named:
        return f"excluded by the recipe ({named!r})"
    if _named(node, recipe.include, prefix):
        return recipe.shape_verdict(out_f, in_f) if out_f % 16 or in_f % 16 else None
    if recipe.keep_first_last:
        if end:
            return "the graph's first or last matrix product (kept 16-bit, as Megatron's " \
                   "--first-last-layers-bf16)"
        if _reaches_output(node):
            return "a head: its product is an output (kept 16-bit)"
    return recipe.shape_verdict(out_f, in_f)


def _chosen_why(node: fx.Node, recipe: FP8Recipe, prefix: str) -> str:
    named = _named(node, recipe.include, prefix)
    if named:
        return f"included by the recipe ({named!r})"
    return "passes the rule" if recipe.rule == "auto" else "rule 'all'"


def _named(node: fx.Node, patterns: tuple[str, ...], prefix: str) -> str | None:
    path, classes = module_info(node)
    path = ".".join(p for p in (prefix, path) if p)
    key = op_key(node)
    for pattern in patterns:
        if pattern.startswith("aten.") and (key == pattern or key.startswith(pattern + ".")):
            return pattern
        if not pattern.startswith("aten.") and module_match(pattern, path, classes) is not None:
            return pattern
    return None


def _reaches_output(node: fx.Node) -> bool:
    """Whether every reader of ``node``, through views and casts, is the graph's output."""
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        for user in n.users:
            if user.op == "output":
                continue
            if user.target not in _PASS_THROUGH or user in seen:
                return False
            seen.add(user)
            stack.append(user)
    return True


def _master(gm: fx.GraphModule, b: Any) -> Any:
    """The bias the FP8 product takes: the fp32 parameter behind the passes' cast."""
    if is_amp_cast(b) and b.target is CAST and isinstance(b.args[0], fx.Node) \
            and b.args[0].op == "get_attr":
        return b.args[0]
    return b


def _weight_shape(weight: fx.Node, transposed: bool) -> tuple[int, int]:
    shape = _shape(weight)
    return (int(shape[1]), int(shape[0])) if transposed else (int(shape[0]), int(shape[1]))


def _shape(node: Any) -> tuple:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(getattr(val, "shape", ()))
