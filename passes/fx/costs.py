"""FLOPs and bytes of a rewritten FX graph: the analysis behind ``ampgraph inspect``.

Sizes come from each node's ``meta["val"]`` (fake tensors). Symbolic sizes (the dynamic
batch dimension) are replaced by their hints: the sizes of the example inputs the graph
was captured with, so the numbers are for one forward at those shapes.

Methods (also in docs/cli.md):

- matmul/conv FLOPs: ``2 * multiply-adds`` of linear, mm, bmm, addmm, baddbmm, matmul,
  convolutions (transposed included) and scaled-dot-product attention; a node's FLOPs are
  "low" when the node runs in the low dtype.
- parameter bytes at run time: the fp32 master weights (float parameters and buffers the
  graph reads) plus the low-precision copies the graph makes of them (casts of
  ``get_attr`` nodes, and the weights linears cast for themselves).
- activation bytes: the sum of output bytes of every non-view node of one forward (the
  inserted activation casts included), compared with the same nodes at their captured
  dtypes (fp32 for an fp32 model) and without the casts: a proxy for what autograd saves
  for backward. :func:`live_peak` runs the graph in order and frees each output after its
  last use: the peak live activation memory of an inference forward.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import fx

from passes.costs import GraphCosts
from passes.fx.nodes import op_key

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# ------------------------------------------------------------------------------ sizes


def hint(size: Any) -> int:
    """A concrete int for a (possibly symbolic) size: its hint, else 1.

    Example:
        >>> hint(fake.shape[0])  # the dynamic batch captured at 8
        8
    """
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    value = getattr(node, "hint", None)
    if value is None:
        try:
            value = node.shape_env.size_hint(node.expr)
        except Exception:  # unbacked sizes have no hint
            value = 1
    return int(value)


def shape_of(val: Any) -> tuple[int, ...]:
    """The concrete shape of a (fake) tensor, symbolic sizes by their hints.

    Example:
        >>> shape_of(node.meta["val"])
        (8, 128)
    """
    return tuple(hint(d) for d in val.shape)


def tensor_bytes(val: Any, dtype: torch.dtype | None = None) -> int:
    """Bytes of a (fake) tensor at its concrete sizes, optionally as ``dtype`` (0 for a
    non-tensor).

    Example:
        >>> tensor_bytes(torch.empty(8, 128), torch.bfloat16)
        2048
    """
    if not isinstance(val, torch.Tensor):
        return 0
    return math.prod(shape_of(val)) * (dtype or val.dtype).itemsize


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _tensors(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, tuple | list):
        return [t for v in val for t in _tensors(v)]
    return []


# ------------------------------------------------------------------------------ FLOPs

MATMUL_OPS = ("aten.linear", "aten.mm", "aten.bmm", "aten.matmul", "aten.addmm",
              "aten.baddbmm")
CONV_OPS = ("aten.conv1d", "aten.conv2d", "aten.conv3d", "aten.convolution",
            "aten._convolution", "aten.conv_transpose1d", "aten.conv_transpose2d",
            "aten.conv_transpose3d")
ATTENTION_OPS = ("aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention",
                 "aten._scaled_dot_product_efficient_attention",
                 "aten._scaled_dot_product_flash_attention_for_cpu")


def _base(key: str) -> str:
    parts = key.split(".")
    return ".".join(parts[:2])


def node_flops(node: fx.Node) -> int:
    """FLOPs (2 x multiply-adds) of a matmul, convolution or attention node, else 0.

    Example:
        >>> node_flops(linear_node)  # x (8, 64) @ w (128, 64).T
        131072
    """
    if node.op != "call_function":
        return 0
    head = node.meta.get("amp_head_product")  # a fused head and loss: its product's
    if head is not None:
        logits, x = head
        return 2 * math.prod(shape_of(logits)) * shape_of(x)[-1]
    key = _base(node.meta.get("amp_orig_op") or op_key(node))  # routed ops: what they run
    out = _tensors(_val(node))
    if not out:
        return 0
    args = [_val(a) for a in node.args]
    if key in MATMUL_OPS:
        a = args[1] if key in ("aten.addmm", "aten.baddbmm") else args[0]
        if not isinstance(a, torch.Tensor) or a.dim() == 0:
            return 0
        return 2 * math.prod(shape_of(out[0])) * shape_of(a)[-1]
    if key in CONV_OPS:
        w = args[1] if len(args) > 1 else None
        if not isinstance(w, torch.Tensor):
            return 0
        transposed = "transpose" in key or (key.endswith("convolution") and len(node.args) > 6
                                             and bool(node.args[6]))
        per_point = math.prod(shape_of(w)[1:])
        # weight (Cout, Cin/g, k..): each output point takes Cin/g*k MACs; transposed weight
        # (Cin, Cout/g, k..): each input point feeds Cout/g*k outputs.
        source = args[0] if transposed else out[0]
        if not isinstance(source, torch.Tensor):
            return 0
        return 2 * math.prod(shape_of(source)) * per_point
    if key in ATTENTION_OPS and len(args) >= 3:
        q, k, v = args[:3]
        if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (q, k, v)):
            return 0
        qs, ks, vs = shape_of(q), shape_of(k), shape_of(v)
        return 2 * math.prod(qs[:-2]) * qs[-2] * ks[-2] * (qs[-1] + vs[-1])
    return 0


# ------------------------------------------------------------------------------ bytes


def _is_view(node: fx.Node) -> bool:
    return bool(getattr(node.target, "is_view", False)) or op_key(node) == "getitem"


def out_bytes(node: fx.Node, original: bool = False) -> int:
    """Output bytes of a node after the rewrite (or as captured, with ``original``).

    The rewrite keeps the captured shapes in ``meta["val"]`` and records a changed dtype in
    ``meta["amp_dtype"]`` (the captured one in ``meta["amp_orig_dtype"]``).

    Example:
        >>> out_bytes(linear_node), out_bytes(linear_node, original=True)
        (2048, 4096)
    """
    val = node.meta.get("amp_orig_val", node.meta.get("val")) if original else _val(node)
    ts = _tensors(val)
    dtype = node.meta.get("amp_orig_dtype" if original else "amp_dtype")
    if len(ts) == 1 and isinstance(dtype, torch.dtype):
        return tensor_bytes(ts[0], dtype)
    return sum(tensor_bytes(t) for t in ts)


def live_peak(gm: fx.GraphModule, original: bool = False) -> int:
    """Peak bytes of live activations running the graph in order, each output freed after
    its last use (views and getitem alias their base; weight casts count as parameters).
    With ``original`` the inserted casts alias their input and dtypes are the captured ones.

    Example:
        >>> live_peak(gm), live_peak(gm, original=True)
        (40960, 73728)
    """
    nodes = [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function", "output")]

    def root(n: fx.Node) -> fx.Node:
        while n.op == "call_function" and n.all_input_nodes and (
                _is_view(n) or (original and n.meta.get("amp_cast"))):
            n = n.all_input_nodes[0]
        return n

    size: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op == "output" or root(n) is not n:
            continue
        src = n.all_input_nodes[0] if n.all_input_nodes else None
        if n.meta.get("amp_cast") and src is not None and src.op == "get_attr":
            continue
        size[n] = out_bytes(n, original)
    frees: dict[int, list[fx.Node]] = {}
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            if root(a) in size:
                last[root(a)] = len(nodes) if n.op == "output" else i
    for r, i in last.items():
        frees.setdefault(i, []).append(r)
    live = peak = 0
    for i, n in enumerate(nodes):
        if n in size:
            live += size[n]
            peak = max(peak, live)
        live -= sum(size[r] for r in frees.get(i, ()))
        if n in size and n not in last:
            live -= size[n]
    return peak


def graph_costs(graphs: Iterable[fx.GraphModule]) -> GraphCosts:
    """FLOPs, parameter and activation bytes over the rewritten graphs of a model (the
    peaks: the largest graph's).

    Example:
        >>> costs = graph_costs(c.gm for _, c in net.amp_parts()[0])
        >>> costs.low_flops == costs.flops
        True
    """
    flops = low_flops = fp8_flops = fp8_copies = 0
    params: dict[str, int] = {}
    copies = act = act_fp32 = peak = peak_fp32 = 0
    for gm in graphs:
        peak = max(peak, live_peak(gm))
        peak_fp32 = max(peak_fp32, live_peak(gm, original=True))
        for node in gm.graph.nodes:
            val = _val(node)
            if node.op == "get_attr":
                if isinstance(val, torch.Tensor) and val.dtype in FLOAT_DTYPES:
                    params[str(node.target)] = tensor_bytes(val)
                continue
            if node.op != "call_function":
                continue
            if node.meta.get("amp_cast"):
                src = node.all_input_nodes[0] if node.all_input_nodes else None
                if src is not None and src.op == "get_attr":
                    copies += out_bytes(node)
                else:
                    act += out_bytes(node)
                continue
            for key, i in (("amp_fused_weight_cast", 1), ("amp_fused_bias_cast", 2)):
                fused = node.meta.get(key)  # a linear casting its own weight / bias
                if fused is not None and isinstance(_val(node.args[i]), torch.Tensor):
                    copies += _val(node.args[i]).numel() * fused.itemsize
            f = node_flops(node)
            flops += f
            if node.meta.get("amp_precision") == "low" or "amp_head_product" in node.meta:
                low_flops += f
            elif node.meta.get("amp_precision") == "fp8":  # fp8_linear(x, weight, bias)
                fp8_flops += f
                if isinstance(_val(node.args[1]), torch.Tensor):
                    fp8_copies += _val(node.args[1]).numel()
            if not _is_view(node):
                act += out_bytes(node)
                act_fp32 += out_bytes(node, original=True)
    fp32 = sum(params.values())
    return GraphCosts(flops, low_flops, fp32, copies, fp32, act, act_fp32, peak, peak_fp32,
                      fp8_flops, fp8_copies)


__all__ = [
    "ATTENTION_OPS",
    "CONV_OPS",
    "FLOAT_DTYPES",
    "MATMUL_OPS",
    "graph_costs",
    "hint",
    "live_peak",
    "node_flops",
    "out_bytes",
    "shape_of",
    "tensor_bytes",
]
