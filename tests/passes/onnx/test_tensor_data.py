"""passes.onnx.tensor_data: sizes without copies, bounds, and the one-cast conversion of
large weights, which must give the exact path's bytes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from passes.onnx import initializers
from passes.onnx.initializers import convert_tensor
from passes.onnx.tensor_data import bounds, cast_bulk, fits, is_bulk, nbytes, read_float

F16, BF16 = TensorProto.FLOAT16, TensorProto.BFLOAT16


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, np.int64, np.int8,
                                   np.bool_, ml_dtypes.bfloat16, np.complex64])
def test_nbytes_is_the_length_of_raw_data(dtype):
    t = numpy_helper.from_array(np.zeros((3, 5), dtype), "t")
    assert nbytes(t) == len(t.raw_data)


def test_nbytes_is_zero_without_raw_data_and_bulk_needs_raw_data_only():
    typed = helper.make_tensor("f", TensorProto.FLOAT, [2000], [0.0] * 2000)
    assert nbytes(typed) == 0 and not is_bulk(typed, 16)
    raw = numpy_helper.from_array(np.zeros(2000, np.float32), "r")
    assert is_bulk(raw, 4096) and not is_bulk(raw, 8000)
    raw.float_data.append(1.0)  # two value fields: left to the checker as it is
    assert not is_bulk(raw, 16)


def test_read_float_views_raw_data_and_refuses_the_rest():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(read_float(numpy_helper.from_array(a)), a)
    assert read_float(numpy_helper.from_array(a.astype(np.float16))) is None
    assert read_float(helper.make_tensor("f", TensorProto.FLOAT, [2], [1.0, 2.0])) is None
    short = numpy_helper.from_array(a)
    short.raw_data = short.raw_data[:8]
    assert read_float(short) is None  # the exact path reports the broken tensor


def test_bounds_propagate_nan_and_fits_refuses_it():
    big = np.linspace(-3, 5, 3_000_001, dtype=np.float32)  # reduced on threads
    assert bounds(big) == (-3.0, 5.0)
    big[2_500_000] = np.nan
    lo, hi = bounds(big)
    assert np.isnan(lo) and np.isnan(hi) and not fits(lo, hi, F16)
    assert bounds(np.array([], np.float32)) == (0.0, 0.0)
    assert fits(-65504.0, 65504.0, F16) and not fits(-1e9, 0.0, F16)


def _exact(arr: np.ndarray, dtype: int, monkeypatch) -> TensorProto:
    with monkeypatch.context() as m:
        m.setattr(initializers, "read_float", lambda t: None)  # the general path only
        return convert_tensor(numpy_helper.from_array(arr, "w"), dtype, "w")[0]


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("size", [17, 5000, 2_500_000])  # one thread, and pieces
def test_one_cast_gives_the_exact_paths_bytes(dtype, size, monkeypatch):
    rng = np.random.default_rng(size)
    arr = (rng.standard_normal(size) * (0.02 if dtype == F16 else 1e-36)).astype(np.float32)
    tiny = 2.0**-24 if dtype == F16 else 2.0**-133
    arr[:8] = [0.0, -0.0, tiny / 2, -tiny / 2, tiny / 3, -tiny * 0.9, tiny, 1e-45]
    doc = numpy_helper.from_array(arr, "w")
    doc.doc_string = "weights"
    fast, n = convert_tensor(doc, dtype, "w")
    assert n == 0 and fast.doc_string == "weights"
    exact = _exact(arr, dtype, monkeypatch)
    exact.doc_string = "weights"
    assert fast.SerializeToString() == exact.SerializeToString()


def test_out_of_range_or_nan_weights_take_the_exact_path(monkeypatch):
    arr = np.full(100, 0.5, np.float32)
    arr[3], arr[4] = 1e6, np.nan
    fast, n = convert_tensor(numpy_helper.from_array(arr, "w"), F16, "w")
    assert n == 1  # the clamp is counted, as before
    assert fast.SerializeToString() == _exact(arr, F16, monkeypatch).SerializeToString()


def test_convert_into_the_source_tensor_itself():
    arr = np.linspace(-1, 1, 4096, dtype=np.float32)
    t = numpy_helper.from_array(arr, "w")
    out, _ = convert_tensor(t, F16, "w", out=t)
    assert out is t and t.data_type == F16
    np.testing.assert_array_equal(numpy_helper.to_array(t), arr.astype(np.float16))


def test_cast_bulk_refuses_what_it_does_not_handle():
    assert cast_bulk(np.zeros(4, np.float64), F16) is None
    assert cast_bulk(np.zeros(4, np.float32), TensorProto.FLOAT) is None


@pytest.mark.parametrize("torch_loaded", [True, False])
def test_torch_and_numpy_casts_agree_bit_for_bit(torch_loaded, monkeypatch):
    import sys

    import torch  # noqa: F401 - loaded, so cast_bulk may use it

    rng = np.random.default_rng(1)
    arr = np.concatenate([rng.standard_normal(300_001) * s for s in (1e-8, 0.02, 300.0)])
    arr = arr.astype(np.float32)
    arr[::7] = -arr[::7]
    arr[:3] = [0.0, -0.0, 65504.0]
    if not torch_loaded:
        monkeypatch.delitem(sys.modules, "torch")
    got = cast_bulk(arr, F16)
    ref = np.where((np.abs(arr) > 0) & (np.abs(arr) < 2.0**-24),
                   np.copysign(np.float32(2.0**-24), arr), arr).astype(np.float16)
    assert got == ref.tobytes()
