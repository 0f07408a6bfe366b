"""Model methods that call ``self(...)`` (HuggingFace ``generate``), run through the compiled
module.

HuggingFace's ``generate`` calls the model object it is bound to, so calling it on the
wrapped model would run the fp32 model. :func:`call_routed` runs it instead on a stand-in:
an instance of a subclass of the model's class (so ``isinstance`` and ``super()`` hold)
whose ``forward`` is the compiled module and keeps the model's signature, with a copy of
the model's ``__dict__`` (the same parameters, submodules, config and generation config).
The model's own object is not touched while it runs (other threads may call it); plain
attributes the method set on the stand-in are copied back to the model after it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

# Methods of the wrapped model that call ``self(...)`` (HuggingFace ``generate``): run on
# a stand-in of the model whose forward is the compiled one, see :func:`call_routed`.
ROUTED_METHODS = frozenset({"generate"})

ROUTE_KEY = "_amp_route"  # the stand-in's ``__dict__`` entry holding the compiled module


def route_method(route: Callable[..., Any], model: nn.Module, name: str, attr: Any) -> Any:
    """``attr`` (``getattr(model, name)``), or, for a method of :data:`ROUTED_METHODS`
    bound to ``model``, that method with every ``self(...)`` inside it calling ``route``.

    Example:
        >>> net_generate = route_method(net, model, "generate", model.generate)  # doctest: +SKIP
    """
    if name in ROUTED_METHODS and getattr(attr, "__self__", None) is model:
        return functools.partial(call_routed, route, model, name)
    return attr


def call_routed(route: Callable[..., Any], model: nn.Module, name: str,
                *args: Any, **kwargs: Any) -> Any:
    """``model.<name>(*args, **kwargs)`` with every ``self(...)`` and ``self.forward(...)``
    inside it calling ``route`` (the compiled module), on a stand-in of ``model`` (see the
    module docstring).

    Example:
        >>> call_routed(net, model, "generate", input_ids=ids)  # doctest: +SKIP
    """
    stand_in = object.__new__(routed_class(type(model)))
    state = model.__dict__
    stand_in.__dict__.update(state)
    stand_in.__dict__[ROUTE_KEY] = route
    try:
        return getattr(stand_in, name)(*args, **kwargs)
    finally:
        for key, value in stand_in.__dict__.items():
            if key != ROUTE_KEY and state.get(key, _MISSING) is not value:
                state[key] = value


_MISSING = object()
_ROUTED_CLASSES: dict[type, type] = {}


def routed_class(cls: type) -> type:
    """The subclass of ``cls`` (same name, module and qualified name) whose ``forward``
    calls the stand-in's route with ``cls.forward``'s signature; made once per class.

    Example:
        >>> routed_class(nn.Linear).__name__
        'Linear'
    """
    routed = _ROUTED_CLASSES.get(cls)
    if routed is None:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return self.__dict__[ROUTE_KEY](*args, **kwargs)

        functools.update_wrapper(forward, cls.forward)  # HF inspects forward's parameters
        routed = _ROUTED_CLASSES[cls] = type(cls.__name__, (cls,), {
            "forward": forward, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__})
    return routed
