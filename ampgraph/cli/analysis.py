"""What ``ampgraph inspect`` shows of a compiled FX model: the summary numbers of its
graphs' costs (computed by ``passes.fx.costs``, rendered here) and a drawable view of the
graph (casts as their own nodes). The methods are in docs/cli.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ampgraph.config import dtype_name
from ampgraph.module import Compiled
from ampgraph.node_rows import node_rows, public
from passes.costs import GraphCosts
from passes.fx.costs import graph_costs
from passes.fx.dtypes import dtype_of


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


# ------------------------------------------------------------------------------ summary


def fx_stats(graphs: Iterable[tuple[str, Compiled]]) -> dict[str, Any]:
    """The summary numbers of the compiled graphs of a model (``passes.fx.costs``).

    Example:
        >>> fx_stats(net.amp_parts()[0])["low_flops_share"]
        1.0
    """
    return summary_numbers(graph_costs(compiled.gm for _, compiled in graphs))


def summary_numbers(costs: GraphCosts) -> dict[str, Any]:
    """The ``inspect`` summary's numbers from a graph's costs (PyTorch and ONNX targets):
    the costs, the 16-bit and FP8 shares of the FLOPs, the savings against fp32.

    Example:
        >>> summary_numbers(GraphCosts(100, 50, 8, 4, 8, 30, 40, 10, 20))["activation_saving"]
        0.25
    """
    c = costs
    return {
        "matmul_conv_flops": c.flops,
        "matmul_conv_flops_low": c.low_flops,
        "matmul_conv_flops_fp8": c.fp8_flops,
        "low_flops_share": round(c.low_flops / c.flops, 4) if c.flops else 0.0,
        "fp8_flops_share": round(c.fp8_flops / c.flops, 4) if c.flops else 0.0,
        "param_bytes_fp32": c.param_bytes_fp32,
        "param_bytes_low": c.param_bytes_low,
        "param_bytes_fp8": c.param_bytes_fp8,
        "param_bytes_runtime": c.param_bytes_fp32 + c.param_bytes_low + c.param_bytes_fp8,
        "param_bytes_baseline": c.param_bytes_baseline,
        "activation_bytes": c.activation_bytes,
        "activation_bytes_fp32": c.activation_bytes_fp32,
        "activation_saving": _saving(c.activation_bytes, c.activation_bytes_fp32),
        "activation_peak_bytes": c.peak_bytes,
        "activation_peak_bytes_fp32": c.peak_bytes_fp32,
        "activation_peak_saving": _saving(c.peak_bytes, c.peak_bytes_fp32),
    }


def _saving(after: int, before: int) -> float:
    return round(1 - after / before, 4) if before else 0.0


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
                what = public(".".join(p for p in (prefix, str(src.target)) if p)) if (
                    src is not None and src.op == "get_attr") else ""
                view.nodes.append(ViewNode(pid(node.name), f"cast to {to}", "cast", "cast",
                                           "cast", prefix, what or f"from {src}"))
            elif node.op == "output":
                view.nodes.append(ViewNode(pid(node.name), f"{prefix or 'output'}", "output",
                                           "n/a", "output", prefix))
            else:
                row = rows.get(public(node.name), {})
                kind = "input" if node.op == "placeholder" else "op"
                op = row.get("op", node.op)
                view.nodes.append(ViewNode(pid(node.name), public(node.name), op,
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
