"""``AmpModule.forward`` with the signature of the model it compiles.

``inspect.signature(net.forward)`` then equals ``inspect.signature(model.forward)``:
HuggingFace's Trainer drops the dataset columns forward does not name, Accelerate rewraps
``forward.__func__``. :func:`class_forward` does the same for the class
(``ampgraph.compiled_class``): ``inspect.signature(type(net).forward)`` equals
``inspect.signature(type(model).forward)``, which HuggingFace's ``find_labels`` reads.
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
    ``__signature__`` is ``self`` + ``model.forward``'s parameters; None if it has none.

    Example:
        >>> list(inspect.signature(signed_forward(nn.Linear(2, 2), run)).parameters)
        ['self', 'input']
    """
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None
    first = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return _calling(run, sig.replace(parameters=[first, *sig.parameters.values()]),
                    getattr(type(model).forward, "__doc__", None))


def class_forward(model_cls: type, run: Callable[..., Any]) -> Any:
    """:func:`signed_forward` for a class: a function calling ``run`` whose ``__signature__``
    is ``model_cls.forward``'s (``self`` included), what libraries that inspect a model's
    class read (HuggingFace's ``find_labels``); None if it has none.

    Example:
        >>> list(inspect.signature(class_forward(nn.Linear, run)).parameters)
        ['self', 'input']
    """
    try:
        sig = inspect.signature(model_cls.forward)
    except (TypeError, ValueError):
        return None
    return _calling(run, sig, getattr(model_cls.forward, "__doc__", None))


def _calling(run: Callable[..., Any], sig: inspect.Signature, doc: str | None) -> Any:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        return run(self, *args, **kwargs)

    forward.__signature__ = sig
    forward.__doc__ = doc
    return forward
