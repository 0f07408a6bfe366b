"""Tensor helpers every runtime shares: storage references and layout-keeping empties."""

from __future__ import annotations

import torch


def storage_refs(t: torch.Tensor) -> int:
    """How many tensors share ``t``'s storage (a kept buffer is free again at its own
    count: nothing outside its keeper, no autograd graph, holds it)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


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
