"""``share_mask_conversions``: a boolean attention mask is made additive once per graph.

``scaled_dot_product_attention`` turns a boolean ``attn_mask`` into an additive one on
every call: ``where(mask, scalar_tensor(0), scalar_tensor(-inf))`` in the query's dtype,
three kernels. Eager HF models often skip the mask (an all-ones padding mask, checked on
the host); an exported graph keeps it, and every layer's attention reads the same mask,
so BERT-base converts it twelve times a forward (36 ops) and its efficient-attention
kernels each keep their own converted copy for backward. This pass converts each boolean
mask once per query dtype, just before its first attention, with the same ops and values,
from two 0-d constants made at rewrite time (one kernel a graph), and hands every
attention the result: SDPA takes an additive mask in the query's dtype as it is.

Values: the additive mask is the one SDPA makes itself on the CPU and for CUDA's flash,
efficient and math kernels (``-inf`` where the mask is False). Releases whose cuDNN path
fills ``-65504`` instead differ from it only in rows with every key masked, which that
workaround leaves unmasked; with ``-inf`` they give the other kernels' zeros. The kernel
choice does not depend on the mask's dtype (an additive mask in the query's dtype is what
every backend accepts). The pipeline runs this pass only where attention stays aten's: a
runtime that routes attention handles boolean masks its own way.
"""

from __future__ import annotations

import torch
from torch import fx

from passes._infra import PassResult, visiting
from passes.fx.dtypes import dtype_of
from passes.fx.nodes import sdpa_mask, set_sdpa_mask, tensors
from passes.policy import FP32, LOW

aten = torch.ops.aten

SDPA = aten.scaled_dot_product_attention.default


def share_mask_conversions(gm: fx.GraphModule, recompile: bool = True) -> PassResult:
    """Give every ``scaled_dot_product_attention`` whose ``attn_mask`` is boolean the
    additive mask ``where(mask, 0, -inf)`` in its query's dtype, made once per (mask,
    dtype) before the first of them.

    Example:
        >>> share_mask_conversions(gm).modified  # BERT: one conversion instead of twelve
        True
    """
    graph = gm.graph
    converted: dict[tuple[fx.Node, torch.dtype], fx.Node] = {}
    modified = False
    for node in visiting(list(graph.find_nodes(op="call_function", target=SDPA))):
        mask = sdpa_mask(node)
        dtype = dtype_of(node.args[0])
        if mask is None or dtype_of(mask) != torch.bool or dtype not in (
                torch.float32, torch.float16, torch.bfloat16) or _fake_mode(mask) is None:
            continue
        additive = converted.get((mask, dtype))
        if additive is None:
            with graph.inserting_before(node):
                additive = converted[(mask, dtype)] = _convert(gm, mask, dtype)
        set_sdpa_mask(node, additive)
        modified = True
    if modified and recompile:
        gm.recompile()
    return PassResult(gm, modified)



def _fake_mode(mask: fx.Node) -> object | None:
    """The fake mode of the mask's captured value (the new nodes' values are made in it),
    or None where it has none (a graph not captured with fake tensors: left as it is)."""
    ts = tensors(mask.meta.get("val"))
    return getattr(ts[0], "fake_mode", None) if len(ts) == 1 else None


def _convert(gm: fx.GraphModule, mask: fx.Node, dtype: torch.dtype) -> fx.Node:
    """``where(mask, 0, -inf)`` in ``dtype``, its two scalars constants of ``gm``."""
    (val,) = tensors(mask.meta["val"])
    graph = gm.graph
    scalars = []
    for value, name in ((0.0, "zero"), (float("-inf"), "neg_inf")):
        const = torch.scalar_tensor(value, dtype=dtype, device=val.device)
        target = _free_name(gm, f"_amp_mask_{name}_{str(dtype).removeprefix('torch.')}")
        object.__setattr__(gm, target, const)  # a plain attribute, as export's constants
        read = graph.create_node("get_attr", target)
        read.meta.update(val=val.fake_mode.from_tensor(const), amp_dtype=dtype,
                         amp_precision="n/a", amp_reason="a constant of the mask conversion")
        scalars.append(read)
    where = graph.call_function(aten.where.self, (mask, *scalars))
    with val.fake_mode:
        fake = aten.where.self(val, *(s.meta["val"] for s in scalars))
    where.meta.update(
        val=fake, amp_dtype=dtype, amp_precision=LOW if dtype != torch.float32 else FP32,
        amp_reason=f"the boolean mask {mask.name} made additive in {dtype} once, for every "
                   "attention that reads it (each converted it on every call)")
    if "nn_module_stack" in mask.meta:
        where.meta["nn_module_stack"] = mask.meta["nn_module_stack"]
    return where


def _free_name(gm: fx.GraphModule, name: str) -> str:
    stem, i = name, 1
    while hasattr(gm, name):
        name, i = f"{stem}_{i}", i + 1
    return name
