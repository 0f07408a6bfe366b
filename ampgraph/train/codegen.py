"""Source generation for the train step, and the runtime pieces the generated code uses.

``build_train_step`` describes its configuration as a :class:`StepSpec`; :func:`generate`
writes the step as straight-line Python with only the code that configuration needs (no
clipping code when clipping is off, no all-reduce when not distributed, no scaling without
a loss-scale manager), and :func:`make_step_function` compiles it against a namespace of
the objects it uses. The source is registered with ``linecache`` so tracebacks show it.
"""

from __future__ import annotations

import itertools
import linecache
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from ampgraph.train.loss_scale import unscale_by_device

__all__ = ["ALWAYS", "FOUND_INF", "HOST", "Counters", "StepOutput", "StepSpec", "generate",
           "make_step_function", "runtime_helpers"]

# How the optimizer step is gated on overflow.
HOST = "host"  # one host sync fetches (found_inf, scale); skip optimizer.step() on overflow
FOUND_INF = "found_inf"  # the optimizer takes found_inf (fused Adam/AdamW/SGD): no sync
ALWAYS = "always"  # FixedLossScaleManager(drop_overflow_update=False): always step, no sync

_counter = itertools.count()


@dataclass(frozen=True)
class StepSpec:
    """Everything the generated code is specialised on.

    Attributes:
        title: one line for the generated docstring (level, dtype, manager ...).
        has_loss_fn: call ``loss_fn(net(*args[:-1], **kwargs), args[-1])``; else the model
            returns the loss (a tensor or an object with ``.loss``).
        cast_outputs: cast floating outputs to fp32 before ``loss_fn`` (keep_io_types=False).
        scaled: a loss-scale manager is present (scale the loss, unscale the gradients).
        dynamic: the manager's scale changes, so ``update_loss_scale`` is called.
        decision: HOST, FOUND_INF or ALWAYS.
        clip_norm: max gradient norm, or None for no clipping.
        norm_type: the p of the clipping norm.
        distributed: all-reduce (MAX) the overflow flag over ``group``.
        accumulation_steps: micro-batches per optimizer step.
        no_sync: the network is DDP: skip its gradient all-reduce on non-final micro-batches.
        monitor: call ``monitor.after_backward`` on stepping calls.
        multi_device: parameters live on several devices (unscale per device).
        custom_unscale: the manager unscales (``manager.unscale_``: per-layer scales).
        observe: hand the unscaled gradients to ``manager.observe_gradients`` (on clean steps
            when the step synchronises).
        update: the optimizer update when it is not ``optimizer.step()`` (16-bit weights:
            ``update(optimizer)``).
        sharded: gradients are DTensors (FSDP2 ``fully_shard``): unscale each rank's local
            shard, and the all-reduced flag makes the ranks agree.

    Raises:
        ValueError: a combination no configuration gives (``dynamic``, ``custom_unscale``
            or ``observe`` without ``scaled``: they are the manager's; ``no_sync`` without
            accumulation; ``update`` with the FOUND_INF decision, which only a fused
            ``optimizer.step()`` takes; an unknown decision or fewer than one micro-batch).

    Example:
        >>> StepSpec(title="O2 fp16", scaled=True, dynamic=True, clip_norm=1.0).decision
        'host'
    """

    title: str
    has_loss_fn: bool = True
    cast_outputs: bool = False
    scaled: bool = False
    dynamic: bool = False
    decision: str = HOST
    clip_norm: float | None = None
    norm_type: float = 2.0
    distributed: bool = False
    accumulation_steps: int = 1
    no_sync: bool = False
    monitor: bool = False
    multi_device: bool = False
    custom_unscale: bool = False
    observe: bool = False
    update: bool = False
    sharded: bool = False

    def __post_init__(self) -> None:
        if self.decision not in (HOST, FOUND_INF, ALWAYS):
            raise ValueError(f"decision must be {HOST!r}, {FOUND_INF!r} or {ALWAYS!r}, got "
                             f"{self.decision!r}")
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be at least 1, got "
                             f"{self.accumulation_steps}")
        manager_only = [f for f in ("dynamic", "custom_unscale", "observe") if getattr(self, f)]
        if manager_only and not self.scaled:
            raise ValueError(f"{', '.join(manager_only)} come from a loss-scale manager: set "
                             "scaled=True too")
        if self.no_sync and self.accumulation_steps == 1:
            raise ValueError("no_sync skips the all-reduce of non-final micro-batches: it "
                             "needs accumulation_steps > 1")
        if self.update and self.decision == FOUND_INF:
            raise ValueError("decision=FOUND_INF hands found_inf to a fused optimizer.step(); "
                             "an own update rule (update=True) decides on the host (HOST)")


def generate(spec: StepSpec) -> str:
    """The source of ``train_step(*args, **kwargs) -> StepOutput`` for ``spec``.

    Names the source uses, all provided by the namespace: torch, dist, net, module,
    loss_fn, optimizer, manager, params, found_inf, one, counters, group, monitor,
    StepOutput, update, fp32_loss, model_loss, cast_fp32, to_host, unscale_by_device,
    clip_grad_norm_, nullcontext, local_grads, full_tensor.

    Example:
        >>> "clip_grad_norm_" in generate(StepSpec(title="O2 bf16"))
        False
    """
    n = spec.accumulation_steps
    last = n - 1
    lines = [
        "def train_step(*args, **kwargs):",
        f'    """ampgraph train step: {spec.title}."""',
    ]
    add = lines.append
    # 1. start of a cycle: fresh gradients and a clear overflow flag
    indent = "    "
    add("    # start of a cycle: fresh gradients, clear overflow flag")
    if n > 1:
        add("    micro = counters.micro")
        add("    if micro == 0:")
        indent = "        "
    add(f"{indent}for p in params:")
    add(f"{indent}    p.grad = None")
    add(f"{indent}found_inf.zero_()")
    add("    scale = manager.scale" if spec.scaled else "    scale = one")
    # 2. forward (fp32 loss), non-finite loss check, backward of loss x scale
    add("    # forward through the compiled model, loss in fp32, backward of loss x scale")
    body = "    "
    if spec.no_sync:
        add(f"    with net.no_sync() if micro != {last} else nullcontext():")
        body = "        "
    if spec.has_loss_fn:
        out = "cast_fp32(net(*args[:-1], **kwargs))" if spec.cast_outputs else (
            "net(*args[:-1], **kwargs)")
        add(f"{body}loss = fp32_loss(loss_fn({out}, args[-1]))")
    else:
        add(f"{body}loss = fp32_loss(model_loss(net(*args, **kwargs)))")
    add(f"{body}found_inf.logical_or_(loss.detach().isfinite().logical_not_())")
    factor = " * scale" if spec.scaled else ""
    divisor = f" / {n}" if n > 1 else ""
    target = f"(loss{divisor}{factor})" if factor or divisor else "loss"
    add(f"{body}{target}.backward()")
    if n > 1:
        add(f"    if micro != {last}:")
        add("        counters.micro = micro + 1")
        add("        return StepOutput(loss.detach(), torch.stack((found_inf, scale)), False)")
        add("    counters.micro = 0")
    # 3. unscale in fp32 with the fused non-finite check
    if spec.custom_unscale:
        add("    # the manager unscales (per-layer scales); found_inf = 1 if any is inf/NaN")
    elif spec.scaled:
        add("    # unscale the fp32 gradients in place; found_inf = 1 if any is inf/NaN")
        add("    inv_scale = scale.double().reciprocal().float()")
        inv = "inv_scale"
    else:
        add("    # no loss scaling: the fused kernel only checks for inf/NaN (multiplies by 1)")
        inv = "one"
    if spec.custom_unscale:
        add("    manager.unscale_(params, found_inf)  # per-layer scales")
    elif spec.multi_device:
        add(f"    unscale_by_device(params, found_inf, {inv})")
    elif spec.sharded:
        add("    grads = local_grads(params)  # each rank's shard of the DTensor gradients")
        add(f"    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, {inv})")
    else:
        add("    grads = [p.grad for p in params if p.grad is not None]")
        add(f"    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, {inv})")
    # 4. every rank takes the same decision
    if spec.distributed:
        add("    # every rank takes the same decision")
        add("    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)")
    if spec.monitor:
        add("    monitor.after_backward(counters.step_index, module, optimizer, scale, found_inf)")
    early = spec.observe and spec.decision == HOST
    clean_block = False  # the last lines are the body of `if not host[0]:`
    if early:  # statistics only on clean steps: synchronise before measuring
        add("    info = torch.stack((found_inf, scale))  # this step's (overflow, scale)")
        add("    host = to_host(info)  # the step's one host synchronisation")
        add("    if not host[0]:")
        add("        manager.observe_gradients(params, found_inf)")
        clean_block = True
    elif spec.observe:
        add("    manager.observe_gradients(params, found_inf)  # on the device, no sync")
    # 5. clip the unscaled gradients
    grad_norm = "None"
    if spec.clip_norm is not None:  # on every step, overflow or not: ends a clean block
        clean_block = False
        add(f"    grad_norm = clip_grad_norm_(params, {spec.clip_norm!r}, "
            f"norm_type={spec.norm_type!r})")
        if spec.sharded:
            add("    grad_norm = full_tensor(grad_norm)  # the norm over every rank's shard")
        grad_norm = "grad_norm"
    # 6. optimizer step unless overflow
    step_call = "update(optimizer)" if spec.update else "optimizer.step()"
    if not early:
        add("    info = torch.stack((found_inf, scale))  # this step's (overflow, scale)")
    host = "None"
    if spec.decision == HOST:
        if not early:
            add("    host = to_host(info)  # the step's one host synchronisation")
        if not clean_block:
            add("    if not host[0]:")
        add(f"        {step_call}")
        host = "host"
    elif spec.decision == FOUND_INF:
        add("    # the fused optimizer skips its update on the device when found_inf is 1")
        add("    optimizer.found_inf = found_inf")
        add("    try:")
        add("        optimizer.step()")
        add("    finally:")
        add("        del optimizer.found_inf")
    else:
        add(f"    {step_call}  # drop_overflow_update=False: step even on overflow")
    # 7. manager update (on the device)
    if spec.dynamic:
        add("    manager.update_loss_scale(found_inf)  # on the device, no sync")
    add("    counters.step_index += 1")
    add(f"    return StepOutput(loss.detach(), info, True, {grad_norm}, {host})")
    return "\n".join(lines) + "\n"


def make_step_function(source: str, namespace: dict[str, Any]) -> Callable[..., Any]:
    """Compile ``source`` (from :func:`generate`) with ``namespace`` as its globals.

    Example:
        >>> f = make_step_function("def train_step():\\n    return one\\n", {"one": 1})
        >>> f()
        1
    """
    filename = f"<ampgraph-train-step-{next(_counter)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope = dict(namespace)
    exec(compile(source, filename, "exec"), scope)  # noqa: S102 - our own generated code
    return scope["train_step"]


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
        "local_grads": local_grads, "full_tensor": full_tensor,
    }
