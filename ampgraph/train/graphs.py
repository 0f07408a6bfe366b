"""The whole train step as CUDA graphs: ``build_train_step(..., cuda_graph=True)``.

A step of an eager model is launch-bound on a GPU: the host takes as long to enqueue the
kernels as the GPU takes to run them. Captured once as a CUDA graph (forward, backward,
unscale, the overflow check, the loss-scale update, the optimizer step and the weight
groups' refresh), a step is one launch. What it takes:

- **Phases.** The generated step is split into straight-line phase functions
  (``codegen.phases``): "whole" for one micro-batch a step; with accumulation "first"
  (gradients zeroed in place, the flag cleared), "middle" and "last" (unscale, step,
  update). Each (phase, input signature) is a graph of its own.
- **Static memory.** Gradients are zeroed in place, never dropped, so every graph reads
  and writes the same gradient tensors; the working copies are refreshed in place; the
  loss scale, the overflow flag and the optimizer's state stay where they are. Each call's
  inputs are copied into the graph's static input tensors; its outputs are cloned, so a
  later replay does not overwrite what the caller holds.
- **Warm-up, then capture.** The first ``warmup_steps`` calls of a signature run eagerly
  (on the capture's side stream): they capture the model, make the optimizer's state and
  the gradients. The next call captures, after marking every working copy stale so the
  graph records their refresh, and replays once for its own step.
- **A bounded cache.** At most ``max_graphs`` graphs live; the least recently used goes
  first (a signature seen again warms up and captures again).
- **Eager where capture is impossible.** A capture that fails (a host synchronisation in
  the model, an op CUDA graphs refuse) warns once, with the reason, and that signature
  runs the same phase code eagerly from then on.
- **After a replay** the parameters' version counters are bumped (the graph changed them
  where autograd could not see), so eager calls refresh their copies; an optimizer whose
  float hyperparameters changed since the capture (a scheduler on a float ``lr``) raises:
  the graph would replay the old value.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ampgraph.module import AmpModule
from ampgraph.runtime.cuda.graphs import captures_on
from ampgraph.train.codegen import HOST, StepSpec, graph_obstacles
from ampgraph.train.replay_check import CaptureMismatch

__all__ = ["GraphCapture", "StepGraphs", "graph_inputs", "mark_weights_stale", "resolve_capture"]


@dataclass(frozen=True)
class GraphCapture:
    """How ``build_train_step(..., cuda_graph=...)`` captures the step (``True`` = the
    defaults).

    Attributes:
        warmup_steps: eager calls of each input signature before its capture (>= 1: the
            first call captures the model and makes the optimizer's state).
        max_graphs: graphs kept at once (each holds its own activations' memory).
        check: instead of CUDA graphs, run the step through ``ReplayCheck`` on any device:
            it fails with ``CaptureMismatch`` where a CUDA graph would not replay the step
            faithfully (slow; for tests and for checking a step without a GPU).

    Raises:
        ValueError: a count below 1.

    Example:
        >>> GraphCapture(max_graphs=2).warmup_steps
        3
    """

    warmup_steps: int = 3
    max_graphs: int = 4
    check: bool = False

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "max_graphs"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GraphCapture.{name} must be an integer >= 1, got {value!r}")


class _Entry:
    """One (phase, signature): its eager calls so far, then its graph."""

    __slots__ = ("calls", "handle", "inputs", "outputs", "held", "hyper", "eager")

    def __init__(self) -> None:
        self.calls = 0
        self.handle: Any = None
        self.inputs: list[torch.Tensor] = []
        self.outputs: Any = None
        self.held: list[torch.Tensor] = []  # what the graph reads that it did not make
        self.hyper: tuple = ()  # the optimizer's plain-number settings it baked in
        self.eager = False


class StepGraphs:
    """The phase functions of a step, each run as graphs per input signature.

    Args:
        functions: phase name -> the phase's generated function.
        params: the parameters the step trains.
        optimizer: the step's optimizer (its hyperparameters are checked at each replay).
        refresh: marks every working copy stale (``AmpModule.mark_weights_stale`` of each
            compiled module), called before each capture.
        holds: what the graphs read that they do not make (gradients, working copies),
            kept alive with each graph.
        engine: ``runtime.cuda.graphs.CudaGraphEngine`` or ``replay_check.ReplayCheck``.
        config: the :class:`GraphCapture`.

    Example:
        >>> loss, info, norm = graphs("whole", (x, y), {})  # doctest: +SKIP
    """

    def __init__(self, functions: dict[str, Callable[..., Any]], params: list[torch.Tensor],
                 optimizer: torch.optim.Optimizer, refresh: Callable[[], None],
                 holds: Callable[[], list[torch.Tensor]], engine: Any,
                 config: GraphCapture) -> None:
        self.functions, self.params, self.optimizer = functions, params, optimizer
        self.refresh, self.holds, self.engine, self.config = refresh, holds, engine, config
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.captures = 0  # graphs captured so far (tests, benchmarks)
        self.replays = 0

    def __call__(self, phase: str, args: tuple, kwargs: dict) -> tuple:
        leaves, spec = tree_flatten((args, kwargs))
        key = (phase, spec, *map(_signature, leaves))
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
            if len(self._entries) > _SIGNATURES * self.config.max_graphs:
                self._forget_oldest_uncaptured()
        self._entries.move_to_end(key)
        fn = self.functions[phase]
        if entry.eager:
            return fn(*args, **kwargs)
        if entry.handle is not None:
            self._check_unchanged(entry)
            for static, new in zip(entry.inputs, (t for t in leaves
                                                  if isinstance(t, torch.Tensor))):
                static.copy_(new)
            out = self.engine.replay(entry.handle, entry.outputs)
            self.replays += 1
            return self._after(phase, out)
        entry.calls += 1
        if entry.calls <= self.config.warmup_steps:
            return self.engine.warmup(fn, args, kwargs)
        return self._capture(entry, phase, fn, leaves, spec)

    def _capture(self, entry: _Entry, phase: str, fn: Callable[..., Any], leaves: list,
                 spec: Any) -> tuple:
        self._evict()
        statics = [t.detach().clone() if isinstance(t, torch.Tensor) else t for t in leaves]
        args, kwargs = tree_unflatten(statics, spec)
        try:
            handle, out = self.engine.capture(fn, args, kwargs, self.refresh)
        except Exception as exc:
            if isinstance(exc, CaptureMismatch):
                raise
            self.refresh()  # the capture recorded refreshes it never ran
            entry.eager = True
            warnings.warn(
                f"ampgraph: the train step ({phase} phase) could not be captured as a CUDA "
                f"graph for these inputs ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
                "they run eagerly from now on", RuntimeWarning, stacklevel=4)
            args, kwargs = tree_unflatten(leaves, spec)
            return fn(*args, **kwargs)
        entry.handle, entry.outputs = handle, out
        entry.inputs = [t for t in statics if isinstance(t, torch.Tensor)]
        entry.held = self.holds()
        entry.hyper = _hyperparameters(self.optimizer)
        self.captures += 1
        return self._after(phase, out)

    def _after(self, phase: str, out: tuple) -> tuple:
        if phase in ("whole", "last"):  # the graph stepped the masters: eager calls refresh
            torch.autograd.graph.increment_version(self.params)
        return tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in out)

    def _forget_oldest_uncaptured(self) -> None:
        """Signatures that come and go (a new length every batch) never capture: forget
        the least recently seen one so their entries do not pile up."""
        for key, entry in self._entries.items():
            if entry.handle is None:
                del self._entries[key]
                return

    def _evict(self) -> None:
        captured = [k for k, e in self._entries.items() if e.handle is not None]
        for key in captured[:max(0, len(captured) - self.config.max_graphs + 1)]:
            del self._entries[key]  # least recently used first

    def _check_unchanged(self, entry: _Entry) -> None:
        now = _hyperparameters(self.optimizer)
        if now != entry.hyper:
            raise RuntimeError(
                f"ampgraph: the optimizer's hyperparameters changed after the train step was "
                f"captured as a CUDA graph ({_changed(entry.hyper, now)}); the graph replays "
                "the values it captured. Give the optimizer tensors for what changes (e.g. "
                "lr=torch.tensor(1e-3) with fused=True or capturable=True: schedulers then "
                "change it in place), or call reset_graphs() after changing it")

    def reset(self) -> None:
        """Drop every graph (after the optimizer's state or the parameters were replaced):
        each signature warms up and captures again."""
        self._entries.clear()

    def __len__(self) -> int:
        return sum(1 for e in self._entries.values() if e.handle is not None)


_SIGNATURES = 16  # signatures remembered per graph kept (warming up, eager or captured)


def _signature(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return (tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad)
    try:
        hash(leaf)
    except TypeError:  # an object the step reads as it is: the same object, the same graph
        return ("object", id(leaf))
    return leaf


def _hyperparameters(optimizer: torch.optim.Optimizer) -> tuple:
    """Each param group's plain-number settings (what a capture bakes in)."""
    return tuple(tuple((k, v) for k, v in group.items()
                       if isinstance(v, (int, float, bool, tuple)) and k != "params")
                 for group in optimizer.param_groups)


def _changed(then: tuple, now: tuple) -> str:
    for i, (a, b) in enumerate(zip(then, now)):
        for (k, x), (_, y) in zip(a, b):
            if x != y:
                return f"param group {i}: {k} {x!r} -> {y!r}"
    return "param groups added or removed"


def resolve_capture(option: Any, spec: StepSpec, optimizer: torch.optim.Optimizer,
                   device: torch.device) -> GraphCapture | None:
    """The capture ``build_train_step``'s ``cuda_graph=option`` asks of a step of ``spec``,
    or None to run it eagerly (with a warning where capture is impossible).

    Raises:
        ValueError: ``option`` is not a bool or a GraphCapture, or the optimizer cannot be
            captured (the message names the fix).

    Example:
        >>> resolve_capture(False, spec, opt, torch.device("cuda")) is None  # doctest: +SKIP
        True
    """
    if option is False or option is None:
        return None
    if option is True:
        option = GraphCapture()
    if not isinstance(option, GraphCapture):
        raise ValueError(f"cuda_graph must be a bool or an ampgraph.GraphCapture, got "
                         f"{option!r}")
    # torch refuses to capture an optimizer with a param group's capturable off (fused too)
    not_capturable = [i for i, g in enumerate(optimizer.param_groups)
                      if g.get("capturable") is False]
    decided_on_host = spec.decision == HOST and not (spec.update or spec.sharded)
    if decided_on_host or not_capturable:
        name = type(optimizer).__name__
        why = (f"param groups {not_capturable} are not capturable" if not_capturable else
               "it cannot skip an overflowing step on the device, so the step would decide "
               "on the host")
        raise ValueError(
            f"cuda_graph: {name} cannot be captured in a CUDA graph ({why}): create it with "
            f"torch.optim.{name if name in _FUSED else 'AdamW'}(params, lr=..., fused=True, "
            "capturable=True) (SGD: fused=True, without momentum), or build the step "
            "without cuda_graph")
    obstacles = [o for o in graph_obstacles(spec) if not o.startswith("the optimizer")]
    if not captures_on(device) and not option.check:
        obstacles.insert(0, f"the model is on {device}: CUDA graphs need a CUDA device "
                            "(GraphCapture(check=True) checks on any device that the step "
                            "could be captured)")
    if obstacles:
        warnings.warn(f"ampgraph: cuda_graph: the train step runs eagerly: {obstacles[0]}",
                      RuntimeWarning, stacklevel=3)
        return None
    return option


_FUSED = ("Adam", "AdamW", "SGD")


def mark_weights_stale(network: nn.Module) -> None:
    """Every compiled module of ``network`` refreshes all its copies at its next call."""
    for m in network.modules():
        if isinstance(m, AmpModule):
            m.mark_weights_stale()


def graph_inputs(network: nn.Module, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """What a captured step reads that it did not make: gradients and working copies."""
    held = [p.grad for p in params if p.grad is not None]
    for m in network.modules():
        if isinstance(m, AmpModule):
            held += m.working_copies()
    return held
