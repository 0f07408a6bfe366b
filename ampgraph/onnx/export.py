"""``export_onnx``: torch.onnx export of the FP32 model, then the ONNX mixed-precision pass.

Example:
    >>> import ampgraph
    >>> ampgraph.export_onnx(model, (x,), "model_fp16.onnx", amp_level="O2")
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from onnx import ModelProto

from ampgraph.onnx.convert import convert_onnx
from passes.onnx import io as pio


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
