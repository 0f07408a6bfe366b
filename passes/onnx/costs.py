"""FLOPs and bytes of a converted ONNX model: the analysis behind ``ampgraph inspect``.

Sizes come from ONNX shape inference with the graph inputs fixed to given shapes
(symbolic dimensions the caller leaves open count as 1), so FLOPs and bytes are for one
run at those shapes. The methods match ``passes.fx.costs`` (docs/cli.md); FLOPs are those
of MatMul, Gemm, Conv and ConvTranspose of the default domain.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto, TensorProto

from passes.costs import GraphCosts
from passes.onnx.subgraphs import all_graphs

LOW_TYPES = (TensorProto.FLOAT16, TensorProto.BFLOAT16)
Shapes = dict[str, tuple[int, tuple]]  # value name -> (elem type, concrete shape)


def itemsize(elem_type: int) -> int:
    """Bytes of one element of an ONNX elem type (4 for unknown ones).

    Example:
        >>> itemsize(TensorProto.BFLOAT16)
        2
    """
    try:
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)).itemsize
    except Exception:  # unknown or exotic element types
        return 4


def value_shapes(model: ModelProto, fixed: dict[str, tuple]) -> Shapes:
    """value name -> (elem type, concrete shape), by shape inference on a weight-free copy
    with the graph inputs named in ``fixed`` given those shapes; values whose shape stays
    unknown are left out.

    Example:
        >>> value_shapes(model, {"x": (4, 16)})["logits"]
        (1, (4, 10))
    """
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
    out: Shapes = {}
    for g in all_graphs(inferred.graph):
        for vi in (*g.input, *g.value_info, *g.output):
            tt = vi.type.tensor_type
            dims = tuple(d.dim_value for d in tt.shape.dim)
            if tt.elem_type and tt.HasField("shape") and all(dims):
                out[vi.name] = (tt.elem_type, dims)
        for t in g.initializer:
            out[t.name] = (t.data_type, tuple(t.dims))
    return out


def node_flops(node: onnx.NodeProto, shapes: Shapes) -> int:
    """FLOPs (2 x multiply-adds) of a MatMul, Gemm, Conv or ConvTranspose node, else 0.

    Example:
        >>> node_flops(matmul, {"x": (1, (4, 16)), "W": (1, (16, 8)), "y": (1, (4, 8))})
        1024
    """
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


def live_peak(model: ModelProto, shapes: Shapes) -> int:
    """Peak bytes of live values running the main graph in order, each freed after its last
    use (graph inputs included, initializers excluded).

    Example:
        >>> live_peak(result.model, value_shapes(result.model, {"x": (4, 16)}))
        384
    """
    g = model.graph
    inits = {t.name for t in g.initializer}

    def size(name: str) -> int:
        v = shapes.get(name)
        return math.prod(v[1]) * itemsize(v[0]) if v else 0

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


def model_costs(original: ModelProto, result: Any, fixed: dict[str, tuple]) -> GraphCosts:
    """FLOPs, initializer bytes and activation bytes of a converted model against its
    original, subgraphs included (the peaks: the main graph's).

    Args:
        original: the fp32 model.
        result: its ``passes.onnx.convert.ConversionResult``.
        fixed: graph input name -> the shape to take it at.

    Example:
        >>> model_costs(model, convert_model(model, "O2"), {"x": (4, 16)}).low_flops
        1024
    """
    before, after = value_shapes(original, fixed), value_shapes(result.model, fixed)
    flops = low_flops = act = act_fp32 = 0
    for g in all_graphs(result.model.graph):
        for node in g.node:
            f = node_flops(node, after)
            flops += f
            d = result.assignment.get(node.name)
            if d is not None and d.precision == "low":
                low_flops += f
            act += sum(math.prod(after[o][1]) * itemsize(after[o][0])
                       for o in node.output if o in after)
    for g in all_graphs(original.graph):
        for node in g.node:
            act_fp32 += sum(math.prod(before[o][1]) * itemsize(before[o][0])
                            for o in node.output if o in before)
    peak, peak_fp32 = live_peak(result.model, after), live_peak(original, before)
    fp32 = low = baseline = 0
    for g in all_graphs(result.model.graph):
        for t in g.initializer:
            size = math.prod(t.dims) * itemsize(t.data_type)
            fp32 += size if t.data_type == TensorProto.FLOAT else 0
            low += size if t.data_type in LOW_TYPES else 0
    for g in all_graphs(original.graph):
        baseline += sum(math.prod(t.dims) * 4 for t in g.initializer
                        if t.data_type == TensorProto.FLOAT)
    return GraphCosts(flops, low_flops, fp32, low, baseline, act, act_fp32, peak, peak_fp32)


__all__ = ["itemsize", "live_peak", "model_costs", "node_flops", "value_shapes"]
