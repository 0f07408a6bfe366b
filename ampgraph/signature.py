"""``AmpModule.forward`` with the signature of the model it compiles.

``inspect.signature(net.forward)`` then equals ``inspect.signature(model.forward)``:
HuggingFace's Trainer drops the dataset columns forward does not name, Accelerate rewraps
``forward.__func__``.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

from torch import nn


class SignedForward:
    """``AmpModule.forward``, bound per instance to the function :func:`signed_forward`
    made for it (kept in the instance's ``_amp_forward``), or to ``fn`` without one. A
    non-data descriptor, so assigning ``net.forward`` (Accelerate's autocast wrapper) still
    shadows it per instance."""

    def __init__(self, fn: Any) -> None:
        self._fn = fn
        functools.update_wrapper(self, fn)

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        if obj is None:
            return self._fn
        return types.MethodType(obj.__dict__.get("_amp_forward") or self._fn, obj)


def signed_forward(model: nn.Module, run: Callable[..., Any]) -> Any:
    """A function ``(self, *args, **kwargs)`` calling ``run`` (AmpModule's forward), whose
    ``__signature__`` is ``self`` + ``model.forward``'s parameters; None if it has none."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return run(self, *args, **kwargs)

    first = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = sig.replace(parameters=[first, *sig.parameters.values()])
    forward.__doc__ = getattr(type(model).forward, "__doc__", None)
    return forward
