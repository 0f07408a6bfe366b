"""``loss_only()``: calls whose caller reads only the loss of what the model returns.

``build_train_step``'s step calls the compiled model inside ``with loss_only():`` when
the model computes its own loss (``loss_fn=None``): nothing else it returns is read, so
the graph that runs those calls may drop the logits the model returns beside the loss
and fuse their product with the loss (``head_loss="drop_logits"``,
``passes/fx/routing/head_loss.py``). Such calls get graphs of their own (the cache key
says so): the same module called directly still returns everything.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from contextvars import ContextVar

__all__ = ["graph_mode", "head_loss_for", "loss_only", "wants_loss_only"]

_LOSS_ONLY: ContextVar[bool] = ContextVar("ampgraph_loss_only", default=False)


@contextlib.contextmanager
def loss_only() -> Iterator[None]:
    """Calls in the body read only the loss of the model's outputs.

    Example:
        >>> with loss_only():
        ...     wants_loss_only()
        True
    """
    token = _LOSS_ONLY.set(True)
    try:
        yield
    finally:
        _LOSS_ONLY.reset(token)


def wants_loss_only() -> bool:
    """Whether the present call is inside :func:`loss_only`.

    Example:
        >>> wants_loss_only()
        False
    """
    return _LOSS_ONLY.get()


def graph_mode(training: bool) -> Hashable:
    """What keys a call's graphs apart besides its inputs: the training flag, paired with
    "loss only" inside :func:`loss_only`.

    Example:
        >>> graph_mode(True)
        True
    """
    return (training, "loss only") if wants_loss_only() else training


def head_loss_for(configured: str, training: bool) -> str:
    """The ``head_loss`` mode a capture runs: the compiled module's (``configured``), but
    logits are dropped only in training or for a caller inside :func:`loss_only`, and
    "off" stays off.

    Example:
        >>> head_loss_for("drop_logits", training=False), head_loss_for("auto", True)
        ('auto', 'auto')
    """
    if configured == "off":
        return "off"
    return "drop_logits" if wants_loss_only() or training and configured == "drop_logits" \
        else "auto"
