"""The ONNX mixed-precision pass: index, paint, fix ranges, rewrite, verify.

``convert_model`` is the dialect's whole pipeline on an in-memory ModelProto (weights
loaded), run as named passes (:func:`onnx_passes`) by ``passes._infra.PassManager`` as the
FX pipeline is: a failure raises ``PassError`` naming the pass and, when known, the node.
Loading, saving, external data and user-facing validation live in ``ampgraph.onnx``; this
module never touches files.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import networkx as nx
from onnx import ModelProto, TensorProto

from passes._infra import PassManager, PassResult, named, visiting
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
from passes.onnx.subgraphs import all_graphs
from passes.onnx.verify import verify_model
from passes.paint import Assignment, Decision, paint
from passes.policy import FP32, LevelPolicy

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
        ValueError: unknown level or dtype; a model a pass cannot take
            (``passes._infra.PassInputError``, naming the pass and node).
        PassError: a pass failed, or the result failed verification (a bug: please
            report it); the message names the pass and, when known, the node.

    Example:
        >>> result = convert_model(model, "O2", "fp16", op_block_list=["Softmax"])
        >>> result.precision("MatMul_0")
        'low'
    """
    if dtype not in LOW_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose 'fp16' or 'bf16'")
    low = LOW_DTYPES[dtype]
    op_block_list = tuple(op_block_list)
    make_policy(level, keep_norm_fp32=keep_norm_fp32, deny_ops=op_block_list)  # ValueError now
    # a copy without the large weights' data: each is converted from the caller's tensor
    # straight into its stub, or copied at the end (attach_data) if it stays as it is
    work, pairs = detached_copy(model) if copy else (model, [])
    state = ConvertState(pairs)
    PassManager(onnx_passes(
        level, low, state, keep_io_types=keep_io_types, op_block_list=op_block_list,
        node_block_list=node_block_list, keep_norm_fp32=keep_norm_fp32, fp32_nodes=fp32_nodes,
        check=check), input_errors=True).run(work)
    if level == "O0":
        return ConversionResult(work, state.assignment, state.dataflow)
    message = clamp_warning(state.stats["clamped"].items(), low)
    if message:
        warnings.warn(message, ConstantRangeWarning, stacklevel=2)
    return ConversionResult(work, state.assignment, state.dataflow, state.stats["casts"],
                            state.stats["clamped"], state.forced)


@dataclass
class ConvertState:
    """What the passes hand to later passes and to :class:`ConversionResult`.

    Attributes:
        pairs: (stub, caller's tensor) of the weights ``detached_copy`` left out.
        index, dataflow: the model's index and the DiGraph painted.
        forced: node name -> why the pass keeps it in FP32.
        assignment: the painting.
        requests: the dtype each consumer slot asks for.
        out_of_range: what the last range check forced to FP32 (empty: ranges fit).
        io_types, expected: what ``verify`` checks (see ``verify_model``).
        stats: what the rewrite did (``casts``, ``clamped``, ``written``).
    """

    pairs: list[tuple[TensorProto, TensorProto]] = field(default_factory=list)
    index: ModelIndex | None = None
    dataflow: nx.DiGraph | None = None
    forced: dict[str, str] = field(default_factory=dict)
    assignment: Assignment = field(default_factory=dict)
    requests: Requests | None = None
    out_of_range: dict[str, str] = field(default_factory=dict)
    io_types: dict[str, int] = field(default_factory=dict)
    expected: dict[str, dict[int, int]] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


Pass = Callable[[ModelProto], PassResult]


def onnx_passes(
    level: str,
    low: int,
    state: ConvertState,
    *,
    keep_io_types: bool = True,
    op_block_list: Iterable[str] = (),
    node_block_list: Iterable[str] = (),
    keep_norm_fp32: bool | None = None,
    fp32_nodes: Iterable[str] = (),
    check: bool = True,
) -> list[Pass]:
    """The passes :func:`convert_model` runs, in order, each a named ``fn(model) ->
    PassResult`` (the name a failure is reported under); they hand their results on in
    ``state``. ``fit_ranges`` runs ``paint``, ``collect_requests`` and
    ``keep_ranges_fp32`` in rounds until no constant's range forces another node to FP32
    (a failure in a round names the inner pass). At O0 the model is indexed on a copy and
    only painted. Arguments as for :func:`convert_model`, ``low`` an ONNX dtype.

    Example:
        >>> [p.__name__ for p in onnx_passes("O2", TensorProto.FLOAT16, ConvertState())][2:]
        ['mark_low_blockers', 'fit_ranges', 'insert_casts', 'attach_data', 'verify']
    """
    rules = [(module_key(p), FP32, "node_block_list") for p in node_block_list]
    policy_for = functools.partial(make_policy, level, keep_norm_fp32=keep_norm_fp32,
                                   deny_ops=tuple(op_block_list))
    paint_pass = named("paint", _paint, state, policy_for, rules)
    passes = [
        named("index_model", _index_model, state, level == "O0"),
        named("build_dataflow", _build_dataflow, state),
        named("mark_low_blockers", _mark_low_blockers, state, low, tuple(fp32_nodes)),
    ]
    if level == "O0":  # nothing changes: the decisions only
        return passes + [paint_pass, named("attach_data", _attach_data, state)]
    rounds = [
        paint_pass,
        named("collect_requests", _collect_requests, state, low, keep_io_types),
        named("keep_ranges_fp32", _keep_ranges_fp32, state, low),
    ]
    passes += [
        named("fit_ranges", _fit_ranges, state, rounds),
        named("insert_casts", _insert_casts, state, low, keep_io_types),
        named("attach_data", _attach_data, state),
    ]
    if check:
        passes.append(named("verify", _verify, state))
    return passes


# The passes. Each walks the nodes it works on through ``visiting`` (a PassError names the
# node it was at) and hands its results on in ``state``.


def _index_model(model: ModelProto, state: ConvertState, shadow: bool) -> PassResult:
    """Index the model (unnamed and duplicate nodes get names); ``shadow``: a copy of it."""
    if shadow:
        target = ModelProto()
        target.CopyFrom(model)
    else:
        target = model
    names = _node_names(target)
    state.index = ModelIndex.build(target, {stub.name: src for stub, src in state.pairs})
    return PassResult(model, not shadow and _node_names(model) != names)


def _build_dataflow(model: ModelProto, state: ConvertState) -> PassResult:
    state.dataflow = build_dataflow(state.index)
    return PassResult(model, False)


def _mark_low_blockers(model: ModelProto, state: ConvertState, low: int,
                       fp32_nodes: tuple[str, ...]) -> PassResult:
    """Nodes whose schema has no ``low`` version, or whose FP32-only inputs share its type,
    and the nodes the caller keeps in FP32: forced to FP32."""
    types = state.index.types()
    for rec in visiting(state.index.nodes):
        if rec.role == "compute":
            why = low_blocker(rec.node, rec.opset, types, low)
            if why:
                state.forced[rec.name] = why
    state.forced.update({name: "automatic mode: this region is kept in fp32"
                         for name in fp32_nodes})
    return PassResult(model, False)


def _paint(model: ModelProto, state: ConvertState, policy_for: Callable[..., LevelPolicy],
           rules: list[tuple[str, str, str]]) -> PassResult:
    """Paint with the user's rules and the pass's own FP32 nodes (``state.forced``)."""
    forced = [(module_key(_escape(n)), FP32, "pass") for n in state.forced]
    painted = paint(state.dataflow, policy_for(module_rules=rules + forced))
    state.assignment = _tidy(painted, state.forced)
    return PassResult(model, False)


def _collect_requests(model: ModelProto, state: ConvertState, low: int,
                      keep_io_types: bool) -> PassResult:
    state.requests = collect_requests(state.index, state.assignment, low, keep_io_types)
    return PassResult(model, False)


def _keep_ranges_fp32(model: ModelProto, state: ConvertState, low: int) -> PassResult:
    """Consumers of constants beyond the low dtype's range, and large constant cones: FP32
    (found in ``state.out_of_range``, for the next round)."""
    index, forced = state.index, state.forced
    precision = {k: d.precision for k, d in state.assignment.items() if isinstance(k, str)}
    readers = _low_readers(index, state.requests, low)  # constants' bounds: read once, kept
    extra = unsafe_range_consumers(index, readers, low, precision, index.bounds)
    cones = large_constant_cones(index, low, precision, index.bounds)
    extra.update({k: v for k, v in cones.items() if k not in forced})
    state.out_of_range = extra
    return PassResult(model, False)


def _fit_ranges(model: ModelProto, state: ConvertState, rounds: list[Pass]) -> PassResult:
    """Paint, request and check ranges again while the check forces nodes to FP32."""
    manager = PassManager(rounds, input_errors=True)
    for _ in range(_MAX_RANGE_ROUNDS):
        manager.run(model)
        if not state.out_of_range:
            break
        state.forced.update(state.out_of_range)
    return PassResult(model, False)


def _insert_casts(model: ModelProto, state: ConvertState, low: int,
                  keep_io_types: bool) -> PassResult:
    """Shared Casts, converted constants, retargeted Casts (``casts.Rewriter``)."""
    state.io_types = _io_types(model, keep_io_types)
    state.expected = _expected(state.requests)
    state.stats = Rewriter(state.index, state.requests, low, keep_io_types).run()
    return PassResult(model, True)  # every graph is rebuilt


def _attach_data(model: ModelProto, state: ConvertState) -> PassResult:
    """The weights left as they were get their data back from the caller's tensors."""
    attach_data(state.pairs)
    return PassResult(model, False)


def _verify(model: ModelProto, state: ConvertState) -> PassResult:
    verify_model(model, io_types=state.io_types, expected=state.expected,
                 sized=state.stats["written"])
    return PassResult(model, False)


def _node_names(model: ModelProto) -> list[str]:
    return [n.name for g in all_graphs(model.graph) for n in g.node]


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


__all__ = ["ConversionResult", "ConvertState", "convert_model", "onnx_passes"]
