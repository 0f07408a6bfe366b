"""Apply a painted precision assignment to an ONNX model: Casts, constants, retargets.

Three phases, after the TensorFlow grappler and TVM ToMixedPrecision designs:

1. Requests (:func:`collect_requests`): each consumer slot asks for a dtype: a painted
   node per its precision and its schema's type parameters; control-flow interfaces and
   (with ``keep_io_types``) graph outputs for their original dtype; a non-float op whose
   float inputs share a type (``Equal``) for FLOAT. Float->float Casts are aliases: a
   request for their output is a request for their input, so no Cast->Cast chain remains.
2. Materialise (:class:`Rewriter`): a constant all of whose readers agree is converted in
   place, otherwise a converted copy is added; a Cast from int/bool is retargeted when all
   readers agree, otherwise a second Cast reads the same source; any other value gets one
   Cast per (value, dtype), placed after its producer (in the producer's scope, so nested
   subgraphs share it).
3. Rebuild each graph innermost first, then rename so graph outputs keep their names.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from onnx import NodeProto, TensorProto, helper

from passes._infra import visiting
from passes.onnx.graph import ModelIndex, Scope
from passes.onnx.initializers import const_tensor, const_variant, convert_tensor, set_const
from passes.onnx.policy import DTYPE_TAG, FLOAT, FLOAT_TYPES
from passes.onnx.schema import node_slots, plan_node, shared_float_inputs
from passes.onnx.subgraphs import rename_values
from passes.paint import Decision
from passes.policy import LOW

IN, OUT = "in", "out"


INSERTED = "ampgraph: inserted cast"  # doc_string of the casts this pass adds


def _holds(v, dtype: int) -> bool:
    """Whether constant ``v`` can be stored in ``dtype`` under its opset: an initializer or
    ``Constant`` always can, a ``ConstantOfShape`` only from opset 20 for bf16 (before,
    it stays fp32 and a Cast after it gives its low readers their dtype)."""
    rec = v.producer
    if rec is None or rec.role != "const":
        return True
    slots = node_slots(rec.node, rec.opset)
    return slots.allows(slots.outputs[0], dtype)


def _widens(low: int, high: int) -> bool:
    """``low -> high`` is exact (fp16/bf16 -> fp32 or fp64; fp32 -> fp64)."""
    rank = {TensorProto.FLOAT16: 1, TensorProto.BFLOAT16: 1, TensorProto.FLOAT: 2,
            TensorProto.DOUBLE: 3}
    return low in rank and high in rank and rank[high] > rank[low]


@dataclass
class Requests:
    """What every consumer slot asks for, after painting.

    Attributes:
        items: (value root, dtype, ("in", NodeRec, slot) | ("out", Scope, index)).
        alias: output of a float->float Cast -> its input.
        out_dtype: node output -> dtype it will have (painted nodes).

    Example:
        >>> reqs.root("x_copy")  # x_copy = Cast(x, to=FLOAT)
        'x'
    """

    items: list[tuple[str, int, tuple]] = field(default_factory=list)
    alias: dict[str, str] = field(default_factory=dict)
    out_dtype: dict[str, int] = field(default_factory=dict)

    def root(self, name: str) -> str:
        while name in self.alias:
            name = self.alias[name]
        return name

    def by_value(self) -> dict[str, set[int]]:
        out: dict[str, set[int]] = defaultdict(set)
        for name, dtype, _ in self.items:
            out[name].add(dtype)
        return out


def collect_requests(
    index: ModelIndex, decisions: dict, low: int, keep_io_types: bool
) -> Requests:
    """Phase 1: the dtype each consumer slot needs under ``decisions``.

    Example:
        >>> reqs = collect_requests(index, paint(graph, policy), FLOAT16, True)
        >>> reqs.by_value()["x"]
        {10}
    """
    types = index.types()
    req = Requests()
    for rec in visiting(index.nodes):
        if rec.role == "alias":
            req.alias[rec.node.output[0]] = rec.node.input[0]
    for rec in visiting(index.nodes):
        node = rec.node
        if rec.role == "compute":
            d = decisions.get(rec.name)
            want = low if isinstance(d, Decision) and d.precision == LOW else FLOAT
            ins, outs = plan_node(node, rec.opset, types, want)
            req.out_dtype.update({node.output[j]: dt for j, dt in outs.items()})
        elif rec.role == "control" and node.op_type == "Cast":
            ins = {}  # a user's narrowing Cast converts whatever float it is given
        elif rec.role == "control":
            ins = {i: types[v] for i, v in enumerate(node.input) if types.get(v) in FLOAT_TYPES}
        elif rec.role == "nonfloat":
            ins = {i: FLOAT for i in shared_float_inputs(node, rec.opset, types)}
        else:
            ins = {}
        for slot, dtype in ins.items():
            req.items.append((req.root(node.input[slot]), dtype, (IN, rec, slot)))
    for scope in index.scopes:
        for k, out in enumerate(scope.graph.output):
            orig = types.get(out.name, 0)
            if orig not in FLOAT_TYPES:
                continue
            top = scope.parent is None
            dtype = low if top and not keep_io_types and orig == FLOAT else orig
            req.items.append((req.root(out.name), dtype, (OUT, scope, k)))
    return req


class Rewriter:
    """Phases 2 and 3: materialise the requests on the model indexed by ``index``.

    Example:
        >>> stats = Rewriter(index, reqs, FLOAT16, keep_io_types=True).run()
        >>> stats["casts"]
        3
    """

    def __init__(self, index: ModelIndex, requests: Requests, low: int, keep_io_types: bool):
        self.index, self.req, self.low, self.keep_io = index, requests, low, keep_io_types
        self.dtype: dict[str, int] = {}
        self.cache: dict[tuple[str, int], str] = {}
        self.after: dict[str, list[NodeProto]] = defaultdict(list)
        self.head: dict[int, list[NodeProto]] = defaultdict(list)
        self.tail: dict[int, list[NodeProto]] = defaultdict(list)
        self.new_inits: dict[int, list] = defaultdict(list)
        self.created: dict[str, Scope] = {}
        self.clamped: dict[str, int] = {}
        self.written: set[str] = set()
        self.casts = 0

    def run(self) -> dict:
        self._materialise_dtypes()
        # readers that accept any dtype (Shape) skip removed Casts
        for rec in visiting(self.index.nodes):
            for i, name in enumerate(rec.node.input):
                if name in self.req.alias:
                    rec.node.input[i] = self.req.root(name)
        renames: dict[str, str] = {}
        for name, dtype, where in self.req.items:
            got = self._resolve(name, dtype)
            if where[0] == IN:
                where[1].node.input[where[2]] = got
            else:
                self._output(where[1], where[2], got, renames)
        self._convert_in_place()
        self._retype()
        for scope in reversed(self.index.scopes):  # innermost first: extend() copies nodes
            self._rebuild(scope)
        rename_values(self.index.model, renames)
        written = {renames.get(n, n) for n in self.written}  # initializers written here
        return {"casts": self.casts, "clamped": dict(self.clamped), "dtypes": self.dtype,
                "written": written}

    # -- phase 2 -------------------------------------------------------------------------
    def _materialise_dtypes(self) -> None:
        wanted = self.req.by_value()
        for name, v in self.index.values.items():
            if v.dtype not in FLOAT_TYPES or name in self.req.alias:
                continue
            role = v.producer.role if v.producer is not None else v.origin
            if role == "input":
                lowered = not self.keep_io and v.dtype == FLOAT
                self.dtype[name] = self.low if lowered else v.dtype
            elif role in ("init", "const", "retarget"):
                agreed = wanted.get(name, set())
                one = next(iter(agreed)) if len(agreed) == 1 else v.dtype
                self.dtype[name] = one if _holds(v, one) else v.dtype
            elif role == "compute":
                self.dtype[name] = self.req.out_dtype.get(name, v.dtype)
            else:
                self.dtype[name] = v.dtype

    def _resolve(self, name: str, dtype: int) -> str:
        if self.dtype.get(name, dtype) == dtype:
            return name
        key = (name, dtype)
        if key in self.cache:
            return self.cache[key]
        v = self.index.values[name]
        prev = v.producer
        if (prev is not None and prev.node.op_type == "Cast" and prev.role == "control"
                and self.dtype.get(prev.node.input[0]) == dtype
                and _widens(dtype, self.dtype.get(name, v.dtype))):
            return prev.node.input[0]  # low -> fp32 (a user Cast) -> low is the low value
        new = self.index.fresh(f"{name}_{DTYPE_TAG.get(dtype, dtype)}")
        role = v.producer.role if v.producer is not None else v.origin
        if role in ("init", "const") and _holds(v, dtype):
            tensor, n = convert_tensor(const_tensor(v), dtype, new,
                                       known=self.index.bounds.get(name))
            self._note_clamp(name, n)
            made = const_variant(self.index, v, tensor, new)
            if v.tensor is not None:
                self.new_inits[id(v.scope)].append(made)
                self.written.add(new)
            else:
                self.after[v.producer.name].append(made)
        elif role == "retarget":  # a second Cast from the same int/bool source
            src = v.producer.node.input[0]
            self.after[v.producer.name].append(self._cast(src, new, dtype))
        elif v.producer is not None:
            self.after[v.producer.name].append(self._cast(name, new, dtype))
        else:
            self.head[id(v.scope)].append(self._cast(name, new, dtype))
        self.created[new] = v.scope
        self.dtype[new] = dtype
        self.cache[key] = new
        return new

    def _cast(self, src: str, out: str, dtype: int) -> NodeProto:
        self.casts += 1
        return helper.make_node("Cast", [src], [out], name=self.index.fresh(f"{out}_cast"),
                                to=dtype, doc_string=INSERTED)

    def _note_clamp(self, name: str, n: int) -> None:
        if n:
            self.clamped[name] = max(self.clamped.get(name, 0), n)

    def _output(self, scope: Scope, k: int, got: str, renames: dict[str, str]) -> None:
        """Graph output ``k`` of ``scope`` must be named as before and read ``got``."""
        name = scope.graph.output[k].name
        if got == name:
            return
        if self.index.values[name].scope is not scope:  # a subgraph returning an outer value:
            out = self.index.fresh(f"{name}_out")  # outputs bind by position, rename the entry
            self.tail[id(scope)].append(helper.make_node("Identity", [got], [out], name=out))
            scope.graph.output[k].name = out
            return
        alias_removed = name in self.req.alias
        if got in self.created and self.created[got] is scope and got not in renames:
            if not alias_removed:
                renames[name] = self.index.fresh(f"{name}_{DTYPE_TAG[self.dtype[name]]}")
            renames[got] = name
        else:
            ident = self.index.fresh(f"{name}_identity")
            self.tail[id(scope)].append(helper.make_node("Identity", [got], [name], name=ident))

    def _convert_in_place(self) -> None:
        for name, dtype in self.dtype.items():
            v = self.index.values.get(name)
            if v is None or dtype == v.dtype:
                continue
            role = v.producer.role if v.producer is not None else v.origin
            if role in ("init", "const"):  # an initializer is converted straight into place
                tensor, n = convert_tensor(const_tensor(v), dtype, name, out=v.tensor,
                                           known=self.index.bounds.get(name))
                self._note_clamp(name, n)
                set_const(v, tensor)
                if v.tensor is not None:
                    self.written.add(name)
            elif role == "retarget":
                node = v.producer.node
                for attr in node.attribute:
                    if attr.name == "to":
                        attr.i = dtype

    def _retype(self) -> None:
        """Declared types of inputs, outputs and value_info follow the new dtypes."""
        for scope in self.index.scopes:
            g = scope.graph
            for vi in (*g.input, *g.value_info):
                tt = vi.type.tensor_type
                if tt.elem_type in FLOAT_TYPES and vi.name in self.dtype:
                    tt.elem_type = self.dtype[vi.name]
            if scope.parent is None and not self.keep_io:
                for vi in g.output:
                    if vi.type.tensor_type.elem_type == FLOAT:
                        vi.type.tensor_type.elem_type = self.low
            keep = [vi for vi in g.value_info if vi.name not in self.req.alias]
            del g.value_info[:]
            g.value_info.extend(keep)

    # -- phase 3 -------------------------------------------------------------------------
    def _rebuild(self, scope: Scope) -> None:
        g = scope.graph
        nodes = list(self.head[id(scope)])
        removed = set(self.req.alias)
        for node in visiting(g.node):
            if node.op_type == "Cast" and node.output and node.output[0] in removed:
                continue
            nodes.append(node)
            nodes.extend(self.after.get(node.name, ()))
        nodes.extend(self.tail[id(scope)])
        g.ClearField("node")
        g.node.extend(nodes)
        g.initializer.extend(self.new_inits[id(scope)])


__all__ = ["Requests", "Rewriter", "collect_requests"]
