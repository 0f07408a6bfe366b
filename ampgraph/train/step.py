"""``build_train_step``: a generated, specialised mixed-precision training step.

One step: forward through the compiled model -> loss in fp32 -> backward of loss x scale ->
unscale in fp32 with the fused non-finite check -> (distributed) all-reduce MAX of the
overflow flag -> optional clipping -> ``optimizer.step()`` unless overflow -> loss-scale
update. docs/training.md describes the algorithm, the defaults and the recipes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampgraph.config import dtype_name, model_device, resolve_dtype
from ampgraph.train.codegen import (
    ALWAYS,
    FOUND_INF,
    HOST,
    Counters,
    StepOutput,
    StepSpec,
    generate,
    make_step_function,
    runtime_helpers,
)
from ampgraph.train.loss_scale import DynamicLossScaleManager, LossScaleManager

__all__ = ["StepOutput", "TrainStep", "build_train_step"]


class _Default(str):
    """A default argument value that can be told apart from the same value passed explicitly."""


_DEFAULT_LEVEL = _Default("O2")
_DEFAULT_DTYPE = _Default("auto")


class TrainStep:
    """A compiled model, its loss, optimizer and loss scaling as one generated step.

    Build with :func:`build_train_step`. ``step(*args, **kwargs)`` (or calling the object)
    runs one micro-batch; ``code`` is the generated source; ``state_dict`` /
    ``load_state_dict`` hold model, optimizer, loss-scale and step-counter state.

    Attributes:
        network: what the step calls (the AmpModule, or the DDP wrapper around it).
        module: the AmpModule.
        optimizer, loss_fn, loss_scale_manager, accumulation_steps, clip_grad_norm, monitor:
            as given (``loss_scale_manager`` resolved from "auto").
        amp_level, amp_dtype: the compiled level and resolved dtype.
    """

    def __init__(
        self,
        *,
        network: nn.Module,
        module: nn.Module,
        loss_fn: Callable[..., torch.Tensor] | None,
        optimizer: torch.optim.Optimizer,
        manager: LossScaleManager | None,
        spec: StepSpec,
        clip_grad_norm: float | None,
        monitor: Any,
        group: Any,
        params: list[nn.Parameter],
    ) -> None:
        self.network, self.module = network, module
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self.loss_scale_manager = manager
        self.accumulation_steps = spec.accumulation_steps
        self.clip_grad_norm = clip_grad_norm
        self.monitor = monitor
        amp = amp_of(module)
        self.amp_level: str = amp.amp_config.amp_level
        self.amp_dtype: torch.dtype = amp.amp_dtype
        self.spec = spec
        self._counters = Counters()
        device = params[0].device
        self._params = params
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self._code = generate(spec)
        self._fn = make_step_function(self._code, {
            **runtime_helpers(), "net": network, "module": module, "loss_fn": loss_fn,
            "optimizer": optimizer, "manager": manager, "params": params,
            "found_inf": self._found_inf,
            "one": torch.ones((), dtype=torch.float32, device=device),
            "counters": self._counters, "group": group, "monitor": monitor,
            "StepOutput": StepOutput,
        })

    @property
    def code(self) -> str:
        """The Python source of the generated step."""
        return self._code

    @property
    def step_index(self) -> int:
        """Optimizer steps taken so far (skipped overflow steps included)."""
        return self._counters.step_index

    def step(self, *args: Any, **kwargs: Any) -> StepOutput:
        """Run one micro-batch (the last positional argument is the target with a loss_fn).

        Example:
            >>> out = train_step.step(x, y)  # doctest: +SKIP
            >>> out.loss, out.overflow, out.loss_scale  # doctest: +SKIP
        """
        return self._fn(*args, **kwargs)

    __call__ = step

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, loss-scale and counter state; resuming from it continues exactly.

        Example:
            >>> torch.save(train_step.state_dict(), "ckpt.pt")  # doctest: +SKIP
        """
        if self._counters.micro:
            warnings.warn(
                f"TrainStep.state_dict() called after micro-batch {self._counters.micro} of "
                f"{self.accumulation_steps}: gradients accumulated so far are not saved; "
                f"checkpoint when out.stepped is True",
                RuntimeWarning,
                stacklevel=2,
            )
        manager = self.loss_scale_manager
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "loss_scale": None if manager is None else manager.state_dict(),
            "step": {"step_index": self._counters.step_index, "micro": self._counters.micro},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` into the model, optimizer and manager (in place).

        Example:
            >>> train_step.load_state_dict(torch.load("ckpt.pt"))  # doctest: +SKIP
        """
        missing = [k for k in ("model", "optimizer", "loss_scale", "step") if k not in state_dict]
        if missing:
            raise ValueError(f"TrainStep.load_state_dict: missing keys {missing}")
        manager, saved = self.loss_scale_manager, state_dict["loss_scale"]
        if (manager is None) != (saved is None):
            have = "no loss-scale manager" if manager is None else type(manager).__name__
            raise ValueError(
                f"TrainStep.load_state_dict: the checkpoint "
                f"{'has no' if saved is None else 'has'} loss-scale state but this step has "
                f"{have}: build the step with the same loss_scale_manager as the saved run"
            )
        self.module.load_state_dict(state_dict["model"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if manager is not None:
            manager.load_state_dict(saved)
        self._counters.step_index = int(state_dict["step"]["step_index"])
        self._counters.micro = int(state_dict["step"]["micro"])
        for p in self._params:  # no gradient or flag of this process leaks into the resumed run
            p.grad = None
        self._found_inf.zero_()

    def __repr__(self) -> str:
        return f"TrainStep({self.spec.title})"


def build_train_step(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor] | None,
    optimizer: torch.optim.Optimizer,
    amp_level: str = _DEFAULT_LEVEL,
    dtype: str | torch.dtype = _DEFAULT_DTYPE,
    *,
    loss_scale_manager: LossScaleManager | str | None = "auto",
    clip_grad_norm: float | None = None,
    accumulation_steps: int = 1,
    monitor: Any = None,
    **compile_kwargs: Any,
) -> TrainStep:
    """Compile ``model`` and generate a mixed-precision training step for it.

    Args:
        model: an fp32 ``nn.Module``; or a module returned by ``ampgraph.compile``; or one
            wrapped in ``DistributedDataParallel`` after compiling; or one whose blocks were
            compiled one by one (regional compilation, e.g. under FSDP2's ``fully_shard``,
            whose DTensor gradients are unscaled per shard). A compiled model is not
            compiled again: ``amp_level``/``dtype`` left at their defaults take the compiled
            values, explicit values must agree with them.
        loss_fn: ``loss_fn(output, target)`` with the target as the last positional argument
            of each step call; None when the model returns the loss (a scalar tensor or an
            object with ``.loss``, e.g. a HuggingFace model given ``labels``).
        optimizer: built on ``model.parameters()`` (the fp32 master weights).
        amp_level, dtype: as for ``ampgraph.compile``.
        loss_scale_manager: "auto" (``DynamicLossScaleManager()`` for fp16, none for bf16 and
            O0), None, or a ``FixedLossScaleManager`` / ``DynamicLossScaleManager``.
        clip_grad_norm: clip the unscaled gradients to this total 2-norm; None for no clipping.
        accumulation_steps: micro-batches per optimizer step (each loss is divided by it).
        monitor: optional object; if it has ``after_backward(step_index, module, optimizer,
            loss_scale, overflow)`` it is called on each stepping call after the gradients are
            unscaled (and the flag all-reduced), before clipping and the optimizer step.
            ``loss_scale`` and ``overflow`` are 0-dim tensors on the device (call ``.item()``
            only if you accept a host sync).
        **compile_kwargs: forwarded to ``ampgraph.compile`` (keep_batchnorm_fp32, ...).

    Returns:
        A :class:`TrainStep`; ``step(*args, **kwargs)`` returns a :class:`StepOutput`.

    Raises:
        ValueError: invalid arguments, or a level/dtype that contradicts a compiled model.

    Example:
        >>> step = build_train_step(model, nn.functional.cross_entropy, opt)  # doctest: +SKIP
        >>> out = step(x, y)  # doctest: +SKIP
    """
    network, module = _resolve_network(model, amp_level, dtype, compile_kwargs)
    if not isinstance(accumulation_steps, int) or isinstance(accumulation_steps, bool) or (
        accumulation_steps < 1
    ):
        raise ValueError(f"accumulation_steps must be an integer >= 1, got {accumulation_steps!r}")
    if clip_grad_norm is not None:
        if isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float)) or (
            not 0 < float(clip_grad_norm) < float("inf")
        ):
            raise ValueError(
                f"clip_grad_norm must be None or a finite number > 0, got {clip_grad_norm!r}"
            )
        clip_grad_norm = float(clip_grad_norm)
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable or None, got {type(loss_fn).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)}")
    params = _train_params(module, optimizer)
    device = model_device(module)
    amp = amp_of(module)
    manager = _resolve_manager(loss_scale_manager, amp.amp_dtype)
    sharded = _sharded(params)
    if manager is not None:
        manager.to(device)
    distributed, group = _distributed(network)
    has_monitor = monitor is not None and callable(getattr(monitor, "after_backward", None))
    spec = StepSpec(
        title=_title(amp, manager, clip_grad_norm, accumulation_steps, distributed),
        has_loss_fn=loss_fn is not None,
        cast_outputs=not amp.amp_config.keep_io_types,
        scaled=manager is not None,
        dynamic=manager is not None and manager.dynamic,
        decision=HOST if sharded and _decision(optimizer, manager) == FOUND_INF else (
            _decision(optimizer, manager)),
        clip_norm=clip_grad_norm,
        distributed=distributed,
        accumulation_steps=accumulation_steps,
        no_sync=accumulation_steps > 1 and isinstance(network, DistributedDataParallel),
        monitor=has_monitor,
        multi_device=len({p.device for p in params}) > 1,
        sharded=sharded,
    )
    return TrainStep(
        network=network, module=module, loss_fn=loss_fn, optimizer=optimizer, manager=manager,
        spec=spec, clip_grad_norm=clip_grad_norm, monitor=monitor, group=group, params=params,
    )


def _resolve_network(
    model: nn.Module, amp_level: str, dtype: Any, compile_kwargs: dict[str, Any]
) -> tuple[nn.Module, nn.Module]:
    """(what the step calls, the AmpModule): compile unless already compiled."""
    from ampgraph.module import AmpModule

    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    if isinstance(inner, AmpModule):
        if compile_kwargs:
            raise ValueError(
                f"model is already compiled by ampgraph.compile, so build_train_step cannot "
                f"apply {sorted(compile_kwargs)}: pass them to ampgraph.compile instead"
            )
        _check_compiled_matches(inner, amp_level, dtype)
        return model, inner
    regions = [m for m in inner.modules() if isinstance(m, AmpModule)]
    if regions:  # compiled per block ("regional"), e.g. before FSDP2's fully_shard per block
        if compile_kwargs:
            raise ValueError(
                f"model holds modules compiled by ampgraph.compile, so build_train_step cannot "
                f"apply {sorted(compile_kwargs)}: pass them to ampgraph.compile instead"
            )
        amp = amp_of(inner)
        differ = [m for m in regions
                  if (m.amp_config, m.amp_dtype) != (amp.amp_config, amp.amp_dtype)]
        if differ:
            raise ValueError(
                f"the model's compiled blocks differ: {amp!r} vs {differ[0]!r}; compile every "
                "block with the same amp_level, dtype and options"
            )
        _check_compiled_matches(amp, amp_level, dtype)
        return model, inner
    if inner is not model:
        raise ValueError(
            "model is a DistributedDataParallel around an uncompiled module: compile first, "
            "then wrap: DistributedDataParallel(ampgraph.compile(model, ...)); "
            "see docs/training.md"
        )
    import ampgraph

    compiled = ampgraph.compile(model, _plain(amp_level), _plain(dtype), **compile_kwargs)
    return compiled, compiled


def amp_of(module: nn.Module) -> nn.Module:
    """The AmpModule whose configuration a step uses: ``module`` itself, or the first
    compiled block of a regionally compiled model.

    Example:
        >>> amp_of(ampgraph.compile(model)).amp_config.amp_level  # doctest: +SKIP
        'O2'
    """
    from ampgraph.module import AmpModule

    return next(m for m in module.modules() if isinstance(m, AmpModule))


def _sharded(params: list[nn.Parameter]) -> bool:
    """Some parameter is a DTensor (FSDP2's ``fully_shard``)."""
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def _plain(value: Any) -> Any:
    return str.__str__(value) if isinstance(value, str) else value


def _check_compiled_matches(module: nn.Module, amp_level: str, dtype: Any) -> None:
    level = module.amp_config.amp_level
    if not isinstance(amp_level, _Default):
        if not isinstance(amp_level, str) or amp_level.upper() != level:
            raise ValueError(
                f"model was compiled at amp_level={level!r} but build_train_step got "
                f"amp_level={amp_level!r}: drop the argument or pass {level!r} (or give "
                f"build_train_step the uncompiled model)"
            )
    if not isinstance(dtype, _Default) and level != "O0":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wanted = resolve_dtype(dtype, model_device(module))
        if wanted != module.amp_dtype:
            raise ValueError(
                f"model was compiled with dtype {dtype_name(module.amp_dtype)} but "
                f"build_train_step got dtype={_plain(dtype)!r} ({dtype_name(wanted)}): drop the "
                f"argument or pass {dtype_name(module.amp_dtype)!r}"
            )


def _resolve_manager(manager: Any, amp_dtype: torch.dtype) -> LossScaleManager | None:
    if isinstance(manager, str) and manager == "auto":
        return DynamicLossScaleManager() if amp_dtype == torch.float16 else None
    if manager is None or isinstance(manager, LossScaleManager):
        return manager
    raise ValueError(
        f"loss_scale_manager must be 'auto', None, or a FixedLossScaleManager / "
        f"DynamicLossScaleManager instance, got {manager!r}"
    )


def _train_params(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """Optimizer parameters, then trainable model parameters the optimizer does not hold."""
    params: list[nn.Parameter] = []
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    model_ids = {id(p) for p in module.parameters()}
    if not model_ids & seen:
        raise ValueError(
            "the optimizer holds none of the model's parameters: build it on "
            "model.parameters() (the fp32 master weights shared with the compiled module)"
        )
    params += [p for p in module.parameters() if p.requires_grad and id(p) not in seen]
    return params


def _decision(optimizer: torch.optim.Optimizer, manager: LossScaleManager | None) -> str:
    if manager is not None and not manager.get_drop_overflow_update():
        return ALWAYS
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return HOST
    # torch's fused SGD with momentum leaves torch.empty momentum buffers when its very first
    # step is skipped through found_inf, and later steps read them: decide on the host.
    if isinstance(optimizer, torch.optim.SGD) and any(
        g.get("momentum", 0) for g in optimizer.param_groups
    ):
        return HOST
    return FOUND_INF


def _distributed(network: nn.Module) -> tuple[bool, Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return False, None
    group = network.process_group if isinstance(network, DistributedDataParallel) else None
    return dist.get_world_size(group) > 1, group


def _title(amp: nn.Module, manager: LossScaleManager | None, clip: float | None,
           accumulation_steps: int, distributed: bool) -> str:
    parts = [amp.amp_config.amp_level, dtype_name(amp.amp_dtype),
             type(manager).__name__ if manager is not None else "no loss scaling"]
    if clip is not None:
        parts.append(f"clip {clip}")
    if accumulation_steps > 1:
        parts.append(f"{accumulation_steps} micro-batches")
    if distributed:
        parts.append("distributed")
    return ", ".join(parts)
