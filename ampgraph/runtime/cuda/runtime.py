"""CudaRuntime: a GPU step is launch-bound at real sizes, so the runtime adds as few
kernels and as little host time per weight as it can (docs/performance.md#cuda-weight-groups).

Parameter casts come in groups of up to ``GROUP_NUMEL`` elements (``WeightGroup``): one
multi-tensor refresh per group when the masters changed, one multi-tensor conversion of
the group's gradients in backward, instead of a cast and a conversion per weight. Linear,
embedding, attention, dropout and the output casts stay aten's: on the GPU they need
none of the CPU's tricks (the caching allocator reuses its blocks, and the fused kernels
are the fast ones).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

from ampgraph.runtime.base import Runtime
from ampgraph.runtime.cuda.master_weights import MasterCopies, WeightGroup
from ampgraph.runtime.fused_updates import see_fused_updates
from ampgraph.runtime.head_loss import chunk_rows, linear_cross_entropy
from passes.fx.runtime_ops import RuntimeOps

# A group's gradients are ready together, once backward has passed the group's first use:
# 16M elements (64 MiB of fp32 masters, a few transformer blocks of BERT-base size) keeps
# several groups per model, so data-parallel communication overlaps backward; a
# multi-tensor kernel handles about that much per launch anyway
# (docs/performance.md#cuda-group-size).
GROUP_NUMEL = 1 << 24


class CudaRuntime(Runtime):
    """The CUDA runtime; see the module docstring.

    Example:
        >>> CudaRuntime().ops(backend=None).weight_group is not None
        True
    """

    name = "cuda"

    def __init__(self) -> None:
        see_fused_updates()
        self.copies = MasterCopies()
        self._groups: weakref.WeakSet[WeightGroup] = weakref.WeakSet()
        self._lock = threading.Lock()

    def ops(self, backend: str | None) -> RuntimeOps:
        if backend is not None:  # torch.compile fuses the graph's own casts
            return RuntimeOps(fp8_linear=self.fp8_linear(backend))
        return RuntimeOps(weight_group=self.weight_group, group_numel=GROUP_NUMEL,
                          stacked_kv_heads=True, fp8_linear=self.fp8_linear(backend),
                          head_loss=linear_cross_entropy, head_loss_chunk=chunk_rows)

    def weight_group(self, specs: tuple) -> Callable[..., tuple]:
        """What a new group of parameter casts calls (``passes.fx.weight_groups``): its
        :meth:`WeightGroup.low_copies`. The graph holds the group; the runtime only tracks
        it for :meth:`clear` and :meth:`working_copies`."""
        group = WeightGroup(specs, self.copies)
        with self._lock:
            self._groups.add(group)
        return group.low_copies

    def groups(self) -> list[WeightGroup]:
        with self._lock:
            return list(self._groups)

    def working_copies(self) -> list[torch.Tensor]:
        return self.copies.copies()

    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.copies.copies())

    def clear(self) -> None:
        self.copies.clear()
        for group in self.groups():  # their last copies would stand while the keys do
            group.forget()
        self.clear_fp8()

    def invalidate(self) -> None:
        self.copies.invalidate()
        for group in self.groups():
            group.forget()
