"""Constants: reading, converting to a low dtype, and the 16-bit range checks.

A constant is an initializer, a ``Constant`` node or a ``ConstantOfShape`` value. When
low-precision consumers read it, it is converted in place (all consumers agree) or a
converted copy is added next to it (the FP32 consumers keep the original), so a shared
initializer never binds one type parameter to two dtypes.

Values outside the target range are handled before painting is final:

- finite values beyond the largest finite value: when every consumer is a selection or
  saturating op (``Where``, ``Max`` with a very negative constant ...) clamping is exact
  and happens with a :class:`ConstantRangeWarning`; otherwise the consumers (and the
  data moves in between) are kept in FP32, e.g. ``Add(scores, -1e9 mask) -> Softmax``.
- non-zero values below the smallest subnormal are clamped to it, with a warning.
"""

from __future__ import annotations

from collections.abc import Iterable

import ml_dtypes
import numpy as np
from onnx import TensorProto, helper, numpy_helper

from passes._infra import ConstantRangeWarning  # noqa: F401 - re-exported
from passes.onnx.graph import ModelIndex, NodeRec, ValueRec
from passes.onnx.policy import BFLOAT16, DATA_MOVES, FLOAT16, SATURATING, dtype_limits
from passes.onnx.tensor_data import bounds, cast_bulk, fits, read_float

_SMALL = 16  # tensors up to this size are scalars/epsilons: any clamp is reported
VALUE_FREE = frozenset({"Shape", "Size"})  # read only the shape of their input
_NP = {FLOAT16: np.float16, BFLOAT16: ml_dtypes.bfloat16, TensorProto.FLOAT: np.float32}


def const_tensor(value: ValueRec) -> TensorProto:
    """The tensor holding a constant value's data (initializer, Constant or ConstantOfShape).

    Example:
        >>> const_tensor(index.values["W"]).dims
        [4, 4]
    """
    if value.tensor is not None:
        return value.source if value.source is not None else value.tensor
    node = value.producer.node
    for attr in node.attribute:
        if attr.name == "value":
            return attr.t
        if attr.name == "value_float":
            return helper.make_tensor(value.name, TensorProto.FLOAT, [], [attr.f])
        if attr.name == "value_floats":
            return helper.make_tensor(value.name, TensorProto.FLOAT, [len(attr.floats)],
                                      list(attr.floats))
    if node.op_type == "ConstantOfShape":  # default value: float zero
        return helper.make_tensor(value.name, TensorProto.FLOAT, [1], [0.0])
    raise ValueError(f"constant node {node.name!r} has no float value attribute")


def to_array(tensor: TensorProto) -> np.ndarray:
    """Values of a float tensor as a numpy array, with a clear error for unloaded data.

    Example:
        >>> to_array(index.values["W"].tensor).shape
        (4, 4)
    """
    if tensor.data_location == TensorProto.EXTERNAL:
        raise ValueError(
            f"initializer {tensor.name!r} stores its data externally and it was not loaded; "
            "pass the model by path (or onnx.load with load_external_data=True)"
        )
    return numpy_helper.to_array(tensor)


def range_stats(arr: np.ndarray, dtype: int) -> tuple[int, int, int]:
    """Counts of (too large negative, too large positive, too small non-zero) values.

    Example:
        >>> range_stats(np.array([-1e9, 1e5, 1e-9, 1.0]), TensorProto.FLOAT16)
        (1, 1, 1)
    """
    big, tiny = dtype_limits(dtype)
    mag = np.abs(np.asarray(arr, dtype=np.float32))
    under = int(np.count_nonzero(mag < tiny) - np.count_nonzero(mag == 0))
    if mag.size == 0 or float(np.nanmax(mag, initial=0.0)) <= big:  # the common case
        return 0, 0, under
    over = (mag > big) & np.isfinite(mag)
    neg = int(np.count_nonzero(over & (np.asarray(arr) < 0)))
    return neg, int(np.count_nonzero(over)) - neg, under


def within_range(value: ValueRec, dtype: int, cache: dict | None = None) -> bool:
    """Whether no finite value of a float constant is beyond the largest of ``dtype``.

    True means ``range_stats`` would count nothing too large; False (NaN included) means
    "look closer" with ``range_stats``. Two reductions over the data, cached by value name
    in ``cache`` (the bounds do not depend on ``dtype``).

    Example:
        >>> within_range(index.values["mask"], TensorProto.FLOAT16)
        False
    """
    if cache is None or value.name not in cache:
        tensor = const_tensor(value)
        arr = read_float(tensor)
        found = bounds(arr if arr is not None else to_array(tensor))
        if cache is None:
            return fits(*found, dtype)
        cache[value.name] = found
    return fits(*cache[value.name], dtype)


def convert_tensor(tensor: TensorProto, dtype: int, name: str,
                   out: TensorProto | None = None,
                   known: tuple[float, float] | None = None) -> tuple[TensorProto, int]:
    """``tensor`` converted to ``dtype`` with out-of-range values clamped.

    Returns the new tensor and how many values were clamped that deserve a warning: every
    value beyond the largest finite one, and tiny non-zero values (raised to the smallest
    subnormal) in small tensors such as an epsilon; in large weight tensors the latter
    are raised silently. ±inf and NaN are kept. ``out``: a tensor to overwrite with the
    result (it may be ``tensor`` itself); ``known``: the data's (min, max), if computed.

    Large float32 weights within range take one cast from their bytes
    (``tensor_data.cast_bulk``), bit for bit what the general path below gives.

    Example:
        >>> t, n = convert_tensor(numpy_helper.from_array(np.array([1e5], np.float32)),
        ...                       TensorProto.FLOAT16, "w")
        >>> numpy_helper.to_array(t), n
        (array([65504.], dtype=float16), 1)
    """
    dims, doc = list(tensor.dims), tensor.doc_string
    arr = read_float(tensor) if tensor.data_type == TensorProto.FLOAT else None
    if arr is not None and arr.size > _SMALL and fits(*(known or bounds(arr)), dtype):
        data = cast_bulk(arr, dtype)
        if data is not None:
            return _filled(out if out is not None else TensorProto(), name, dtype, dims, data,
                           doc), 0
    arr = np.asarray(arr if arr is not None else to_array(tensor), dtype=np.float32)
    big, tiny = dtype_limits(dtype)
    neg, pos, under = range_stats(arr, dtype)
    if neg or pos:
        finite = np.isfinite(arr)
        arr = np.where(finite, np.clip(arr, -big, big), arr)
    if under:
        small = (np.abs(arr) > 0) & (np.abs(arr) < tiny)
        arr = np.where(small, np.copysign(np.float32(tiny), arr), arr)
    result = numpy_helper.from_array(arr.astype(_NP[dtype]), name)
    result.doc_string = doc
    if out is not None:
        out.CopyFrom(result)
        result = out
    return result, neg + pos + (under if arr.size <= _SMALL else 0)


def _filled(t: TensorProto, name: str, dtype: int, dims: list[int], data: bytes,
            doc: str) -> TensorProto:
    """``t`` holding what ``numpy_helper.from_array`` and the doc_string would give."""
    t.Clear()
    t.dims.extend(dims)
    if name:
        t.name = name
    t.data_type = dtype
    t.raw_data = data
    t.doc_string = doc
    return t


def set_const(value: ValueRec, tensor: TensorProto) -> None:
    """Replace the tensor of a constant value in place (same name).

    Example:
        >>> set_const(value, convert_tensor(const_tensor(value), FLOAT16, value.name)[0])
    """
    if value.tensor is not None:
        if tensor is not value.tensor:  # convert_tensor(out=value.tensor) wrote it already
            value.tensor.CopyFrom(tensor)
        return
    node = value.producer.node
    keep = [a for a in node.attribute if a.name not in ("value", "value_float", "value_floats")]
    del node.attribute[:]
    node.attribute.extend(keep)
    tensor.name = "" if node.op_type == "ConstantOfShape" else tensor.name
    node.attribute.append(helper.make_attribute("value", tensor))


def const_variant(index: ModelIndex, value: ValueRec, tensor: TensorProto, name: str):
    """A copy of a constant holding ``tensor`` under ``name``: an initializer in the same
    graph, or a Constant/ConstantOfShape node to insert after the original one.

    Example:
        >>> const_variant(index, index.values["b"], tensor, "b_fp16").name
        'b_fp16'
    """
    if value.tensor is not None:
        tensor.name = name
        return tensor
    node = value.producer.node
    if node.op_type == "ConstantOfShape":
        tensor.name = ""
        return helper.make_node("ConstantOfShape", list(node.input), [name],
                                name=index.fresh(name + "_node"), value=tensor)
    return helper.make_node("Constant", [], [name], name=index.fresh(name + "_node"), value=tensor)


def unsafe_range_consumers(
    index: ModelIndex,
    low_readers: dict[str, list[tuple[NodeRec, int]]],
    low: int,
    precision: dict[str, str],
    cache: dict | None = None,
) -> dict[str, str]:
    """Nodes to keep in FP32 because clamping a constant they read would change results.

    Args:
        index: the model index.
        low_readers: constant value name -> the (node, input slot) reading it in ``low``.
        low: the low dtype.
        precision: node name -> painted precision ("low"/"fp32"/"n/a").
        cache: bounds of constants by name, shared between calls (``within_range``).

    Returns:
        node name -> reason, for the low readers (and data moves after them) of constants
        with finite values beyond the low dtype's range, unless every path ends in a
        selection op for which clamping is exact.

    Example:
        >>> unsafe_range_consumers(index, {"mask": [(add_rec, 1)]}, FLOAT16, precision)
        {'add': "constant 'mask' holds -1e+09, beyond the float16 range; ..."}
    """
    forced: dict[str, str] = {}
    for name, readers in low_readers.items():
        value = index.values[name]
        if within_range(value, low, cache):
            continue
        arr = to_array(const_tensor(value))
        neg, pos, _ = range_stats(arr, low)
        if not (neg or pos):
            continue
        sign = -1 if pos == 0 else (1 if neg == 0 else 0)
        chain: list[str] = []
        exact = all(_exact(index, rec, slot, sign, chain, 0) for rec, slot in readers)
        if exact:
            continue
        big = float(np.abs(np.where(np.isfinite(arr), arr, 0)).max())
        why = (f"constant {name!r} holds {big:.3g}, beyond the {_tag(low)} range: clamping "
               "would change the result")
        for node in chain:
            if precision.get(node) == "low":
                forced.setdefault(node, why)
        if pos:  # a large product stays large: keep everything downstream fp32 until a
            # normalising op brings values back into range (the FX pass does the same)
            for node in _downstream(index, chain):
                if precision.get(node) == "low":
                    forced.setdefault(node, f"downstream of {why}")
    return forced


def large_constant_cones(index: ModelIndex, low: int, precision: dict[str, str],
                         cache: dict | None = None) -> dict:
    """Low nodes downstream of any reader (fp32 or low) of a large positive constant.

    A product like ``x * 1e5`` computed in fp32 is still beyond fp16's range, so the low ops
    after it must stay fp32 until a normalising op.

    Example:
        >>> large_constant_cones(index, FLOAT16, precision)
        {'mm': "downstream of constant 'big' (1e+05) ..."}
    """
    forced: dict[str, str] = {}
    for name, value in index.values.items():
        is_const = value.tensor is not None or (
            value.producer is not None and value.producer.role == "const")
        if not is_const or value.dtype not in (TensorProto.FLOAT, TensorProto.DOUBLE):
            continue
        if within_range(value, low, cache):
            continue
        arr = to_array(const_tensor(value))
        _, pos, _ = range_stats(arr, low)
        if not pos:
            continue
        readers = [rec.name for rec, _ in index.consumers.get(name, ())]
        why = (f"downstream of constant {name!r} ({float(np.nanmax(arr)):.3g}), beyond the "
               f"{_tag(low)} range")
        for node in _downstream(index, readers):
            if precision.get(node) == "low":
                forced.setdefault(node, why)
    return forced


_NORMALISING = frozenset(
    "LayerNormalization BatchNormalization GroupNormalization InstanceNormalization "
    "RMSNormalization SimplifiedLayerNormalization Softmax LogSoftmax".split()
)


def _downstream(index: ModelIndex, start: list[str]) -> list[str]:
    by_name = {rec.name: rec for rec in index.nodes}
    seen: set[str] = set()
    stack = [by_name[n] for n in start if n in by_name]
    out: list[str] = []
    while stack:
        rec = stack.pop()
        for value in rec.node.output:
            for nxt, _ in index.consumers.get(value, ()):
                if nxt.name in seen:
                    continue
                seen.add(nxt.name)
                out.append(nxt.name)
                if nxt.node.op_type not in _NORMALISING:
                    stack.append(nxt)
    return out


def _exact(index: ModelIndex, rec: NodeRec, slot: int, sign: int, chain: list[str],
           depth: int) -> bool:
    """Whether clamping the value read at (rec, slot) cannot change what ``rec`` computes."""
    op = rec.node.op_type
    rule = SATURATING.get(op, {})
    if op in VALUE_FREE or (slot in rule and rule[slot] in (0, sign)):
        return True
    chain.append(rec.name)
    if op not in DATA_MOVES or depth >= 16:
        return False
    return all(
        _exact(index, nxt, s, sign, chain, depth + 1)
        for out in rec.node.output if out
        for nxt, s in index.consumers.get(out, ())
    )


def _tag(dtype: int) -> str:
    return {FLOAT16: "float16", BFLOAT16: "bfloat16"}.get(dtype, "float")


def clamp_warning(clamped: Iterable[tuple[str, int]], dtype: int) -> str | None:
    """One warning message for all constants clamped during a conversion (None: none).

    Example:
        >>> clamp_warning([("mask", 3)], FLOAT16)
        "clamped constants into the float16 range [5.96e-08, 65504]: 'mask' (3 values); ..."
    """
    items = sorted(clamped, key=lambda kv: -kv[1])
    if not items:
        return None
    shown = ", ".join(f"{n!r} ({k} values)" for n, k in items[:5])
    more = f" and {len(items) - 5} more" if len(items) > 5 else ""
    big, tiny = dtype_limits(dtype)
    return (f"clamped constants into the {_tag(dtype)} range [{tiny:.3g}, {big:.6g}]: {shown}"
            f"{more}; keep their consumers in fp32 with node_block_list to avoid it")


__all__ = [
    "ConstantRangeWarning",
    "clamp_warning",
    "const_tensor",
    "const_variant",
    "convert_tensor",
    "range_stats",
    "set_const",
    "unsafe_range_consumers",
    "within_range",
]
