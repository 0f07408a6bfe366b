"""Initializer data, touched as little as possible: sizes from dims, bounds, 16-bit casts.

Reading ``TensorProto.raw_data`` copies the bytes (protobuf hands out a new ``bytes``),
and so does every ``onnx.checker`` call or ``SerializeToString`` on a model with weights.
Each such sweep costs more than the whole conversion
(docs/performance.md#onnx-conversion-speed), so the pass
takes sizes from ``dims`` and the dtype, reads a large tensor once per use, and converts
it with one cast straight from its bytes (``cast_bulk``; torch's kernel for fp16 when
torch is loaded, numpy's otherwise), falling back to the exact, slower path of
``initializers.convert_tensor`` for anything unusual.

Example:
    >>> nbytes(model.graph.initializer[0])   # no copy of the data
    93763584
"""

from __future__ import annotations

import os
import sys
import threading

import ml_dtypes
import numpy as np
from onnx import TensorProto

from passes.onnx.policy import BFLOAT16, FLOAT16, dtype_limits

_ITEMSIZE = {
    TensorProto.FLOAT: 4, TensorProto.FLOAT16: 2, TensorProto.BFLOAT16: 2,
    TensorProto.DOUBLE: 8, TensorProto.INT64: 8, TensorProto.INT32: 4, TensorProto.INT16: 2,
    TensorProto.INT8: 1, TensorProto.UINT64: 8, TensorProto.UINT32: 4, TensorProto.UINT16: 2,
    TensorProto.UINT8: 1, TensorProto.BOOL: 1, TensorProto.COMPLEX64: 8,
    TensorProto.COMPLEX128: 16,
}
_OTHER_VALUES = ("float_data", "int32_data", "string_data", "int64_data", "double_data",
                 "uint64_data")
_LOW_NP = {FLOAT16: np.dtype(np.float16), BFLOAT16: np.dtype(ml_dtypes.bfloat16)}
_READ_NP = {TensorProto.FLOAT: np.dtype("<f4"), TensorProto.DOUBLE: np.dtype("<f8")}
_SIGNLESS = np.uint16(0x7FFF)


def nbytes(tensor: TensorProto) -> int:
    """Bytes held in ``raw_data``, from dims and dtype (no copy; 0 when there is none).

    Equals ``len(tensor.raw_data)`` for every well-formed tensor; dtypes without a fixed
    item size (packed 4-bit types ...) are measured by reading the field.

    Example:
        >>> nbytes(numpy_helper.from_array(np.zeros((2, 3), np.float32)))
        24
    """
    if not tensor.HasField("raw_data"):
        return 0
    size = _ITEMSIZE.get(tensor.data_type)
    if size is None:
        return len(tensor.raw_data)
    for d in tensor.dims:
        size *= d
    return size


def is_bulk(tensor: TensorProto, threshold: int) -> bool:
    """Whether ``tensor`` keeps more than ``threshold`` bytes in ``raw_data`` and nothing in
    the other value fields (the usual way exporters store weights).

    Example:
        >>> is_bulk(model.graph.initializer[0], 4096)
        True
    """
    return (tensor.data_location != TensorProto.EXTERNAL and tensor.data_type in _ITEMSIZE
            and nbytes(tensor) > threshold
            and not any(len(getattr(tensor, f)) for f in _OTHER_VALUES))


def read_float(tensor: TensorProto) -> np.ndarray | None:
    """A read-only view of a FLOAT/DOUBLE tensor's ``raw_data`` (one copy: the field's
    bytes), or None when the data is stored any other way or its size does not match.

    Example:
        >>> read_float(model.graph.initializer[0]).shape
        (30522, 768)
    """
    np_dtype = _READ_NP.get(tensor.data_type)
    if (np_dtype is None or not tensor.HasField("raw_data") or not is_bulk(tensor, -1)
            or tensor.HasField("segment")):
        return None
    raw = tensor.raw_data
    if len(raw) != nbytes(tensor):
        return None
    return np.frombuffer(raw, dtype=np_dtype).reshape(tuple(tensor.dims))


def bounds(arr: np.ndarray) -> tuple[float, float]:
    """(min, max) of an array, NaN when it holds one; (0, 0) when empty (large arrays
    are reduced in pieces on a few threads).

    Example:
        >>> bounds(np.array([-2.0, 3.0]))
        (-2.0, 3.0)
    """
    if arr.size == 0:
        return 0.0, 0.0
    flat = arr.reshape(-1)
    found: dict[int, tuple] = {}

    def reduce(sl: slice) -> None:
        found[sl.start] = (flat[sl].min(), flat[sl].max())

    _in_pieces(reduce, flat.size)
    lo, hi = np.array(list(found.values()), dtype=np.float64).T  # NaN propagates
    return float(lo.min()), float(hi.max())


def fits(lo: float, hi: float, dtype: int) -> bool:
    """Whether every value between ``lo`` and ``hi`` is within the finite range of ``dtype``
    (False for NaN bounds: the caller takes the exact path).

    Example:
        >>> fits(-1e9, 1.0, TensorProto.FLOAT16)
        False
    """
    big, _ = dtype_limits(dtype)
    return -big <= lo and hi <= big


def cast_bulk(arr: np.ndarray, dtype: int) -> bytes | None:
    """``arr`` (float32, every value within range) cast to fp16/bf16 as little-endian
    bytes, with non-zero values below the smallest subnormal raised to it (sign kept):
    what clamping first and casting after gives, bit for bit, in one cast.

    Values in (0, tiny) round to 0 or to tiny; the zeros of the result whose source is
    not zero are set to tiny (their low bit), so no mask over the input is built. The
    cast itself: ``_torch_cast`` for fp16 when torch is loaded, else numpy (large arrays
    in pieces on a few threads: numpy releases the GIL while casting); the bits agree.
    Returns None for anything else (the caller takes the exact path).

    Example:
        >>> np.frombuffer(cast_bulk(np.array([1e-9, 1.0], np.float32), FLOAT16), np.float16)
        array([6.e-08, 1.e+00], dtype=float16)
    """
    np_dtype = _LOW_NP.get(dtype)
    if np_dtype is None or arr.dtype != np.float32:
        return None
    src = arr.reshape(-1)
    low = np.empty(src.shape, np_dtype)
    if not (dtype == FLOAT16 and _torch_cast(src, low)):
        _in_pieces(lambda sl: np.copyto(low[sl], src[sl], casting="unsafe"), src.size)
    bits = low.view(np.uint16)
    zeros = np.flatnonzero((bits & _SIGNLESS) == 0)
    if zeros.size:
        flushed = zeros[src[zeros] != 0]
        bits[flushed] |= np.uint16(1)
    return low.tobytes()


_STEP = 1 << 15  # elements per torch call: ATen's grain size, so each stays on one thread


def _torch_cast(src: np.ndarray, low: np.ndarray) -> bool:
    """Cast float32 ``src`` into float16 ``low`` with torch's vectorised kernel (F16C /
    AVX-512: ~5x numpy's scalar loop, the same round-to-nearest-even bits); False when
    the array is small or torch is not loaded (it is never imported for this).

    Chunks of ``_STEP`` elements keep ATen from starting its thread pool, which on a
    busy machine costs more than it gains; each goes through a small writable buffer
    (torch warns about read-only numpy memory, and ``src`` views protobuf bytes).
    """
    torch = sys.modules.get("torch")
    if torch is None or src.size < 4 * _STEP:
        return False
    buf = np.empty(_STEP, np.float32)
    staged, out = torch.from_numpy(buf), torch.from_numpy(low)
    for i in range(0, src.size, _STEP):
        k = min(_STEP, src.size - i)
        np.copyto(buf[:k], src[i:i + k])
        out[i:i + k].copy_(staged[:k])
    return True


_PIECE = 1 << 20  # elements: arrays under two pieces are cast on the calling thread


def _in_pieces(work, size: int) -> None:
    """Run ``work(slice)`` over ``range(size)``, in up to 4 pieces on as many threads.

    Plain threads, started per call (tens of microseconds each, for arrays of megabytes):
    nothing lingers, nothing breaks after a fork.
    """
    workers = min(4, os.cpu_count() or 1, size // _PIECE)
    if workers < 2:
        work(slice(0, size))
        return
    step = -(-size // workers)
    pieces = [slice(i, min(i + step, size)) for i in range(0, size, step)]
    errors: list[BaseException] = []

    def run(sl: slice) -> None:
        try:
            work(sl)
        except BaseException as exc:  # re-raised on the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(sl,), daemon=True) for sl in pieces[1:]]
    for t in threads:
        t.start()
    run(pieces[0])
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


__all__ = ["bounds", "cast_bulk", "fits", "is_bulk", "nbytes", "read_float"]
