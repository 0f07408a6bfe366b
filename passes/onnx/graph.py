"""Index of an ONNX model (all scopes) and the dataflow DiGraph the painter reads.

Value names are unique across a model and its subgraphs (SSA), so one index serves the
main graph and every If/Loop/Scan body: a node in a subgraph that reads an outer-scope
value gets an edge from that value's producer, wherever it lives.

Each node gets a *role* that tells the rewriter how to treat it:

- ``compute``: float inputs and outputs; painted (``kind="compute"``).
- ``alias``: a widening float->float Cast; painted as a CLEAR op, then removed (its
  consumers read the source value in whatever dtype they need, so no Cast->Cast chain
  survives). A *narrowing* user Cast rounds on purpose and is kept, as a ``control`` node.
- ``retarget``: a Cast from int/bool/double to float: its ``to`` follows its consumers.
- ``const``: Constant / ConstantOfShape: converted (or duplicated) per requested dtype.
- ``control``: If/Loop/Scan and calls to local functions: interfaces keep their dtypes.
- ``fixed``: float outputs but no float inputs (RandomNormal, SequenceAt ...).
- ``nonfloat``: no float output (Shape, Equal, integer math).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import networkx as nx
import onnx
from onnx import GraphProto, ModelProto, NodeProto, TensorProto

from passes._infra import visiting
from passes.onnx.policy import CONTROL_FLOW, FLOAT_TYPES
from passes.onnx.skeleton import skeleton

PAINT_KIND = {
    "compute": "compute",
    "alias": "compute",
    "retarget": "source",
    "const": "source",
    "control": "source",
    "fixed": "source",
    "nonfloat": "nonfloat",
}


@dataclass(eq=False)
class Scope:
    """One graph: the main graph or a subgraph held by the node named ``owner``.

    Example:
        >>> [s.owner for s in ModelIndex.build(model).scopes]
        [None, 'loop']
    """

    graph: GraphProto
    parent: Scope | None = None
    owner: str | None = None


@dataclass(eq=False)
class NodeRec:
    """A node with its unique name, scope, opset of its domain and role.

    Example:
        >>> ModelIndex.build(model).nodes[0].role
        'compute'
    """

    node: NodeProto
    scope: Scope
    opset: int
    role: str = ""

    @property
    def name(self) -> str:
        return self.node.name


@dataclass(eq=False)
class ValueRec:
    """A value: where it comes from and its original dtype (0 when unknown).

    ``tensor`` is the initializer in the model being converted; ``source``, when set, is
    the caller's tensor holding its data (``tensor`` is then a stub of
    ``skeleton.detached_copy``, given data when converted or at the end).

    Example:
        >>> ModelIndex.build(model).values["W"].origin
        'init'
    """

    name: str
    dtype: int
    scope: Scope
    origin: str  # "input" | "formal" | "init" | "node"
    producer: NodeRec | None = None
    tensor: TensorProto | None = None
    source: TensorProto | None = None


@dataclass(eq=False)
class ModelIndex:
    """Scopes, nodes (flattened, topologically ordered), values and consumers of a model.

    Example:
        >>> index = ModelIndex.build(model)
        >>> [rec.role for rec in index.nodes]
        ['compute', 'compute']
    """

    model: ModelProto
    scopes: list[Scope] = field(default_factory=list)
    nodes: list[NodeRec] = field(default_factory=list)
    values: dict[str, ValueRec] = field(default_factory=dict)
    consumers: dict[str, list[tuple[NodeRec, int]]] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)
    sources: dict[str, TensorProto] = field(default_factory=dict)
    bounds: dict[str, tuple[float, float]] = field(default_factory=dict)  # constant: min, max

    @classmethod
    def build(cls, model: ModelProto, sources: dict[str, TensorProto] | None = None
              ) -> ModelIndex:
        """Index ``model`` in place: unnamed or duplicate nodes get unique names.

        ``sources``: main-graph initializer name -> the tensor holding its data, for a
        model from ``skeleton.detached_copy``.
        """
        index = cls(model)
        index.sources = sources or {}
        opsets = {
            ("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import
        }
        local = {(f.domain, f.name) for f in model.functions}
        types = infer_types(model)
        index.scopes.append(Scope(model.graph))
        index._walk(index.scopes[0], opsets, types, local, seen_nodes=set())
        for rec in visiting(index.nodes):
            for slot, name in enumerate(rec.node.input):
                if name:
                    index.consumers.setdefault(name, []).append((rec, slot))
        return index

    def _walk(self, scope: Scope, opsets, types, local, seen_nodes: set[str]) -> None:
        g = scope.graph
        origin = "input" if scope.parent is None else "formal"
        for vi in g.input:
            self._add_value(vi.name, types.get(vi.name, 0), scope, origin)
        main = scope.parent is None
        for init in g.initializer:
            source = self.sources.get(init.name) if main else None
            self._add_value(init.name, init.data_type, scope, "init", tensor=init, source=source)
        for i, node in enumerate(visiting(g.node)):
            if not node.name or node.name in seen_nodes:
                node.name = _fresh(f"{node.op_type}_{len(self.nodes)}_{i}", seen_nodes)
            seen_nodes.add(node.name)
            self.names.add(node.name)
            domain = "" if node.domain == "ai.onnx" else node.domain
            rec = NodeRec(node, scope, opsets.get(domain, 1))
            for sub in subgraphs(node):  # subgraph nodes come before their owner
                child = Scope(sub, scope, node.name)
                self.scopes.append(child)
                self._walk(child, opsets, types, local, seen_nodes)
            for out in node.output:
                if out:
                    dtype = types.get(out) or _guess(node, types)
                    self._add_value(out, dtype, scope, "node", producer=rec)
                    types.setdefault(out, dtype)
            rec.role = _role(node, types, (node.domain, node.op_type) in local)
            if rec.role == "alias" and self._after_user_rounding(node):
                rec.role = "control"  # a chain of user Casts after a rounding one: as written
            self.nodes.append(rec)

    def _after_user_rounding(self, node: NodeProto) -> bool:
        value = self.values.get(node.input[0])
        prev = value.producer if value is not None else None
        return prev is not None and prev.role == "control" and prev.node.op_type == "Cast"

    def _add_value(self, name: str, dtype: int, scope: Scope, origin: str, **kw) -> None:
        if name in self.values and origin != "init":
            raise ValueError(
                f"value {name!r} is defined twice; ONNX models must be in SSA form "
                "(run onnx.checker.check_model to locate it)"
            )
        if name not in self.values or origin == "init":
            self.values[name] = ValueRec(name, dtype, scope, origin, **kw)
        self.names.add(name)

    def types(self) -> dict[str, int]:
        """Original dtype of every value."""
        return {name: v.dtype for name, v in self.values.items()}

    def fresh(self, base: str) -> str:
        """A value/node name not used anywhere in the model."""
        return _fresh(base, self.names)


def subgraphs(node: NodeProto) -> Iterator[GraphProto]:
    """The subgraphs held by ``node``'s attributes (If branches, Loop/Scan bodies).

    Example:
        >>> [g.name for g in subgraphs(if_node)]
        ['else', 'then']
    """
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def _fresh(base: str, used: set[str]) -> str:
    name, k = base, 0
    while name in used:
        k += 1
        name = f"{base}_{k}"
    used.add(name)
    return name


def _guess(node: NodeProto, types: dict[str, int]) -> int:
    """Dtype of an output shape inference could not type (contrib ops): its first float input."""
    return next((types[v] for v in node.input if types.get(v) in FLOAT_TYPES), 0)


_RANK = {TensorProto.DOUBLE: 3, TensorProto.FLOAT: 2, TensorProto.FLOAT16: 1,
         TensorProto.BFLOAT16: 1}


def _cast_to(node: NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "to"), 0)


def rounds(src: int, dst: int) -> bool:
    """Whether a float->float Cast from ``src`` to ``dst`` loses precision (fp32->fp16,
    fp16<->bf16, fp64->fp32); False for widening casts and non-float types.

    Example:
        >>> F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
        >>> rounds(F32, F16), rounds(F16, F32)
        (True, False)
    """
    if src not in _RANK or dst not in _RANK:
        return False
    return _RANK[dst] < _RANK[src] or (_RANK[dst] == _RANK[src] == 1 and dst != src)


def _role(node: NodeProto, types: dict[str, int], is_local_function: bool) -> str:
    in_float = any(types.get(v) in FLOAT_TYPES for v in node.input if v)
    out_float = any(types.get(v) in FLOAT_TYPES for v in node.output if v)
    default_domain = node.domain in ("", "ai.onnx")
    if is_local_function or any(True for _ in subgraphs(node)) or (
        default_domain and node.op_type in CONTROL_FLOW
    ):
        return "control"
    if not out_float:
        return "nonfloat"
    if default_domain and node.op_type == "Cast":
        if in_float and rounds(types.get(node.input[0], 0), _cast_to(node)):
            return "control"  # a user's narrowing Cast rounds on purpose: kept as written
        return "alias" if in_float else "retarget"
    if default_domain and node.op_type in ("Constant", "ConstantOfShape"):
        return "const"
    return "compute" if in_float else "fixed"


def infer_types(model: ModelProto, *, strict: bool = False) -> dict[str, int]:
    """Elem type of every typed value, by ONNX shape inference on a weight-free skeleton.

    Large initializers are detached during inference, so models over 2 GB work. With
    ``strict`` inference errors (a type parameter bound to two dtypes ...) propagate;
    otherwise inference is best effort and declared types fill the gaps.

    Example:
        >>> infer_types(model)["logits"] == TensorProto.FLOAT
        True
    """
    try:
        inferred = onnx.shape_inference.infer_shapes(
            skeleton(model), check_type=strict, strict_mode=strict
        )
    except Exception:
        if strict:
            raise
        inferred = model  # best effort: fall back to declared types
    types: dict[str, int] = {}
    for g in _all_graphs(inferred.graph):
        for vi in (*g.input, *g.value_info, *g.output):
            if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                types[vi.name] = vi.type.tensor_type.elem_type
        for t in g.initializer:
            types[t.name] = t.data_type
        for node in visiting(g.node):
            if node.op_type == "Constant" and node.output:
                for attr in node.attribute:
                    if attr.name == "value":
                        types[node.output[0]] = attr.t.data_type
                    elif attr.name in ("value_float", "value_floats"):
                        types[node.output[0]] = TensorProto.FLOAT
    return types


def _all_graphs(graph: GraphProto) -> Iterator[GraphProto]:
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from _all_graphs(sub)


def module_key(name: str) -> str:
    """The painter's ``module`` attribute for a node: dots are not path separators here
    (``passes.policy`` would otherwise match "/layer" against "/layer.0/MatMul").

    Example:
        >>> module_key("/layer.0/MatMul")
        '/layer\x1f0/MatMul'
    """
    return name.replace(".", "\x1f")


def build_dataflow(index: ModelIndex) -> nx.DiGraph:
    """The DiGraph for ``passes.paint.paint``: node vertices (by node name), source
    vertices ``("value", name)`` for inputs and initializers, float edges between them;
    the producers of a (sub)graph's outputs are marked ``returned``.

    Example:
        >>> paint(build_dataflow(ModelIndex.build(model)), policy)
    """
    graph = nx.DiGraph()
    for name, v in index.values.items():
        if v.origin != "node" and v.dtype in FLOAT_TYPES:
            graph.add_node(("value", name), kind="source", op="", module="", module_classes=())
    for rec in visiting(index.nodes):
        graph.add_node(
            rec.name, kind=PAINT_KIND[rec.role], op=rec.node.op_type,
            module=module_key(rec.name), module_classes=(),
        )
    for rec in visiting(index.nodes):
        for name in rec.node.input:
            v = index.values.get(name)
            if v is None or v.dtype not in FLOAT_TYPES:
                continue
            src = v.producer.name if v.producer is not None else ("value", name)
            if src != rec.name:
                graph.add_edge(src, rec.name)
    for scope in index.scopes:  # a (sub)graph's outputs: their dtype is part of its interface
        for out in scope.graph.output:
            v = index.values.get(out.name)
            if v is not None and v.producer is not None:
                graph.nodes[v.producer.name]["returned"] = True
    return graph


__all__ = [
    "ModelIndex",
    "NodeRec",
    "Scope",
    "ValueRec",
    "build_dataflow",
    "infer_types",
    "module_key",
    "rounds",
    "skeleton",
    "subgraphs",
]
