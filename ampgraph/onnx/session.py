"""onnxruntime sessions: the CUDA provider (Tensor Cores) when usable, else CPU; input feeds.

Example:
    >>> sess = onnx_session("model_fp16.onnx")      # CUDA EP when usable
    >>> sess.run(None, feeds_for(sess, {"x": x}))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto, TensorProto

from passes.onnx import io as pio
from passes.onnx.io import ModelLike

_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
       "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


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


def session_for(model: Any, device: str):
    """``model`` itself when it is a session already, else :func:`onnx_session` of it."""
    return model if hasattr(model, "run") and hasattr(model, "get_inputs") else onnx_session(
        model, device)


def feeds_for(session: Any, inputs: Any) -> dict[str, np.ndarray]:
    """``inputs`` (a dict, a sequence in input order, or one array; numpy or torch) as the
    session's feeds, each cast to the dtype the session declares."""
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


__all__ = ["cuda_usable", "feeds_for", "onnx_session", "session_for"]
