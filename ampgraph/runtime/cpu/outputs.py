"""Buffers kept for a compiled module's large fp32 outputs.

With ``keep_io_types`` (the default) the rewritten graph casts its low-precision outputs
back to fp32. A language model's logits are the largest tensor of a call, and a fresh tensor
of 32 MiB or more is mmapped by glibc and faults every page in, on every call
(docs/performance.md#kept-buffers).
:meth:`OutputBuffers.cast` converts such an output into a buffer kept from an earlier call
once nothing outside the cache holds it any more, the way a serving runtime binds its
output buffers. Two are kept per output, so that ``out = net(x)`` in a loop, which still
holds the last output while the next call runs, reuses them too; an output the caller
keeps is never overwritten.

In training the output is cast into the buffer as a differentiable cast (its gradient
goes back in the graph's dtype); the buffer is free again once the step's graph, which
saves it or its views, is gone. Only on the CPU (CUDA's caching allocator already reuses
its blocks). :meth:`OutputBuffers.clear` (``AmpModule.clear_weight_cache``) drops them.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ampgraph.runtime.cpu.buffers import take_free
from ampgraph.runtime.cpu.cast import CastInto

# glibc's largest mmap threshold: a fresh allocation this large always faults its pages in
OUTPUT_BYTES = 32 << 20
KEPT_PER_OUTPUT = 2  # the caller may still hold the last one while the next call runs


class OutputBuffers:
    """Per output slot (its place among a graph's outputs), up to ``KEPT_PER_OUTPUT``
    buffers, the oldest replaced by one of a new shape; thread-safe."""

    def __init__(self) -> None:
        self._kept: dict[Any, list[tuple[torch.Tensor, int]]] = {}
        self._lock = threading.Lock()

    def cast(self, x: torch.Tensor, dtype: torch.dtype, slot: Any) -> torch.Tensor:
        """``x.to(dtype)`` (differentiable) for the graph output ``slot``: into a kept
        buffer nothing else holds when the result is large, contiguous and on the CPU."""
        if x.device.type != "cpu" or x.numel() * dtype.itemsize < OUTPUT_BYTES \
                or not x.is_contiguous():
            return x.to(dtype)
        with self._lock:  # all held, or shaped for another input: the oldest is replaced
            out = take_free(self._kept.setdefault(slot, []),
                            lambda buf: buf.shape == x.shape and buf.dtype == dtype,
                            lambda: torch.empty(x.shape, dtype=dtype, device=x.device),
                            KEPT_PER_OUTPUT)
        if x.requires_grad and torch.is_grad_enabled():
            return CastInto.apply(x, out)
        return out.copy_(x)

    def clear(self) -> None:
        with self._lock:
            self._kept = {}

    def nbytes(self) -> int:
        """Bytes held by the kept buffers."""
        with self._lock:
            return sum(buf.numel() * buf.element_size() for kept in self._kept.values()
                       for buf, _ in kept)
