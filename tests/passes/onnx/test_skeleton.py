"""passes.onnx.skeleton: weight-free copies give the checker's verdicts and the pass's
results that copying and serializing the weights gave."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import ModelProto, TensorProto, helper, numpy_helper

import passes.onnx.convert as pconvert
import passes.onnx.verify as pverify
from passes.onnx import convert_model, initializers
from passes.onnx.io import OnnxModelError, load_model
from passes.onnx.skeleton import attach_data, check_structure, detached_copy, skeleton
from passes.onnx.tensor_data import cast_bulk
from tests.passes.onnx.util import F32, init, make, rand, vi

N = 48  # 48 x 48 float32 = 9 KiB: above the 4 KiB the skeletons leave out


def _model() -> ModelProto:
    """Large weights, a shared bias (fp32 and low readers), a mask beyond fp16, a Constant
    node, and a large initializer returned as a graph output and read by a MatMul."""
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "b"], ["h"], name="add"),
        helper.make_node("Add", ["h", "mask"], ["s"], name="add_mask"),
        helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
        helper.make_node("Constant", [], ["c"], name="const",
                         value=numpy_helper.from_array(rand(N, N), "c")),
        helper.make_node("MatMul", ["p", "c"], ["q"], name="mm2"),
        helper.make_node("LayerNormalization", ["q", "g", "b"], ["y"], name="ln"),
        helper.make_node("MatMul", ["x", "E"], ["r"], name="mm3"),
    ]
    mask = np.where(np.arange(N * N).reshape(N, N) % 3 == 0, -1e9, 0.0)
    bias = rand(N * N).reshape(N, N) * 1e-6  # tiny values: raised to the subnormal
    inits = [init("W", rand(N, N)), init("b", bias[0]), init("mask", mask),
             init("g", np.ones(N)), init("E", bias)]
    outputs = [vi("y", F32, [N, N]), vi("E", F32, [N, N]), vi("r", F32, [N, N])]
    return make(nodes, [vi("x", F32, [N, N])], outputs, inits)


def test_detached_copy_plus_attach_is_the_model():
    model = _model()
    work, pairs = detached_copy(model)
    assert len(pairs) == 3 and work.ByteSize() < 4 * 4096  # W, mask, E left out
    attach_data(pairs)
    assert work.SerializeToString() == model.SerializeToString()


def test_skeleton_keeps_types_and_shapes_for_inference():
    sk = skeleton(_model())
    inferred = onnx.shape_inference.infer_shapes(sk, check_type=True, strict_mode=True)
    assert {t.name: list(t.dims) for t in inferred.graph.initializer}["W"] == [N, N]


def test_check_structure_agrees_with_the_checker():
    model = _model()
    check_structure(model)
    bad = ModelProto()
    bad.CopyFrom(model)
    bad.graph.initializer[0].raw_data = bad.graph.initializer[0].raw_data[:100]
    with pytest.raises(onnx.checker.ValidationError) as ours:
        check_structure(bad)
    with pytest.raises(onnx.checker.ValidationError) as theirs:
        onnx.checker.check_model(bad)
    assert str(ours.value) == str(theirs.value) and "too small" in str(ours.value)
    check_structure(bad, sized={"W"})  # lengths the caller vouches for are not read
    with pytest.raises(OnnxModelError, match="too small"):
        load_model(bad)
    dup = ModelProto()
    dup.CopyFrom(model)
    dup.graph.initializer.append(dup.graph.initializer[0])
    with pytest.raises(onnx.checker.ValidationError, match="not unique"):
        check_structure(dup)


def _exact_paths(m: pytest.MonkeyPatch) -> None:
    """What the pass did before: copy everything, check with weights, convert by numpy."""

    def full_copy(model):
        out = ModelProto()
        out.CopyFrom(model)
        return out, []

    m.setattr(pconvert, "detached_copy", full_copy)
    m.setattr(initializers, "read_float", lambda t: None)
    m.setattr(pverify, "check_structure", lambda model, sized=(): onnx.checker.check_model(model))


@pytest.mark.parametrize("level, dtype, keep", [("O2", "fp16", True), ("O3", "bf16", False),
                                                ("O1", "fp16", False), ("O0", "fp16", True)])
def test_conversion_gives_the_bytes_of_the_exact_paths(level, dtype, keep, monkeypatch):
    model = _model()
    before = model.SerializeToString()
    bulk = []
    with monkeypatch.context() as m, warnings.catch_warnings(record=True) as ours_warned:
        warnings.simplefilter("always")
        m.setattr(initializers, "cast_bulk", lambda *a: bulk.append(a) or cast_bulk(*a))
        ours = convert_model(model, level, dtype, keep_io_types=keep)
    assert (len(bulk) >= 2) == (level != "O0")  # W, E (and smaller ones) took one cast
    assert model.SerializeToString() == before  # copy=True leaves the input alone
    owned = ModelProto()
    owned.CopyFrom(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        in_place = convert_model(owned, level, dtype, keep_io_types=keep, copy=False)
    with monkeypatch.context() as m, warnings.catch_warnings(record=True) as exact_warned:
        warnings.simplefilter("always")
        _exact_paths(m)
        exact = convert_model(model, level, dtype, keep_io_types=keep)
    data = exact.model.SerializeToString()
    assert ours.model.SerializeToString() == data
    assert in_place.model.SerializeToString() == data
    assert [str(w.message) for w in ours_warned] == [str(w.message) for w in exact_warned]
    assert ours.clamped == exact.clamped and ours.forced == exact.forced
    if level != "O0":
        types = {t.name: t.data_type for t in ours.model.graph.initializer}
        assert types["W"] == (TensorProto.FLOAT16 if dtype == "fp16" else TensorProto.BFLOAT16)
