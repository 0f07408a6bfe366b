"""Weight-free copies of a model: for shape inference, for ``onnx.checker``, to work on.

Protobuf moves every byte of a message it copies or serializes: ``CopyFrom`` of a
BERT-base model copies its 440 MB of weights and ``onnx.checker.check_model`` serializes
them (docs/performance.md#onnx-conversion-speed). Neither shape inference nor the checker
reads weight values, and the
pass reads each weight once to convert it, so large initializers of the main graph
(more than 4 KiB in ``raw_data``, nothing in the other value fields) are left out:

- :func:`skeleton`: they keep name, dtype and dims, their data marked external (shape
  inference types them from that, for any model size);
- :func:`check_structure`: ``onnx.checker`` on a copy where they keep every field but
  their data, with zero elements: of such a tensor (``raw_data`` only, a fixed-size
  dtype) the checker asks only that its data is long enough for its shape, which is
  measured here. Structure, schemas, names and topological order are checked without
  serializing the weights;
- :func:`detached_copy` / :func:`attach_data`: the working copy of
  ``convert_model(copy=True)``: a skeleton plus (stub, source) pairs; the pass converts
  the sources it lowers straight into their stubs and ``attach_data`` copies the rest,
  so FP32 weights that become fp16 are never copied.

Example:
    >>> check_structure(model)          # raises onnx.checker.ValidationError
"""

from __future__ import annotations

from collections.abc import Collection
from functools import partial

import onnx
from onnx import GraphProto, ModelProto, TensorProto

from passes.onnx.tensor_data import is_bulk, nbytes

BIG = 4096  # bytes of raw_data above which an initializer is left out
_DETACHED = "__ampgraph_detached__"  # external_data location of a stub


def _repeated(fd) -> bool:
    flag = getattr(fd, "is_repeated", None)  # protobuf >= 5.28; older: label 3
    return flag if flag is not None else fd.label == 3


def _copy_fields(src: ModelProto | GraphProto | TensorProto,
                 dst: ModelProto | GraphProto | TensorProto, skip: str) -> None:
    """Copy every set field of ``src`` except ``skip`` into ``dst`` (field by field)."""
    for fd in src.DESCRIPTOR.fields:
        if fd.name == skip:
            continue
        if _repeated(fd):
            if len(getattr(src, fd.name)):
                getattr(dst, fd.name).extend(getattr(src, fd.name))
        elif src.HasField(fd.name):
            if fd.message_type is not None:
                getattr(dst, fd.name).CopyFrom(getattr(src, fd.name))
            else:
                setattr(dst, fd.name, getattr(src, fd.name))


def _external_stub(graph: GraphProto, t: TensorProto) -> TensorProto:
    stub = graph.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
    stub.data_location = TensorProto.EXTERNAL
    stub.external_data.add(key="location", value=_DETACHED)
    return stub


def _checkable_stub(graph: GraphProto, t: TensorProto, sized: Collection[str] = ()
                    ) -> TensorProto:
    if t.name not in sized and len(t.raw_data) < nbytes(t):
        graph.initializer.append(t)  # too short: the checker says so, in its own words
        return t
    stub = graph.initializer.add()  # what the checker would accept, with zero elements
    _copy_fields(t, stub, skip="raw_data")
    del stub.dims[:]
    stub.dims.append(0)
    return stub


def _copy(model: ModelProto, stub) -> tuple[ModelProto, list[tuple[TensorProto, TensorProto]]]:
    out = ModelProto()
    _copy_fields(model, out, skip="graph")
    if model.HasField("graph"):
        _copy_fields(model.graph, out.graph, skip="initializer")
    pairs = []
    for t in model.graph.initializer:
        if is_bulk(t, BIG):
            pairs.append((stub(out.graph, t), t))
        else:
            out.graph.initializer.append(t)
    return out, pairs


def skeleton(model: ModelProto) -> ModelProto:
    """A copy of ``model`` whose large initializers of the main graph keep their name, dtype
    and shape but no data (marked external): cheap to serialize, whatever the model size.

    Example:
        >>> onnx.shape_inference.infer_shapes(skeleton(model_over_2gb))
    """
    return _copy(model, _external_stub)[0]


def check_structure(model: ModelProto, sized: Collection[str] = ()) -> None:
    """``onnx.checker.check_model`` on ``model`` with its large initializers' bytes left out.

    The length of their data is measured (reading it copies it), except for the names in
    ``sized``, whose length the caller vouches for.

    Raises:
        onnx.checker.ValidationError: as ``check_model`` would on ``model``.

    Example:
        >>> check_structure(model)
    """
    onnx.checker.check_model(_copy(model, partial(_checkable_stub, sized=sized))[0])


def detached_copy(model: ModelProto) -> tuple[ModelProto, list[tuple[TensorProto, TensorProto]]]:
    """A :func:`skeleton` of ``model`` to convert, and its (stub, source tensor) pairs.

    Example:
        >>> work, pairs = detached_copy(model)
        >>> ...                     # convert, writing lowered tensors into their stubs
        >>> attach_data(pairs)      # work is now a full model
    """
    return _copy(model, _external_stub)


def is_stub(tensor: TensorProto) -> bool:
    """Whether ``tensor`` is a stub of :func:`detached_copy` not given data yet.

    Example:
        >>> is_stub(detached_copy(model)[1][0][0])
        True
    """
    return (tensor.data_location == TensorProto.EXTERNAL and len(tensor.external_data) == 1
            and tensor.external_data[0].value == _DETACHED)


def attach_data(pairs: list[tuple[TensorProto, TensorProto]]) -> None:
    """Copy its source into every stub still without data, keeping the stub's current name.

    Example:
        >>> attach_data(pairs)
    """
    for stub, source in pairs:
        if is_stub(stub):
            name = stub.name
            stub.CopyFrom(source)
            stub.name = name


__all__ = ["BIG", "attach_data", "check_structure", "detached_copy", "is_stub", "skeleton"]
