"""ampgraph as a Lightning precision plugin: ``Trainer(plugins=[AmpGraphPrecision("O2")])``.

The plugin follows the shape of Lightning's own third-party precisions
(``TransformerEnginePrecision``): it converts the model in place and keeps its state in the
checkpoint.

- ``convert_module`` compiles the LightningModule's children in place: each child that
  owns parameters is replaced by ``ampgraph.compile(child)`` under the same attribute name.
  In place, because the DDP strategy discards the return value; per child, because the
  LightningModule itself is not a network (``training_step`` computes the loss, logs, may
  call several children) and must stay the object the Trainer holds. The compiled children
  share the children's parameter dicts, so state-dict keys, checkpoints and the optimizer
  (built afterwards by ``configure_optimizers``) are unchanged; each captures its graph
  lazily on its first batch. Containers (``ModuleList``/``ModuleDict``) are entered and
  their children compiled; children without parameters (losses, torchmetrics metrics)
  are left alone.
- fp16 loss scaling through the hooks: ``pre_backward`` scales the loss;
  ``optimizer_step`` runs the closure (forward and backward), unscales the gradients,
  all-reduces the overflow flag across ranks, calls ``_after_closure`` (so clipping and
  ``on_before_optimizer_step`` see the true gradients), then steps unless a gradient or a
  loss was not finite, and updates the scale. bf16 needs no scaling.
- ``state_dict``/``load_state_dict``: the manager's state, stored in Lightning checkpoints
  under ``"AmpGraphPrecision"``.

Lightning is imported when this module is, never by ``import ampgraph``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn

from ampgraph.api import compile_resolved
from ampgraph.config import AmpConfig, ResolvedConfig, dtype_name, model_device, parse_dtype
from ampgraph.integrations._scaling import LossScaler
from ampgraph.module import AmpModule
from ampgraph.train.loss_scale import LossScaleManager, resolve_manager

__all__ = ["AmpGraphPrecision", "compile_children"]


def compile_children(module: nn.Module, config: ResolvedConfig) -> list[str]:
    """Replace each child of ``module`` that owns parameters by its version compiled with
    ``config``, in place; enter containers without a forward. Returns the compiled
    children's paths.

    Example:
        >>> config = AmpConfig.create(dtype="bf16").resolve(torch.device("cpu"))
        >>> compile_children(lit_module, config)  # doctest: +SKIP
        ['encoder', 'head']
    """
    done: list[str] = []

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent.named_children()):
            path = f"{prefix}{name}"
            if isinstance(child, AmpModule) or not any(True for _ in child.parameters()):
                continue
            if _is_metric(child):
                continue
            if type(child).forward is nn.Module.forward:  # ModuleList, ModuleDict
                visit(child, f"{path}.")
                continue
            setattr(parent, name, compile_resolved(child, config))
            done.append(path)

    visit(module, "")
    return done


def _is_metric(module: nn.Module) -> bool:
    return any(c.__module__.startswith("torchmetrics") for c in type(module).__mro__)


class AmpGraphPrecision(Precision):
    """Mixed precision by ampgraph's graph rewrite for a Lightning ``Trainer``.

    Args:
        amp_level: "O0"-"O3", as for :func:`ampgraph.compile`.
        dtype: "auto" (bf16 on CPUs and sm_80+ GPUs, fp16 on older GPUs, resolved on the
            Trainer's device), "bf16", "fp16" or a torch dtype.
        loss_scale_manager: "auto" (``DynamicLossScaleManager()`` for fp16, none for bf16),
            None, or a ``FixedLossScaleManager`` / ``DynamicLossScaleManager``.
        **compile_kwargs: passed to :func:`ampgraph.compile` (``custom_deny``,
            ``module_overrides``, ``backend`` ...).

    Attributes:
        compiled: the paths of the children ``convert_module`` compiled.

    Example:
        >>> trainer = lightning.pytorch.Trainer(plugins=[AmpGraphPrecision("O2", dtype="bf16")])
        >>> trainer.fit(lit_module, datamodule)  # doctest: +SKIP
    """

    def __init__(self, amp_level: str = "O2", dtype: str | torch.dtype = "auto", *,
                 loss_scale_manager: LossScaleManager | str | None = "auto",
                 **compile_kwargs: Any) -> None:
        if loss_scale_manager is not None and not isinstance(loss_scale_manager, str) and (
                not isinstance(loss_scale_manager, LossScaleManager)):
            resolve_manager(loss_scale_manager, torch.float16)  # raises with the fix
        self.amp_level = amp_level
        self.dtype = dtype
        self.compile_kwargs = compile_kwargs
        self.config = AmpConfig.create(amp_level=amp_level, dtype=dtype, **compile_kwargs)
        #: the configuration resolved once (None until "auto" is, on the Trainer's device)
        self.resolved: ResolvedConfig | None = None
        self.compiled: list[str] = []
        self._manager_arg = loss_scale_manager
        self._scaler: LossScaler | None = None
        self._pending_state: dict[str, Any] | None = None
        self.amp_dtype: torch.dtype | None = None
        #: whether the last optimizer step was skipped for a non-finite gradient or loss
        self.last_step_skipped = False
        if parse_dtype(dtype) != "auto":  # a named dtype needs no device: scaler known now
            self._resolve(torch.device("cpu"))

    def _resolve(self, device: torch.device) -> None:
        """Resolve the configuration on ``device`` and build the loss scaler, once."""
        if self.resolved is not None:
            return
        self.resolved = self.config.resolve(device)
        self.amp_dtype = self.resolved.dtype
        manager = resolve_manager(self._manager_arg, self.amp_dtype)
        self._scaler = None if manager is None else LossScaler(manager)
        self.precision = "16-mixed" if self.amp_dtype == torch.float16 else (
            "bf16-mixed" if self.amp_dtype == torch.bfloat16 else "32-true")
        if self._pending_state is not None:
            state, self._pending_state = self._pending_state, None
            self.load_state_dict(state)

    @property
    def loss_scale_manager(self) -> LossScaleManager | None:
        """The manager in use (None for bf16 or before "auto" is resolved)."""
        return None if self._scaler is None else self._scaler.manager

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without a manager); synchronises with the device."""
        return 1.0 if self._scaler is None else self._scaler.get_loss_scale()

    # -- Lightning hooks -----------------------------------------------------------------

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Compile ``module``'s children in place (see the module docstring) and return it."""
        trainer = getattr(module, "_trainer", None)
        device = trainer.strategy.root_device if trainer is not None else model_device(module)
        self._resolve(device)
        self.compiled += compile_children(module, self.resolved)
        return module

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if self._scaler is not None:
            tensor = self._scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any,
    ) -> Any:
        if self._scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError("AmpGraphPrecision with fp16 loss scaling cannot drive LBFGS, "
                             "which re-evaluates the closure: use bf16 or another optimizer")
        closure_result = closure()
        # training_step returned None: no backward ran, nothing to unscale or step
        if closure_result is None and getattr(model, "automatic_optimization", True):
            return closure_result
        params = [p for group in optimizer.param_groups for p in group["params"]]
        overflow = self._scaler.unscale_(params)
        self._after_closure(model, optimizer)
        result = None
        if not overflow or not self._scaler.manager.get_drop_overflow_update():
            result = optimizer.step(**kwargs)
        self._scaler.update()
        self.last_step_skipped = overflow
        return closure_result if result is None else result

    def state_dict(self) -> dict[str, Any]:
        manager = self.loss_scale_manager
        if manager is None:
            return {}
        return {"manager": type(manager).__name__, **manager.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.amp_dtype is None:  # "auto" not resolved yet: apply once it is
            self._pending_state = dict(state_dict)
            return
        manager = self.loss_scale_manager
        if manager is None:
            raise ValueError(
                f"AmpGraphPrecision.load_state_dict: the checkpoint holds loss-scale state "
                f"({state_dict.get('manager')}) but this plugin has no manager "
                f"(dtype {dtype_name(self.amp_dtype)}): resume with the saved run's dtype"
            )
        manager.load_state_dict({k: v for k, v in state_dict.items() if k != "manager"})

    def __repr__(self) -> str:
        return (f"AmpGraphPrecision(amp_level={self.amp_level!r}, dtype={self.dtype!r}, "
                f"loss_scale_manager={self.loss_scale_manager!r})")
