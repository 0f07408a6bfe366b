"""Dialect-free precision painting over a networkx DiGraph.

The graph's vertices are a dialect's nodes; edges carry float data from producer to
consumer. Each vertex has attributes:

- ``kind``: ``"compute"`` (a float op the painter decides), ``"source"`` (graph input,
  parameter, constant or explicit cast: a value of fixed dtype, cast on use),
  ``"nonfloat"`` (no float data: integer/bool ops, fp64, shape arithmetic);
- ``op``: the policy key (``aten.linear``, ``MatMul``);
- ``module``: the module path the node came from ("" when unknown);
- ``module_classes``: qualified class names of the modules it sits in;
- ``forced`` (optional): ``(precision, reason)`` a dialect imposes (range hazards);
- ``returned`` (optional): the graph returns the vertex's value.

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
6. O2 between: INFER ops (with the CLEAR ops among them) whose producers and consumers
   are all fp32 ops stay fp32: low precision would add a cast on each side and round
   (RMSNorm's ``variance + eps`` between ``mean`` and ``rsqrt``). Not for a value the
   graph returns (``returned``: its dtype is the graph's output).
7. Selection inputs (O1, O2): a selection op (top-k, sort, argmax: the ``selection``
   group) and the INFER/CLEAR ops that make its float inputs, back to the nearest matrix
   op, fp32 op or source, are fp32. In 16 bits the compared values tie (a MoE router's
   sigmoid scores near 0.5 are 2**-8 apart in bf16) and the choice changes; autocast, which
   keeps such ops in fp32 after the model's explicit ``.float()``, picks as fp32 does.
8. Fallback parts without products (O1, O2): a graph of a child an eager fallback compiles
   on its own (``policy.fallback_part``) with no ALLOW op is fp32. Its inputs come from fp32
   code and its outputs go back to it, so low precision would only round: torchvision's
   ``MultiScaleRoIAlign`` is box coordinates, level mapping and sampling positions.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import networkx as nx

from passes.adjacency import Adjacency
from passes.policy import (
    ALLOW,
    CLEAR,
    DENY,
    FORCED_GROUPS,
    FP32,
    INFER,
    LOW,
    NA,
    NORM,
    NORM_FP32,
    SELECTION,
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


def force_fp32(graph: nx.DiGraph, v: Hashable, reason: str) -> bool:
    """Keep the compute vertex ``v`` fp32 for ``reason`` (what the painter's ``forced``
    attribute says), unless it is not in ``graph``, not a compute op, or a hazard forced it
    already; whether it did.

    Example:
        >>> g = nx.DiGraph(); g.add_node("exp", kind="compute", op="aten.exp")
        >>> force_fp32(g, "exp", "overflows"), force_fp32(g, "exp", "again")
        (True, False)
    """
    data = graph.nodes[v] if v in graph else None
    if data is None or data.get("kind") != COMPUTE or data.get("forced"):
        return False
    data["forced"] = (FP32, reason)
    return True
NO_PRODUCTS_REASON = (
    "eager fallback part without a matrix product or convolution: its inputs come from fp32 "
    "code and its outputs return to it, so low precision would only round")


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
    decide = _Decisions()
    # op key -> (info, base, decision when the level fixes it): one policy lookup per op
    infos: dict[str, tuple[OpInfo, str, Decision | None]] = {}
    modules: dict = {}  # (module, classes) -> module override: one match per module
    has_module_rules = bool(policy.overrides.modules)
    o0 = policy.level == "O0"
    between: set | None = set() if policy.level == "O2" else None  # for rule 6
    selecting = _selection_inputs(graph, policy) if policy.level in ("O1", "O2") else {}
    no_products = (policy.fallback_part and policy.level in ("O1", "O2")  # rule 8
                   and not _has_allow_op(graph, policy))
    for v, data in graph.nodes(data=True):
        kind = data.get("kind", COMPUTE)
        if kind == SOURCE:
            out[v] = decide(NA, data.get("reason", "source: cast on use"))
            continue
        if kind == NONFLOAT:
            out[v] = decide(NA, data.get("reason", "no floating-point data"))
            continue
        op = data.get("op", "")
        cached = infos.get(op)
        if cached is None:
            info = policy.op_info(op)
            if o0:
                base, fixed = "", decide(FP32, "O0: everything fp32", info.cls)
            else:
                base = policy.base(info)
                fixed = (decide(base, _fixed_reason(info, base, policy.level), info.cls)
                         if base in (LOW, FP32) else None)
            cached = infos[op] = (info, base, fixed)
        info, base, fixed = cached
        cls[v] = info.cls
        if o0:
            out[v] = fixed
            continue
        if data.get("forced"):  # the dialect found a hazard (e.g. an fp16 range problem)
            out[v] = decide(data["forced"][0], data["forced"][1], info.cls)
            continue
        if has_module_rules:
            forced = _module_override(policy, data, modules)
            if forced is not None:
                out[v] = decide(forced[0], f"module override: {forced[1]}", info.cls)
                continue
        if no_products and (fixed is None or fixed.precision != FP32):
            out[v] = decide(FP32, NO_PRODUCTS_REASON, info.cls)
            continue
        sel = selecting.get(v)
        if sel is not None:  # rule 7
            out[v] = decide(FP32, f"feeds the selection {sel}: 16-bit values would tie and "
                                  "change what it picks", info.cls)
        elif fixed is not None:
            out[v] = fixed
            if between is not None and info.cls == INFER and info.group != NORM:
                between.add(v)  # (a norm low by the user's keep_batchnorm_fp32=False stays)
        else:
            pending[v] = base
    if pending or between:
        compute = Adjacency(graph, cls)
        paint_only = {v for v, how in pending.items() if how == "paint"}
        follow_only = {v for v, how in pending.items() if how == "follow"}
        if paint_only:
            _paint_o1(compute, cls, paint_only, out)
        if between:
            _between(compute, between, follow_only, out)
        if follow_only:
            _follow(compute, follow_only, out)
    return out


class _Decisions:
    """Shares one :class:`Decision` among the vertices with equal precision, reason and class
    (Decisions are frozen values; most reasons repeat across a large graph)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str, str], Decision] = {}

    def __call__(self, precision: str, reason: str, cls: str = "") -> Decision:
        key = (precision, reason, cls)
        d = self._seen.get(key)
        if d is None:
            d = self._seen[key] = Decision(precision, reason, cls)
        return d


def _selection_inputs(graph: nx.DiGraph, policy: LevelPolicy) -> dict[Hashable, Hashable]:
    """Rule 7: vertex -> the selection vertex it feeds, for every compute selection vertex
    and every INFER/CLEAR compute vertex on a path into one through such vertices (neither
    forced by the dialect nor in a forced group, norms included)."""
    groups: dict[str, tuple[str, str]] = {}  # op key -> (class, group)

    def info(op: str) -> tuple[str, str]:
        hit = groups.get(op)
        if hit is None:
            i = policy.op_info(op)
            hit = groups[op] = (i.cls, i.group)
        return hit

    nodes = graph._node
    fed: dict[Hashable, Hashable] = {}
    stack = []
    for v, data in nodes.items():
        if "op" in data and info(data["op"])[1] == SELECTION:
            stack.append((v, v))
            if data.get("kind", COMPUTE) == COMPUTE and not data.get("forced"):
                fed[v] = v
    pred = graph._pred
    while stack:
        v, sel = stack.pop()
        for u in pred[v]:
            data = nodes[u]
            if u in fed or data.get("kind", COMPUTE) != COMPUTE or data.get("forced"):
                continue
            cls, group = info(data.get("op", ""))
            if cls in (INFER, CLEAR) and group not in FORCED_GROUPS and group != NORM:
                fed[u] = sel
                stack.append((u, sel))
    return fed


def _has_allow_op(graph: nx.DiGraph, policy: LevelPolicy) -> bool:
    ops = {data.get("op", "") for _, data in graph.nodes(data=True)
           if data.get("kind", COMPUTE) == COMPUTE}
    return any(policy.op_info(op).cls == ALLOW for op in ops)


def _module_override(policy: LevelPolicy, data: dict, cache: dict) -> tuple[str, str] | None:
    module, classes = data.get("module", ""), data.get("module_classes", ())
    try:
        key = (module, tuple(classes))
        hit = cache.get(key, cache)
    except TypeError:  # unhashable class entries: no caching
        return policy.overrides.module_precision(module, classes)
    if hit is cache:
        hit = cache[key] = policy.overrides.module_precision(module, classes)
    return hit


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


def _reach(graph: Adjacency, starts: Iterable[Hashable], through: set, forward: bool) -> set:
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


def _paint_o1(graph: Adjacency, cls: dict, todo: set, out: Assignment) -> None:
    decide = _Decisions()
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
        out[v] = decide(FP32, f"O1 deny propagation: downstream of fp32 op {src}", cls[v])
    free = todo - denied
    # 3. fill between low ops.
    between = _reach(graph, low, free, forward=True) & _reach(graph, low, free, forward=False)
    for v in between:
        out[v] = decide(LOW, "O1 fill: between low-precision ops, avoids a cast pair", cls[v])
    free -= between
    low |= between
    # 4. spread clear ops both ways, infer ops forward, until nothing changes. The result
    # is the same in any order; visiting in graph order makes the neighbour a reason
    # names the same on every run (a set's order changes with PYTHONHASHSEED).
    order = [v for v in graph.graph if v in free]
    changed = True
    while changed:
        changed = False
        for v in order:
            if v not in free:
                continue
            preds = graph.predecessors(v)
            if cls[v] == CLEAR:
                near = next((u for u in (*preds, *graph.successors(v)) if u in low), None)
                if near is not None:
                    out[v] = decide(LOW, f"O1 clear op: follows low-precision neighbour {near}",
                                    CLEAR)
            elif preds and all(u in low for u in preds):
                out[v] = decide(LOW, "O1 infer op: all float inputs are low precision", INFER)
            if v in out and out[v].precision == LOW:
                low.add(v)
                free.discard(v)
                changed = True
    for v in free:
        why = "inputs are fp32" if cls[v] == INFER else "no low-precision neighbour"
        out[v] = decide(FP32, f"O1 {cls[v]} op: {why}", cls[v])


def _between(graph: Adjacency, infer: set, clear: set, out: Assignment) -> None:
    """Rule 6: the O2 INFER ops in ``infer`` (decided low) that, with the undecided CLEAR
    ops in ``clear``, form regions whose producers and consumers are all fp32 ops become
    fp32 (their CLEAR ops then follow them, rule 5). The largest such set: members are
    dropped until every one has a producer and a consumer and all of them are fp32 ops or
    members, and none is returned."""
    region = infer | clear
    members = set(region)

    def fp32(u: Hashable) -> bool:
        return u in members if u in region else out[u].precision == FP32

    def stays(v: Hashable) -> bool:
        preds, succs = graph.predecessors(v), graph.successors(v)
        return (bool(preds) and all(map(fp32, preds)) and bool(succs) and all(map(fp32, succs))
                and not graph.graph.nodes[v].get("returned"))

    todo = list(members)  # a worklist: a member leaves once, and only its neighbours are
    while todo:  # looked at again (a chain of N ops ending low: N steps, not N passes)
        v = todo.pop()
        if v in members and not stays(v):
            members.discard(v)
            todo.extend(u for u in (*graph.predecessors(v), *graph.successors(v))
                        if u in members)
    decide = _Decisions()
    for v in graph.topological_order(members & infer):
        src, dst = graph.predecessors(v)[0], graph.successors(v)[0]
        out[v] = decide(FP32, f"O2 infer op between fp32 ops ({src} -> {dst}): low precision "
                              "would add a cast each side", INFER)


def _follow(graph: Adjacency, todo: set, out: Assignment) -> None:
    """O2 CLEAR ops: fp32 when every decided producer is fp32, else low; a CLEAR op fed only
    by sources (directly or through other such CLEAR ops) follows its consumers instead.

    Any order of ``todo`` that puts producers first gives the same result: a vertex reads
    only its producers' decisions (made before it: any other compute vertex is decided
    already) and, for source-fed chains, its consumers' (made after it). So only the edges
    between ``todo`` vertices are sorted, not the whole compute subgraph.
    """
    decide = _Decisions()
    order = graph.topological_order(todo)
    source_fed = []
    for v in order:
        preds = [u for u in graph.predecessors(v) if u in out]  # chain members decide later
        if not preds:
            source_fed.append(v)
        elif all(out[u].precision == FP32 for u in preds):
            out[v] = decide(FP32, f"clear op after fp32 op {preds[0]}: the cast moves to its "
                                  "low-precision consumer", CLEAR)
        else:
            out[v] = decide(LOW, "clear op fed low precision: follows its inputs", CLEAR)
    for v in reversed(source_fed):
        succs = [w for w in graph.successors(v) if w in out]
        if succs and all(out[w].precision == FP32 for w in succs):
            out[v] = decide(FP32, "clear op feeding only fp32 ops: stays fp32", CLEAR)
        else:
            out[v] = decide(LOW, "clear op on an input or weight: follows its consumers", CLEAR)


__all__ = ["Assignment", "Decision", "paint", "COMPUTE", "SOURCE", "NONFLOAT", "ALLOW", "DENY"]
