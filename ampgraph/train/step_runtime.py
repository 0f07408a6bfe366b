"""What the generated train step returns and calls at run time: ``StepOutput``, the step's
counters, and the helpers its source names (``runtime_helpers``)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from ampgraph.capture.loss_only import loss_only
from ampgraph.train.loss_scale import unscale_by_device

__all__ = ["Counters", "StepOutput", "cast_fp32", "fp32_loss", "full_tensor", "local_grads",
           "model_loss", "runtime_helpers", "to_host", "zero_grads"]


class StepOutput:
    """What one call of a :class:`TrainStep` returns.

    Attributes:
        loss: the micro-batch loss, fp32, unscaled, detached (a 0-dim tensor; no sync).
        stepped: True on the call that ran the optimizer step (every call unless
            ``accumulation_steps > 1``, then every N-th).
        grad_norm: total norm of the unscaled gradients before clipping (a tensor), or None
            when clipping is off or the call did not step.
        overflow: gradients or loss were not finite, so the optimizer step was skipped (on a
            non-stepping call: a non-finite loss so far in the cycle).
        loss_scale: the scale this step used (1.0 without a manager).

    It unpacks as ``loss, overflow, loss_scale`` (MindSpore's TrainOneStepWithLossScaleCell).

    Example:
        >>> out = StepOutput(torch.tensor(0.5), torch.tensor([0.0, 1024.0]), True)
        >>> loss, overflow, loss_scale = out
        >>> overflow, loss_scale
        (False, 1024.0)

    ``overflow`` and ``loss_scale`` come from the step's single host synchronisation; when
    the step ran without one (fused optimizers, ``drop_overflow_update=False``) they are
    fetched, in one synchronisation, the first time either is read.
    """

    __slots__ = ("loss", "stepped", "grad_norm", "_info", "_host")

    def __init__(
        self,
        loss: torch.Tensor,
        info: torch.Tensor,
        stepped: bool,
        grad_norm: torch.Tensor | None = None,
        host: list[float] | None = None,
    ) -> None:
        self.loss, self.stepped, self.grad_norm = loss, stepped, grad_norm
        self._info, self._host = info, host

    def _fetch(self) -> list[float]:
        if self._host is None:
            self._host = self._info.tolist()
        return self._host

    @property
    def overflow(self) -> bool:
        return bool(self._fetch()[0])

    @property
    def loss_scale(self) -> float:
        return float(self._fetch()[1])

    def __iter__(self) -> Iterator[Any]:
        """``loss, overflow, loss_scale = out``, like MindSpore's TrainOneStepWithLossScaleCell."""
        return iter((self.loss, self.overflow, self.loss_scale))

    def __repr__(self) -> str:
        return (f"StepOutput(loss={self.loss.item():.6g}, overflow={self.overflow}, "
                f"loss_scale={self.loss_scale}, stepped={self.stepped})")


class Counters:
    """The step's mutable counters: micro-batch within the cycle, optimizer steps so far."""

    __slots__ = ("micro", "step_index")

    def __init__(self) -> None:
        self.micro = 0
        self.step_index = 0


# -- runtime helpers the generated code calls ---------------------------------------------


def fp32_loss(value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"the loss must be a one-element tensor, got {shape}: reduce it in loss_fn "
            f"(e.g. reduction='mean') or in the model"
        )
    if value.dtype != torch.float32:
        value = value.float()
    return value.reshape(()) if value.dim() else value


def model_loss(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None:
        raise ValueError(
            f"with loss_fn=None the model must return its loss: a scalar tensor or an object "
            f"with .loss (HuggingFace models: pass labels=...), got {type(output).__name__}"
        )
    return loss


def cast_fp32(output: Any) -> Any:
    def cast(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float32:
            return t.float()
        return t

    return tree_map(cast, output)


def to_host(info: torch.Tensor) -> list[float]:
    """The step's one host synchronisation: [found_inf, scale] as Python floats."""
    return info.tolist()


def zero_grads(params: list[nn.Parameter]) -> None:
    """Zero the gradients that exist, in place (a graphed step keeps their addresses)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        torch._foreach_zero_(grads)


def local_grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """The gradients as plain tensors; a DTensor gradient gives its local shard (a view:
    unscaling it in place unscales the DTensor)."""
    return [g.to_local() if hasattr(g, "to_local") else g
            for g in (p.grad for p in params) if g is not None]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (e.g. the norm ``clip_grad_norm_`` returns over sharded gradients) as the
    full plain tensor; a plain tensor unchanged."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def runtime_helpers() -> dict[str, Any]:
    """The helper names the generated source uses (looked up now, so tests can patch them).

    Example:
        >>> sorted(runtime_helpers())[:3]
        ['cast_fp32', 'clip_grad_norm_', 'dist']
    """
    return {
        "torch": torch, "dist": dist, "fp32_loss": fp32_loss, "model_loss": model_loss,
        "cast_fp32": cast_fp32, "to_host": to_host, "unscale_by_device": unscale_by_device,
        "clip_grad_norm_": torch.nn.utils.clip_grad_norm_, "nullcontext": nullcontext,
        "local_grads": local_grads, "full_tensor": full_tensor, "zero_grads": zero_grads,
        "loss_only": loss_only,
    }
