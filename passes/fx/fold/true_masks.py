"""``drop_true_masks``: an attention mask that is True everywhere is no mask.

Under export transformers cannot skip a mask on the host, so a model without padding
still traces one: ViT's ``sdpa_mask`` is ``arange(n) >= 0`` broadcast over the batch, all
True, built and converted to an additive mask every forward, and it keeps CUDA's SDPA off
its flash kernel (which takes no mask). When a boolean mask's values follow from the
graph's constants alone (no input, parameter or buffer; sizes may be symbolic only in
the broadcasts it is made by), this pass computes them at rewrite time and, if every one
is True, gives the attention no mask: the same scores, and the kernel the eager model
takes without one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from passes._infra import PassResult, visiting
from passes.fx._torch_internals import OpOverload
from passes.fx.nodes import sdpa_mask, set_sdpa_mask, tensors

aten = torch.ops.aten

SDPA = aten.scaled_dot_product_attention.default
# ops that only broadcast, reshape or alias their first input: a mask made by them from an
# all-True value is all True whatever their (possibly symbolic) sizes
BROADCASTS = {aten.expand.default, aten.unsqueeze.default, aten.view.default,
              aten.reshape.default, aten.alias.default, aten.detach.default,
              aten.clone.default, aten.squeeze.dim, aten.squeeze.default,
              aten.expand_as.default}
MAX_NUMEL = 1 << 16  # a constant mask computed at rewrite time stays small


def drop_true_masks(gm: fx.GraphModule, recompile: bool = True) -> PassResult:
    """Give every ``scaled_dot_product_attention`` whose ``attn_mask`` is a boolean tensor
    computed from constants only, and True everywhere, no mask.

    Example:
        >>> drop_true_masks(gm).modified  # HF ViT: its all-True sdpa_mask
        True
    """
    verdicts: dict[fx.Node, bool] = {}
    modified = False
    for node in visiting(list(gm.graph.find_nodes(op="call_function", target=SDPA))):
        mask = sdpa_mask(node)
        if mask is None:
            continue
        if mask not in verdicts:
            verdicts[mask] = _all_true(gm, mask)
        if not verdicts[mask]:
            continue
        set_sdpa_mask(node, None)
        modified = True
    if modified and recompile:
        gm.recompile()
    return PassResult(gm, modified)



def _all_true(gm: fx.GraphModule, mask: fx.Node) -> bool:
    if _dtype(mask) != torch.bool:
        return False
    node = mask
    while node.op == "call_function" and node.target in BROADCASTS:
        node = node.args[0]
    value = _value(gm, node, {})
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool \
        and bool(value.all())


_UNKNOWN = object()


def _value(gm: fx.GraphModule, node: Any, memo: dict) -> Any:
    """``node``'s value computed from the graph's constants, or ``_UNKNOWN``."""
    if not isinstance(node, fx.Node):
        if isinstance(node, (list, tuple)):
            items = [_value(gm, a, memo) for a in node]
            return _UNKNOWN if any(a is _UNKNOWN for a in items) else type(node)(items)
        return _UNKNOWN if isinstance(node, torch.SymInt) else node
    if node in memo:
        return memo[node]
    memo[node] = _UNKNOWN  # cycles cannot occur; this also bounds repeated failures
    if node.op == "get_attr":
        memo[node] = _constant(gm, node.target)
    elif node.op == "call_function" and isinstance(node.target, OpOverload) \
            and torch.Tag.nondeterministic_seeded not in node.target.tags \
            and all(n <= MAX_NUMEL for n in _numels(node)):
        args = _value(gm, list(node.args), memo)
        kwargs = {k: _value(gm, v, memo) for k, v in node.kwargs.items()}
        if args is not _UNKNOWN and _UNKNOWN not in kwargs.values():
            try:
                memo[node] = node.target(*args, **kwargs)
            except (RuntimeError, TypeError, ValueError):  # what the graph's run would say
                pass
    return memo[node]


def _constant(gm: fx.GraphModule, target: str) -> Any:
    """A plain tensor attribute (a lifted constant: nothing outside the graph changes it);
    parameters and buffers are ``_UNKNOWN``."""
    owner_path, _, attr = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    value = owner.__dict__.get(attr)
    return value if type(value) is torch.Tensor and value.numel() <= MAX_NUMEL else _UNKNOWN


def _numels(node: fx.Node) -> list[int]:
    """Each output's element count at the captured sizes (symbolic: a size too large)."""
    numels = (t.numel() for t in tensors(node.meta.get("val")))
    return [n if type(n) is int else MAX_NUMEL + 1 for n in numels]  # no guard on a SymInt


def _dtype(node: fx.Node) -> torch.dtype | None:
    ts = tensors(node.meta.get("val"))
    return ts[0].dtype if len(ts) == 1 else None
