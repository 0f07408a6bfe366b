"""The loss-scale manager's interface: a scale held as a 0-dim fp32 tensor on the device.

A manager owns a 0-dim fp32 ``scale`` tensor on the model's device, so the train step can
scale, unscale and update without a host synchronisation. ``get_loss_scale()`` returns a
Python float and therefore synchronises; call it when you need the number, not inside the
hot loop. :func:`overflow_flag` and :func:`unscale_by_device` are the pieces every manager and
the train step share.
"""

from __future__ import annotations

from typing import Any

import torch


def overflow_flag(overflow: bool | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``overflow`` as a 0-dim fp32 0/1 tensor on ``like``'s device, without a host sync.

    Example:
        >>> overflow_flag(True, torch.zeros(())).item()
        1.0
    """
    if isinstance(overflow, torch.Tensor):
        if overflow.numel() != 1:
            raise ValueError(
                f"overflow must be a bool or a one-element tensor, got shape "
                f"{tuple(overflow.shape)}"
            )
        flag = overflow.detach().reshape(())
        if flag.dtype != torch.float32:
            flag = flag.ne(0).float()
        return flag.to(like.device, non_blocking=True)
    if isinstance(overflow, (bool, int)) or type(overflow).__name__ == "bool_":
        return torch.full((), float(bool(overflow)), dtype=torch.float32, device=like.device)
    raise ValueError(
        f"overflow must be a bool or a one-element tensor, got {type(overflow).__name__}"
    )


class LossScaleManager:
    """Base class: a loss scale held as a 0-dim fp32 tensor on the model's device.

    Subclasses implement :meth:`update_loss_scale`, :meth:`state_dict` and
    :meth:`load_state_dict`. The train step reads :attr:`scale` (a tensor, no sync) and
    calls ``update_loss_scale(found_inf_tensor)`` once per optimizer step.
    """

    #: True when the scale changes with the overflow pattern.
    dynamic: bool = False

    def __init__(self, loss_scale: float) -> None:
        self._scale = torch.full((), loss_scale, dtype=torch.float32)

    @property
    def scale(self) -> torch.Tensor:
        """The current scale, a 0-dim fp32 tensor on the manager's device (no sync)."""
        return self._scale

    def get_loss_scale(self) -> float:
        """The current loss scale as a Python float (synchronises with the device).

        Example:
            >>> FixedLossScaleManager(64).get_loss_scale()
            64.0
        """
        return float(self._scale.item())

    def get_drop_overflow_update(self) -> bool:
        """Whether the optimizer step is skipped when gradients overflow (MindSpore name).

        Example:
            >>> DynamicLossScaleManager().get_drop_overflow_update()
            True
        """
        return True

    def update_loss_scale(self, overflow: bool | torch.Tensor) -> None:
        """Record one optimizer step's overflow flag (a bool or a 0/1 tensor)."""
        raise NotImplementedError

    # -- optional hooks: the defaults are what the fixed and dynamic managers need --------

    #: True when :meth:`observe_gradients` wants the unscaled gradients of clean steps.
    wants_gradients: bool = False
    #: True when gradients carry per-parameter scales (:meth:`unscale_` must be called).
    custom_unscale: bool = False

    def instrument(self, module: torch.nn.Module) -> None:
        """Called once by ``build_train_step`` with the compiled module (default: nothing).

        Example:
            >>> FixedLossScaleManager().instrument(torch.nn.Linear(1, 1))
        """

    def unscale_(self, params: list[torch.Tensor], found_inf: torch.Tensor) -> None:
        """Divide every ``p.grad`` by its scale in place; set ``found_inf`` on inf/NaN.

        The default divides all by :attr:`scale` with the fused kernel (one call per device).
        A trainer integration calls this after backward instead of unscaling itself.

        Example:
            >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.full((2,), 8.0)
            >>> flag = torch.zeros(())
            >>> FixedLossScaleManager(8).unscale_([p], flag); p.grad.tolist()
            [1.0, 1.0]
        """
        unscale_by_device(params, found_inf, self._scale.double().reciprocal().float())

    def observe_gradients(self, params: list[torch.Tensor], found_inf: torch.Tensor) -> None:
        """See the unscaled gradients before the optimizer step (default: nothing).

        The train step calls it only when :attr:`wants_gradients`, after :meth:`unscale_` and
        the overflow all-reduce, and (when it synchronises anyway) only on clean steps.

        Example:
            >>> FixedLossScaleManager().observe_gradients([], torch.zeros(()))
        """

    def to(self, device: torch.device | str) -> LossScaleManager:
        """Move the state tensors to ``device`` (in place) and return self.

        Example:
            >>> DynamicLossScaleManager().to("cpu").scale.device.type
            'cpu'
        """
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

    def state_dict(self) -> dict[str, Any]:
        """The manager's state as plain Python numbers (synchronises)."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` in place (tensors keep their device)."""
        raise NotImplementedError

    def _check_keys(self, state_dict: dict[str, Any], keys: tuple[str, ...]) -> None:
        owner = type(self).__name__
        if not isinstance(state_dict, dict):
            raise ValueError(f"{owner}.load_state_dict expects a dict, got {type(state_dict)}")
        missing = [k for k in keys if k not in state_dict]
        if missing:
            raise ValueError(
                f"{owner}.load_state_dict: missing keys {missing}; expected {list(keys)} "
                f"(was the state saved by a different manager type?)"
            )


def unscale_by_device(
    params: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """Unscale every gradient in place by ``inv_scale``, one fused kernel per device, and
    OR each device's non-finite flag into ``found_inf``.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.full((2,), 4.0)
        >>> flag = torch.zeros(()); unscale_by_device([p], flag, torch.tensor(0.25))
        >>> p.grad.tolist(), flag.item()
        ([1.0, 1.0], 0.0)
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_device.setdefault(p.grad.device, []).append(p.grad)
    for device, grads in by_device.items():
        flag = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(device))
        found_inf.logical_or_(flag.to(found_inf.device))
