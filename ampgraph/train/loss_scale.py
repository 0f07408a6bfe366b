"""Loss-scale managers with MindSpore's names and defaults, kept on the device.

A manager owns a 0-dim fp32 ``scale`` tensor (and, when dynamic, an int32 growth tracker)
on the model's device, so the train step can scale, unscale and update without a host
synchronisation. ``get_loss_scale()`` returns a Python float and therefore synchronises;
call it when you need the number, not inside the hot loop.

Defaults compared (docs/training.md has the full table):

- ``DynamicLossScaleManager``: init 2**16 (GradScaler's; MindSpore's 2**24 on request),
  divide by 2 on overflow (never below 1.0), multiply by 2 after 2000 clean steps.
- ``torch.amp.GradScaler``: init 2**16, x0.5 on overflow (no floor), x2.0 after 2000 clean
  steps.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

__all__ = ["DynamicLossScaleManager", "FixedLossScaleManager", "LossScaleManager"]

_FP32_MAX = float(torch.finfo(torch.float32).max)
_INT32_MAX = 2**31 - 1


def _real(owner: str, name: str, value: Any, allowed: str) -> float:
    """``value`` as a finite float, or ValueError naming ``owner.name`` and what is allowed."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"{owner}: {name} must be {allowed}, got {value!r} ({type(value).__name__})"
        )
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{owner}: {name} must be {allowed}, got {value!r}")
    return number


def _scale_value(owner: str, name: str, value: Any) -> float:
    allowed = f"a finite number >= 1 and <= {_FP32_MAX:.3e} (the fp32 maximum)"
    number = _real(owner, name, value, allowed)
    if not 1.0 <= number <= _FP32_MAX:
        raise ValueError(f"{owner}: {name} must be {allowed}, got {value!r}")
    return number


def _window_value(owner: str, value: Any) -> int:
    allowed = f"an integer >= 1 and <= {_INT32_MAX} (clean steps before the scale grows)"
    number = _real(owner, "scale_window", value, allowed)
    if not number.is_integer() or not 1 <= number <= _INT32_MAX:
        raise ValueError(f"{owner}: scale_window must be {allowed}, got {value!r}")
    return int(number)


def _factor_value(owner: str, value: Any) -> float:
    allowed = "a finite number > 1 (the scale is divided by it on overflow)"
    number = _real(owner, "scale_factor", value, allowed)
    if not number > 1.0:
        raise ValueError(f"{owner}: scale_factor must be {allowed}, got {value!r}")
    return number


def _found_inf(overflow: bool | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``overflow`` as a 0-dim fp32 0/1 tensor on ``like``'s device, without a host sync."""
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


class FixedLossScaleManager(LossScaleManager):
    """A constant loss scale (MindSpore ``FixedLossScaleManager``).

    Args:
        loss_scale: the scale, a finite number >= 1.
        drop_overflow_update: skip the optimizer step when gradients overflow. With False
            the optimizer always steps (MindSpore's behaviour) and the step needs no host
            synchronisation at all.

    Raises:
        ValueError: ``loss_scale`` is not a finite number >= 1, or ``drop_overflow_update``
            is not a bool.

    Example:
        >>> m = FixedLossScaleManager(loss_scale=1024.0)
        >>> m.update_loss_scale(True)
        >>> m.get_loss_scale()
        1024.0
    """

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True) -> None:
        owner = type(self).__name__
        super().__init__(_scale_value(owner, "loss_scale", loss_scale))
        if not isinstance(drop_overflow_update, bool):
            raise ValueError(
                f"{owner}: drop_overflow_update must be True or False, "
                f"got {drop_overflow_update!r}"
            )
        self.drop_overflow_update = drop_overflow_update

    def get_drop_overflow_update(self) -> bool:
        """Whether the optimizer step is skipped on overflow.

        Example:
            >>> FixedLossScaleManager(drop_overflow_update=False).get_drop_overflow_update()
            False
        """
        return self.drop_overflow_update

    def update_loss_scale(self, overflow: bool | torch.Tensor) -> None:
        """Nothing to do: the scale is fixed.

        Example:
            >>> FixedLossScaleManager().update_loss_scale(False)
        """

    def state_dict(self) -> dict[str, Any]:
        """``{"loss_scale": float, "drop_overflow_update": bool}``.

        Example:
            >>> FixedLossScaleManager(8).state_dict()["loss_scale"]
            8.0
        """
        return {"loss_scale": self.get_loss_scale(),
                "drop_overflow_update": self.drop_overflow_update}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`.

        Example:
            >>> m = FixedLossScaleManager()
            >>> m.load_state_dict(FixedLossScaleManager(4).state_dict())
            >>> m.get_loss_scale()
            4.0
        """
        self._check_keys(state_dict, ("loss_scale", "drop_overflow_update"))
        fresh = FixedLossScaleManager(state_dict["loss_scale"], state_dict["drop_overflow_update"])
        self._scale.fill_(fresh.get_loss_scale())
        self.drop_overflow_update = fresh.drop_overflow_update

    def __repr__(self) -> str:
        return (f"FixedLossScaleManager(loss_scale={self.get_loss_scale()}, "
                f"drop_overflow_update={self.drop_overflow_update})")


class DynamicLossScaleManager(LossScaleManager):
    """A loss scale that backs off on overflow and grows after clean steps (MindSpore).

    On overflow the scale is divided by ``scale_factor`` (never below ``min_loss_scale``,
    default 1.0) and the count of
    clean steps restarts; after ``scale_window`` consecutive clean steps it is multiplied by
    ``scale_factor`` unless that would make it infinite. The update is
    ``torch._amp_update_scale_`` (GradScaler's own kernel, backoff ``1/scale_factor``) followed
    by a clamp to 1.0, so with ``scale_factor=2`` and a scale that stays >= 1 the trajectory
    equals ``torch.amp.GradScaler(init_scale, 2.0, 0.5, scale_window)`` step for step.
    Updating needs no host synchronisation.

    Args:
        init_loss_scale: the first scale: GradScaler's 2**16 by default, whose first
            steps do not overflow on the models we measured (MindSpore's default, 2**24,
            skipped the first 6 of 14 steps of a GPT-2 small on a GPU; pass it to choose it).
        scale_factor: growth and backoff factor, > 1.
        scale_window: clean steps before the scale grows, an integer >= 1.
        min_loss_scale: the floor, >= 1 and <= init_loss_scale. A floor above 1 stops a burst
            of overflows from collapsing the scale until small gradients underflow (the
            remedy ``NumericsMonitor`` suggests); overflowing steps are still skipped.

    Raises:
        ValueError: an argument outside those ranges, or not a number.

    Example:
        >>> m = DynamicLossScaleManager(init_loss_scale=2**16, scale_window=2)
        >>> m.update_loss_scale(True); m.get_loss_scale()
        32768.0
        >>> m.update_loss_scale(False); m.update_loss_scale(False); m.get_loss_scale()
        65536.0
    """

    dynamic = True

    def __init__(
        self, init_loss_scale: float = 2**16, scale_factor: float = 2, scale_window: int = 2000,
        *, min_loss_scale: float = 1.0,
    ) -> None:
        owner = type(self).__name__
        init = _scale_value(owner, "init_loss_scale", init_loss_scale)
        super().__init__(init)
        self.scale_factor = _factor_value(owner, scale_factor)
        self.scale_window = _window_value(owner, scale_window)
        self.min_loss_scale = _scale_value(owner, "min_loss_scale", min_loss_scale)
        if self.min_loss_scale > init:
            raise ValueError(f"{owner}: min_loss_scale ({min_loss_scale!r}) must be <= "
                             f"init_loss_scale ({init_loss_scale!r})")
        self._growth_tracker = torch.zeros((), dtype=torch.int32)

    @property
    def growth_tracker(self) -> torch.Tensor:
        """Consecutive clean steps since the last change, a 0-dim int32 tensor."""
        return self._growth_tracker

    def update_loss_scale(self, overflow: bool | torch.Tensor) -> None:
        """Back off on overflow, grow after ``scale_window`` clean steps (no host sync).

        Args:
            overflow: a bool, or a one-element tensor that is nonzero on overflow (the
                train step passes its ``found_inf`` tensor).

        Example:
            >>> m = DynamicLossScaleManager(init_loss_scale=2)
            >>> for _ in range(3):
            ...     m.update_loss_scale(torch.tensor(1.0))
            >>> m.get_loss_scale()
            1.0
        """
        found_inf = _found_inf(overflow, self._scale)
        torch._amp_update_scale_(
            self._scale, self._growth_tracker, found_inf,
            self.scale_factor, 1.0 / self.scale_factor, self.scale_window,
        )
        self._scale.clamp_min_(self.min_loss_scale)

    def state_dict(self) -> dict[str, Any]:
        """Scale, factor, window and the clean-step count, as Python numbers.

        Example:
            >>> sorted(DynamicLossScaleManager().state_dict())
            ['growth_tracker', 'loss_scale', 'min_loss_scale', 'scale_factor', 'scale_window']
        """
        return {
            "loss_scale": self.get_loss_scale(),
            "scale_factor": self.scale_factor,
            "scale_window": self.scale_window,
            "growth_tracker": int(self._growth_tracker.item()),
            "min_loss_scale": self.min_loss_scale,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` in place.

        Example:
            >>> a = DynamicLossScaleManager(init_loss_scale=8)
            >>> b = DynamicLossScaleManager()
            >>> b.load_state_dict(a.state_dict()); b.get_loss_scale()
            8.0
        """
        keys = ("loss_scale", "scale_factor", "scale_window", "growth_tracker")
        self._check_keys(state_dict, keys)
        fresh = DynamicLossScaleManager(
            state_dict["loss_scale"], state_dict["scale_factor"], state_dict["scale_window"],
            min_loss_scale=min(state_dict.get("min_loss_scale", 1.0), state_dict["loss_scale"]),
        )
        tracker = state_dict["growth_tracker"]
        if isinstance(tracker, torch.Tensor):
            tracker = int(tracker.item())
        if isinstance(tracker, bool) or not isinstance(tracker, int) or tracker < 0:
            raise ValueError(
                f"DynamicLossScaleManager.load_state_dict: growth_tracker must be an integer "
                f">= 0, got {tracker!r}"
            )
        self.scale_factor, self.scale_window = fresh.scale_factor, fresh.scale_window
        self.min_loss_scale = fresh.min_loss_scale
        self._scale.fill_(fresh.get_loss_scale())
        self._growth_tracker.fill_(tracker)

    def __repr__(self) -> str:
        return (f"DynamicLossScaleManager(loss_scale={self.get_loss_scale()}, "
                f"scale_factor={self.scale_factor}, scale_window={self.scale_window}, "
                f"min_loss_scale={self.min_loss_scale})")


def unscale_by_device(
    params: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """Unscale every gradient in place by ``inv_scale``, one fused kernel per device, and
    OR each device's non-finite flag into ``found_inf``."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_device.setdefault(p.grad.device, []).append(p.grad)
    for device, grads in by_device.items():
        flag = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, flag, inv_scale.to(device))
        found_inf.logical_or_(flag.to(found_inf.device))


def resolve_manager(manager: Any, amp_dtype: torch.dtype) -> LossScaleManager | None:
    """``"auto"``: a ``DynamicLossScaleManager()`` for fp16, None for bf16 and O0; an
    explicit manager or None as given."""
    if isinstance(manager, str) and manager == "auto":
        return DynamicLossScaleManager() if amp_dtype == torch.float16 else None
    if manager is None or isinstance(manager, LossScaleManager):
        return manager
    raise ValueError(
        f"loss_scale_manager must be 'auto', None, or a FixedLossScaleManager / "
        f"DynamicLossScaleManager instance, got {manager!r}"
    )
