"""Type-parameter bookkeeping from ONNX op schemas.

Which input and output slots of a node share a type parameter decides which slots must
change dtype together: Resize's ``X`` (T1) can go to float16 while its ``roi`` (T2)
stays float, but GroupNormalization's ``scale`` shares T with ``X``. Ops without a
registered schema (contrib domains, local functions) are treated as one shared type.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache

import onnx
from onnx import NodeProto

from passes.onnx.policy import BFLOAT16, FLOAT, FLOAT16, FLOAT_TYPES, FP32_INPUTS, TYPE_STR
from passes.onnx.subgraphs import all_graphs

ANY = "*"  # the shared type parameter of a schema-less op


@dataclass(frozen=True)
class Slots:
    """Type parameter of each input/output slot and the float dtypes each allows.

    Example:
        >>> node_slots(resize_node, 19).allows("T2", TensorProto.FLOAT16)
        True
    """

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    allowed: Mapping[str, frozenset[int]]
    known: bool

    def allows(self, param: str, dtype: int) -> bool:
        return not self.known or dtype in self.allowed.get(param, frozenset())


@lru_cache(maxsize=4096)
def _slots(op_type: str, domain: str, opset: int, n_in: int, n_out: int) -> Slots:
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except Exception:  # onnx raises SchemaError for unknown (contrib) ops
        return Slots((ANY,) * n_in, (ANY,) * n_out, {}, known=False)
    allowed: dict[str, frozenset[int]] = {
        c.type_param_str: frozenset(TYPE_STR[t] for t in c.allowed_type_strs if t in TYPE_STR)
        for c in schema.type_constraints
    }
    for formal in (*schema.inputs, *schema.outputs):
        if formal.type_str not in allowed:  # a fixed type such as tensor(float)
            fixed = TYPE_STR.get(formal.type_str)
            allowed[formal.type_str] = frozenset({fixed} if fixed else ())
    return Slots(_expand(schema.inputs, n_in), _expand(schema.outputs, n_out), allowed, True)


def _expand(formals: list, n: int) -> tuple[str, ...]:
    out = [f.type_str for f in formals[:n]]
    while len(out) < n:  # variadic tail
        out.append(formals[-1].type_str if formals else ANY)
    return tuple(out)


def node_slots(node: NodeProto, opset: int) -> Slots:
    """Type parameters of ``node``'s slots under the given opset of its domain.

    Example:
        >>> node_slots(onnx.helper.make_node("Resize", ["x", "roi", "s"], ["y"]), 19).inputs
        ('T1', 'T2', 'tensor(float)')
    """
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    return _slots(node.op_type, domain, opset, len(node.input), len(node.output))


def float_slots(node: NodeProto, types: Mapping[str, int]) -> tuple[list[int], list[int]]:
    """Indices of the inputs and outputs of ``node`` that hold float/float16/bfloat16.

    Example:
        >>> float_slots(gather_node, {"W": FLOAT, "ids": TensorProto.INT64, "e": FLOAT})
        ([0], [0])
    """
    ins = [i for i, v in enumerate(node.input) if v and types.get(v) in FLOAT_TYPES]
    outs = [j for j, v in enumerate(node.output) if v and types.get(v) in FLOAT_TYPES]
    return ins, outs


def low_blocker(node: NodeProto, opset: int, types: Mapping[str, int], low: int) -> str | None:
    """Why ``node`` cannot compute in ``low`` precision, or None when it can.

    A node can run low when one of its float type parameters allows the low dtype and is
    not tied to an input that must stay FP32.

    Example:
        >>> low_blocker(range_node, 17, types, TensorProto.FLOAT16)
        'Range inputs [0, 1, 2] must stay fp32 and share its data type'
    """
    slots = node_slots(node, opset)
    ins, outs = float_slots(node, types)
    fixed = set(FP32_INPUTS.get(node.op_type, ()))
    pinned = {slots.inputs[i] for i in ins if i in fixed} if slots.known else set()
    free = [slots.inputs[i] for i in ins if i not in fixed] + [slots.outputs[j] for j in outs]
    if any(p not in pinned and slots.allows(p, low) for p in free):
        return None
    if pinned and not any(p not in pinned for p in free):
        return f"{node.op_type} inputs {sorted(fixed)} must stay fp32 and share its data type"
    return f"the ONNX schema of {node.op_type} (opset {opset}) has no {_name(low)} version"


def plan_node(
    node: NodeProto, opset: int, types: Mapping[str, int], want: int
) -> tuple[dict[int, int], dict[int, int]]:
    """Dtype required of each float input and produced at each float output.

    ``want`` is the node's precision (FLOAT or the low dtype). Slots in
    :data:`FP32_INPUTS`, and type parameters that do not allow ``want``, get FLOAT.

    Example:
        >>> plan_node(resize, 19, types, TensorProto.FLOAT16)
        ({0: 10, 1: 1, 2: 1}, {0: 10})
    """
    slots = node_slots(node, opset)
    ins, outs = float_slots(node, types)
    fixed = set(FP32_INPUTS.get(node.op_type, ()))
    pinned = {slots.inputs[i] for i in ins if i in fixed} if slots.known else set()

    def choose(param: str, original: int) -> int:
        if param in pinned:
            return FLOAT
        if slots.allows(param, want):
            return want
        return FLOAT if slots.allows(param, FLOAT) else original

    inputs = {
        i: FLOAT if i in fixed else choose(slots.inputs[i], types[node.input[i]]) for i in ins
    }
    outputs = {j: choose(slots.outputs[j], types[node.output[j]]) for j in outs}
    return inputs, outputs


def shared_float_inputs(node: NodeProto, opset: int, types: Mapping[str, int]) -> list[int]:
    """Float inputs of a non-float op that share a type parameter with another float input
    (``Equal(a, b)``): they must agree, so they are all requested in FLOAT.

    Example:
        >>> shared_float_inputs(equal_node, 17, {"a": FLOAT16, "b": FLOAT, "c": 9})
        [0, 1]
    """
    slots = node_slots(node, opset)
    ins, _ = float_slots(node, types)
    groups: dict[str, list[int]] = {}
    for i in ins:
        groups.setdefault(slots.inputs[i], []).append(i)
    return sorted(i for members in groups.values() if len(members) > 1 for i in members)


def opset_held(model: onnx.ModelProto, low: int, ops: frozenset[str]) -> dict[str, int]:
    """The op types of ``model`` (among ``ops``, default domain) whose schema at the model's
    opset has no ``low`` version while a later opset's has: each with that first opset.
    bf16 ``Conv``, ``ConvTranspose``, pooling, ``LSTM``/``GRU`` come with opset 22.

    Example:
        >>> opset_held(cnn_at_opset_20, TensorProto.BFLOAT16, frozenset({"Conv"}))
        {'Conv': 22}
    """
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    present = {n.op_type for g in all_graphs(model.graph) for n in g.node
               if n.domain in ("", "ai.onnx") and n.op_type in ops}
    held = {}
    for op in sorted(present):
        if _takes(op, opset, low):
            continue
        first = next((v for v in range(opset + 1, onnx.defs.onnx_opset_version() + 1)
                      if _takes(op, v, low)), None)
        if first is not None:
            held[op] = first
    return held


def _takes(op_type: str, opset: int, dtype: int) -> bool:
    """Whether some type parameter of ``op_type``'s schema at ``opset`` allows ``dtype``."""
    return any(dtype in allowed for allowed in _slots(op_type, "", opset, 0, 0).allowed.values())


def _name(dtype: int) -> str:
    return {FLOAT: "float", FLOAT16: "float16", BFLOAT16: "bfloat16"}.get(dtype, str(dtype))


__all__ = ["Slots", "float_slots", "low_blocker", "node_slots", "opset_held", "plan_node"]
