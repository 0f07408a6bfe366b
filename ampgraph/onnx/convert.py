"""``convert_onnx``: an FP32 ONNX model to mixed precision, by level, with an automatic mode.

The conversion itself is ``passes.onnx.convert_model``; this module loads and saves
models (external data included), checks inputs with clear errors and runs the automatic
(tolerance-driven) mode, which bisects over painted regions validated on onnxruntime.

Example:
    >>> import ampgraph
    >>> ampgraph.export_onnx(model, (x,), "model_fp16.onnx", amp_level="O2")
    >>> sess = ampgraph.onnx_session("model_fp16.onnx")      # CUDA EP when usable
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from onnx import ModelProto

from ampgraph.config import DTYPE_NAMES, AmpConfig, ResolvedConfig, dtype_name
from ampgraph.onnx.session import feeds_for, onnx_session
from ampgraph.onnx.validate import compare_output
from passes.onnx import ConstantRangeWarning, convert_model, low_regions
from passes.onnx import io as pio
from passes.onnx.io import ModelLike, OnnxModelError, max_ir_version
from passes.onnx.policy import LOW_CAPABLE, LOW_DTYPES
from passes.onnx.regions import bisect_regions
from passes.onnx.schema import opset_held


def convert_onnx(
    model: ModelLike,
    amp_level: str = "O2",
    dtype: str = "fp16",
    *,
    keep_io_types: bool = True,
    op_block_list: Sequence[str] | None = None,
    node_block_list: Sequence[str] | None = None,
    output_path: str | os.PathLike | None = None,
    keep_norm_fp32: bool | None = None,
    auto_tolerance: float | None = None,
    auto_inputs: Any = None,
    auto_device: str = "auto",
) -> ModelProto:
    """Convert an FP32 ONNX model to mixed precision (MindSpore levels O0-O3).

    Args:
        model: a ModelProto, serialized bytes, or a path (use a path for models over 2 GB
            with external data).
        amp_level: "O0".."O3": the same levels and op classes as ``ampgraph.compile``.
        dtype: "fp16" or "bf16" (or torch's names for them; an ONNX graph has no device
            to choose for, so no "auto").
        keep_io_types: graph inputs/outputs keep their dtypes.
        op_block_list: ONNX op types forced to FP32 (e.g. ``["Softmax"]``).
        node_block_list: node names (fnmatch patterns) forced to FP32.
        output_path: where to write the result (external data next to it for large models).
        keep_norm_fp32: None takes the level's default.
        auto_tolerance: if set, keep in FP32 the fewest painted regions needed so that every
            output's max abs error is at most ``auto_tolerance`` times its max magnitude.
        auto_inputs: inputs for the automatic mode (dict name->array or positional list).
        auto_device: provider used to validate in the automatic mode ("auto", "cpu", "cuda").

    Returns:
        The converted model. For models saved with external data the returned proto refers
        to the data written next to ``output_path``.

    Raises:
        OnnxModelError: the input is not a valid ONNX model (nothing is written).
        ValueError: bad level/dtype/options, or the tolerance cannot be met.

    Example:
        >>> fp16 = convert_onnx("model.onnx", "O2", op_block_list=["Softmax"],
        ...                     output_path="model_fp16.onnx")
    """
    config = AmpConfig(amp_level=amp_level, dtype=dtype).resolve(device=None)
    return convert_resolved(
        model, config, keep_io_types=keep_io_types, op_block_list=op_block_list,
        node_block_list=node_block_list, output_path=output_path, keep_norm_fp32=keep_norm_fp32,
        auto_tolerance=auto_tolerance, auto_inputs=auto_inputs, auto_device=auto_device)


def convert_resolved(
    model: ModelLike,
    config: ResolvedConfig,
    *,
    keep_io_types: bool = True,
    op_block_list: Sequence[str] | None = None,
    node_block_list: Sequence[str] | None = None,
    output_path: str | os.PathLike | None = None,
    keep_norm_fp32: bool | None = None,
    auto_tolerance: float | None = None,
    auto_inputs: Any = None,
    auto_device: str = "auto",
) -> ModelProto:
    """:func:`convert_onnx` with the level and dtype already resolved for an ONNX graph
    (``AmpConfig(...).resolve(device=None)``): ``export_onnx`` resolves before it exports.

    Example:
        >>> config = AmpConfig(amp_level="O2", dtype="fp16").resolve(device=None)
        >>> fp16 = convert_resolved("model.onnx", config, output_path="model_fp16.onnx")
    """
    amp_level = config.level
    # the stamp and the pass name the low dtype; at O0 nothing runs low and the pass,
    # which converts nothing then, still takes a 16-bit name
    dtype = dtype_name(config.dtype) if amp_level != "O0" else "fp16"
    stamped = dtype_name(config.dtype)
    proto, external = pio.load_model(model)
    stamp = {p.key: p.value for p in proto.metadata_props}
    if stamp.get("ampgraph.amp_level", "O0") != "O0":  # converting twice: no-op, or refused
        done = (stamp["ampgraph.amp_level"], DTYPE_NAMES.get(stamp.get("ampgraph.dtype", "")))
        if done != (amp_level, config.dtype):  # "fp16" and "float16" alike
            raise ValueError(
                f"this model was already converted by ampgraph at {stamp['ampgraph.amp_level']} "
                f"{stamp.get('ampgraph.dtype')}; convert the original FP32 model instead"
            )
        if output_path is not None:
            proto = pio.save_model(proto, Path(output_path), external)
        return proto
    _check_opset(proto, amp_level, dtype)
    kw = dict(keep_io_types=keep_io_types, op_block_list=tuple(op_block_list or ()),
              node_block_list=tuple(node_block_list or ()), keep_norm_fp32=keep_norm_fp32)
    owned = not isinstance(model, ModelProto) and auto_tolerance is None  # loaded here
    result = convert_model(proto, amp_level, dtype, copy=not owned, **kw)
    if auto_tolerance is not None and amp_level != "O0":
        if auto_inputs is None:
            raise ValueError("auto_tolerance needs auto_inputs= (validation inputs)")
        result = _auto(proto, result, amp_level, dtype, kw, auto_tolerance, auto_inputs,
                       auto_device)
    if amp_level != "O0" and not any(getattr(d, "cls", "") for d in result.assignment.values()):
        warnings.warn("convert_onnx: the model has no float tensors to convert; it is returned "
                      "unchanged", UserWarning, stacklevel=3)
    out = result.model
    if amp_level != "O0":
        _warn_opset_held(out, dtype)
    out.ir_version = min(out.ir_version, max_ir_version())
    pio.stamp(out, {"ampgraph.amp_level": amp_level, "ampgraph.dtype": stamped})
    if output_path is not None:
        large = external or pio.data_bytes(out) > pio.EXTERNAL_DATA_BYTES
        out = pio.save_model(out, Path(output_path), large)
    return out


def _warn_opset_held(model: ModelProto, dtype: str) -> None:
    """Say which ops stay fp32 only because the model's opset has no ``dtype`` version of
    them (bf16 ``Conv`` and pooling come with opset 22), and the opset that has them."""
    held = opset_held(model, LOW_DTYPES[dtype], LOW_CAPABLE)
    if held:
        opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        warnings.warn(f"convert_onnx: opset {opset} has no {dtype} version of "
                      f"{', '.join(held)}: they run fp32 between casts (opset "
                      f"{max(held.values())} has them; export at that opset to run them "
                      f"{dtype})", UserWarning, stacklevel=3)


def _check_opset(proto: ModelProto, amp_level: str, dtype: str) -> None:
    """Refuse opsets the pass cannot write casts for, naming the upgrade."""
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    fix = ("upgrade it first: onnx.version_converter.convert_version(model, 17); "
           "nothing was written")
    if amp_level != "O0" and opset < 6:
        raise ValueError(f"the model's opset {opset} is too old for mixed precision (Cast "
                         f"takes a string type before opset 6); {fix}")
    if amp_level != "O0" and dtype in ("bf16", "bfloat16") and opset < 13:
        raise ValueError(f"bf16 needs opset >= 13 (the model's opset {opset} has no bfloat16 "
                         f"kernels for MatMul/Conv); {fix}")


def _auto(model, first, level, dtype, kw, tolerance, inputs, device):
    """Keep in FP32 the fewest painted regions (found by bisection) that meet ``tolerance``."""
    from tqdm.auto import tqdm

    ref = onnx_session(model, device)
    expected = ref.run(None, feeds_for(ref, inputs))
    regions = low_regions(first.dataflow, first.assignment)
    cache: dict[frozenset, tuple[float, Any]] = {}
    bar = tqdm(desc="ampgraph auto", unit="trial", file=sys.stderr,
               disable=not sys.stderr.isatty())

    def trial(blocked: frozenset) -> tuple[float, Any]:
        if blocked not in cache:
            nodes = [n for i in blocked for n in regions[i]]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConstantRangeWarning)
                res = first if not blocked else convert_model(model, level, dtype,
                                                               fp32_nodes=nodes, **kw)
            sess = onnx_session(res.model, device)
            got = sess.run(None, feeds_for(sess, inputs))
            err = max((compare_output("", r, c, 0, 0).max_rel for r, c in zip(expected, got)),
                      default=0.0)
            cache[blocked] = (err, res)
            bar.update(1)
            bar.set_postfix(error=f"{err:.3g}", fp32_regions=len(blocked))
        return cache[blocked]

    try:
        blocked = bisect_regions(len(regions), lambda b: trial(b)[0], tolerance)
        return trial(blocked)[1]
    finally:
        bar.close()


__all__ = ["OnnxModelError", "convert_onnx", "convert_resolved", "max_ir_version"]
