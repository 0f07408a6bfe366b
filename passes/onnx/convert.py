"""The ONNX mixed-precision pass: index, paint, fix ranges, rewrite, verify.

``convert_model`` is the dialect's whole pipeline on an in-memory ModelProto (weights
loaded). Loading, saving, external data and user-facing validation live in
``ampgraph.onnx``; this module never touches files.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import networkx as nx
from onnx import ModelProto

from passes.onnx.casts import IN, Requests, Rewriter, collect_requests
from passes.onnx.graph import ModelIndex, build_dataflow, module_key
from passes.onnx.initializers import (
    ConstantRangeWarning,
    clamp_warning,
    large_constant_cones,
    unsafe_range_consumers,
)
from passes.onnx.policy import FLOAT, LOW_DTYPES, make_policy
from passes.onnx.schema import low_blocker
from passes.onnx.skeleton import attach_data, detached_copy
from passes.onnx.verify import verify_model
from passes.paint import Assignment, Decision, paint
from passes.policy import FP32

_MAX_RANGE_ROUNDS = 10


@dataclass
class ConversionResult:
    """What :func:`convert_model` returns.

    Attributes:
        model: the converted model (a new ModelProto unless ``copy=False``).
        assignment: node name -> Decision (precision and the rule that decided it).
        dataflow: the painted DiGraph (for regions and explanations).
        casts: Cast nodes added.
        clamped: constant name -> values clamped into the low dtype's range.
        forced: node name -> why the pass itself kept it in FP32.

    Example:
        >>> result = convert_model(model, "O2")
        >>> result.casts, result.assignment["softmax"].reason
        (3, 'deny list: softmax family: ...')
    """

    model: ModelProto
    assignment: Assignment
    dataflow: nx.DiGraph
    casts: int = 0
    clamped: dict[str, int] = field(default_factory=dict)
    forced: dict[str, str] = field(default_factory=dict)

    def precision(self, node_name: str) -> str:
        """Precision ("low", "fp32" or "n/a") decided for a node."""
        return self.assignment[node_name].precision


def convert_model(
    model: ModelProto,
    level: str = "O2",
    dtype: str = "fp16",
    *,
    keep_io_types: bool = True,
    op_block_list: Iterable[str] = (),
    node_block_list: Iterable[str] = (),
    keep_norm_fp32: bool | None = None,
    fp32_nodes: Iterable[str] = (),
    check: bool = True,
    copy: bool = True,
) -> ConversionResult:
    """Convert an FP32 ONNX model to mixed precision at an AMP level.

    Args:
        model: the model, weights in memory.
        level: "O0".."O3" (see ``passes.policy.LEVEL_TABLE``).
        dtype: "fp16" or "bf16".
        keep_io_types: graph inputs and outputs keep their dtypes (casts at the boundary).
        op_block_list: op types forced to FP32.
        node_block_list: node names (fnmatch patterns) forced to FP32.
        keep_norm_fp32: None takes the level's default (FP32 norms except at O3).
        fp32_nodes: exact node names forced to FP32 (the automatic mode's regions).
        check: run :func:`passes.onnx.verify.verify_model` on the result.
        copy: work on a copy (the input is left untouched).

    Returns:
        A :class:`ConversionResult`.

    Raises:
        ValueError: unknown level or dtype.
        PassError: the result failed verification (a bug: please report it).

    Example:
        >>> result = convert_model(model, "O2", "fp16", op_block_list=["Softmax"])
        >>> result.precision("MatMul_0")
        'low'
    """
    if dtype not in LOW_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose 'fp16' or 'bf16'")
    low = LOW_DTYPES[dtype]
    # a copy without the large weights' data: each is converted from the caller's tensor
    # straight into its stub, or copied at the end (attach_data) if it stays as it is
    work, pairs = detached_copy(model) if copy else (model, [])
    sources = {stub.name: source for stub, source in pairs}
    if level == "O0":  # nothing changes: index (it names unnamed nodes) a throwaway copy
        shadow = ModelProto()
        shadow.CopyFrom(work)
        index = ModelIndex.build(shadow, sources)
    else:
        index = ModelIndex.build(work, sources)
    graph = build_dataflow(index)
    types = index.types()
    forced: dict[str, str] = {}
    for rec in index.nodes:
        if rec.role == "compute":
            why = low_blocker(rec.node, rec.opset, types, low)
            if why:
                forced[rec.name] = why
    forced.update({name: "automatic mode: this region is kept in fp32" for name in fp32_nodes})
    rules = [(module_key(p), FP32, "node_block_list") for p in node_block_list]
    for _ in range(_MAX_RANGE_ROUNDS):
        policy = make_policy(
            level, keep_norm_fp32=keep_norm_fp32, deny_ops=op_block_list,
            module_rules=rules + [(module_key(_escape(n)), FP32, "pass") for n in forced],
        )
        assignment = _tidy(paint(graph, policy), forced)
        if level == "O0":
            attach_data(pairs)
            return ConversionResult(work, assignment, graph)
        requests = collect_requests(index, assignment, low, keep_io_types)
        precision = {k: d.precision for k, d in assignment.items() if isinstance(k, str)}
        readers = _low_readers(index, requests, low)  # constants' bounds: read once, kept
        extra = unsafe_range_consumers(index, readers, low, precision, index.bounds)
        cones = large_constant_cones(index, low, precision, index.bounds)
        extra.update({k: v for k, v in cones.items() if k not in forced})
        if not extra:
            break
        forced.update(extra)
    io_types = _io_types(work, keep_io_types)
    expected = _expected(requests)
    stats = Rewriter(index, requests, low, keep_io_types).run()
    attach_data(pairs)
    message = clamp_warning(stats["clamped"].items(), low)
    if message:
        warnings.warn(message, ConstantRangeWarning, stacklevel=2)
    if check:
        verify_model(work, io_types=io_types, expected=expected, sized=stats["written"])
    return ConversionResult(work, assignment, graph, stats["casts"], stats["clamped"], forced)


def _escape(name: str) -> str:
    """An fnmatch pattern matching exactly ``name``."""
    return re.sub(r"([*?\[])", r"[\1]", name)


def _tidy(assignment: Assignment, forced: dict[str, str]) -> Assignment:
    """Readable reasons: the pass's own FP32 decisions say why, patterns show dots."""
    out: Assignment = {}
    for v, d in assignment.items():
        if v in forced and d.precision == FP32:
            d = Decision(FP32, f"kept fp32: {forced[v]}", d.cls)
        reason = d.reason.replace("\\x1f", ".").replace("\x1f", ".")  # repr'd and raw
        out[v] = Decision(d.precision, reason, d.cls)
    return out


def _low_readers(index: ModelIndex, requests: Requests, low: int) -> dict[str, list]:
    """Constant value -> (node, slot) reading it in the low dtype."""
    readers: dict[str, list] = {}
    for name, dtype, where in requests.items:
        if dtype != low or where[0] != IN:
            continue
        v = index.values.get(name)
        if v is None or v.dtype != FLOAT:
            continue
        if v.origin == "init" or (v.producer is not None and v.producer.role == "const"):
            readers.setdefault(name, []).append((where[1], where[2]))
    return readers


def _io_types(model: ModelProto, keep_io_types: bool) -> dict[str, int]:
    if not keep_io_types:
        return {}
    out = {}
    for vi in (*model.graph.input, *model.graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            out[vi.name] = vi.type.tensor_type.elem_type
    inits = {t.name for t in model.graph.initializer}
    return {k: v for k, v in out.items() if k not in inits}


def _expected(requests: Requests) -> dict[str, dict[int, int]]:
    out: dict[str, dict[int, int]] = {}
    for _, dtype, where in requests.items:
        if where[0] == IN:
            out.setdefault(where[1].name, {})[where[2]] = dtype
    return out


__all__ = ["ConversionResult", "convert_model"]
