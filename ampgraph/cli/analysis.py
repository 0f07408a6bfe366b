"""Statistics of a rewritten FX graph for ``ampgraph inspect``: FLOPs, parameter and
activation bytes, and a drawable view of the graph (casts as their own nodes).

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
  for backward. ``activation_peak_bytes`` runs the graph in order and frees each output
  after its last use: the peak live activation memory of an inference forward.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from ampgraph.config import dtype_name
from ampgraph.module import Compiled
from ampgraph.node_rows import node_rows
from passes.fx.dtypes import dtype_of
from passes.fx.nodes import op_key

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass
class ViewNode:
    """One drawable node. ``precision`` is bf16/fp16/fp32/n/a, or "cast" for casts."""

    id: str
    label: str
    op: str
    precision: str
    kind: str  # "input" | "op" | "cast" | "output"
    module: str = ""
    detail: str = ""


@dataclass
class GraphView:
    """Nodes and edges to draw (parameters are left out; their casts are drawn)."""

    nodes: list[ViewNode] = field(default_factory=list)
    edges: list[tuple[str, str]] = field(default_factory=list)


# ------------------------------------------------------------------------------ sizes


def hint(size: Any) -> int:
    """A concrete int for a (possibly symbolic) size: its hint, else 1."""
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
    return tuple(hint(d) for d in val.shape)


def tensor_bytes(val: Any, dtype: torch.dtype | None = None) -> int:
    """Bytes of a (fake) tensor at its concrete sizes, optionally as ``dtype``."""
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


# ------------------------------------------------------------------------------ stats


def _is_view(node: fx.Node) -> bool:
    return bool(getattr(node.target, "is_view", False)) or op_key(node) == "getitem"


def out_bytes(node: fx.Node, original: bool = False) -> int:
    """Output bytes of a node after the rewrite (or as captured, with ``original``).

    The rewrite keeps the captured shapes in ``meta["val"]`` and records a changed dtype in
    ``meta["amp_dtype"]`` (the captured one in ``meta["amp_orig_dtype"]``).
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


def fx_stats(graphs: Iterable[tuple[str, Compiled]]) -> dict[str, Any]:
    """FLOP, parameter and activation statistics over the compiled graphs of a model.

    Example:
        >>> fx_stats(net.amp_parts()[0])["low_flops_share"]
        1.0
    """
    flops = low_flops = 0
    params: dict[str, int] = {}
    copies = act = act_fp32 = peak = peak_fp32 = 0
    for _, compiled in graphs:
        peak = max(peak, live_peak(compiled.gm))
        peak_fp32 = max(peak_fp32, live_peak(compiled.gm, original=True))
        for node in compiled.gm.graph.nodes:
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
            if node.meta.get("amp_precision") == "low":
                low_flops += f
            if not _is_view(node):
                act += out_bytes(node)
                act_fp32 += out_bytes(node, original=True)
    fp32 = sum(params.values())
    return summary_numbers(flops, low_flops, fp32, copies, fp32, act, act_fp32, peak, peak_fp32)


def summary_numbers(flops: int, low_flops: int, param_fp32: int, param_low: int,
                    param_baseline: int, act: int, act_fp32: int, peak: int,
                    peak_fp32: int) -> dict[str, Any]:
    """The ``inspect`` summary's numbers, shared by the PyTorch and ONNX targets."""
    return {
        "matmul_conv_flops": flops,
        "matmul_conv_flops_low": low_flops,
        "low_flops_share": round(low_flops / flops, 4) if flops else 0.0,
        "param_bytes_fp32": param_fp32,
        "param_bytes_low": param_low,
        "param_bytes_runtime": param_fp32 + param_low,
        "param_bytes_baseline": param_baseline,
        "activation_bytes": act,
        "activation_bytes_fp32": act_fp32,
        "activation_saving": round(1 - act / act_fp32, 4) if act_fp32 else 0.0,
        "activation_peak_bytes": peak,
        "activation_peak_bytes_fp32": peak_fp32,
        "activation_peak_saving": round(1 - peak / peak_fp32, 4) if peak_fp32 else 0.0,
    }


# ------------------------------------------------------------------------------ view


def fx_view(graphs: list[tuple[str, Compiled]], low: torch.dtype) -> GraphView:
    """The drawable graph: inputs, ops, casts (own nodes) and outputs; parameters omitted."""
    view = GraphView()
    many = len(graphs) > 1
    for gi, (prefix, compiled) in enumerate(graphs):
        pid = (lambda name, gi=gi: f"{gi}/{name}") if many else (lambda name: name)
        rows = {r["name"]: r for r in node_rows(prefix, compiled, low)}
        shown: set[str] = set()
        for node in compiled.gm.graph.nodes:
            if node.op in ("get_attr", "call_module"):
                continue
            inputs = [a for a in node.all_input_nodes if a.name in shown]
            if node.meta.get("amp_cast"):
                dtype = dtype_of(node)
                to = dtype_name(dtype) if dtype is not None else "?"
                src = node.all_input_nodes[0] if node.all_input_nodes else None
                what = ".".join(p for p in (prefix, str(src.target)) if p) if (
                    src is not None and src.op == "get_attr") else ""
                view.nodes.append(ViewNode(pid(node.name), f"cast to {to}", "cast", "cast",
                                           "cast", prefix, what or f"from {src}"))
            elif node.op == "output":
                view.nodes.append(ViewNode(pid(node.name), f"{prefix or 'output'}", "output",
                                           "n/a", "output", prefix))
            else:
                row = rows.get(node.name, {})
                kind = "input" if node.op == "placeholder" else "op"
                op = row.get("op", node.op)
                view.nodes.append(ViewNode(pid(node.name), node.name, op,
                                           row.get("precision", "n/a"), kind,
                                           row.get("module", prefix), row.get("reason", "")))
                for key, i, what in (("amp_fused_weight_cast", 1, "weight"),
                                     ("amp_fused_bias_cast", 2, "bias")):
                    fused = node.meta.get(key)
                    if fused is None:  # the cast runs inside the linear: drawn apart
                        continue
                    param = ".".join(p for p in (prefix, str(node.args[i].target)) if p)
                    cast_id = pid(f"{node.name}_{what}_cast")
                    view.nodes.append(ViewNode(cast_id, f"cast to {dtype_name(fused)}", "cast",
                                               "cast", "cast", prefix,
                                               f"{param} (fused into {node.name})"))
                    view.edges.append((cast_id, pid(node.name)))
            shown.add(node.name)
            view.edges += [(pid(a.name), pid(node.name)) for a in inputs]
    return view
