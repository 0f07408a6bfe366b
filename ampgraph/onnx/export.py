"""``export_onnx``: torch.onnx export of the FP32 model, then the ONNX mixed-precision pass.

Example:
    >>> import ampgraph
    >>> ampgraph.export_onnx(model, (x,), "model_fp16.onnx", amp_level="O2")
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import onnx
from onnx import ModelProto

from ampgraph.config import AmpConfig
from ampgraph.onnx.convert import convert_resolved
from passes.onnx import io as pio


def export_onnx(
    model: Any,
    args: Any,
    path: str | os.PathLike,
    amp_level: str = "O2",
    dtype: str = "fp16",
    *,
    kwargs: Mapping[str, Any] | None = None,
    keep_io_types: bool = True,
    dynamic_batch: bool = True,
    dynamic_sequence: bool = True,
    opset: int | None = None,
    **convert_kwargs: Any,
) -> ModelProto:
    """Export an FP32 ``torch.nn.Module`` with torch.onnx and convert it to mixed precision.

    The dynamo exporter runs first. When it fails, the TorchScript exporter
    (``dynamo=False``) is tried and a :class:`UserWarning` says so and why; when both fail,
    the error names both causes.

    Args:
        model: the module (exported in eval mode; its mode is restored afterwards).
        args: positional example inputs (a tensor or a tuple; ``()`` when all are keywords).
        path: output .onnx file.
        amp_level, dtype, keep_io_types: as in :func:`convert_onnx` (a bad level or dtype
            is refused before the export).
        kwargs: keyword example inputs, e.g. ``{"input_ids": ids, "attention_mask": mask}``
            (HuggingFace models); the ONNX inputs take their names.
        dynamic_batch: keep dimension 0 of every tensor input dynamic.
        dynamic_sequence: keep dimension 1 of 2-D integer and bool inputs (token ids,
            attention masks) dynamic too.
        opset: ONNX opset (None: the exporter's default).
        **convert_kwargs: passed to :func:`convert_onnx` (op_block_list, ...).

    Returns:
        The converted model, also written to ``path``.

    Example:
        >>> export_onnx(model, (torch.randn(2, 3, 32, 32),), "resnet_fp16.onnx")
        >>> export_onnx(bert, (), "bert_fp16.onnx", kwargs={"input_ids": ids,
        ...                                                  "attention_mask": mask})
    """
    config = AmpConfig(amp_level=amp_level, dtype=dtype).resolve(device=None)  # before export
    args = args if isinstance(args, tuple) else (args,)
    kwargs = dict(kwargs or {})
    axes = {name: _dynamic_axes(value, dynamic_batch, dynamic_sequence)
            for name, value in _named_inputs(model, args, kwargs)}
    training = model.training
    model.eval()
    try:
        proto, fp32_path, tmp = _export(model, args, kwargs, axes, opset)
    finally:
        model.train(training)
    try:
        if fp32_path is not None:
            return convert_resolved(fp32_path, config, keep_io_types=keep_io_types,
                                    output_path=path, **convert_kwargs)
        if dynamic_batch and any(d.dim_value for i in proto.graph.input
                                 for d in i.type.tensor_type.shape.dim[:1]):
            warnings.warn("torch.export specialised the batch dimension (an example batch "
                          "of 1, or a shape computed from it); use an example batch >= 2",
                          stacklevel=2)
        return convert_resolved(proto, config, keep_io_types=keep_io_types,
                                output_path=path, **convert_kwargs)
    finally:
        if tmp is not None:
            tmp.cleanup()


def _named_inputs(model: Any, args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """(name, value) of every example input: ``input_<i>`` for positional ones (or the
    forward parameter's name when it has one), the keyword's name otherwise."""
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    names = [params[i] if i < len(params) else f"input_{i}" for i in range(len(args))]
    return [*zip(names, args), *kwargs.items()]


def _dynamic_axes(value: Any, batch: bool, sequence: bool) -> dict[int, str]:
    import torch

    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return {}
    axes = {0: "batch"} if batch else {}
    if sequence and value.dim() == 2 and not value.dtype.is_floating_point:
        axes[1] = "sequence"
    return axes


def _export(model: Any, args: tuple, kwargs: dict, axes: dict[str, dict[int, str]],
            opset: int | None) -> tuple[ModelProto | None, Path | None, Any]:
    """(proto, None, None), or (None, path, tempdir) for models kept with external data."""
    import torch

    shapes = torch.export.ShapesCollection()
    for name, value in _named_inputs(model, args, kwargs):
        if axes.get(name):
            shapes[value] = {d: torch.export.Dim.AUTO for d in axes[name]}
    external = (sum(p.numel() * p.element_size() for p in model.parameters())
                > pio.EXTERNAL_DATA_BYTES)
    try:
        with _quiet():
            program = torch.onnx.export(
                model, args, kwargs=kwargs or None, dynamo=True, opset_version=opset,
                dynamic_shapes=shapes.dynamic_shapes(model, args, kwargs) if shapes else None,
                verbose=False)
        if not external:
            return program.model_proto, None, None
        tmp = tempfile.TemporaryDirectory()
        fp32 = Path(tmp.name) / "fp32.onnx"
        program.save(str(fp32), external_data=True)
        return None, fp32, tmp
    except Exception as dynamo_error:
        first = _one_line(dynamo_error)
    warnings.warn(f"torch.onnx's dynamo exporter failed ({first}); exported with the "
                  "TorchScript exporter (dynamo=False) instead", UserWarning, stacklevel=3)
    tmp = tempfile.TemporaryDirectory()
    fp32 = Path(tmp.name) / "fp32.onnx"
    names = [name for name, value in _named_inputs(model, args, kwargs)
             if isinstance(value, torch.Tensor)]
    try:
        with _quiet():
            torch.onnx.export(model, args, str(fp32), kwargs=kwargs or None, dynamo=False,
                              opset_version=opset or 17, input_names=names,
                              dynamic_axes={n: a for n, a in axes.items() if a and n in names})
    except Exception as script_error:
        tmp.cleanup()
        raise RuntimeError(f"torch.onnx could not export the model: the dynamo exporter "
                           f"failed ({first}) and so did the TorchScript exporter "
                           f"({_one_line(script_error)})") from script_error
    if external:
        return None, fp32, tmp
    proto = onnx.load(str(fp32))
    tmp.cleanup()
    return proto, None, None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


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


__all__ = ["export_onnx"]
