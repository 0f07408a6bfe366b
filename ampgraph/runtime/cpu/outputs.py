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

For a graph handed to ``torch.compile``, :meth:`OutputBuffers.linear` makes an output that
is a linear's product cast back (the logits) itself, without gradients: the product in the
low dtype goes into a buffer kept for it too (a fresh one would fault its pages in as well),
then is cast into the kept output; the values are the linear's cast back, as in the graph.
Two passes, not a product and a cast per column block: under a machine's other load each
of a block's parallel regions waits for both cores, and a block loop lost there
(docs/performance.md#the-compiler-route).

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

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
               dtype: torch.dtype, slot: Any) -> torch.Tensor:
        """``linear(x, w, b).to(dtype)`` for the graph output ``slot``, ``w`` and ``b`` in
        ``x``'s dtype: when the result is large, on the CPU and needs no gradient, into a
        kept buffer, through a kept buffer for the product (see the module docstring).

        Example:
            >>> OutputBuffers().linear(x, w, None, torch.float32, 0).dtype  # doctest: +SKIP
            torch.float32
        """
        rows = x.numel() // max(1, x.shape[-1]) if x.dim() else 0
        cols = w.shape[0] if w.dim() == 2 else 0
        if x.device.type != "cpu" or rows * cols * dtype.itemsize < OUTPUT_BYTES \
                or x.dim() < 2 or w.dim() != 2 or not x.is_contiguous() \
                or torch.is_grad_enabled() and any(
                    t is not None and t.requires_grad for t in (x, w, b)):
            return torch.nn.functional.linear(x, w, b).to(dtype)
        shape = (*x.shape[:-1], cols)
        with self._lock:
            out = take_free(self._kept.setdefault(slot, []),
                            lambda buf: buf.shape == shape and buf.dtype == dtype,
                            lambda: torch.empty(shape, dtype=dtype, device=x.device),
                            KEPT_PER_OUTPUT)
            low = take_free(self._kept.setdefault((slot, "product"), []),
                            lambda buf: buf.shape == shape and buf.dtype == x.dtype,
                            lambda: torch.empty(shape, dtype=x.dtype, device=x.device), 1)
        x2, low2 = x.view(rows, x.shape[-1]), low.view(rows, cols)
        if b is None:
            torch.mm(x2, w.t(), out=low2)
        else:
            torch.addmm(b, x2, w.t(), out=low2)
        out.copy_(low)
        return out

    def clear(self) -> None:
        with self._lock:
            self._kept = {}

    def nbytes(self) -> int:
        """Bytes held by the kept buffers."""
        with self._lock:
            return sum(buf.numel() * buf.element_size() for kept in self._kept.values()
                       for buf, _ in kept)
