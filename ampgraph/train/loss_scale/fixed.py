"""A constant loss scale (MindSpore's ``FixedLossScaleManager``)."""

from __future__ import annotations

from typing import Any

import torch

from ampgraph.train.loss_scale.base import LossScaleManager
from ampgraph.train.loss_scale.values import scale_value


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
        super().__init__(scale_value(owner, "loss_scale", loss_scale))
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
