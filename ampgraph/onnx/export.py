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
import torch
from onnx import ModelProto
from torch.utils import _pytree as pytree

from ampgraph.capture.hf_caches import register_hf_caches
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
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    exporter: str = "auto",
    check: bool = True,
    opset: int | None = None,
    **convert_kwargs: Any,
) -> ModelProto:
    """Export an FP32 ``torch.nn.Module`` with torch.onnx and convert it to mixed precision.

    The dynamo exporter runs first. When it fails, the TorchScript exporter
    (``dynamo=False``) is tried and a :class:`UserWarning` says so and why; when both fail,
    the error names both causes. Outputs holding HuggingFace cache objects are exported as
    their tensors (dynamo: through their pytree registration; TorchScript: as flattened
    outputs named by their path, e.g. ``past_key_values.0.1``). The converted model is then
    run once on the example inputs with onnxruntime, so a model that does not run fails
    here, not in the user's session.

    Args:
        model: the module (exported in eval mode; its mode is restored afterwards).
        args: positional example inputs (a tensor or a tuple; ``()`` when all are keywords).
        path: output .onnx file.
        amp_level, dtype, keep_io_types: as in :func:`convert_onnx` (a bad level or dtype
            is refused before the export).
        kwargs: keyword example inputs, e.g. ``{"input_ids": ids, "attention_mask": mask}``
            (HuggingFace models); the ONNX inputs take their names.
        dynamic_batch: keep dimension 0 of every tensor input dynamic (named ``batch``).
        dynamic_sequence: keep dimension 1 of 2-D integer and bool inputs (token ids,
            attention masks) dynamic too, named per input (``<input>_sequence``), so that
            inputs of different lengths (a seq2seq model's source and target) stay apart.
        dynamic_axes: per-input axis names, ``{input: {dim: name}}``, replacing the
            defaults above for the inputs it names (``{}`` for an input: all static).
        exporter: ``"auto"`` (dynamo, then TorchScript), ``"dynamo"`` or ``"torchscript"``.
        check: run the converted model on the example inputs (onnxruntime; a kernel the
            provider lacks, such as bf16 on the CPU, skips the check).
        opset: ONNX opset. None: 22 for bf16 (the first whose convolutions and pooling
            take bf16), the exporter's default otherwise (the TorchScript exporter writes
            at most 20). At an opset without a bf16 version of an op the level runs low,
            the op runs fp32 between casts and a :class:`UserWarning` names it.
        **convert_kwargs: passed to :func:`convert_onnx` (op_block_list, ...).

    Returns:
        The converted model, also written to ``path``.

    Example:
        >>> export_onnx(model, (torch.randn(2, 3, 32, 32),), "resnet_fp16.onnx")
        >>> export_onnx(bert, (), "bert_fp16.onnx", kwargs={"input_ids": ids,
        ...                                                  "attention_mask": mask})
    """
    config = AmpConfig(amp_level=amp_level, dtype=dtype).resolve(device=None)  # before export
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {EXPORTERS}, not {exporter!r}")
    args = args if isinstance(args, tuple) else (args,)
    kwargs = dict(kwargs or {})
    named = _named_inputs(model, args, kwargs)
    unknown = set(dynamic_axes or {}) - {name for name, _ in named}
    if unknown:
        raise ValueError(f"dynamic_axes names inputs the model does not take: "
                         f"{sorted(unknown)} (inputs: {[name for name, _ in named]})")
    axes = {name: _dynamic_axes(name, value, dynamic_batch, dynamic_sequence)
            for name, value in named}
    axes.update({name: dict(a) for name, a in (dynamic_axes or {}).items()})
    if opset is None and config.level != "O0" and config.dtype == torch.bfloat16:
        opset = BF16_OPSET
    training = model.training
    model.eval()
    try:
        proto, fp32_path, tmp = _export(model, args, kwargs, axes, opset, exporter)
    finally:
        model.train(training)
    try:
        if fp32_path is None and dynamic_batch and any(
                d.dim_value for i in proto.graph.input
                for d in i.type.tensor_type.shape.dim[:1]):
            warnings.warn("torch.export specialised the batch dimension (an example batch "
                          "of 1, or a shape computed from it); use an example batch >= 2",
                          stacklevel=2)
        converted = convert_resolved(proto if fp32_path is None else fp32_path, config,
                                     keep_io_types=keep_io_types, output_path=path,
                                     **convert_kwargs)
    finally:
        if tmp is not None:
            tmp.cleanup()
    if check:
        _check_run(path, named)
    return converted


EXPORTERS = ("auto", "dynamo", "torchscript")
# bf16's default opset: the first whose Conv, ConvTranspose, pooling and LSTM/GRU schemas
# take bfloat16 (ConstantOfShape's from 20); at a lower one they run fp32 between casts
BF16_OPSET = 22
TORCHSCRIPT_MAX_OPSET = 20  # torch.onnx's TorchScript exporter writes no later opset


def _check_run(path: str | os.PathLike, named: list[tuple[str, Any]]) -> None:
    """Run the exported model once on the example inputs (onnxruntime: CUDA when usable,
    else the CPU). A kernel the provider does not implement (the CPU provider has no bf16
    Gemm) is not the model's fault: that check is left to the user's device."""
    from ampgraph.onnx.session import feeds_for, session_for

    inputs = {name: value.detach().cpu().numpy() for name, value in named
              if isinstance(value, torch.Tensor)}
    try:
        session = session_for(str(path), "auto")
        session.run(None, feeds_for(session, inputs))
    except Exception as exc:
        if "NOT_IMPLEMENTED" in str(exc):
            return
        raise RuntimeError(f"the exported model {os.fspath(path)!r} does not run on its "
                           f"example inputs in onnxruntime: {_one_line(exc)} (pass "
                           f"check=False to keep it anyway)") from exc


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


def _dynamic_axes(name: str, value: Any, batch: bool, sequence: bool) -> dict[int, str]:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return {}
    axes = {0: "batch"} if batch else {}
    if sequence and value.dim() == 2 and not value.dtype.is_floating_point:
        axes[1] = f"{name}_sequence"
    return axes


class _TensorOutputs(torch.nn.Module):
    """``model(*args, **kwargs)`` called with the tensor inputs only, positionally, in the
    order of ``_named_inputs`` (the rest bound here), its outputs flattened to tensors (HF
    caches through their pytree registration): what the TorchScript exporter takes, which
    takes no cache objects. ``names``: each output's path in the model's output
    (``logits``, ``past_key_values.0.1``), known after the first call."""

    def __init__(self, model: Any, args: tuple, kwargs: dict):
        super().__init__()
        self.model, self.names = model, None
        self.args, self.kwargs = list(args), dict(kwargs)
        self.slots = [("arg", i) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.slots += [("kw", k) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]

    def inputs(self) -> tuple:
        return tuple(self.args[i] if kind == "arg" else self.kwargs[i]
                     for kind, i in self.slots)

    def forward(self, *tensors: torch.Tensor) -> tuple:
        args, kwargs = list(self.args), dict(self.kwargs)
        for (kind, i), t in zip(self.slots, tensors):
            if kind == "arg":
                args[i] = t
            else:
                kwargs[i] = t
        leaves, _ = pytree.tree_flatten_with_path(self.model(*args, **kwargs))
        if self.names is None:
            self.names = [".".join(_key_name(k) for k in path) or "output"
                          for path, _ in leaves]
        return tuple(leaf for _, leaf in leaves)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _export(model: Any, args: tuple, kwargs: dict, axes: dict[str, dict[int, str]],
            opset: int | None, exporter: str = "auto"
            ) -> tuple[ModelProto | None, Path | None, Any]:
    """(proto, None, None), or (None, path, tempdir) for models kept with external data."""
    register_hf_caches()  # cache outputs (past_key_values) export as their tensors
    external = (sum(p.numel() * p.element_size() for p in model.parameters())
                > pio.EXTERNAL_DATA_BYTES)
    first = None
    if exporter != "torchscript":
        try:
            return _export_dynamo(model, args, kwargs, axes, opset, external)
        except Exception as dynamo_error:
            if exporter == "dynamo":
                raise
            first = _one_line(dynamo_error)
        warnings.warn(f"torch.onnx's dynamo exporter failed ({first}); exported with the "
                      "TorchScript exporter (dynamo=False) instead", UserWarning, stacklevel=3)
    tmp = tempfile.TemporaryDirectory()
    fp32 = Path(tmp.name) / "fp32.onnx"
    names = [name for name, value in _named_inputs(model, args, kwargs)
             if isinstance(value, torch.Tensor)]
    flat = _TensorOutputs(model, args, kwargs)
    try:
        with torch.no_grad():
            flat(*flat.inputs())  # the output names
        with _quiet():
            torch.onnx.export(flat, flat.inputs(), str(fp32), dynamo=False,
                              opset_version=min(opset or 17, TORCHSCRIPT_MAX_OPSET),
                              input_names=names, output_names=flat.names,
                              dynamic_axes={n: a for n, a in axes.items() if a and n in names})
    except Exception as script_error:
        tmp.cleanup()
        if first is None:
            raise RuntimeError(f"torch.onnx's TorchScript exporter could not export the "
                               f"model: {_one_line(script_error)}") from script_error
        raise RuntimeError(f"torch.onnx could not export the model: the dynamo exporter "
                           f"failed ({first}) and so did the TorchScript exporter "
                           f"({_one_line(script_error)})") from script_error
    if external:
        return None, fp32, tmp
    proto = onnx.load(str(fp32))
    tmp.cleanup()
    return proto, None, None


def _export_dynamo(model: Any, args: tuple, kwargs: dict, axes: dict[str, dict[int, str]],
                   opset: int | None, external: bool
                   ) -> tuple[ModelProto | None, Path | None, Any]:
    shapes = torch.export.ShapesCollection()
    for name, value in _named_inputs(model, args, kwargs):
        if axes.get(name):
            shapes[value] = {d: torch.export.Dim.AUTO for d in axes[name]}
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
