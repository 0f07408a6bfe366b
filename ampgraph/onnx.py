"""ONNX: export, convert to mixed precision, run on the best provider, validate.

The conversion itself is ``passes.onnx.convert_model``; this module loads and saves
models (external data included), checks inputs with clear errors, picks onnxruntime
providers, compares outputs and runs the automatic (tolerance-driven) mode.

Example:
    >>> import ampgraph
    >>> ampgraph.export_onnx(model, (x,), "model_fp16.onnx", amp_level="O2")
    >>> sess = ampgraph.onnx_session("model_fp16.onnx")      # CUDA EP when usable
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto, TensorProto

from passes.onnx import ConstantRangeWarning, convert_model, low_regions
from passes.onnx import io as pio
from passes.onnx.io import ModelLike, OnnxModelError, max_ir_version
from passes.onnx.regions import bisect_regions
from passes.policy import LEVELS

_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
       "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


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
        dtype: "fp16" or "bf16".
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
    if isinstance(amp_level, str):
        amp_level = amp_level.upper()  # "o2" like ampgraph.compile and the CLI
    if amp_level not in LEVELS:
        raise ValueError(f"unknown amp_level {amp_level!r}: choose one of {', '.join(LEVELS)}")
    if dtype not in ("fp16", "bf16", "float16", "bfloat16"):
        raise ValueError(f"unknown dtype {dtype!r} for ONNX: choose 'fp16' or 'bf16'")
    proto, external = pio.load_model(model)
    stamp = {p.key: p.value for p in proto.metadata_props}
    if stamp.get("ampgraph.amp_level", "O0") != "O0":  # converting twice: no-op, or refused
        if (stamp["ampgraph.amp_level"], stamp.get("ampgraph.dtype")) != (amp_level, dtype):
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
                      "unchanged", UserWarning, stacklevel=2)
    out = result.model
    out.ir_version = min(out.ir_version, max_ir_version())
    pio.stamp(out, {"ampgraph.amp_level": amp_level, "ampgraph.dtype": dtype})
    if output_path is not None:
        large = external or pio.data_bytes(out) > pio.EXTERNAL_DATA_BYTES
        out = pio.save_model(out, Path(output_path), large)
    return out


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


def export_onnx(
    model: Any,
    args: Any,
    path: str | os.PathLike,
    amp_level: str = "O2",
    dtype: str = "fp16",
    *,
    keep_io_types: bool = True,
    dynamic_batch: bool = True,
    opset: int | None = None,
    **convert_kwargs: Any,
) -> ModelProto:
    """Export an FP32 ``torch.nn.Module`` with torch.onnx (dynamo) and convert it.

    Args:
        model: the module (exported in eval mode; its mode is restored afterwards).
        args: positional example inputs (a tensor or a tuple).
        path: output .onnx file.
        amp_level, dtype, keep_io_types: as in :func:`convert_onnx`.
        dynamic_batch: keep dimension 0 of every tensor input dynamic.
        opset: ONNX opset (None: the exporter's default).
        **convert_kwargs: passed to :func:`convert_onnx` (op_block_list, ...).

    Returns:
        The converted model, also written to ``path``.

    Example:
        >>> export_onnx(model, (torch.randn(2, 3, 32, 32),), "resnet_fp16.onnx")
    """
    import torch

    args = args if isinstance(args, tuple) else (args,)
    dims = None
    if dynamic_batch:
        dims = tuple({0: torch.export.Dim.AUTO} if isinstance(a, torch.Tensor) and a.dim()
                     else None for a in args)
    training = model.training
    model.eval()
    try:
        with _quiet():
            program = torch.onnx.export(model, args, dynamo=True, dynamic_shapes=dims,
                                        opset_version=opset, verbose=False)
    finally:
        model.train(training)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if size > pio.EXTERNAL_DATA_BYTES:
        with tempfile.TemporaryDirectory() as tmp:
            fp32 = Path(tmp) / "fp32.onnx"
            program.save(str(fp32), external_data=True)
            return convert_onnx(fp32, amp_level, dtype, keep_io_types=keep_io_types,
                                output_path=path, **convert_kwargs)
    proto = program.model_proto
    if dynamic_batch and any(d.dim_value for i in proto.graph.input
                             for d in i.type.tensor_type.shape.dim[:1]):
        warnings.warn("torch.export specialised the batch dimension (an example batch of 1, "
                      "or a shape computed from it); use an example batch >= 2", stacklevel=2)
    return convert_onnx(proto, amp_level, dtype, keep_io_types=keep_io_types,
                        output_path=path, **convert_kwargs)


def onnx_session(model_or_path: ModelLike, device: str = "auto", **session_kwargs: Any):
    """An onnxruntime InferenceSession on CUDA (Tensor Cores) when usable, else CPU.

    Args:
        model_or_path: ModelProto, bytes or path (a path for models with external data).
        device: "auto", "cpu", "cuda" or "cuda:N".
        **session_kwargs: passed to ``onnxruntime.InferenceSession``; ``cuda_options`` (a
            dict) adds CUDA provider options, e.g. ``{"enable_cuda_graph": "1"}``.

    Raises:
        RuntimeError: ``device="cuda"`` but CUDA or the CUDA execution provider is unusable.

    Example:
        >>> sess = onnx_session("model_fp16.onnx")
        >>> sess.get_providers()[0]
        'CUDAExecutionProvider'
    """
    import onnxruntime as ort

    options = session_kwargs.pop("sess_options", None) or ort.SessionOptions()
    options.log_severity_level = 3  # no provider-load noise on machines without CUDA
    kind, _, index = device.partition(":")
    if kind not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    use_cuda = kind != "cpu" and cuda_usable()
    if kind == "cuda" and not use_cuda:
        raise RuntimeError("device='cuda' but CUDA is not usable here (torch.cuda.is_available() "
                           "or onnxruntime's CUDAExecutionProvider is missing); use device='cpu'")
    cuda_options = {"device_id": int(index or 0), **session_kwargs.pop("cuda_options", {})}
    providers: list = ["CPUExecutionProvider"]
    if use_cuda:
        providers.insert(0, ("CUDAExecutionProvider", cuda_options))
    if isinstance(model_or_path, ModelProto):
        if pio.has_external(model_or_path):
            raise ValueError("this model keeps its weights in external data: pass its path")
        proto, source = model_or_path, model_or_path.SerializeToString()
    elif isinstance(model_or_path, bytes):
        proto, source = onnx.load_model_from_string(model_or_path), model_or_path
    else:
        proto = onnx.load(str(model_or_path), load_external_data=False)
        source = str(model_or_path)
    if not use_cuda and pio.has_dtype(proto, TensorProto.FLOAT16):
        # onnxruntime 1.31's CPU provider runs fp16 graphs through inserted Casts; with them
        # its MatmulTransposeFusion crashes the process on some graphs (LSTM -> Transpose ->
        # MatMul). The fusion is minor: leave it out for fp16 models on CPU.
        session_kwargs.setdefault("disabled_optimizers", ["MatmulTransposeFusion"])
    return ort.InferenceSession(source, options, providers=providers, **session_kwargs)


def cuda_usable() -> bool:
    """Whether a CUDA GPU and onnxruntime's CUDA execution provider are both available.

    Example:
        >>> device = "cuda" if cuda_usable() else "cpu"
    """
    import onnxruntime as ort
    import torch

    return torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()


@dataclass(frozen=True)
class OutputError:
    """Errors of one output: max abs, max abs / max |reference|, cosine (``report.outputs``)."""

    name: str
    max_abs: float
    max_rel: float
    cosine: float
    passed: bool


@dataclass(frozen=True)
class ValidationReport:
    """Per-output comparison of a candidate model against a reference.

    An output passes when ``max_abs <= atol + rtol * max|reference|`` and is finite.

    Example:
        >>> print(validate_onnx("fp32.onnx", "fp16.onnx", {"x": x}))
        output                       max_abs     max_rel    cosine  ok
        logits                        0.0021     0.00043  0.999999  yes
    """

    outputs: tuple[OutputError, ...]
    rtol: float
    atol: float

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    @property
    def max_rel(self) -> float:
        return max((o.max_rel for o in self.outputs), default=0.0)

    def __str__(self) -> str:
        rows = [f"{'output':<24}{'max_abs':>12}{'max_rel':>12}{'cosine':>10}  ok"]
        rows += [f"{o.name:<24}{o.max_abs:>12.3g}{o.max_rel:>12.3g}{o.cosine:>10.6f}  "
                 f"{'yes' if o.passed else 'NO'}" for o in self.outputs]
        return "\n".join(rows)


def validate_onnx(
    reference: Any, candidate: Any, inputs: Any, *, rtol: float = 1e-2, atol: float = 1e-3,
    device: str = "auto",
) -> ValidationReport:
    """Run two models on the same inputs and compare every output.

    Args:
        reference, candidate: ModelProto, path or InferenceSession.
        inputs: dict name->array, a sequence in input order, or one array (numpy or torch);
            each is cast to the dtype the session declares (fp16 inputs included).
        rtol, atol: tolerance of the pass/fail verdict (fp16-sized defaults).
        device: provider for models not given as sessions.

    Example:
        >>> report = validate_onnx("fp32.onnx", "fp16.onnx", {"x": x})
        >>> report.passed, report.max_rel
        (True, 0.0012)
    """
    ref, cand = (_session(m, device) for m in (reference, candidate))
    expected = ref.run(None, _feeds(ref, inputs))
    got = cand.run(None, _feeds(cand, inputs))
    names = [o.name for o in ref.get_outputs()]
    return ValidationReport(tuple(_compare(n, r, c, rtol, atol)
                                  for n, r, c in zip(names, expected, got)), rtol, atol)


def _compare(name: str, ref: np.ndarray, got: np.ndarray, rtol: float, atol: float):
    r, c = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    if r.shape != c.shape:
        return OutputError(name, float("inf"), float("inf"), 0.0, False)
    both = np.isfinite(r) & np.isfinite(c)
    same = ~np.isfinite(r) & ((c == r) | (np.isnan(c) & np.isnan(r)))  # inf/nan where ref has
    diff = np.abs(c - r)[both]
    max_abs = float("inf") if not (both | same).all() else float(diff.max(initial=0.0))
    scale = float(np.abs(r[np.isfinite(r)]).max(initial=0.0))
    denom = float(np.linalg.norm(r[both]) * np.linalg.norm(c[both]))
    cosine = float(r[both] @ c[both] / denom) if denom > 0 else float(max_abs == 0)
    max_rel = max_abs / scale if scale > 0 else max_abs
    return OutputError(name, max_abs, max_rel, cosine, bool(max_abs <= atol + rtol * scale))


def _session(model: Any, device: str):
    return model if hasattr(model, "run") and hasattr(model, "get_inputs") else onnx_session(
        model, device)


def _feeds(session: Any, inputs: Any) -> dict[str, np.ndarray]:
    specs = session.get_inputs()
    if isinstance(inputs, Mapping):
        pairs = [(s, inputs[s.name]) for s in specs if s.name in inputs]
    else:
        seq = inputs if isinstance(inputs, list | tuple) else [inputs]
        pairs = list(zip(specs, seq))
    feeds = {}
    for spec, value in pairs:
        if hasattr(value, "detach"):
            value = value.detach().cpu().numpy()
        arr, target = np.asarray(value), _NP.get(spec.type)
        feeds[spec.name] = arr.astype(target, copy=False) if target is not None else arr
    return feeds


def _auto(model, first, level, dtype, kw, tolerance, inputs, device):
    """Keep in FP32 the fewest painted regions (found by bisection) that meet ``tolerance``."""
    from tqdm.auto import tqdm

    ref = onnx_session(model, device)
    expected = ref.run(None, _feeds(ref, inputs))
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
            got = sess.run(None, _feeds(sess, inputs))
            err = max((_compare("", r, c, 0, 0).max_rel for r, c in zip(expected, got)),
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


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence torch.onnx's progress prints, warnings and log lines."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


__all__ = [
    "OnnxModelError",
    "OutputError",
    "ValidationReport",
    "convert_onnx",
    "cuda_usable",
    "export_onnx",
    "max_ir_version",
    "onnx_session",
    "validate_onnx",
]
