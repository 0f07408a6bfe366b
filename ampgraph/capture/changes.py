"""What changed between the state a graph was captured with and the state now, said the
way a user reads it: ``model.temperature: 1.0 -> 4.0``, ``model.fc.weight: a Parameter
(4, 4) replaced by a Parameter (4, 4)``, ``model.fc forward hooks: added``. A tensor swapped
for a like one (same kind, shape, dtype and device) is a change the graph can take
(``rebindable``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
STATE_DICTS = ("_modules", "_parameters", "_buffers")
MISSING = object()  # a key absent before or after


@dataclasses.dataclass
class Change:
    """One difference between the state a graph was captured with and the state now."""

    where: str  # e.g. "model.temperature", "model.encoder.layer.3 forward hooks"
    what: str  # e.g. "1.0 -> 4.0"
    rebindable: bool = False  # a tensor swapped for a like one: the graph can take it

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def like_tensors(a: Any, b: Any) -> bool:
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and _kind(a) is _kind(b) and a.shape == b.shape and a.dtype == b.dtype
            and a.device == b.device)


def _kind(t: torch.Tensor) -> type:
    """A tensor's class, a Parameter counting as a plain tensor (``functional_call``
    substitutes plain tensors for parameters)."""
    cls = type(t)
    return torch.Tensor if cls is nn.Parameter else cls


def entry(label: str, key: Any) -> str:
    """``model.a _parameters`` + ``weight`` -> ``model.a.weight``."""
    path, _, kind = label.rpartition(" ")
    if kind in STATE_DICTS:
        return f"{path}.{key}"
    if kind in HOOK_DICTS:
        return f"{path} {kind.strip('_').replace('_', ' ')}"
    return f"{label}.{key}"


def short(value: Any) -> str:
    if isinstance(value, nn.Parameter):
        return f"a Parameter {tuple(value.shape)}"
    if isinstance(value, torch.Tensor):
        return f"a tensor {tuple(value.shape)}"
    if isinstance(value, nn.Module):
        return f"a {type(value).__name__}"
    if callable(value):
        return getattr(value, "__qualname__", type(value).__name__)
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def describe(before: Any, after: Any) -> str:
    if before is MISSING:
        return f"added ({short(after)})"
    if after is MISSING:
        return "removed"
    if isinstance(before, (nn.Module, torch.Tensor)) or isinstance(after, (nn.Module,
                                                                        torch.Tensor)):
        return f"{short(before)} replaced by {short(after)}"
    return f"{short(before)} -> {short(after)}"


def where(dtype: torch.dtype, device: int) -> str:
    return f"{str(dtype).removeprefix('torch.')} on {'cpu' if device < 0 else f'cuda:{device}'}"
