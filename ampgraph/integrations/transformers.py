"""ampgraph in the HuggingFace ``Trainer``.

A compiled model already works in the plain ``transformers.Trainer``: ``AmpModule`` keeps
the model's forward signature (the Trainer drops dataset columns by it), its ``config``
and methods, the model's state-dict keys, and runs with any outer autocast switched off
(``TrainingArguments(bf16=True)`` then changes nothing inside the graph). Its class is
named like the model's, with the model class's forward signature, and is a
``PreTrainedModel`` when the model is one (:mod:`ampgraph.compiled_class`), so the plain
Trainer finds the label names and ``can_return_loss`` by ``type(model)`` as for the model
itself (``evaluate`` reports ``eval_loss``), and ``save_model`` goes through the wrapped
model's ``save_pretrained`` (config.json, tied weights, ``from_pretrained``-loadable).

:class:`AmpGraphTrainer` adds what the plain Trainer cannot do for a compiled model:

- it compiles the model itself (``amp_level``, ``amp_dtype``);
- fp16 loss scaling: the loss's gradient is scaled in backward (the logged loss is not),
  the gradients are unscaled after the last micro-batch of each optimizer step, before the
  Trainer clips them; a step with a non-finite gradient or loss is skipped on every rank
  (the flag is all-reduced) and reported to Accelerate, so the LR scheduler does not
  advance (``accelerator.optimizer_step_was_skipped``); the scale is logged as
  ``loss_scale``.

Transformers is imported when this module is, never by ``import ampgraph``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import Trainer

from ampgraph.api import compile_resolved
from ampgraph.config import AmpConfig, model_device
from ampgraph.integrations._scaling import LossScaler
from ampgraph.module import AmpModule
from ampgraph.train.loss_scale import LossScaleManager, resolve_manager

__all__ = ["AmpGraphTrainer"]


class AmpGraphTrainer(Trainer):
    """A ``transformers.Trainer`` that trains the model through ``ampgraph.compile``.

    Args:
        *args, **kwargs: as for ``transformers.Trainer``; ``model`` is required (not
            ``model_init``) and may already be compiled.
        amp_level: "O0"-"O3".
        amp_dtype: "auto" (resolved on ``args.device``), "bf16", "fp16" or a torch dtype.
        loss_scale_manager: "auto" (dynamic for fp16, none for bf16), None, or a manager.

    Raises:
        ValueError: ``TrainingArguments(fp16=True | bf16=True)`` (Accelerate's autocast and
            GradScaler on top of ampgraph's casts), no model, or a bad manager.

    Example:
        >>> trainer = AmpGraphTrainer(model=hf_model, args=TrainingArguments(...),
        ...                           train_dataset=ds, amp_dtype="fp16")
        >>> trainer.train()  # doctest: +SKIP
    """

    def __init__(self, *args: Any, amp_level: str = "O2", amp_dtype: str | torch.dtype = "auto",
                 loss_scale_manager: LossScaleManager | str | None = "auto",
                 **kwargs: Any) -> None:
        args = list(args)
        model = kwargs.get("model", args[0] if args else None)
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if model is None:
            raise ValueError("AmpGraphTrainer needs model=...: it compiles the model once "
                             "(model_init is not supported)")
        if training_args is not None and (training_args.fp16 or training_args.bf16):
            raise ValueError(
                "AmpGraphTrainer does the mixed precision itself: leave TrainingArguments "
                "fp16/bf16 False and pass amp_dtype='fp16' or 'bf16' to AmpGraphTrainer"
            )
        if not isinstance(model, AmpModule):
            device = training_args.device if training_args is not None else model_device(model)
            config = AmpConfig.create(amp_level=amp_level, dtype=amp_dtype).resolve(device)
            model = compile_resolved(model, config)
        if "model" in kwargs:
            kwargs["model"] = model
        else:
            args[0] = model
        manager = resolve_manager(loss_scale_manager, model.amp_dtype)
        #: the loss scaler (None without a manager: bf16, O0)
        self.loss_scaler = None if manager is None else LossScaler(manager)
        self._skip_next_step = False
        super().__init__(*args, **kwargs)

    @property
    def loss_scale_manager(self) -> LossScaleManager | None:
        return None if self.loss_scaler is None else self.loss_scaler.manager

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        result = super().compute_loss(model, inputs, *args, **kwargs)
        if self.loss_scaler is None or not (torch.is_grad_enabled() and model.training):
            return result
        if isinstance(result, tuple):  # return_outputs=True
            return (self.loss_scaler.scale_grad(result[0]), *result[1:])
        return self.loss_scaler.scale_grad(result)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)
        scaler = self.loss_scaler
        if scaler is None:
            return loss
        scaler.scale(loss.detach().reshape(-1)[:1].float())  # records a non-finite loss
        if self.accelerator.sync_gradients:  # the last micro-batch: unscale before clipping
            self._gate(self.optimizer)
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            self._skip_next_step = scaler.unscale_(params) and (
                scaler.manager.get_drop_overflow_update())
        return loss

    def _gate(self, optimizer: Any) -> None:
        """Make ``optimizer.step()`` (Accelerate's wrapper) skip when this step overflowed,
        mark it skipped (``step_was_skipped`` reads ``_is_overflow``), and update the scale."""
        if optimizer.__dict__.get("_ampgraph_gated"):
            return
        step = optimizer.step

        def gated_step(*args: Any, **kwargs: Any) -> Any:
            skip, self._skip_next_step = self._skip_next_step, False
            optimizer._is_overflow = skip
            result = None if skip else step(*args, **kwargs)
            self.loss_scaler.update()
            return result

        # keeps the LR scheduler's marker (_wrapped_by_lr_sched) on the step it wrapped
        optimizer.step = functools.update_wrapper(gated_step, step)
        optimizer._ampgraph_gated = True

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if self.loss_scaler is not None and "loss" in logs:
            logs["loss_scale"] = self.loss_scaler.get_loss_scale()
        super().log(logs, *args, **kwargs)
