"""The properties every fuzzed ONNX graph must have after ``ampgraph.onnx.convert_onnx``.

Checked independently of the pass's own verify step:

- structure: ``onnx.checker`` (full check) and strict shape inference accept the result;
  graph inputs and outputs keep float32 (keep_io_types); O0 adds no node;
- casts: none to its input's own dtype, no ``low -> fp32 -> low`` round trip, one Cast per
  (value, dtype);
- policy: at O1/O2 every deny-list op reads its float inputs in float32; at O1-O3 every
  allow-list op reads low-precision inputs unless the pass says why it kept it fp32;
- converting the converted model again is rejected or a no-op (no double casts);
- numerics, evaluated with ``onnx.reference`` (faithful fp16/bf16 arithmetic; see
  :func:`evaluate`): outputs finite wherever FP32 is finite and within the FX suites'
  tolerance (relative L2 error <= 32 units of roundoff); fp16 models also run in
  onnxruntime (CPU provider) and give finite outputs there.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import ModelProto, TensorProto

from ampgraph.onnx import convert_onnx
from passes.onnx import ONNX_TABLE, ConstantRangeWarning, convert_model
from passes.policy import ALLOW, DENY, make_policy
from tests.reliability.fx_checks import FLOOR_FRACTION, KnownBug, known_numerics_bug
from tests.reliability.onnx_programs import build_onnx_model, onnx_inputs
from tests.reliability.strategies import Program

F32, F16, BF16 = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16
LOW = {"fp16": F16, "bf16": BF16}
FLOATS = (F32, F16, BF16)
TOLERANCE = {"fp16": 32 * 2.0**-11, "bf16": 32 * 2.0**-8}  # as fx_checks.tolerance


@dataclass
class OnnxOutcome:
    rel_err: float
    numerics_checked: bool
    casts: int


def types(model: ModelProto) -> dict[str, int]:
    """Every value's dtype by strict ONNX shape inference."""
    inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    g = inferred.graph
    out = {t.name: t.data_type for t in g.initializer}
    for v in (*g.input, *g.value_info, *g.output):
        if v.type.tensor_type.elem_type:
            out[v.name] = v.type.tensor_type.elem_type
    return out


def _cast_to(node: onnx.NodeProto) -> int:
    return next(a.i for a in node.attribute if a.name == "to")


def check_onnx_program(program: Program, level: str, dtype: str) -> OnnxOutcome:
    """Convert one random graph and check every property; raise AssertionError on a violation."""
    names: list[str] = []
    fp32 = build_onnx_model(program, names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConstantRangeWarning)
        model = _known_onnx(program, convert_onnx, fp32, level, dtype)
        result = convert_model(fp32, level, dtype)  # the same pass, with its reasons
    onnx.checker.check_model(model, full_check=True)
    t = types(model)
    for v in (*model.graph.input, *model.graph.output):
        assert t[v.name] == F32, f"graph input/output {v.name} is {t[v.name]}"
    casts = [n for n in model.graph.node if n.op_type == "Cast"]
    added = len(casts) - sum(n.op_type == "Cast" for n in fp32.graph.node)
    if level == "O0":
        assert len(model.graph.node) == len(fp32.graph.node), "O0 changed the graph"
    user_nodes = {n.name for n in fp32.graph.node}
    check_casts(model, t, user_nodes)
    check_policy(model, t, level, dtype, result.forced)
    numerics = not program.discrete_on_computed
    rel = check_numerics(fp32, model, onnx_inputs(program), level, dtype, numerics, program,
                         names)
    check_convert_twice(model, level, dtype, user_nodes)
    return OnnxOutcome(rel, numerics, added)


def known_onnx_bug(program: Program, exc: BaseException) -> str | None:
    """The open ONNX bug ``exc`` shows (pin it in test_fuzz_onnx.py), or None (none open)."""
    del program, exc
    return None


def _known_onnx(program: Program, fn, *args):
    try:
        return fn(*args)
    except Exception as exc:
        name = known_onnx_bug(program, exc)
        if name is not None:
            raise KnownBug(name) from exc
        raise


def check_casts(model: ModelProto, t: dict[str, int], user_nodes: set[str]) -> None:
    """Casts the pass added: no no-op casts, no round trips, one per (value, dtype)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    seen: Counter = Counter()
    for n in model.graph.node:
        if n.op_type != "Cast" or n.name in user_nodes:
            continue
        to, src = _cast_to(n), n.input[0]
        assert t.get(src) != to, f"Cast {n.name} casts {src} to its own dtype"
        seen[(src, to)] += 1
        inner = producer.get(src)
        if inner is not None and inner.op_type == "Cast" and to in (F16, BF16):
            assert not (_cast_to(inner) == F32 and t.get(inner.input[0]) == to), \
                f"redundant cast pair {inner.input[0]} -> {src} -> {n.output[0]}"
    dupes = {k: v for k, v in seen.items() if v > 1}
    assert not dupes, f"several Casts of one value to one dtype: {dupes}"


def check_policy(model: ModelProto, t: dict[str, int], level: str, dtype: str,
                 forced: dict[str, str]) -> None:
    if level == "O0":
        return
    policy = make_policy(level, table=ONNX_TABLE)
    for n in model.graph.node:
        cls = policy.op_info(n.op_type).cls
        floats = [t.get(i) for i in n.input if i and t.get(i) in FLOATS]
        if cls == DENY and level in ("O1", "O2"):
            assert all(d == F32 for d in floats), f"deny op {n.name} reads {floats} at {level}"
        if cls == ALLOW and n.name not in forced:
            assert floats and all(d == LOW[dtype] for d in floats), \
                f"allow op {n.name} ({n.op_type}) reads {floats} at {level}"


def check_convert_twice(model: ModelProto, level: str, dtype: str, user_nodes: set[str]) -> None:
    """Converting again raises ValueError or changes nothing; never two Casts of one value."""
    ops = Counter(n.op_type for n in model.graph.node)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConstantRangeWarning)
            again = convert_onnx(model, level, dtype)
    except ValueError:
        return
    check_casts(again, types(again), user_nodes)
    after = Counter(n.op_type for n in again.graph.node)
    assert after == ops, f"a second conversion changed the graph: {ops} -> {after}"


def run(model: ModelProto, feeds: dict[str, np.ndarray], basic: bool = False) -> list:
    """Run on onnxruntime's CPU provider (``basic``: only basic graph optimisations)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if basic:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    sess = ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def evaluate(model: ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run with ``onnx.reference`` (numpy): fp16 and bf16 arithmetic as written.

    onnxruntime's CPU provider is not a faithful fp16 executor: it lacks fp16 kernels for
    most ops (MatMul ...), wraps them in Casts to fp32 and removes the resulting
    fp32->fp16->fp32 Cast pairs, so an fp16 overflow the pass introduced can vanish there.
    """
    from onnx.reference import ReferenceEvaluator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy overflow: checked below
        return [np.asarray(o, np.float32) for o in ReferenceEvaluator(model).run(None, feeds)]


def check_numerics(fp32: ModelProto, model: ModelProto, feeds: dict[str, np.ndarray],
                   level: str, dtype: str, close: bool, program: Program | None = None,
                   names: list[str] = ()) -> float:
    """Outputs finite where FP32 is, and (``close``) within tolerance; fp16 also runs in
    onnxruntime (the runtime users deploy on) and must be finite there too. The error is
    relative as in ``fx_checks.check_outputs`` (floor: 5% of the largest of ``names``)."""
    if dtype == "fp16":
        ran = _ort(model, feeds) if program is None else _known_onnx(program, _ort, model, feeds)
        for r, o in zip(_ort(fp32, feeds), ran):
            assert np.isfinite(o[np.isfinite(r)]).all(), "onnxruntime: non-finite output"
    # O3 runs norms, softmax and reductions low too; numpy accumulates them in fp16 where
    # real kernels use fp32 accumulators, so the reference is pessimistic there: 2x.
    limit = TOLERANCE[dtype] * (2 if level == "O3" else 1)
    floor = FLOOR_FRACTION * max((float(np.abs(v).max()) for v in _values(fp32, feeds, names)),
                                 default=0.0)
    worst = 0.0
    for r, o in zip(evaluate(fp32, feeds), evaluate(model, feeds)):
        assert o.shape == r.shape
        finite = np.isfinite(r)
        err = float(np.linalg.norm((o - r)[finite].astype(np.float64)))
        scale = max(float(np.linalg.norm(r[finite].astype(np.float64))),
                    max(floor, 1e-3) * max(int(finite.sum()), 1) ** 0.5)
        rel = err / scale if np.isfinite(o[finite]).all() else float("inf")
        worst = max(worst, rel)
        if rel > limit and (close or rel == float("inf")):
            name = None if program is None else known_numerics_bug(program, dtype)
            if name is not None:
                raise KnownBug(name)
            raise AssertionError("non-finite output where FP32 is finite" if rel == float("inf")
                                 else f"relative L2 error {rel:.4g} > {limit}")
    return worst


def _values(model: ModelProto, feeds: dict[str, np.ndarray], names: list[str]) -> list:
    """The FP32 values of the program (by tensor name), from the reference evaluator."""
    if not names:
        return []
    from onnx.reference import ReferenceEvaluator

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        every = ReferenceEvaluator(model).run(None, feeds, intermediate=True)
    return [np.asarray(every[n]) for n in names if n in every and np.size(every[n])]


def _ort(model: ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    try:
        return run(model, feeds)
    except Exception as exc:  # onnxruntime 1.31's ORT_ENABLE_ALL fusions reject some valid
        if "INVALID_ARGUMENT" not in str(exc):  # graphs with dead attention-like code
            raise
        return run(model, feeds, basic=True)
