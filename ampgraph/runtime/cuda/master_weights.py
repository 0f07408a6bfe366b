"""Low-precision copies of the fp32 masters, refreshed once per step by multi-tensor ops.

A graph's parameter casts come here in groups (``passes.fx.weight_groups``). A
:class:`WeightGroup` keeps one low-precision copy of each member between calls and
refreshes the group with one ``torch._foreach_copy_`` only when a master changed: its
version counter (every in-place update bumps it: any optimizer, ``p.mul_()``, ``copy_``
under ``no_grad``) or its storage (``p.data = ...``). Forwards between two updates
(gradient accumulation, evaluation, generation) cast nothing. Backward returns the
group's gradients to the masters in fp32 by one more ``_foreach_copy_``; autograd then
accumulates each into its master's ``.grad`` as for any leaf, so DDP's and FSDP2's hooks
fire per group, in the middle of backward, and any optimizer the user owns works.

This is the pattern of Apex's O2, Megatron's ``Float16OptimizerWithFloat16Params`` and
Transformer Engine's master weights, without owning the optimizer: the masters stay the
user's parameters. The cost is the copies: 2 bytes per low weight, held between steps
(autocast holds the same copies from their first use in forward until backward).

A copy still saved by a live autograd graph (two forwards before one backward with an
update between them) is never written over: the group makes new copies and the old ones
live on with that graph. Changes through ``p.data`` that keep the storage bypass both
checks: call ``AmpModule.clear_weight_cache()`` after them.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_Spec = tuple[torch.dtype, "torch.memory_format | None"]


def _storage_refs(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class WeightGroup:
    """A group's kept copies; :meth:`low_copies` returns them, refreshed if a master
    changed.

    Example:
        >>> group = WeightGroup(((torch.bfloat16, None),))
        >>> group.low_copies(torch.ones(2, requires_grad=True))[0].dtype
        torch.bfloat16
    """

    def __init__(self, specs: tuple[_Spec, ...]) -> None:
        self.specs = specs
        self._copies: list[torch.Tensor] = []
        self._key: list[tuple[int, int, int]] = []
        self._lock = threading.Lock()
        self.refreshes = 0  # how often the copies were written (tests, benchmarks)

    def low_copies(self, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``tuple(p.to(low) for p in params)``, differentiable, from the kept copies."""
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            return _GroupCast.apply(self, *params)
        return tuple(c.view_as(c) for c in self.current(params))

    def current(self, params: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The copies of ``params``, written again first if any master changed."""
        key = [(id(p), p._version, p.data_ptr()) for p in params]
        if key == self._key:
            return self._copies
        with self._lock, torch.no_grad(), torch.inference_mode(False):
            if key == self._key:  # another thread refreshed them meanwhile
                return self._copies
            copies = self._copies
            if not copies or any(_storage_refs(c) > 1 or c.shape != p.shape
                                 or c.device != p.device for c, p in zip(copies, params)):
                copies = [_empty(p, dtype, fmt) for p, (dtype, fmt) in zip(params, self.specs)]
            masters = [p.detach() for p in params]
            torch._foreach_copy_(copies, masters)
            self._copies, self._key = copies, key
            self.refreshes += 1
            return copies

    def clear(self) -> None:
        with self._lock:
            self._copies, self._key = [], []

    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self._copies)


class _GroupCast(torch.autograd.Function):
    """``(p.to(low) for p in params)`` from the group's kept copies; backward converts the
    group's gradients to the masters' dtypes and strides with one multi-tensor copy."""

    @staticmethod
    def forward(ctx: Any, group: WeightGroup, *params: torch.Tensor) -> tuple:
        ctx.set_materialize_grads(False)
        ctx.masters = [(p.shape, p.stride(), p.dtype, p.device) for p in params]
        return tuple(c.view_as(c) for c in group.current(params))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        wanted = [i for i, g in enumerate(grads)
                  if g is not None and ctx.needs_input_grad[i + 1]]
        out: list[torch.Tensor | None] = [None] * len(grads)
        if torch.is_grad_enabled():  # create_graph: differentiable conversions
            for i in wanted:
                out[i] = grads[i].to(ctx.masters[i][2])
            return None, *out
        full = [torch.empty_strided(shape, stride, dtype=dtype, device=device)
                for shape, stride, dtype, device in (ctx.masters[i] for i in wanted)]
        if full:
            torch._foreach_copy_(full, [grads[i] for i in wanted])
        for i, g in zip(wanted, full):
            out[i] = g
        return None, *out


def _empty(p: torch.Tensor, dtype: torch.dtype, memory_format: torch.memory_format | None
           ) -> torch.Tensor:
    """An empty ``dtype`` tensor shaped as ``p``, in ``memory_format`` or, without one, with
    ``p``'s strides."""
    if memory_format is None:
        return torch.empty_strided(p.shape, p.stride(), dtype=dtype, device=p.device)
    return torch.empty(p.shape, dtype=dtype, device=p.device, memory_format=memory_format)
