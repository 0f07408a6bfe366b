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
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampgraph.config import dtype_name, model_device
from ampgraph.runtime.cuda.graphs import CudaGraphEngine
from ampgraph.train.codegen import (
    FOUND_INF,
    HOST,
    LAST,
    WHOLE,
    StepSpec,
    gate,
    generate,
    make_step_function,
    phases,
)
from ampgraph.train.graphs import (
    GraphCapture,
    StepGraphs,
    graph_inputs,
    mark_weights_stale,
    resolve_capture,
)
from ampgraph.train.loss_scale import LossScaleManager, resolve_manager
from ampgraph.train.low_precision_weights import LowPrecisionUpdate, weight_update
from ampgraph.train.memory_tiers import resolve_memory
from ampgraph.train.network import (
    DEFAULT_DTYPE,
    DEFAULT_LEVEL,
    amp_of,
    distributed_group,
    is_sharded,
    resolve_network,
    train_params,
)
from ampgraph.train.release_grads import ReleasedGradients, check_release
from ampgraph.train.replay_check import ReplayCheck
from ampgraph.train.step_runtime import Counters, StepOutput, runtime_helpers

__all__ = ["GraphCapture", "StepOutput", "TrainStep", "build_train_step"]


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
        update: LowPrecisionUpdate | None = None,
        graph_capture: GraphCapture | None = None,
    ) -> None:
        self.network, self.module = network, module
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self.loss_scale_manager = manager
        self.accumulation_steps = spec.accumulation_steps
        self.clip_grad_norm = clip_grad_norm
        self.monitor = monitor
        self.weight_update = update  # None with fp32 master weights
        amp = amp_of(module)
        self.amp_level: str = amp.amp_config.amp_level
        self.amp_dtype: torch.dtype = amp.amp_dtype
        self.spec = spec
        self._counters = Counters()
        device = params[0].device
        self._params = params
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        # release_grads: the parameters are stepped from their gradients' hooks
        self.released = ReleasedGradients(optimizer, params, self._found_inf, update) \
            if spec.release else None
        self._code = generate(spec)
        namespace = {
            **runtime_helpers(), "net": network, "module": module, "loss_fn": loss_fn,
            "optimizer": optimizer, "manager": manager, "params": params,
            "found_inf": self._found_inf,
            "one": torch.ones((), dtype=torch.float32, device=device),
            "counters": self._counters, "group": group, "monitor": monitor,
            "StepOutput": StepOutput, "update": update, "released": self.released,
        }
        self._fn = make_step_function(self._code, namespace)
        self.graphs: StepGraphs | None = None  # the CUDA graphs of the step, if captured
        self._phases = phases(spec.accumulation_steps)
        if graph_capture is not None:
            self.graphs = StepGraphs(
                {phase: make_step_function(generate(spec, phase), namespace)
                 for phase in set(self._phases)},
                params, optimizer, refresh=lambda: mark_weights_stale(network),
                holds=lambda: graph_inputs(network, params),
                engine=ReplayCheck() if graph_capture.check else CudaGraphEngine(),
                config=graph_capture)

    @property
    def code(self) -> str:
        """The Python source of the generated (eager) step."""
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
        if self.graphs is not None:
            return self._graphed(args, kwargs)
        return self._fn(*args, **kwargs)

    __call__ = step

    def _graphed(self, args: tuple, kwargs: dict) -> StepOutput:
        counters = self._counters
        phase = self._phases[counters.micro]
        loss, info, grad_norm = self.graphs(phase, args, kwargs)
        if phase not in (WHOLE, LAST):
            counters.micro += 1
            return StepOutput(loss, info, False)
        counters.micro = 0
        counters.step_index += 1
        return StepOutput(loss, info, True, grad_norm)

    def reset_graphs(self) -> None:
        """Drop the step's CUDA graphs: each input signature warms up and captures again
        (after replacing the optimizer's state, the parameters or a float hyperparameter).

        Example:
            >>> train_step.reset_graphs()  # doctest: +SKIP
        """
        if self.graphs is not None:
            self.graphs.reset()

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer, loss-scale and counter state; resuming from it continues exactly.

        Example:
            >>> torch.save(train_step.state_dict(), "ckpt.pt")  # doctest: +SKIP
        """
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                **self.progress_state_dict()}

    def progress_state_dict(self) -> dict[str, Any]:
        """The loss-scale manager's state and the step counters: :meth:`state_dict` less the
        model and the optimizer (which a sharded checkpoint saves through
        ``torch.distributed.checkpoint``: :func:`ampgraph.parallel.save_checkpoint`).

        Example:
            >>> sorted(train_step.progress_state_dict())  # doctest: +SKIP
            ['loss_scale', 'step']
        """
        if self._counters.micro:
            warnings.warn(
                f"TrainStep.state_dict() called after micro-batch {self._counters.micro} of "
                f"{self.accumulation_steps}: gradients accumulated so far are not saved; "
                f"checkpoint when out.stepped is True",
                RuntimeWarning,
                stacklevel=3,
            )
        manager = self.loss_scale_manager
        return {
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
        self._check_loss_scale_state(state_dict["loss_scale"])
        self.module.load_state_dict(state_dict["model"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.load_progress_state_dict(state_dict)

    def load_progress_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`progress_state_dict`: the manager and the counters; gradients and
        the overflow flag of this process are cleared and the CUDA graphs captured again
        (the model and optimizer state are the caller's to restore first).

        Example:
            >>> train_step.load_progress_state_dict(saved)  # doctest: +SKIP
        """
        missing = [k for k in ("loss_scale", "step") if k not in state_dict]
        if missing:
            raise ValueError(f"TrainStep.load_state_dict: missing keys {missing}")
        self._check_loss_scale_state(state_dict["loss_scale"])
        if self.loss_scale_manager is not None:
            self.loss_scale_manager.load_state_dict(state_dict["loss_scale"])
        self._counters.step_index = int(state_dict["step"]["step_index"])
        self._counters.micro = int(state_dict["step"]["micro"])
        for p in self._params:  # no gradient or flag of this process leaks into the resumed run
            p.grad = None
        self._found_inf.zero_()
        self.reset_graphs()  # the graphs wrote the old gradients and optimizer state

    def _check_loss_scale_state(self, saved: Any) -> None:
        manager = self.loss_scale_manager
        if (manager is None) != (saved is None):
            have = "no loss-scale manager" if manager is None else type(manager).__name__
            raise ValueError(
                f"TrainStep.load_state_dict: the checkpoint "
                f"{'has no' if saved is None else 'has'} loss-scale state but this step has "
                f"{have}: build the step with the same loss_scale_manager as the saved run"
            )

    def __repr__(self) -> str:
        return f"TrainStep({self.spec.title})"


def build_train_step(
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor] | None,
    optimizer: torch.optim.Optimizer,
    amp_level: str = DEFAULT_LEVEL,
    dtype: str | torch.dtype = DEFAULT_DTYPE,
    *,
    loss_scale_manager: LossScaleManager | str | None = "auto",
    clip_grad_norm: float | None = None,
    accumulation_steps: int = 1,
    monitor: Any = None,
    master_weights: str = "fp32",
    cuda_graph: bool | GraphCapture = False,
    release_grads: bool = False,
    memory: str | None = None,
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
        master_weights: "fp32" (fp32 parameters, the default); "kahan" or "stochastic":
            floating parameters (norm parameters excepted) are stored in the low dtype in
            place and updated with Kahan compensation or stochastic rounding into bf16
            (``ampgraph.train.low_precision_weights``; SGD, Adam, AdamW); "none": 16-bit
            parameters with round-to-nearest updates (a baseline). Build the step before the
            compiled model's first call.
        cuda_graph: capture the whole step (forward, backward, unscale, overflow check,
            loss-scale update, optimizer step, the weights' refresh) as CUDA graphs and
            replay them: ``True`` or a :class:`GraphCapture` (warm-up calls, graphs kept,
            ``check=True`` to check on any device that the step could be captured). One
            graph per input signature and accumulation phase; the optimizer must skip an
            overflowing step on the device: ``torch.optim.AdamW(params, fused=True,
            capturable=True)`` (or Adam, or SGD without momentum, fused). Where capture is
            impossible (no CUDA device, a collective, a monitor, a model that
            synchronises) the step runs eagerly with a warning. docs/training.md#cuda-graphs.
        release_grads: step each parameter in backward as soon as its gradient is complete
            and free it (``ampgraph.train.release_grads``; SGD, Adam, AdamW; not with
            clipping, accumulation, fp16 loss scaling, a monitor, DDP/FSDP2, cuda_graph).
        memory: None, or a tier that sets the two above: "default", "lean" (gradients
            released), "leanest" (also bf16 weights and state: ``master_weights=
            "stochastic"``); ``ampgraph.train.memory_tiers``, docs/training.md#memory.
        **compile_kwargs: forwarded to ``ampgraph.compile`` (keep_batchnorm_fp32, ...).

    Returns:
        A :class:`TrainStep`; ``step(*args, **kwargs)`` returns a :class:`StepOutput`.

    Raises:
        ValueError: invalid arguments, a level/dtype that contradicts a compiled model, or
            ``cuda_graph`` with an optimizer that cannot be captured (the message names the
            fix).

    Example:
        >>> step = build_train_step(model, nn.functional.cross_entropy, opt)  # doctest: +SKIP
        >>> out = step(x, y)  # doctest: +SKIP
    """
    master_weights, release_grads = resolve_memory(memory, master_weights, release_grads)
    network, module = resolve_network(model, amp_level, dtype, compile_kwargs)
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
    params = train_params(module, optimizer)
    device = model_device(module)
    amp = amp_of(module)
    manager = resolve_manager(loss_scale_manager, amp.amp_dtype)
    sharded = is_sharded(params)
    distributed, group = distributed_group(network)
    has_monitor = monitor is not None and callable(getattr(monitor, "after_backward", None))
    if release_grads:  # refused before anything is changed (weights, the manager's hooks)
        check_release(optimizer, clip=clip_grad_norm, accumulation_steps=accumulation_steps,
                      scaled=manager is not None, monitor=has_monitor, distributed=distributed,
                      sharded=sharded, cuda_graph=bool(cuda_graph))
    if manager is not None:
        manager.to(device)
        manager.instrument(module)
    update = weight_update(master_weights, module, optimizer)
    decision = gate(optimizer, manager, update is not None)
    if sharded and decision == FOUND_INF:  # DTensor gradients: decide on the host
        decision = HOST
    spec = StepSpec(
        title=_title(amp, manager, clip_grad_norm, accumulation_steps, distributed),
        has_loss_fn=loss_fn is not None,
        cast_outputs=not amp.amp_config.keep_io_types,
        scaled=manager is not None,
        dynamic=manager is not None and manager.dynamic,
        decision=decision,
        clip_norm=clip_grad_norm,
        distributed=distributed,
        accumulation_steps=accumulation_steps,
        no_sync=accumulation_steps > 1 and isinstance(network, DistributedDataParallel),
        monitor=has_monitor,
        multi_device=len({p.device for p in params}) > 1,
        custom_unscale=manager is not None and manager.custom_unscale,
        observe=manager is not None and manager.wants_gradients,
        update=update is not None,
        sharded=sharded,
        release=bool(release_grads),
    )
    return TrainStep(
        network=network, module=module, loss_fn=loss_fn, optimizer=optimizer, manager=manager,
        spec=spec, clip_grad_norm=clip_grad_norm, monitor=monitor, group=group, params=params,
        update=update, graph_capture=resolve_capture(cuda_graph, spec, optimizer, device),
    )


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
