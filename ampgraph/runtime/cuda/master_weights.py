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
import weakref
from typing import Any

import torch

from ampgraph.runtime.tensors import empty_as, storage_refs

_Spec = tuple[torch.dtype, "torch.memory_format | None"]


class MasterCopies:
    """The low-precision copy of each master, per (dtype, memory format), shared by every
    graph of a module (train and eval graphs read the same copies); thread-safe; an entry
    dies with its master."""

    def __init__(self) -> None:
        self._entries: dict[tuple, list] = {}  # (id, dtype, format) -> [ref, copy, key]
        self._lock = threading.Lock()
        self.refreshes = 0  # multi-tensor refreshes made (tests, benchmarks)

    def refreshed(self, params: tuple[torch.Tensor, ...], specs: tuple[_Spec, ...],
                  keys: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """The copies of ``params``, the stale ones written again by one multi-tensor copy
        (``keys``: each master's identity, version and storage)."""
        with self._lock, torch.no_grad(), torch.inference_mode(False):
            copies, stale = [], []
            for p, (dtype, fmt), key in zip(params, specs, keys):
                slot = (key[0], dtype, fmt)
                entry = self._entries.get(slot)
                if entry is None or entry[0]() is not p:
                    entry = self._entries[slot] = [weakref.ref(p, self._forget(slot)),
                                                   None, None]
                copy = entry[1]
                if entry[2] != key:
                    if copy is None or storage_refs(copy) > 1 or copy.shape != p.shape \
                            or copy.device != p.device:  # saved by a live graph: a new one
                        copy = entry[1] = empty_as(p, dtype, fmt)
                    entry[2] = key
                    stale.append((copy, p.detach()))
                copies.append(copy)
            if stale:
                torch._foreach_copy_([c for c, _ in stale], [p for _, p in stale])
                self.refreshes += 1
            return copies

    def _forget(self, slot: tuple):
        def drop(ref: weakref.ref) -> None:
            with self._lock:
                entry = self._entries.get(slot)
                if entry is not None and entry[0] is ref:
                    del self._entries[slot]
        return drop

    def copies(self) -> list[torch.Tensor]:
        with self._lock:
            return [e[1] for e in self._entries.values() if e[1] is not None]

    def clear(self) -> None:
        with self._lock:
            self._entries = {}


class WeightGroup:
    """One graph's group of parameter casts; :meth:`low_copies` returns the copies from
    ``store``, refreshed if a master changed.

    Example:
        >>> group = WeightGroup(((torch.bfloat16, None),), MasterCopies())
        >>> group.low_copies(torch.ones(2, requires_grad=True))[0].dtype
        torch.bfloat16
    """

    def __init__(self, specs: tuple[_Spec, ...], store: MasterCopies) -> None:
        self.specs = specs
        self.store = store
        self._last: tuple[list, list[torch.Tensor]] = ([], [])  # (keys, copies), one object

    def low_copies(self, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``tuple(p.to(low) for p in params)``, differentiable, from the kept copies."""
        if torch.is_grad_enabled() and any(p.requires_grad for p in params):
            return _GroupCast.apply(self, *params)
        return tuple(c.view_as(c) for c in self.current(params))

    def current(self, params: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The copies of ``params``, written again first if any master changed (a master
        changed only if its key did: the last copies stand while every key does)."""
        key = [(id(p), p._version, p.data_ptr()) for p in params]
        last = self._last
        if key == last[0]:
            return last[1]
        copies = self.store.refreshed(params, self.specs, key)
        self._last = (key, copies)
        return copies

    def forget(self) -> None:
        """Look the copies up in the store again at the next call."""
        self._last = ([], [])


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
