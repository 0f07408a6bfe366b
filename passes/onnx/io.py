"""Reading and writing ONNX models: clear errors, external data, atomic writes, and the
IR version the installed onnxruntime can load.

Models over 2 GB must be read by path (their weights live in external data files) and are
written with external data next to the output file. Shape inference in this package runs
on a weight-free skeleton (``graph.infer_types``), so nothing here serializes > 2 GB.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

import onnx
from onnx import ModelProto, TensorProto, helper

from passes.onnx.skeleton import check_structure
from passes.onnx.subgraphs import all_graphs
from passes.onnx.tensor_data import nbytes

ModelLike = ModelProto | str | os.PathLike | bytes
EXTERNAL_DATA_BYTES = 1_800_000_000  # above this, weights are written as external data


class OnnxModelError(ValueError):
    """The input is not a readable, valid ONNX model.

    Example:
        >>> load_model(b"garbage")
        Traceback (most recent call last):
        OnnxModelError: the given bytes are not a serialized ONNX model (...)
    """


def load_model(model: ModelLike) -> tuple[ModelProto, bool]:
    """Read and check a model; return it (weights loaded) and whether it had external data.

    Raises:
        FileNotFoundError: no file at the path.
        OnnxModelError: unreadable bytes, not an ONNX model, or rejected by onnx.checker.

    Example:
        >>> model, external = load_model("big_model.onnx")
    """
    where, external = "the given ModelProto", False
    if isinstance(model, ModelProto):
        proto = model
    elif isinstance(model, bytes | bytearray):
        proto, where = _parse(bytes(model), "the given bytes"), "the given bytes"
    elif isinstance(model, str | os.PathLike):
        path = Path(model)
        where = str(path)
        if not path.is_file():
            raise FileNotFoundError(f"no ONNX model at {path}")
        try:
            proto = onnx.load(str(path), load_external_data=False)
            external = has_external(proto)
            if external:
                onnx.load_external_data_for_model(proto, str(path.parent))
        except Exception as exc:
            raise OnnxModelError(f"{path} is not a readable ONNX model ({exc}); re-export it "
                                 "or check the download; nothing was written") from exc
    else:
        raise TypeError(f"model must be an onnx.ModelProto, bytes or a path, not "
                        f"{type(model).__name__}")
    if not proto.opset_import or not proto.graph.output or proto.ir_version <= 0:
        raise OnnxModelError(f"{where} is not an ONNX model (no opset, outputs or IR version); "
                             "nothing was written")
    try:
        if data_bytes(proto) <= EXTERNAL_DATA_BYTES:
            check_structure(proto)  # check_model without serializing the weights
        elif isinstance(model, str | os.PathLike):
            onnx.checker.check_model(str(model))  # path-based: no 2 GB protobuf limit
    except Exception as exc:
        raise OnnxModelError(f"{where} is not a valid ONNX model: {exc}; fix it or "
                             "re-export it (nothing was written)") from exc
    return proto, external


def _parse(data: bytes, where: str) -> ModelProto:
    try:
        return onnx.load_model_from_string(data)
    except Exception as exc:
        raise OnnxModelError(f"{where} are not a serialized ONNX model ({exc})") from exc


def has_external(proto: ModelProto) -> bool:
    """Whether any initializer of ``proto`` (subgraphs included) lives in external data.

    Example:
        >>> has_external(onnx.load("model.onnx", load_external_data=False))
        True
    """
    return any(t.data_location == TensorProto.EXTERNAL for g in all_graphs(proto.graph)
               for t in g.initializer)


def has_dtype(model: ModelProto, dtype: int) -> bool:
    """Whether any initializer holds, or any Cast produces, ``dtype`` (subgraphs included).

    Example:
        >>> has_dtype(converted, TensorProto.FLOAT16)
        True
    """
    for g in all_graphs(model.graph):
        if any(t.data_type == dtype for t in g.initializer):
            return True
        for n in g.node:
            if n.op_type == "Cast" and any(a.name == "to" and a.i == dtype for a in n.attribute):
                return True
    return False


def data_bytes(model: ModelProto) -> int:
    """Bytes of initializer data held in memory (subgraphs included), from their dims:
    reading ``raw_data`` would copy it.

    Example:
        >>> data_bytes(model) > EXTERNAL_DATA_BYTES  # write with external data
        False
    """
    return sum(nbytes(t) for g in all_graphs(model.graph) for t in g.initializer)


def save_model(model: ModelProto, path: Path, external: bool) -> ModelProto:
    """Write ``model`` to ``path`` atomically; return the proto the caller should keep.

    With ``external`` the weights go to ``<name>.data`` next to ``path`` and the file is
    checked by path; a model too large for memory serialization is returned referring
    to that data, a smaller one is returned self-contained.

    Example:
        >>> save_model(model, Path("out/model_fp16.onnx"), external=True)
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        if external:
            data = path.with_name(path.name + ".data")
            data.unlink(missing_ok=True)
            small = data_bytes(model) <= EXTERNAL_DATA_BYTES
            keep = ModelProto()
            if small:
                keep.CopyFrom(model)  # the caller gets a self-contained proto back
            onnx.save_model(model, str(tmp), save_as_external_data=True,
                            all_tensors_to_one_file=True, location=data.name, size_threshold=1024)
            os.replace(tmp, path)
            onnx.checker.check_model(str(path))
            return keep if small else model
        onnx.save_model(model, str(tmp))
        os.replace(tmp, path)
        return model
    finally:
        tmp.unlink(missing_ok=True)


def stamp(model: ModelProto, props: dict[str, str]) -> None:
    """Set ``metadata_props`` entries, keeping the others.

    Example:
        >>> stamp(model, {"ampgraph.amp_level": "O2"})
    """
    merged = {p.key: p.value for p in model.metadata_props}
    merged.update(props)
    onnx.helper.set_model_props(model, merged)


@lru_cache(maxsize=1)
def max_ir_version() -> int:
    """The highest ONNX IR version the installed onnxruntime loads (probed once).

    Example:
        >>> model.ir_version = min(model.ir_version, max_ir_version())
    """
    import onnxruntime as ort  # only here: the pass itself never needs onnxruntime

    options = ort.SessionOptions()
    options.log_severity_level = 4
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                                   [x], [helper.make_tensor_value_info("y", 1, [1])])
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    for ir in range(onnx.IR_VERSION, 6, -1):
        probe.ir_version = ir
        try:
            ort.InferenceSession(probe.SerializeToString(), options,
                                 providers=["CPUExecutionProvider"])
            return ir
        except Exception:  # onnxruntime raises a generic Fail for unsupported IR versions
            continue
    return 7


__all__ = [
    "EXTERNAL_DATA_BYTES",
    "OnnxModelError",
    "data_bytes",
    "has_dtype",
    "has_external",
    "load_model",
    "max_ir_version",
    "save_model",
    "stamp",
]
