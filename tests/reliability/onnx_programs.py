"""Random ONNX graphs: the fuzz :class:`~tests.reliability.strategies.Program` built with
``onnx.helper`` (opset 17, IR 10, shapes static at (B, T, D) = (2, 8, 8)).

Op kinds mirror the FX ones where ONNX has the op: MatMul/Gemm/Conv with shared initializers,
LayerNormalization, BatchNormalization, InstanceNormalization, Softmax, activations,
elementwise ops, Reshape/Transpose round trips, Concat + Split, ArgMax feeding
GatherElements / Gather (with integer arithmetic on the indices), Greater masks feeding
Where, a -1e9 / finfo.min mask fill (a constant fp16 cannot hold), user Casts.
Discrete kinds keep the FX names, so ``Program.discrete_on_computed`` works for both.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import ModelProto, TensorProto, helper, numpy_helper

from tests.reliability.strategies import (
    MASK_FILLS,
    MASK_THRESHOLDS,
    B,
    D,
    Program,
    T,
    build_program,
)

ONNX_ARITY: dict[str, int] = {
    "matmul_w": 1, "gemm": 1, "conv": 1, "layer_norm": 1, "batch_norm": 1,
    "instance_norm": 1, "softmax": 1, "log_softmax": 1, "act": 1, "scale": 1, "center": 1,
    "reshape": 1, "transpose": 1, "exp_tanh": 1, "big_scale": 1, "scale_linear": 1,
    "half_round": 1, "amax": 2,
    "add": 2, "sub": 2, "gate": 2, "matmul": 2, "cat_split": 2, "attention": 3,
    "argmax_gather": 2, "argmax_embed": 2, "where": 3, "masked_softmax": 2, "count_scale": 2,
}
ONNX_KINDS = tuple(ONNX_ARITY)
N_SHARED = 3
ACTS = ("Relu", "Tanh", "Sigmoid", "Softplus", "LeakyRelu")
SCALES = (0.5, -1.0, 0.25, 1.5)
F32 = TensorProto.FLOAT


def build_onnx_program(draw: Callable[[int, int], int], max_ops: int = 10,
                       rotate: int = 0) -> Program:
    return build_program(draw, max_ops, ONNX_KINDS, rotate, ONNX_ARITY)


@st.composite
def onnx_programs(draw: st.DrawFn, max_ops: int = 10, rotate: int = 0) -> Program:
    """Hypothesis strategy: a random program over the ONNX op kinds."""
    return build_onnx_program(lambda lo, hi: draw(st.integers(lo, hi)), max_ops, rotate)


def random_onnx_program(rng: random.Random, max_ops: int = 10) -> Program:
    return build_onnx_program(rng.randint, max_ops)


class _Builder:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, TensorProto] = {}
        self.count = 0

    def name(self, hint: str) -> str:
        self.count += 1
        return f"{hint}_{self.count}"

    def init(self, name: str, value: np.ndarray) -> str:
        if name not in self.inits:
            self.inits[name] = numpy_helper.from_array(np.asarray(value), name)
        return name

    def weight(self, name: str, shape: tuple[int, ...], scale: float) -> str:
        if name not in self.inits:
            value = (self.rng.standard_normal(shape) * scale).astype(np.float32)
            self.inits[name] = numpy_helper.from_array(value, name)
        return name

    def const(self, value: float) -> str:
        return self.init(f"c_{value!r}", np.array(value, np.float32))

    def ints(self, name: str, values: list[int]) -> str:
        return self.init(name, np.array(values, np.int64))

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        out = self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def op_n(self, op_type: str, inputs: list[str], n: int, **attrs) -> list[str]:
        name = self.name(op_type.lower())
        outs = [f"{name}_o{i}" for i in range(n)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, **attrs))
        return outs


def _emit(b: _Builder, i: int, kind: str, p: int, a: list[str]) -> str:
    s = 1 / np.sqrt(D)
    if kind == "matmul_w":
        k = p % N_SHARED
        h = b.op("MatMul", [a[0], b.weight(f"w{k}", (D, D), s)])
        return b.op("Add", [h, b.weight(f"b{k}", (D,), 0.1)])
    if kind == "gemm":
        k = p % N_SHARED
        flat = b.op("Reshape", [a[0], b.ints("shape_2d", [-1, D])])
        h = b.op("Gemm", [flat, b.weight(f"w{k}", (D, D), s), b.weight(f"b{k}", (D,), 0.1)],
                 transB=1)
        return b.op("Reshape", [h, b.ints("shape_3d", [-1, T, D])])
    if kind == "conv":
        t = b.op("Transpose", [a[0]], perm=[0, 2, 1])
        c = b.op("Conv", [t, b.weight(f"cw{p % 2}", (D, D, 3), s / 2),
                          b.weight(f"cb{p % 2}", (D,), 0.1)], pads=[1, 1])
        return b.op("Transpose", [c], perm=[0, 2, 1])
    if kind == "layer_norm":
        return b.op("LayerNormalization", [a[0], b.weight(f"ln{i}_g", (D,), 0.2),
                                           b.weight(f"ln{i}_b", (D,), 0.2)], axis=-1)
    if kind in ("batch_norm", "instance_norm"):
        t = b.op("Transpose", [a[0]], perm=[0, 2, 1])
        g = b.init(f"n{i}_g", (1 + 0.2 * b.rng.standard_normal(D)).astype(np.float32))
        beta = b.weight(f"n{i}_b", (D,), 0.2)
        if kind == "batch_norm":
            mean = b.weight(f"n{i}_m", (D,), 0.2)
            var = b.init(f"n{i}_v", (0.5 + b.rng.random(D)).astype(np.float32))
            n = b.op("BatchNormalization", [t, g, beta, mean, var])
        else:
            n = b.op("InstanceNormalization", [t, g, beta])
        return b.op("Transpose", [n], perm=[0, 2, 1])
    if kind == "softmax":
        return b.op("Softmax", [a[0]], axis=-1 - p % 2)
    if kind == "log_softmax":
        return b.op("Mul", [b.op("LogSoftmax", [a[0]], axis=-1), b.const(0.25)])
    if kind == "act":
        return b.op(ACTS[p % len(ACTS)], [a[0]])
    if kind == "scale":
        return b.op("Mul", [a[0], b.const(SCALES[p % len(SCALES)])])
    if kind == "center":
        return b.op("Sub", [a[0], b.op("ReduceMean", [a[0]], axes=[-1], keepdims=1)])
    if kind == "reshape":
        flat = b.op("Reshape", [a[0], b.ints("shape_flat", [-1, T * D])])
        return b.op("Reshape", [b.op("Relu", [flat]), b.ints("shape_3d", [-1, T, D])])
    if kind == "transpose":
        return b.op("Transpose", [a[0]], perm=[0, 2, 1])
    if kind == "exp_tanh":
        return b.op("Exp", [b.op("Tanh", [a[0]])])
    if kind == "big_scale":  # 1e5 overflows fp16: a constant-range hazard
        return b.op("Div", [b.op("Relu", [b.op("Mul", [a[0], b.const(1e5)])]), b.const(1e5)])
    if kind == "scale_linear":  # a large scale factor through a matmul and back
        h = b.op("MatMul", [b.op("Mul", [a[0], b.const(1e5)]), b.weight(f"w{p % N_SHARED}",
                                                                       (D, D), s)])
        return b.op("Mul", [h, b.const(1e-5)])
    if kind == "half_round":  # a user-written cast pair: kept as it is
        to = (TensorProto.FLOAT16, TensorProto.BFLOAT16)[p % 2]
        return b.op("Cast", [b.op("Cast", [a[0]], to=to)], to=F32)
    if kind == "amax":
        return b.op("Sub", [a[1], b.op("ReduceMax", [a[0]], axes=[-1], keepdims=1)])
    if kind in ("add", "sub"):
        return b.op(kind.capitalize(), [a[0], a[1]])
    if kind == "gate":
        return b.op("Mul", [a[0], b.op("Tanh", [a[1]])])
    if kind == "matmul":
        bt = b.op("Transpose", [a[1]], perm=[0, 2, 1])
        return b.op("Mul", [b.op("MatMul", [a[0], bt]), b.const(float(s))])
    if kind == "attention":
        bt = b.op("Transpose", [a[1]], perm=[0, 2, 1])
        scores = b.op("Mul", [b.op("MatMul", [a[0], bt]), b.const(float(s))])
        return b.op("MatMul", [b.op("Softmax", [scores], axis=-1), a[2]])
    if kind == "cat_split":
        axis = 1 + p % 2
        cat = b.op("Concat", [a[0], a[1]], axis=axis)
        u, v = b.op_n("Split", [cat, b.ints("split_halves", [T, T])], 2, axis=axis)
        return b.op("Sub", [v, b.op("Mul", [u, b.const(0.5)])])
    if kind == "argmax_gather":
        idx = b.op("ArgMax", [a[0]], axis=-1, keepdims=1)
        idx = b.op("Expand", [idx, b.ints("shape_btd", [B, T, D])])
        return b.op("Sub", [a[1], b.op("GatherElements", [a[1], idx], axis=-1)])
    if kind == "argmax_embed":
        idx = b.op("ArgMax", [a[0]], axis=-1, keepdims=0)
        idx = b.op("Mod", [b.op("Add", [b.op("Mul", [idx, b.ints("i3", [3])]),
                                         b.ints(f"i{p}", [p])]), b.ints("iD", [D])])
        return b.op("Add", [b.op("Gather", [b.weight(f"emb{i}", (D, D), 1.0), idx]), a[1]])
    if kind == "where":
        mask = b.op("Greater", [a[0], b.const(0.0)])
        return b.op("Where", [mask, a[1], a[2]])
    if kind == "masked_softmax":
        mask = b.op("Greater", [a[0], b.const(float(MASK_THRESHOLDS[p % 2]))])
        filled = b.op("Where", [mask, b.const(float(MASK_FILLS[p % 3])), a[1]])
        return b.op("Softmax", [filled], axis=-1)
    if kind == "count_scale":
        mask = b.op("Cast", [b.op("Greater", [a[0], b.const(0.0)])], to=TensorProto.INT64)
        count = b.op("ReduceSum", [mask, b.ints("axes_last", [-1])], keepdims=1)
        scaled = b.op("Mul", [a[1], b.op("Cast", [count], to=F32)])
        return b.op("Mul", [scaled, b.const(1.0 / D)])
    raise ValueError(f"unknown ONNX fuzz kind {kind!r}")


def build_onnx_model(program: Program, names: list[str] | None = None) -> ModelProto:
    """The fp32 ONNX model a program describes (opset 17, IR 10, checked); ``names`` (if
    given) receives the tensor name of each program value."""
    b = _Builder(program.seed)
    values = ["x", "y"]
    for i, op in enumerate(program.ops):
        values.append(_emit(b, i, op.kind, op.param, [values[s] for s in op.srcs]))
    if names is not None:
        names.extend(values)
    outputs, seen = [], set()
    for k, o in enumerate(program.outputs):
        if values[o] in seen:
            continue
        seen.add(values[o])
        out = f"out{k}"
        b.nodes.append(helper.make_node("Identity", [values[o]], [out], name=f"output_{k}"))
        outputs.append(helper.make_tensor_value_info(out, F32, [B, T, D]))
    inputs = [helper.make_tensor_value_info(n, F32, [B, T, D]) for n in ("x", "y")]
    graph = helper.make_graph(b.nodes, "fuzz", inputs, outputs, list(b.inits.values()))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def onnx_inputs(program: Program) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(program.seed + 1)
    return {n: rng.standard_normal((B, T, D)).astype(np.float32) for n in ("x", "y")}
