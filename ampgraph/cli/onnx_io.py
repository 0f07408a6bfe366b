"""``ampgraph inspect`` / ``convert`` on ONNX files: decisions, statistics, random inputs.

The decisions are those of the ONNX pass (``passes.onnx.convert_model``, the function
behind ``ampgraph.convert_onnx``); the statistics are ``passes.onnx.costs``'s with the
graph inputs fixed to ``--input-shape`` (symbolic dimensions default to 1), rendered as
the PyTorch target's are (``ampgraph.cli.analysis``; methods in docs/cli.md).
"""

from __future__ import annotations

import ast
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto, TensorProto

from ampgraph.cli.analysis import GraphView, ViewNode, summary_numbers
from ampgraph.cli.target import CliError, one_line
from passes.onnx import convert_model
from passes.onnx import io as pio
from passes.onnx.costs import model_costs, node_flops, value_shapes
from passes.onnx.subgraphs import all_graphs

_LOW = {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}
_NAMES = {TensorProto.FLOAT: "fp32", TensorProto.DOUBLE: "fp64", **_LOW}


def load(path: str) -> ModelProto:
    """Read and check an ONNX file (CliError on failure)."""
    try:
        return pio.load_model(path)[0]
    except (OSError, ValueError) as exc:
        raise CliError(one_line(exc)) from exc


def convert(model: ModelProto, level: str, dtype: str, **kw: Any) -> Any:
    """``convert_model`` with option errors turned into CliError."""
    try:
        return convert_model(model, level, dtype, **kw)
    except ValueError as exc:
        raise CliError(one_line(exc)) from exc


def graph_inputs(model: ModelProto) -> list[onnx.ValueInfoProto]:
    """Graph inputs that are not initializers."""
    inits = {t.name for t in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in inits]


def input_shapes(model: ModelProto, shapes: list[tuple[int, ...]]) -> dict[str, tuple]:
    """Concrete shape per graph input: ``--input-shape`` in order, else declared dims (1 for
    symbolic ones)."""
    inputs = graph_inputs(model)
    if shapes and len(shapes) != len(inputs):
        raise CliError(f"{len(shapes)} --input-shape for a model with {len(inputs)} inputs "
                       f"({', '.join(vi.name for vi in inputs)})")
    out = {}
    for i, vi in enumerate(inputs):
        dims = vi.type.tensor_type.shape.dim
        out[vi.name] = shapes[i] if shapes else tuple(d.dim_value or 1 for d in dims)
    return out


def random_feeds(model: ModelProto, shapes: list[tuple[int, ...]],
                 int_high: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for every graph input (floats ~ N(0, 1), integers in [0, int_high))."""
    rng = np.random.default_rng(seed)
    feeds = {}
    fixed = input_shapes(model, shapes)
    for vi in graph_inputs(model):
        elem = vi.type.tensor_type.elem_type
        np_type = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
        shape = fixed[vi.name]
        if np_type.kind == "f" or elem == TensorProto.BFLOAT16:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
        elif np_type.kind == "b":
            feeds[vi.name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[vi.name] = rng.integers(0, int_high, shape).astype(np_type)
    return feeds


def onnx_stats(original: ModelProto, result: Any, fixed: dict[str, tuple]) -> dict[str, Any]:
    """The summary numbers of a converted model against its original
    (``passes.onnx.costs``).

    Example:
        >>> onnx_stats(model, convert(model, "O2", "fp16"), {"x": (4, 16)})["low_flops_share"]
        1.0
    """
    return summary_numbers(model_costs(original, result, fixed))


def _module(node: onnx.NodeProto | None) -> str:
    """Module path from torch.onnx's name scopes metadata ("" when absent)."""
    if node is None:
        return ""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            try:
                scopes = [s for s in ast.literal_eval(prop.value) if s]
            except (ValueError, SyntaxError):
                return ""
            return scopes[-2] if len(scopes) >= 2 else ""
    return ""


def _precision(decision: Any, low: str) -> str:
    return {"low": low, "fp32": "fp32"}.get(decision.precision, "n/a")


def onnx_rows(original: ModelProto, result: Any, low: str,
              fixed: dict[str, tuple] | None = None) -> list[dict[str, Any]]:
    """One row per graph input, initializer and node, in graph order; a node's ``flops``
    at the input shapes ``fixed`` (0 without them)."""
    nodes = {n.name: n for g in all_graphs(result.model.graph) for n in g.node}
    shapes = value_shapes(result.model, fixed) if fixed is not None else None
    types = {vi.name: vi.type.tensor_type.elem_type for vi in original.graph.input}
    inits = {t.name: t.data_type for g in all_graphs(original.graph) for t in g.initializer}
    stored = {t.name: t.data_type for g in all_graphs(result.model.graph) for t in g.initializer}
    rows = []
    for v, data in result.dataflow.nodes(data=True):
        d = result.assignment.get(v)
        if isinstance(v, tuple):
            name = v[1]
            dtype = stored.get(name, inits.get(name, types.get(name, 0)))
            reason = d.reason if d else ""
            if name in inits and dtype != inits[name]:
                reason = f"initializer stored in {_NAMES.get(dtype, dtype)}: its readers run there"
            rows.append({"name": name, "op": "initializer" if name in inits else "input",
                         "module": "", "precision": _NAMES.get(dtype, "n/a"), "reason": reason,
                         "flops": 0})
            continue
        node = nodes.get(v)
        rows.append({"name": v, "op": data.get("op", ""), "module": _module(node),
                     "precision": _precision(d, low) if d else "n/a",
                     "reason": d.reason if d else "",
                     "flops": node_flops(node, shapes) if node and shapes else 0})
    return rows


def onnx_view(result: Any, low: str) -> GraphView:
    """Inputs, nodes, inserted Casts (own nodes) and outputs of the converted main graph."""
    view = GraphView()
    g = result.model.graph
    producer: dict[str, str] = {}
    inits = {t.name for t in g.initializer}
    for vi in g.input:
        if vi.name not in inits:
            elem = vi.type.tensor_type.elem_type
            view.nodes.append(ViewNode(f"input:{vi.name}", vi.name, "input",
                                       _NAMES.get(elem, "n/a"), "input"))
            producer[vi.name] = f"input:{vi.name}"
    for node in g.node:
        d = result.assignment.get(node.name)
        if d is None and node.op_type == "Cast":
            to = next((a.i for a in node.attribute if a.name == "to"), 0)
            view.nodes.append(ViewNode(node.name, f"cast to {_NAMES.get(to, to)}", "cast",
                                       "cast", "cast", "", f"Cast of {node.input[0]}"))
        else:
            view.nodes.append(ViewNode(node.name, node.name, node.op_type,
                                       _precision(d, low) if d else "n/a", "op",
                                       _module(node), d.reason if d else ""))
        view.edges += [(producer[i], node.name) for i in node.input if i in producer]
        producer.update({o: node.name for o in node.output if o})
    for vi in g.output:
        view.nodes.append(ViewNode(f"output:{vi.name}", vi.name, "output", "n/a", "output"))
        if vi.name in producer:
            view.edges.append((producer[vi.name], f"output:{vi.name}"))
    return view
