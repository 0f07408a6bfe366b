"""Gradient sinks: a parameter whose gradient is handed over in parts, each part stepped as
soon as it is formed, instead of accumulated whole into ``p.grad``.

``train/release_grads.py``'s ``ReleasedGradients`` (``build_train_step(...,
release_grads=True)`` with fp32 master weights) registers itself as the sink of each
parameter it steps. An op that forms a parameter's whole gradient by blocks (the fused head,
``head_loss.py``: its weight's gradient by blocks of vocabulary rows) asks :func:`sink_of`
for the weight's sink; while :meth:`GradSink.accepting`, it hands each block to
:meth:`GradSink.take` and returns no gradient for the weight, so the weight's gradient never
exists whole. Outside a step's backward (or with no sink) it returns the gradient as usual.

Only an op that forms *all* of a parameter's gradient may hand it over: the graph pass that
emits it decides that (the parameter has no other use in the graph).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["GradSink", "register_sink", "sink_of", "unregister_sink"]


class GradSink(Protocol):
    """Where a parameter's gradient goes by parts (see the module docstring)."""

    def accepting(self) -> bool:
        """Whether parts handed over now are stepped (a step's backward is running)."""

    def take(self, p: torch.Tensor, start: int, grad: torch.Tensor) -> None:
        """Step ``p``'s flat elements ``[start, start + grad.numel())`` with ``grad``."""

    def finish(self, p: torch.Tensor) -> None:
        """Every part of ``p``'s gradient in this backward has been taken."""


_SINKS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_sink(p: torch.Tensor, sink: GradSink) -> None:
    """Make ``sink`` the one that takes ``p``'s gradient by parts."""
    _SINKS[p] = sink


def unregister_sink(p: torch.Tensor, sink: GradSink) -> None:
    """Take ``sink`` off ``p`` (if it is still ``p``'s)."""
    if _SINKS.get(p) is sink:
        del _SINKS[p]


def sink_of(p: torch.Tensor) -> GradSink | None:
    """``p``'s sink, or None: its gradient goes to ``p.grad`` as usual.

    Example:
        >>> sink_of(torch.nn.Parameter(torch.ones(2))) is None
        True
    """
    return _SINKS.get(p)
