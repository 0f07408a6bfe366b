"""``NumericsMonitor`` plumbing: the log writer (JSON lines, TensorBoard) and small helpers.

:func:`fetch` is where the monitor synchronises with the device: one concatenation and one
``.cpu()`` per device per logged step. TensorBoard is imported only when a writer is made.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import torch

from ampgraph.monitor.history import NumericsWarning

__all__ = ["LOG_NAME", "ROOT_LAYER", "LogWriter", "clean", "entry", "fetch", "layer_name",
           "optimizer_info", "parse_dtype", "summary_writer"]

LOG_NAME = "numerics.jsonl"
ROOT_LAYER = "<root>"  # parameters that belong to the model itself, not a submodule
TB_FIELDS = ("underflow_rate", "overflow_count", "norm")  # per layer and kind
_DTYPES = {"fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


class LogWriter:
    """Writes records to ``log_dir/numerics.jsonl`` (a fresh file per run) and TensorBoard.

    With ``log_dir=None`` it writes nothing. Without the tensorboard package it warns once
    (:class:`NumericsWarning`) and writes the JSON lines only.
    """

    def __init__(self, log_dir: Path | None, tensorboard: bool, start: dict[str, Any]) -> None:
        self.log_dir, self.tensorboard = log_dir, tensorboard and log_dir is not None
        self._tb: Any = None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            with open(log_dir / LOG_NAME, "w") as f:
                f.write(json.dumps(start) + "\n")

    def write(self, record: dict[str, Any]) -> None:
        if self.log_dir is None:
            return
        with open(self.log_dir / LOG_NAME, "a") as f:
            f.write(json.dumps(clean(record)) + "\n")
        if self.tensorboard:
            self._scalars(record)

    def _scalars(self, record: dict[str, Any]) -> None:
        if self._tb is None:
            self._tb = summary_writer(self.log_dir)
            if self._tb is None:
                self.tensorboard = False
                return
        w, hist = self._tb, record["history"]
        for step, scale in zip(hist["step"], hist["loss_scale"]):
            w.add_scalar("numerics/loss_scale", scale, step)
        if record["kind"] != "step":
            return
        step = record["step"]
        w.add_scalar("numerics/skipped_steps", record["skipped_steps"], step)
        for layer, kinds in record["layers"].items():
            for kind, stats in kinds.items():
                for field in TB_FIELDS:
                    if stats.get(field) is not None:
                        w.add_scalar(f"numerics/{kind}/{field}/{layer}", stats[field], step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def summary_writer(log_dir: Path | None) -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter``, or None (with a warning) without it."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        warnings.warn(f"NumericsMonitor(tensorboard=True) but TensorBoard is not available "
                      f"({exc}); pip install tensorboard. Writing {LOG_NAME} only.",
                      NumericsWarning, stacklevel=5)
        return None
    return SummaryWriter(str(log_dir))


def parse_dtype(dtype: Any) -> torch.dtype | None:
    """None, fp16 or bf16 from a name or torch dtype; ValueError otherwise."""
    if dtype is None or dtype in (torch.float16, torch.bfloat16):
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"NumericsMonitor: dtype must be None, 'fp16' or 'bf16' (or the torch "
                     f"dtype), got {dtype!r}")


def layer_name(param_name: str) -> str:
    """The owning module's path: ``encoder.layer.0.attention.query.weight`` -> its module."""
    return param_name.rpartition(".")[0] or ROOT_LAYER


def entry(scale: Any, overflow: Any) -> Any:
    """One step's (overflow, scale): a 2-element device tensor (a copy, no sync) when either
    is a tensor, else a tuple of floats. An unknown overflow (None) is NaN."""
    flag: Any = math.nan if overflow is None else overflow
    if overflow is not None and not isinstance(overflow, torch.Tensor):
        flag = float(bool(overflow))
    value = 1.0 if scale is None else scale
    tensors = [t for t in (flag, value) if isinstance(t, torch.Tensor)]
    if not tensors:
        return flag, float(value)
    like = tensors[-1]

    def as_tensor(v: Any) -> torch.Tensor:
        if isinstance(v, torch.Tensor):
            return v.detach().reshape(()).to(like.device, torch.float32)
        return like.new_full((), float(v), dtype=torch.float32)

    return torch.stack((as_tensor(flag), as_tensor(value)))


def fetch(tensors: list[torch.Tensor]) -> list[list[float]]:
    """Each tensor's values as host floats: one concatenation and ``.cpu()`` per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[list[float]] = [[] for _ in tensors]
    for indices in by_device.values():
        flat = torch.cat([tensors[i].reshape(-1).float() for i in indices])
        host = flat.cpu().tolist()  # the logged step's host synchronisation
        offset = 0
        for i in indices:
            n = tensors[i].numel()
            out[i], offset = host[offset:offset + n], offset + n
    return out


def optimizer_info(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's type, its distinct ``eps`` values and state tensor dtypes."""
    eps = sorted({float(g["eps"]) for g in optimizer.param_groups if "eps" in g})
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for s in optimizer.state.values()
                     for v in s.values() if isinstance(v, torch.Tensor) and v.dim()})
    return {"type": type(optimizer).__name__, "eps": eps, "state_dtypes": dtypes}


def clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become null, floats keep 6 significant digits."""
    if isinstance(value, float):
        return float(f"{value:.6g}") if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean(v) for v in value]
    return value
