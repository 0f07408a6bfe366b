"""``ampgraph inspect`` / ``convert`` on ONNX files: decisions, statistics, random inputs.

The decisions are those of the ONNX pass (``passes.onnx.convert_model``, the function
behind ``ampgraph.convert_onnx``). Sizes come from ONNX shape inference with the graph
inputs fixed to ``--input-shape`` (symbolic dimensions default to 1), so FLOPs and bytes
are for one run at those shapes. Methods match ``ampgraph.cli.analysis`` (docs/cli.md).
"""

from __future__ import annotations

import ast
import math
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto, TensorProto

from ampgraph.cli.analysis import GraphView, ViewNode, summary_numbers
from ampgraph.cli.target import CliError, one_line
from passes.onnx import convert_model
from passes.onnx import io as pio
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


def _itemsize(elem_type: int) -> int:
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).itemsize
    except Exception:  # unknown or exotic element types
        return 4


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


def _infer(model: ModelProto, fixed: dict[str, tuple]) -> dict[str, tuple[int, tuple]]:
    """value name -> (elem type, concrete shape) by shape inference on a weight-free copy."""
    skeleton = ModelProto()
    skeleton.CopyFrom(model)
    for g in all_graphs(skeleton.graph):
        for t in g.initializer:  # shape inference needs dims, not weights
            if t.HasField("raw_data") and len(t.raw_data) > 4096:
                t.ClearField("raw_data")
                t.data_location = TensorProto.EXTERNAL
                entry = t.external_data.add()
                entry.key, entry.value = "location", "__ampgraph_cli_detached__"
    for vi in skeleton.graph.input:
        if vi.name in fixed:
            shape = vi.type.tensor_type.shape
            shape.ClearField("dim")
            for d in fixed[vi.name]:
                shape.dim.add().dim_value = d
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton, data_prop=True)
    except Exception:  # best effort: declared shapes only
        inferred = skeleton
    out: dict[str, tuple[int, tuple]] = {}
    for g in all_graphs(inferred.graph):
        for vi in (*g.input, *g.value_info, *g.output):
            tt = vi.type.tensor_type
            dims = tuple(d.dim_value for d in tt.shape.dim)
            if tt.elem_type and tt.HasField("shape") and all(dims):
                out[vi.name] = (tt.elem_type, dims)
        for t in g.initializer:
            out[t.name] = (t.data_type, tuple(t.dims))
    return out


def _node_flops(node: onnx.NodeProto, shapes: dict[str, tuple[int, tuple]]) -> int:
    def dims(i: int) -> tuple | None:
        v = shapes.get(node.input[i]) if len(node.input) > i else None
        return v[1] if v else None

    out = shapes.get(node.output[0]) if node.output else None
    if node.domain not in ("", "ai.onnx") or out is None:
        return 0
    if node.op_type == "MatMul" and dims(0):
        return 2 * math.prod(out[1]) * dims(0)[-1]
    if node.op_type == "Gemm" and dims(0):
        trans = any(a.name == "transA" and a.i for a in node.attribute)
        return 2 * math.prod(out[1]) * dims(0)[0 if trans else 1]
    if node.op_type == "Conv" and dims(1):
        return 2 * math.prod(out[1]) * math.prod(dims(1)[1:])
    if node.op_type == "ConvTranspose" and dims(0) and dims(1):
        return 2 * math.prod(dims(0)) * math.prod(dims(1)[1:])
    return 0


def _live_peak(model: ModelProto, shapes: dict[str, tuple[int, tuple]]) -> int:
    """Peak bytes of live values running the main graph in order, each freed after its last
    use (graph inputs included, initializers excluded)."""
    g = model.graph
    inits = {t.name for t in g.initializer}

    def size(name: str) -> int:
        v = shapes.get(name)
        return math.prod(v[1]) * _itemsize(v[0]) if v else 0

    last: dict[str, int] = {}
    for i, node in enumerate(g.node):
        for name in node.input:
            last[name] = i
    for vi in g.output:
        last[vi.name] = len(g.node)
    live = sum(size(vi.name) for vi in g.input if vi.name not in inits)
    peak = live
    for i, node in enumerate(g.node):
        live += sum(size(o) for o in node.output if o)
        peak = max(peak, live)
        done = {n for n in (*node.input, *node.output) if n and n not in inits
                and last.get(n, i) <= i}
        live -= sum(size(n) for n in done)
    return peak


def onnx_stats(original: ModelProto, result: Any, fixed: dict[str, tuple]) -> dict[str, Any]:
    """FLOPs, initializer bytes and activation bytes of the original and converted model."""
    before, after = _infer(original, fixed), _infer(result.model, fixed)
    flops = low_flops = act = act_fp32 = 0
    for g in all_graphs(result.model.graph):
        for node in g.node:
            f = _node_flops(node, after)
            flops += f
            d = result.assignment.get(node.name)
            if d is not None and d.precision == "low":
                low_flops += f
            act += sum(math.prod(after[o][1]) * _itemsize(after[o][0])
                       for o in node.output if o in after)
    for g in all_graphs(original.graph):
        for node in g.node:
            act_fp32 += sum(math.prod(before[o][1]) * _itemsize(before[o][0])
                            for o in node.output if o in before)
    peak, peak_fp32 = _live_peak(result.model, after), _live_peak(original, before)
    fp32 = low = baseline = 0
    for g in all_graphs(result.model.graph):
        for t in g.initializer:
            size = math.prod(t.dims) * _itemsize(t.data_type)
            fp32 += size if t.data_type == TensorProto.FLOAT else 0
            low += size if t.data_type in _LOW else 0
    for g in all_graphs(original.graph):
        baseline += sum(math.prod(t.dims) * 4 for t in g.initializer
                        if t.data_type == TensorProto.FLOAT)
    return summary_numbers(flops, low_flops, fp32, low, baseline, act, act_fp32, peak,
                           peak_fp32)


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


def onnx_rows(original: ModelProto, result: Any, low: str) -> list[dict[str, str]]:
    """One row per graph input, initializer and node, in graph order."""
    nodes = {n.name: n for g in all_graphs(result.model.graph) for n in g.node}
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
                         "module": "", "precision": _NAMES.get(dtype, "n/a"), "reason": reason})
            continue
        rows.append({"name": v, "op": data.get("op", ""), "module": _module(nodes.get(v)),
                     "precision": _precision(d, low) if d else "n/a",
                     "reason": d.reason if d else ""})
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
