"""The eager fallback: a model that cannot be captured whole runs its own Python in fp32,
with each child compiled on its own (which captures on its first call, with the real
inputs it receives).

:func:`eager_plan` makes that shallow copy of the model; :class:`EagerPart` is what
``explain`` lists for each module that stayed eager, with the reason.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from torch import nn

M = TypeVar("M", bound=nn.Module)
_COPIES = "_amp_plan_copies"  # a plan's (copy, original) pairs: its root's and containers'


@dataclass
class EagerPart:
    """A module that could not be captured and runs its own code eagerly in fp32."""

    path: str
    module_type: str
    reason: str


def eager_plan(model: nn.Module, path: str,
               compile_child: Callable[[nn.Module, str], nn.Module]) -> nn.Module:
    """A shallow copy of ``model`` whose children are ``compile_child(child, child_path)``.

    Containers without a forward of their own (ModuleList, ModuleDict) are copied the
    same way; a module without children runs as it is, in fp32. ``model`` and its module
    dicts are left as they are.

    Example:
        >>> plan = eager_plan(model, "", lambda child, path: nn.Identity())
        >>> plan is not model and plan.fc is not model.fc
        True
    """
    plan = copy.copy(model)
    copies = [(plan, model)]  # what follow_modes keeps in the model's train/eval mode
    children: OrderedDict[str, nn.Module | None] = OrderedDict()
    for name, child in model._modules.items():
        sub = f"{path}.{name}" if path else name
        if child is None:
            children[name] = None
        elif type(child).forward is nn.Module.forward:
            children[name] = eager_plan(child, sub, compile_child)
            copies += children[name].__dict__.pop(_COPIES)
        else:
            children[name] = compile_child(child, sub)
    plan.__dict__["_modules"] = children
    plan.__dict__[_COPIES] = copies
    return plan


def follow_modes(plan: M | None) -> M | None:
    """``plan`` (None passes), each module it copied in the train/eval mode of its original
    now: the user may switch the model (``model.train()``) rather than the compiled module.

    Example:
        >>> model.train(); follow_modes(plan).training  # doctest: +SKIP
        True
    """
    if plan is not None:
        for copied, original in plan.__dict__[_COPIES]:
            copied.training = original.training
    return plan


def compiled_children(module: nn.Module, kind: type[M]) -> list[M]:
    """The outermost descendants of ``module`` of type ``kind``: the compiled children of
    an eager plan, through the containers copied around them.

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
