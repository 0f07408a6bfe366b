"""A loss scale that backs off on overflow and grows after clean steps (MindSpore's
``DynamicLossScaleManager``), updated on the device by GradScaler's own kernel.

Defaults compared (docs/training.md has the full table):

- ``DynamicLossScaleManager``: init 2**16 (GradScaler's; MindSpore's 2**24 on request),
  divide by 2 on overflow (never below 1.0), multiply by 2 after 2000 clean steps.
- ``torch.amp.GradScaler``: init 2**16, x0.5 on overflow (no floor), x2.0 after 2000 clean
  steps.
"""

from __future__ import annotations

from typing import Any

import torch

from ampgraph.train.loss_scale.base import LossScaleManager, overflow_flag
from ampgraph.train.loss_scale.values import factor_value, scale_value, window_value


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
        init = scale_value(owner, "init_loss_scale", init_loss_scale)
        super().__init__(init)
        self.scale_factor = factor_value(owner, scale_factor)
        self.scale_window = window_value(owner, scale_window)
        self.min_loss_scale = scale_value(owner, "min_loss_scale", min_loss_scale)
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
        flag = overflow_flag(overflow, self._scale)
        torch._amp_update_scale_(
            self._scale, self._growth_tracker, flag,
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
