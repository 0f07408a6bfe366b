"""Tensor helpers every runtime shares: storage references and layout-keeping empties."""

from __future__ import annotations

import itertools
import operator

import torch


def storage_refs(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (a kept buffer is free again at its own
    count: nothing outside its keeper, no autograd graph, holds it).

    Example:
        >>> t = torch.empty(3); storage_refs(t)
        1
        >>> v = t.view(3); storage_refs(t)
        2
    """
    # the storage object made to ask holds one more reference while it is asked
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


def all_alone(tensors: list[torch.Tensor]) -> bool:
    """Whether no tensor of ``tensors`` shares its storage with any other tensor: each
    ``storage_refs(t) == 1``, asked by C-level ``map`` calls (no Python per tensor).

    Example:
        >>> t = torch.empty(3); all_alone([t])
        True
        >>> v = t.view(3); all_alone([t])
        False
    """
    counts = map(torch._C._storage_Use_Count, map(_CDATA, map(_STORAGE, tensors)))
    return all(map(operator.eq, counts, _ALONE))  # as storage_refs: one more while asked


_STORAGE = operator.methodcaller("untyped_storage")
_CDATA = operator.attrgetter("_cdata")
_ALONE = itertools.repeat(2)


def empty_as(p: torch.Tensor, dtype: torch.dtype, memory_format: torch.memory_format | None
             ) -> torch.Tensor:
    """An empty ``dtype`` tensor shaped as ``p``, in ``memory_format`` or, without one, with
    ``p``'s strides (a channels-last master stays so).

    Example:
        >>> empty_as(torch.ones(2, 3).t(), torch.bfloat16, None).stride()
        (1, 2)
    """
    if memory_format is None:
        return torch.empty_strided(p.shape, p.stride(), dtype=dtype, device=p.device)
    return torch.empty(p.shape, dtype=dtype, device=p.device, memory_format=memory_format)
