"""How a call reaches a compiled module's graph, from outside it.

- Autocast is off while the graph runs (:func:`autocast_off`): the graph's casts are the
  precision, and Accelerate, Lightning and the HF Trainer wrap forward in autocast.
- Under ``torch.compile`` of the compiled module (or of a model holding one), the call is
  dynamo's graph break (:func:`outside_dynamo`): ampgraph's graphs run as they are, not
  traced into an inductor graph (``backend="inductor"`` is how they meet inductor).
- When a graph raises, the eager model runs the same inputs (:func:`raise_eager_error`):
  if it rejects them too, its error is raised, in its words (a wrong dtype reads as the
  user's model says it, not with the graph's bf16).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampgraph.capture.hooks import forward_of
from ampgraph.capture.state import AUTOCAST_DEVICES


def autocast_on() -> bool:
    return any(torch.is_autocast_enabled(d) for d in AUTOCAST_DEVICES)


def autocast_off() -> contextlib.ExitStack:
    """Disable autocast on every device where it is on; the graph keeps its fp32 ops fp32
    and capture sees no autocast.

    Example:
        >>> with autocast_off():
        ...     out = graph(x)  # doctest: +SKIP
    """
    stack = contextlib.ExitStack()
    for device in AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


def outside_dynamo(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` as dynamo's graph break, with autocast off (made on first use: dynamo is
    imported only once it traces).

    Example:
        >>> outside_dynamo(AmpModule._run_hooked)(net, x)  # doctest: +SKIP
    """
    disabled = _DISABLED.get(run)
    if disabled is None:
        import torch._dynamo

        def call(*args: Any, **kwargs: Any) -> Any:
            with autocast_off():
                return run(*args, **kwargs)

        disabled = _DISABLED[run] = torch._dynamo.disable(call, recursive=True)
    return disabled


_DISABLED: dict[Callable[..., Any], Callable[..., Any]] = {}


def raise_eager_error(model: nn.Module, args: tuple, kwargs: dict, exc: Exception) -> None:
    """A graph raised ``exc``: raise what the eager model raises for the same inputs;
    return when eager takes them (``exc`` is then ampgraph's to raise, with a note).

    Example:
        >>> try:
        ...     flat = graph(x)
        ... except Exception as exc:
        ...     raise_eager_error(model, (x,), {}, exc)
        ...     raise  # doctest: +SKIP
    """
    try:
        with torch.no_grad():
            forward_of(model)(*args, **kwargs)
    except Exception as eager:
        raise eager from None
    exc.add_note("ampgraph: the eager model takes these inputs; please report this failure")
