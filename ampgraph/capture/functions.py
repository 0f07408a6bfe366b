"""A user's ``torch.autograd.Function`` keeps its own backward.

Non-strict torch.export runs a Function's ``forward`` and records its aten ops; the
graph's backward is then autograd's derivative of those ops, not the Function's
``backward``: a straight-through estimator (forward ``round``, backward identity) gives a
gradient of 0, a gradient reversal layer loses its sign, a fused kernel's hand-written
backward is replaced. While :func:`opaque_functions` is active (around export), each
``Function.apply`` the traced model makes becomes an opaque call
(:mod:`ampgraph.capture.opaque`): at run time the graph calls ``Function.apply`` itself on
real fp32 tensors, so its forward and backward run as written, every call.

Only the exporting thread's calls are kept out (other threads' ``apply`` runs as before),
and not those made inside an opaque call's own fake run. Functions that torch.export
already traces faithfully, or that ampgraph stands in for while it exports (activation
checkpointing's, ``capture/checkpoints.py``), are traced as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ampgraph.capture.opaque import OpaqueCall, emit
from ampgraph.capture.watch import active

_APPLY = torch.autograd.Function.__dict__["apply"]  # the classmethod object


def _traced_as_is() -> tuple[type, ...]:
    """Functions export traces faithfully (their backward is autograd's derivative of their
    forward anyway) or that ampgraph stands in for."""
    import torch.utils.checkpoint as ckpt

    return (ckpt.CheckpointFunction,)


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


def _apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    watch = active()
    if watch is None or watch.paused or watch.route is None or issubclass(cls, _traced_as_is()):
        return _APPLY.__func__(cls, *args, **kwargs)
    return emit(FunctionCall(cls, args, kwargs))


@contextlib.contextmanager
def opaque_functions() -> Iterator[None]:
    """Within the block, ``Function.apply`` calls made by a model being exported (in this
    thread, while :func:`~ampgraph.capture.watch.watching` routes its calls) become opaque
    calls; ``Function.apply`` is torch's own again on exit, whatever happens.

    Example:
        >>> with watching(model, route), opaque_functions():
        ...     ep = torch.export.export(root, inputs, strict=False)  # doctest: +SKIP
    """
    torch.autograd.Function.apply = classmethod(_apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = _APPLY
