"""Source generation for the train step (the pieces its code calls: ``step_runtime.py``).

``build_train_step`` describes its configuration as a :class:`StepSpec`; :func:`generate`
writes the step as straight-line Python with only the code that configuration needs (no
clipping code when clipping is off, no all-reduce when not distributed, no scaling without
a loss-scale manager), and :func:`make_step_function` compiles it against a namespace of
the objects it uses. The source is registered with ``linecache`` so tracebacks show it.
"""

from __future__ import annotations

import itertools
import linecache
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ALWAYS", "FOUND_INF", "HOST", "PHASES", "StepSpec", "gate", "generate",
           "graph_obstacles", "make_step_function", "phases"]

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
        release: each parameter is stepped in backward and its gradient freed there
            (``released``, ``release_grads.py``): nothing after backward but the result.

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
    release: bool = False

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
        if self.release and (self.scaled or self.clip_norm is not None or self.monitor
                             or self.distributed or self.sharded or self.accumulation_steps > 1):
            raise ValueError("release steps each parameter in backward: no loss scaling, "
                             "clipping, monitor, collective or accumulation after it")
        if self.update and self.decision == FOUND_INF:
            raise ValueError("decision=FOUND_INF hands found_inf to a fused optimizer.step(); "
                             "an own update rule (update=True) decides on the host (HOST)")


# The phases of a step captured as CUDA graphs (``ampgraph.train.graphs``): straight-line
# code with no counters, each a graph of its own. "whole" is a step of one micro-batch;
# with accumulation a cycle runs "first", then "middle" ones, then "last".
WHOLE, FIRST, MIDDLE, LAST = "whole", "first", "middle", "last"
PHASES = (WHOLE, FIRST, MIDDLE, LAST)


def phases(accumulation_steps: int) -> tuple[str, ...]:
    """The phase of each call of a cycle of ``accumulation_steps`` micro-batches.

    Example:
        >>> phases(3)
        ('first', 'middle', 'last')
    """
    if accumulation_steps == 1:
        return (WHOLE,)
    return (FIRST, *[MIDDLE] * (accumulation_steps - 2), LAST)


def generate(spec: StepSpec, phase: str | None = None) -> str:
    """The source of ``train_step(*args, **kwargs) -> StepOutput`` for ``spec``; with a
    ``phase`` (``PHASES``), that phase of a step to capture as a CUDA graph, returning
    ``(loss, info, grad_norm)`` tensors: gradients zeroed in place rather than dropped
    (they keep their addresses), no counters, no host synchronisation.

    Names the source uses, all provided by the namespace: torch, dist, net, module,
    loss_fn, optimizer, manager, params, found_inf, one, counters, group, monitor,
    StepOutput, update, fp32_loss, model_loss, cast_fp32, to_host, unscale_by_device,
    clip_grad_norm_, nullcontext, local_grads, full_tensor, zero_grads, loss_only,
    released.

    Raises:
        ValueError: a phase the spec cannot run as a graph (a host decision, a
            collective, a monitor: see ``graph_obstacles``), or an unknown phase.

    Example:
        >>> "clip_grad_norm_" in generate(StepSpec(title="O2 bf16"))
        False
    """
    if phase is not None:
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        obstacles = graph_obstacles(spec)
        if obstacles:
            raise ValueError(f"this step cannot be captured as a CUDA graph: {obstacles[0]}")
    n = spec.accumulation_steps
    last = n - 1
    title = spec.title if phase is None else f"{spec.title}; CUDA graph phase {phase!r}"
    lines = [
        "def train_step(*args, **kwargs):",
        f'    """ampgraph train step: {title}."""',
    ]
    add = lines.append
    # 1. start of a cycle: fresh gradients and a clear overflow flag
    indent = "    "
    if phase is None:
        add("    # start of a cycle: fresh gradients, clear overflow flag")
        if n > 1:
            add("    micro = counters.micro")
            add("    if micro == 0:")
            indent = "        "
        add(f"{indent}for p in params:")
        add(f"{indent}    p.grad = None")
        add(f"{indent}found_inf.zero_()")
    elif phase in (WHOLE, FIRST):
        add("    # start of a cycle: gradients zeroed in place (addresses kept), flag cleared")
        add("    zero_grads(params)")
        add("    found_inf.zero_()")
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
    else:  # only the loss is read: the graph may drop the logits (head_loss)
        add(f"{body}with loss_only():")
        add(f"{body}    loss = fp32_loss(model_loss(net(*args, **kwargs)))")
    add(f"{body}found_inf.logical_or_(loss.detach().isfinite().logical_not_())")
    factor = " * scale" if spec.scaled else ""
    divisor = f" / {n}" if n > 1 else ""
    target = f"(loss{divisor}{factor})" if factor or divisor else "loss"
    if spec.release:
        add(f"{body}with released.stepping():  # each parameter stepped, its gradient freed")
        add(f"{body}    {target}.backward()")
        add("    counters.step_index += 1")
        add("    info = torch.stack((found_inf, scale))  # this step's (overflow, scale)")
        add("    return StepOutput(loss.detach(), info, True, None, None)")
        return "\n".join(lines) + "\n"
    add(f"{body}{target}.backward()")
    if phase in (FIRST, MIDDLE):
        add("    return loss.detach(), torch.stack((found_inf, scale)), None")
        return "\n".join(lines) + "\n"
    if phase is None and n > 1:
        add(f"    if micro != {last}:")
        add("        counters.micro = micro + 1")
        add("        return StepOutput(loss.detach(), torch.stack((found_inf, scale)), False)")
        add("    counters.micro = 0")
    _finish(spec, add, graphed=phase is not None)
    return "\n".join(lines) + "\n"


def _finish(spec: StepSpec, add: Callable[[str], None], graphed: bool) -> None:
    """Unscale, agree, clip, step and update: the lines after the last backward."""
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
    if graphed:
        add(f"    return loss.detach(), info, {grad_norm}")
        return
    add("    counters.step_index += 1")
    add(f"    return StepOutput(loss.detach(), info, True, {grad_norm}, {host})")


def gate(optimizer: Any, manager: Any, own_update: bool = False) -> str:
    """How the optimizer step of a step with this optimizer and loss-scale manager is
    gated on overflow: ALWAYS, HOST or FOUND_INF (see the constants).

    Example:
        >>> gate(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1), None)
        'host'
    """
    if manager is not None and not manager.get_drop_overflow_update():
        return ALWAYS
    if own_update:  # the 16-bit update rule is not a fused optimizer: decide on the host
        return HOST
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return HOST
    # torch's fused SGD with momentum leaves torch.empty momentum buffers when its very first
    # step is skipped through found_inf, and later steps read them: decide on the host.
    if isinstance(optimizer, torch.optim.SGD) and any(
        g.get("momentum", 0) for g in optimizer.param_groups
    ):
        return HOST
    return FOUND_INF


def graph_obstacles(spec: StepSpec) -> list[str]:
    """Why a step of ``spec`` cannot be captured as a CUDA graph (empty: it can), each
    reason naming what to change.

    Example:
        >>> graph_obstacles(StepSpec(title="t"))[0][:40]
        'the optimizer step is decided on the hos'
    """
    reasons = []
    if spec.decision == HOST:
        reasons.append("the optimizer step is decided on the host (a synchronisation each "
                       "step): use a fused optimizer, e.g. torch.optim.AdamW(params, "
                       "fused=True, capturable=True), which skips an overflowing step on "
                       "the device")
    for flag, what in (("distributed", "a collective over a process group (DDP, FSDP2)"),
                       ("sharded", "DTensor (FSDP2) gradients"),
                       ("monitor", "a monitor called from the step"),
                       ("multi_device", "parameters on several devices"),
                       ("custom_unscale", "a manager that unscales per layer"),
                       ("update", "16-bit weights updated by ampgraph's own rule"),
                       ("release", "parameters stepped in backward (release_grads)")):
        if getattr(spec, flag):
            reasons.append(f"{what} is not captured: build the step without it")
    return reasons


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
