"""Verify a converted ONNX model: types agree, casts are shared, no Cast round trips.

Raises :class:`passes._infra.PassError` naming the check and the node. Checks:

- ``onnx.checker`` (structure, schemas, topological order) and strict shape inference
  (every type parameter bound to one dtype), both on weight-free copies
  (``skeleton``), for any model size;
- no float->float Cast reads the output of another float->float Cast;
- at most one Cast per (value, dtype) in the whole model;
- graph inputs and outputs keep their declared dtypes when asked to;
- every painted node reads its float inputs in the dtype the plan asked for.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import onnx
from onnx import ModelProto, TensorProto

from passes._infra import PassError, visiting
from passes.onnx.casts import INSERTED
from passes.onnx.graph import infer_types, rounds
from passes.onnx.policy import FLOAT_TYPES
from passes.onnx.skeleton import check_structure
from passes.onnx.subgraphs import all_graphs


def verify_model(
    model: ModelProto,
    *,
    io_types: Mapping[str, int] | None = None,
    expected: Mapping[str, Mapping[int, int]] | None = None,
    sized: Collection[str] = (),
) -> dict[str, int]:
    """Check a converted model; return the dtype of every typed value.

    Args:
        model: the converted model (weights in memory or detached).
        io_types: graph input/output name -> dtype it must still have.
        expected: node name -> {input slot: dtype} the painted plan asked for.
        sized: initializers of the main graph whose data length needs no check (the pass
            wrote them from arrays of their shape): their bytes are not read.

    Raises:
        PassError: the first failed check, naming the node.

    Example:
        >>> types = verify_model(converted, io_types={"x": TensorProto.FLOAT})
    """
    _checker(model, sized)
    types = _strict_types(model)
    producers: dict[str, onnx.NodeProto] = {}
    casts: dict[tuple[str, int], str] = {}
    for g in all_graphs(model.graph):
        for node in visiting(g.node):
            for out in node.output:
                producers[out] = node
    for g in all_graphs(model.graph):
        for node in visiting(g.node):
            if node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
                continue
            to = next(a.i for a in node.attribute if a.name == "to")
            src = node.input[0]
            key = (src, to)
            if key in casts and node.doc_string == INSERTED:  # a user's own Cast may repeat
                raise PassError("verify", node.name, f"second Cast of {src!r} to "
                                f"{_dt(to)} (first: {casts[key]!r}); casts must be shared")
            casts[key] = node.name
            prev = producers.get(src)
            if (node.doc_string == INSERTED and to in FLOAT_TYPES
                    and types.get(src) in FLOAT_TYPES and prev is not None
                    and prev.op_type == "Cast" and types.get(prev.input[0]) in FLOAT_TYPES
                    and types.get(prev.input[0]) == to
                    and not rounds(types.get(prev.input[0], 0), types.get(src, 0))):
                # only low -> fp32 -> low is a waste; after a narrowing (user) Cast the
                # chain rounds on purpose
                raise PassError("verify", node.name, f"Cast->Cast round trip through {src!r} "
                                f"(from {prev.name!r})")
    for name, dtype in (io_types or {}).items():
        if types.get(name) != dtype:
            raise PassError("verify", None, f"graph input/output {name!r} is "
                            f"{_dt(types.get(name, 0))}, expected {_dt(dtype)} (keep_io_types)")
    nodes = {n.name: n for g in all_graphs(model.graph) for n in g.node}
    expected = expected or {}
    for node in visiting([nodes[name] for name in expected if name in nodes]):
        for slot, dtype in expected[node.name].items():
            got = types.get(node.input[slot], 0)
            if got != dtype:
                raise PassError("verify", node.name, f"input {slot} ({node.input[slot]!r}) is "
                                f"{_dt(got)}, the precision plan asked for {_dt(dtype)}")
    return types


def _checker(model: ModelProto, sized: Collection[str]) -> None:
    try:
        check_structure(model, sized)  # the weights' bytes left out: any size, no serialization
    except onnx.checker.ValidationError as exc:
        raise PassError("verify", None, f"onnx.checker rejects the converted model: {exc}") from exc


def _strict_types(model: ModelProto) -> dict[str, int]:
    try:
        return infer_types(model, strict=True)
    except Exception as exc:  # onnx raises InferenceError with the node in the message
        raise PassError("verify", None, f"shape inference fails on the converted model: {exc}"
                        ) from exc


def _dt(dtype: int) -> str:
    return TensorProto.DataType.Name(dtype) if dtype else "unknown"


__all__ = ["verify_model"]
