"""The eager fallback: a model that cannot be captured whole runs its own Python in fp32,
with each child compiled on its own (which captures on its first call, with the real
inputs it receives).

:class:`EagerPlan` runs the model's own ``forward`` on the model itself (its attributes,
lists and counters are the ones forward updates, every call), with the children of the
model, and of the containers it holds (``ModuleList``, ``ModuleDict``), swapped for their
compiled modules for the duration of the call. :class:`EagerPart` is what ``explain`` lists
for each module that stayed eager, with the reason.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

from ampgraph.capture.hooks import forward_of

M = TypeVar("M", bound=nn.Module)


@dataclass
class EagerPart:
    """A module that could not be captured and runs its own code eagerly in fp32."""

    path: str
    module_type: str
    reason: str


class EagerPlan(nn.Module):
    """What runs a model export refuses whole; see the module docstring. Its own children
    are the compiled ones (containers as holders of theirs), for reports and tests; it is
    never registered inside the model.

    Example:
        >>> plan = EagerPlan(model, "", lambda child, path: nn.Identity())
        >>> plan.fc is not model.fc and model.fc is model._modules["fc"]
        True
    """

    def __init__(self, model: nn.Module, path: str,
                 compile_child: Callable[[nn.Module, str], nn.Module]) -> None:
        super().__init__()
        self.__dict__["_model"] = model  # not registered: the model is the user's
        self.__dict__["_swaps"] = swaps = []  # (module, its children while a call runs)
        self.__dict__["_lock"] = threading.RLock()  # one eager call at a time swaps them
        self.__dict__["_modules"] = _compiled(model, path, compile_child, swaps)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            saved = [(m, m.__dict__["_modules"]) for m, _ in self._swaps]
            try:
                for m, children in self._swaps:
                    m.__dict__["_modules"] = children
                return forward_of(self._model)(*args, **kwargs)
            finally:
                for m, children in saved:
                    m.__dict__["_modules"] = children


def _compiled(module: nn.Module, path: str, compile_child: Callable[[nn.Module, str], nn.Module],
              swaps: list) -> OrderedDict:
    """``module``'s children, each compiled (a container recursed into: its holder); the
    swaps that install them are appended to ``swaps``."""
    shown: OrderedDict[str, nn.Module | None] = OrderedDict()
    installed: OrderedDict[str, nn.Module | None] = OrderedDict()
    for name, child in module._modules.items():
        sub = f"{path}.{name}" if path else name
        if child is None:
            shown[name] = installed[name] = None
        elif type(child).forward is nn.Module.forward:  # a container: its own children
            holder = object.__new__(type(child))
            holder.__dict__.update(child.__dict__)
            holder.__dict__["_modules"] = _compiled(child, sub, compile_child, swaps)
            shown[name], installed[name] = holder, child
        else:
            shown[name] = installed[name] = compile_child(child, sub)
    swaps.append((module, installed))
    return shown


def compiled_children(module: nn.Module, kind: type[M]) -> list[M]:
    """The outermost descendants of ``module`` of type ``kind``: the compiled children of
    an eager plan, through the containers around them.

    Example:
        >>> compiled_children(plan, AmpModule)  # doctest: +SKIP
    """
    out: list[M] = []
    for child in module.children():
        if isinstance(child, kind):
            out.append(child)
        else:
            out += compiled_children(child, kind)
    return out
