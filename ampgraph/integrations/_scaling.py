"""fp16 loss scaling for trainers that run their own backward and optimizer step.

The algorithm of ``build_train_step`` (docs/training.md), cut at the points a trainer
exposes: :meth:`LossScaler.scale` before backward, :meth:`LossScaler.unscale_` after the
last backward of an optimizer step (before clipping), :meth:`LossScaler.update` after the
step or the skip. The Lightning plugin and the HF Trainer subclass both use it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ampgraph.train.loss_scale import LossScaleManager
from ampgraph.train.step_runtime import local_grads


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, gradient times ``scale`` backward: ``backward(loss)`` then equals
    ``backward(loss * scale)`` while the trainer still logs the unscaled loss."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad * scale.to(grad.dtype), None


class LossScaler:
    """One manager's scaling state across the micro-batches of an optimizer step.

    A non-finite loss counts as an overflow (as in ``build_train_step``): its gradients may
    be finite while the loss is not.
    """

    def __init__(self, manager: LossScaleManager) -> None:
        self.manager = manager
        self._found_inf: torch.Tensor | None = None

    def _flag(self, device: torch.device) -> torch.Tensor:
        if self.manager.scale.device != device:
            self.manager.to(device)
        if self._found_inf is None or self._found_inf.device != device:
            self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        return self._found_inf

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (recording a non-finite loss)."""
        flag = self._flag(loss.device)
        flag.logical_or_(loss.detach().isfinite().all().logical_not())
        return loss * self.manager.scale

    def scale_grad(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` unchanged, with its gradient multiplied by the scale in backward."""
        flag = self._flag(loss.device)
        flag.logical_or_(loss.detach().isfinite().all().logical_not())
        return _ScaleGrad.apply(loss, self.manager.scale)

    def unscale_(self, params: Iterable[torch.Tensor]) -> bool:
        """Unscale the gradients in place, all-reduce the overflow flag (MAX) across ranks
        when ``torch.distributed`` is initialised, and return it (one host sync)."""
        params = list(params)
        device = next((p.device for p in params if p.grad is not None), None)
        flag = self._flag(device if device is not None else self.manager.scale.device)
        inv = self.manager.scale.double().reciprocal().float()
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g in local_grads(params):
            by_device.setdefault(g.device, []).append(g)
        for dev, grads in by_device.items():
            local = flag if dev == flag.device else torch.zeros((), device=dev)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, local, inv.to(dev))
            if local is not flag:
                flag.logical_or_(local.to(flag.device))
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def update(self) -> None:
        """Update the scale with this step's flag and clear it for the next step."""
        if self._found_inf is None:
            return
        self.manager.update_loss_scale(self._found_inf)
        self._found_inf.zero_()

    def get_loss_scale(self) -> float:
        return self.manager.get_loss_scale()
