"""Dialect-free precision painting over a networkx DiGraph.

The graph's vertices are a dialect's nodes; edges carry float data from producer to
consumer. Each vertex has attributes:

- ``kind``: ``"compute"`` (a float op the painter decides), ``"source"`` (graph input,
  parameter, constant or explicit cast: a value of fixed dtype, cast on use),
  ``"nonfloat"`` (no float data: integer/bool ops, fp64, shape arithmetic);
- ``op``: the policy key (``aten.linear``, ``MatMul``);
- ``module``: the module path the node came from ("" when unknown);
- ``module_classes``: qualified class names of the modules it sits in;
- ``forced`` (optional): ``(precision, reason)`` a dialect imposes (range hazards).

:func:`paint` returns an :class:`Assignment`: vertex -> :class:`Decision` with the
precision (``LOW``, ``FP32`` or ``NA``) and the rule that decided it. It never looks
at torch or onnx objects, so the FX and ONNX passes share it.

Rules (TensorFlow grappler's auto_mixed_precision, per level table in policy.py):

1. ALLOW ops are low, DENY ops fp32, module/op overrides win over both.
2. O1 deny propagation: INFER/CLEAR ops downstream of a DENY op through INFER/CLEAR ops,
   on a path to an INFER/DENY op, stay fp32 (feeding them low would just round).
3. O1 fill: INFER/CLEAR ops both downstream and upstream of low ops become low, so no
   cast pair sits between two low ops.
4. O1 spread: CLEAR ops next to low ops and INFER ops fed only by low ops become low.
5. O2 follow: a CLEAR op fed only by fp32 ops stays fp32 (the cast moves to the first
   low consumer); otherwise low.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import networkx as nx

from passes.policy import (
    ALLOW,
    CLEAR,
    DENY,
    FORCED_GROUPS,
    FP32,
    INFER,
    LOW,
    NA,
    NORM_FP32,
    LevelPolicy,
    OpInfo,
)

COMPUTE = "compute"
SOURCE = "source"
NONFLOAT = "nonfloat"


@dataclass(frozen=True)
class Decision:
    """The precision of one vertex and why."""

    precision: str
    reason: str
    cls: str = ""


Assignment = dict[Hashable, Decision]


def paint(graph: nx.DiGraph, policy: LevelPolicy) -> Assignment:
    """Assign a precision to every vertex of ``graph`` under ``policy``.

    Args:
        graph: dataflow graph; vertex attributes as described in the module docstring.
        policy: level, norm handling and overrides (see ``passes.policy.make_policy``).

    Returns:
        Vertex -> Decision, for every vertex.

    Example:
        >>> g = nx.DiGraph()
        >>> g.add_node("mm", kind="compute", op="aten.mm")
        >>> paint(g, make_policy("O1"))["mm"].precision
        'low'
    """
    out: Assignment = {}
    cls: dict[Hashable, str] = {}
    pending: dict[Hashable, str] = {}  # vertex -> "paint" | "follow"
    for v, data in graph.nodes(data=True):
        kind = data.get("kind", COMPUTE)
        if kind == SOURCE:
            out[v] = Decision(NA, data.get("reason", "source: cast on use"))
            continue
        if kind == NONFLOAT:
            out[v] = Decision(NA, data.get("reason", "no floating-point data"))
            continue
        info = policy.op_info(data.get("op", ""))
        cls[v] = info.cls
        if policy.level == "O0":
            out[v] = Decision(FP32, "O0: everything fp32", info.cls)
            continue
        if data.get("forced"):  # the dialect found a hazard (e.g. an fp16 range problem)
            out[v] = Decision(data["forced"][0], data["forced"][1], info.cls)
            continue
        forced = policy.overrides.module_precision(
            data.get("module", ""), data.get("module_classes", ())
        )
        if forced is not None:
            out[v] = Decision(forced[0], f"module override: {forced[1]}", info.cls)
            continue
        base = policy.base(info)
        if base in (LOW, FP32):
            out[v] = Decision(base, _fixed_reason(info, base, policy.level), info.cls)
        else:
            pending[v] = base
    compute = graph.subgraph(cls)
    if pending:
        paint_only = {v for v, how in pending.items() if how == "paint"}
        follow_only = {v for v, how in pending.items() if how == "follow"}
        if paint_only:
            _paint_o1(compute, cls, paint_only, out)
        if follow_only:
            _follow(compute, follow_only, out)
    return out


def _fixed_reason(info: OpInfo, precision: str, level: str) -> str:
    if info.group in FORCED_GROUPS:
        return f"deny list: {info.reason}" if info.group == NORM_FP32 else info.reason
    if level == "O3":
        return f"O3: everything low precision ({info.cls} op)"
    if info.cls == ALLOW and precision == LOW:
        return f"allow list: {info.reason}"
    if info.cls == DENY and precision == FP32:
        return f"deny list: {info.reason}"
    return f"{level}: whole network low precision ({info.cls} op: {info.reason})"


def _reach(graph: nx.DiGraph, starts: Iterable[Hashable], through: set, forward: bool) -> set:
    """Vertices in ``through`` reachable from ``starts`` by paths inside ``through``."""
    seen: set = set()
    stack = list(starts)
    step = graph.successors if forward else graph.predecessors
    while stack:
        v = stack.pop()
        for w in step(v):
            if w in through and w not in seen:
                seen.add(w)
                stack.append(w)
    return seen


def _paint_o1(graph: nx.DiGraph, cls: dict, todo: set, out: Assignment) -> None:
    low = {v for v, d in out.items() if d.precision == LOW and v in graph}
    fp32 = {v for v, d in out.items() if d.precision == FP32 and v in graph}
    # 2. deny propagation.
    downstream_of_deny = _reach(graph, fp32, todo, forward=True)
    infer_targets = {v for v in todo if cls[v] == INFER} | fp32
    leads_to_infer = _reach(graph, infer_targets, todo, forward=False) | {
        v for v in todo if cls[v] == INFER
    }
    denied = downstream_of_deny & leads_to_infer
    for v in denied:
        src = next((u for u in graph.predecessors(v) if u in fp32 or u in denied), None)
        out[v] = Decision(FP32, f"O1 deny propagation: downstream of fp32 op {src}", cls[v])
    free = todo - denied
    # 3. fill between low ops.
    between = _reach(graph, low, free, forward=True) & _reach(graph, low, free, forward=False)
    for v in between:
        out[v] = Decision(LOW, "O1 fill: between low-precision ops, avoids a cast pair", cls[v])
    free -= between
    low |= between
    # 4. spread clear ops both ways, infer ops forward, until nothing changes.
    changed = True
    while changed:
        changed = False
        for v in list(free):
            preds = [u for u in graph.predecessors(v)]
            if cls[v] == CLEAR:
                near = next((u for u in (*preds, *graph.successors(v)) if u in low), None)
                if near is not None:
                    out[v] = Decision(LOW, f"O1 clear op: follows low-precision neighbour {near}",
                                      CLEAR)
            elif preds and all(u in low for u in preds):
                out[v] = Decision(LOW, "O1 infer op: all float inputs are low precision", INFER)
            if v in out and out[v].precision == LOW:
                low.add(v)
                free.discard(v)
                changed = True
    for v in free:
        why = "inputs are fp32" if cls[v] == INFER else "no low-precision neighbour"
        out[v] = Decision(FP32, f"O1 {cls[v]} op: {why}", cls[v])


def _follow(graph: nx.DiGraph, todo: set, out: Assignment) -> None:
    """O2 CLEAR ops: fp32 when every decided producer is fp32, else low; a CLEAR op fed only
    by sources (directly or through other such CLEAR ops) follows its consumers instead."""
    order = [v for v in nx.topological_sort(graph) if v in todo]
    source_fed = []
    for v in order:
        preds = [u for u in graph.predecessors(v) if u in out]  # chain members decide later
        if not preds:
            source_fed.append(v)
        elif all(out[u].precision == FP32 for u in preds):
            out[v] = Decision(FP32, f"clear op after fp32 op {preds[0]}: the cast moves to its "
                                    "low-precision consumer", CLEAR)
        else:
            out[v] = Decision(LOW, "clear op fed low precision: follows its inputs", CLEAR)
    for v in reversed(source_fed):
        succs = [w for w in graph.successors(v) if w in out]
        if succs and all(out[w].precision == FP32 for w in succs):
            out[v] = Decision(FP32, "clear op feeding only fp32 ops: stays fp32", CLEAR)
        else:
            out[v] = Decision(LOW, "clear op on an input or weight: follows its consumers", CLEAR)


__all__ = ["Assignment", "Decision", "paint", "COMPUTE", "SOURCE", "NONFLOAT", "ALLOW", "DENY"]
