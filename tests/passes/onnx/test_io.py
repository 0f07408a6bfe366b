"""passes.onnx.io: reading with clear errors, external data, atomic writes, metadata."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import ModelProto, helper, numpy_helper

from passes.onnx import io as pio
from tests.passes.onnx.util import F16, F32, init, make, rand, vi


def model(size: int = 4) -> ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    return make(nodes, [vi("x", F32, [2, size])], [vi("y", F32, [2, size])],
                [init("W", rand(size, size))])


def test_load_model_takes_protos_bytes_and_paths(tmp_path):
    m = model()
    assert pio.load_model(m) == (m, False)
    from_bytes, external = pio.load_model(m.SerializeToString())
    assert from_bytes == m and not external
    path = tmp_path / "m.onnx"
    onnx.save(m, str(path))
    assert pio.load_model(path)[0] == m and pio.load_model(str(path))[0] == m


def test_load_model_loads_external_data_and_says_so(tmp_path):
    path = tmp_path / "ext.onnx"
    onnx.save_model(model(64), str(path), save_as_external_data=True, location="ext.bin",
                    size_threshold=0)
    proto, external = pio.load_model(path)
    assert external and not pio.has_external(proto)  # the weights are in memory
    assert numpy_helper.to_array(proto.graph.initializer[0]).shape == (64, 64)
    assert pio.has_external(onnx.load(str(path), load_external_data=False))


def test_load_model_errors_say_what_is_wrong(tmp_path):
    with pytest.raises(FileNotFoundError, match="no ONNX model at"):
        pio.load_model(tmp_path / "missing.onnx")
    with pytest.raises(TypeError, match="ModelProto, bytes or a path, not int"):
        pio.load_model(3)
    with pytest.raises(pio.OnnxModelError, match="the given bytes are not a serialized ONNX"):
        pio.load_model(b"\xff\xfe garbage")
    with pytest.raises(pio.OnnxModelError, match="not an ONNX model .no opset, outputs"):
        pio.load_model(ModelProto())
    broken = model()
    broken.graph.node[0].input[1] = "nowhere"  # reads a value nothing defines
    with pytest.raises(pio.OnnxModelError, match="is not a valid ONNX model"):
        pio.load_model(broken)
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"not protobuf at all")
    with pytest.raises(pio.OnnxModelError, match="is not a readable ONNX model"):
        pio.load_model(garbage)
    assert issubclass(pio.OnnxModelError, ValueError)


def test_sizes_and_dtypes_of_the_weights():
    m = model(8)
    assert pio.data_bytes(m) == 8 * 8 * 4
    assert not pio.has_dtype(m, F16)
    cast = helper.make_node("Cast", ["y"], ["y16"], name="c", to=F16)
    m.graph.node.append(cast)
    assert pio.has_dtype(m, F16)  # a Cast producing it counts
    half = numpy_helper.from_array(np.ones(3, np.float16), "h")
    assert pio.has_dtype(make([helper.make_node("Identity", ["h"], ["y"], name="i")], [],
                              [vi("y", F16, [3])], [half]), F16)


def test_save_model_writes_atomically_with_or_without_external_data(tmp_path):
    m = model(64)
    plain = tmp_path / "out" / "plain.onnx"
    assert pio.save_model(m, plain, external=False) is m
    assert onnx.load(str(plain)) == m and sorted(p.name for p in plain.parent.iterdir()) == \
        ["plain.onnx"]  # no temporary file left behind
    ext = tmp_path / "out" / "ext.onnx"
    whole = ModelProto()
    whole.CopyFrom(m)
    kept = pio.save_model(m, ext, external=True)
    assert (tmp_path / "out" / "ext.onnx.data").stat().st_size == 64 * 64 * 4
    assert kept == whole and not pio.has_external(kept)  # small: the caller keeps it whole
    assert pio.has_external(onnx.load(str(ext), load_external_data=False))
    assert sorted(p.name for p in ext.parent.iterdir()) == \
        ["ext.onnx", "ext.onnx.data", "plain.onnx"]


def test_stamp_keeps_the_other_metadata():
    m = model()
    helper.set_model_props(m, {"producer": "me"})
    pio.stamp(m, {"ampgraph.amp_level": "O2"})
    pio.stamp(m, {"ampgraph.dtype": "fp16"})
    assert {p.key: p.value for p in m.metadata_props} == {
        "producer": "me", "ampgraph.amp_level": "O2", "ampgraph.dtype": "fp16"}


def test_max_ir_version_is_one_onnxruntime_loads():
    import onnxruntime as ort

    ir = pio.max_ir_version()
    assert 7 <= ir <= onnx.IR_VERSION
    m = model()
    m.ir_version = ir
    ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
