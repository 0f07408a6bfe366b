"""A user's ``torch.autograd.Function`` keeps its own backward.

Non-strict torch.export runs a Function's ``forward`` and records its aten ops; the
graph's backward is then autograd's derivative of those ops, not the Function's
``backward``: a straight-through estimator (forward ``round``, backward identity) gives a
gradient of 0, a gradient reversal layer loses its sign, a fused kernel's hand-written
backward is replaced. While :func:`opaque_functions` is active (around export), each
application of a Function the traced model makes becomes an opaque call
(:mod:`ampgraph.capture.opaque`): at run time the graph calls ``Function.apply`` itself on
real fp32 tensors, so its forward and backward run as written, every call.

Two doors lead into a Function: ``Function.apply`` (patched while export runs), and its
``forward``, which torch's C++ ``apply`` looks up on the class when the model holds an
``apply`` bound before the export (``round_ste = RoundSTE.apply`` at import time). Each
Function class defined outside torch has its ``forward`` wrapped for the export too.

Only the exporting thread's calls are kept out (other threads' run as before), and not
those made inside an opaque call's own fake run. torch's own Functions are traced as
before (export handles them, or ampgraph stands in for them: activation checkpointing's,
``capture/checkpoints.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.function import _is_setup_context_defined

from ampgraph.capture.opaque import OpaqueCall, emit
from ampgraph.capture.watch import active

_APPLY = torch.autograd.Function.__dict__["apply"]  # the classmethod object


def kept_out(cls: type) -> bool:
    """Whether applications of ``cls`` are kept out of the graph: a Function defined
    outside torch."""
    return not (cls.__module__ or "").startswith("torch.")


class FunctionCall(OpaqueCall):
    """``cls.apply(*args, **kwargs)`` kept out of the graph."""

    kind = "autograd.Function"

    def __init__(self, cls: type, args: tuple, kwargs: dict) -> None:
        self.cls = cls
        super().__init__(f"{cls.__qualname__}.apply", args, kwargs)

    def run(self, args: tuple, kwargs: dict) -> Any:
        return self.cls.apply(*args, **kwargs)

    def run_fake(self, args: tuple, kwargs: dict) -> Any:
        return _APPLY.__func__(self.cls, *args, **kwargs)


def _routing() -> bool:
    watch = active()
    return watch is not None and not watch.paused and watch.route is not None


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    if not _routing() or not kept_out(cls):
        return _APPLY.__func__(cls, *args, **kwargs)
    return emit(FunctionCall(cls, args, kwargs))


def _wrapped_forward(cls: type, forward: Any) -> Any:
    """``cls``'s forward, which keeps an application out of the graph while routing."""
    with_ctx = not _is_setup_context_defined(cls.setup_context)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _routing():
            return forward(*args, **kwargs)
        return emit(FunctionCall(cls, args[1:] if with_ctx else args, kwargs))

    return staticmethod(wrapper)


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


@contextlib.contextmanager
def opaque_functions() -> Iterator[None]:
    """Within the block, applications of Functions defined outside torch, made by a model
    being exported (in this thread, while :func:`~ampgraph.capture.watch.watching` routes
    its calls), become opaque calls; torch's ``Function.apply`` and each class's
    ``forward`` are back on exit, whatever happens.

    Example:
        >>> with watching(model, route), opaque_functions():
        ...     ep = torch.export.export(root, inputs, strict=False)  # doctest: +SKIP
    """
    wrapped: list[tuple[type, Any]] = []  # (class, its own forward entry or None)
    try:
        torch.autograd.Function.apply = classmethod(_apply)
        for cls in dict.fromkeys(_subclasses(torch.autograd.Function)):
            if kept_out(cls) and "forward" in dir(cls):
                wrapped.append((cls, cls.__dict__.get("forward")))
                cls.forward = _wrapped_forward(cls, cls.forward)
        yield
    finally:
        torch.autograd.Function.apply = _APPLY
        for cls, own in reversed(wrapped):
            if own is None:
                delattr(cls, "forward")
            else:
                cls.forward = own
