"""Buffers kept between calls and handed out only while nothing else holds them.

The weight cache's working copies, gradient buffers and scratch, and the kept outputs
(``outputs.py``), are reused this way: a buffer is free again once no tensor outside its
pool shares its storage (the caller dropped it, and no autograd graph saved it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ampgraph.runtime.tensors import storage_refs


def take_free(pool: list[tuple[torch.Tensor, int]], fits: Callable[[torch.Tensor], bool],
              make: Callable[[], torch.Tensor], limit: int) -> torch.Tensor:
    """A view of the first buffer of ``pool`` (``(buffer, its own references)`` pairs) that
    ``fits`` and that nothing outside the pool holds, else of a new one from ``make()``
    (outside inference mode, so it stays writable outside it), kept in ``pool`` in place of
    the oldest once ``limit`` are kept. Call it under the pool owner's lock: the view marks
    the buffer in use before another thread can pick it."""
    for buf, alone in pool:
        if fits(buf) and storage_refs(buf) == alone:
            return buf.view_as(buf)
    with torch.inference_mode(False):
        buf = make()
    if len(pool) >= limit:
        pool.pop(0)
    pool.append((buf, storage_refs(buf)))
    return buf.view_as(buf)
