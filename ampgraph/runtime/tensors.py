"""Tensor helpers every runtime shares: storage references, layout-keeping empties, and the
weak reference by which a kept copy dies with its master."""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable, Hashable
from typing import Any

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
        (1, 3)
    """
    if memory_format is None:
        return torch.empty_strided(p.shape, p.stride(), dtype=dtype, device=p.device)
    return torch.empty(p.shape, dtype=dtype, device=p.device, memory_format=memory_format)


def master_ref(master: torch.Tensor, entries: dict[Hashable, Any], slot: Hashable, lock: Any,
               then: Callable[[], None] | None = None) -> weakref.ref:
    """A weak reference to ``master`` for ``entries[slot]`` (an entry whose item 0 is this
    reference): when ``master`` dies, the entry is dropped under ``lock``, unless the slot
    holds a newer master's entry by then, and ``then()`` runs.

    Example:
        >>> import threading; p, kept = torch.ones(1), {}
        >>> kept["p"] = (master_ref(p, kept, "p", threading.Lock()), "copy")
        >>> del p; kept
        {}
    """
    def drop(ref: weakref.ref) -> None:
        with lock:
            entry = entries.get(slot)
            if entry is not None and entry[0] is ref:
                del entries[slot]
                if then is not None:
                    then()
    return weakref.ref(master, drop)
