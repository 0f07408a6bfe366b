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

import itertools
import operator
import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from ampgraph.runtime.tensors import all_alone, empty_as, master_ref, storage_refs

_Spec = tuple[torch.dtype, "torch.memory_format | None"]


class MasterCopies:
    """The low-precision copy of each master, per (dtype, memory format), shared by every
    graph of a module (train and eval graphs read the same copies); thread-safe; an entry
    dies with its master. ``epoch`` changes whenever an entry is made, dropped or given a
    new copy: a group that saw the same epoch holds the store's current entries."""

    def __init__(self) -> None:
        self._entries: dict[tuple, list] = {}  # (id, dtype, format) -> [ref, copy, key]
        self._lock = threading.Lock()
        self.refreshes = 0  # multi-tensor refreshes made (tests, benchmarks)
        self.epoch = 0

    def refreshed(self, params: tuple[torch.Tensor, ...], specs: tuple[_Spec, ...],
                  keys: list[tuple[int, int, int]]
                  ) -> tuple[list[torch.Tensor], list[list], int]:
        """The copies of ``params``, the stale ones written again by one multi-tensor copy
        (``keys``: each master's identity, version and storage), their entries, and the
        epoch they belong to."""
        with self._lock, torch.no_grad(), torch.inference_mode(False):
            copies, entries, stale = [], [], []
            for p, (dtype, fmt), key in zip(params, specs, keys):
                slot = (key[0], dtype, fmt)
                entry = self._entries.get(slot)
                if entry is None or entry[0]() is not p:
                    ref = master_ref(p, self._entries, slot, self._lock, self._moved)
                    entry = self._entries[slot] = [ref, None, None]
                    self.epoch += 1
                copy = entry[1]
                if entry[2] != key:
                    if copy is None or storage_refs(copy) > 1 or copy.shape != p.shape \
                            or copy.device != p.device:  # saved by a live graph: a new one
                        copy = entry[1] = empty_as(p, dtype, fmt)
                        self.epoch += 1
                    entry[2] = key
                    stale.append((copy, p.detach()))
                copies.append(copy)
                entries.append(entry)
            if stale:  # plain tensors: Parameters cost torch's subclass handling (4x here)
                torch._foreach_copy_([c for c, _ in stale], [p for _, p in stale])
                self.refreshes += 1
            return copies, entries, self.epoch

    def refresh_versions(self, epoch: int, entries: list[list], copies: list[torch.Tensor],
                         params: tuple[torch.Tensor, ...], keys: Iterable[tuple],
                         stale: tuple[bool, ...]) -> bool:
        """Write again the copies of masters changed in place only (same identities and
        storages as when ``entries`` were read at ``epoch``), with no Python per parameter:
        False, doing nothing, if the store moved on or a stale copy is held elsewhere."""
        with self._lock, torch.no_grad(), torch.inference_mode(False):
            if epoch != self.epoch:
                return False
            if all(stale):
                targets, sources = copies, params
            else:
                targets = list(itertools.compress(copies, stale))
                sources = itertools.compress(params, stale)
            if not all_alone(targets):  # saved by a live graph: the store makes new ones
                return False
            torch._foreach_copy_(targets, list(map(torch.Tensor.detach, sources)))
            list(map(operator.setitem, entries, _KEY_SLOT, keys))
            self.refreshes += 1
            return True

    def _moved(self) -> None:  # an entry died with its master
        self.epoch += 1

    def copies(self) -> list[torch.Tensor]:
        with self._lock:
            return [e[1] for e in self._entries.values() if e[1] is not None]

    def invalidate(self) -> None:
        """Mark every copy stale, keeping it: the next refresh writes each one again, in
        place where nothing else holds it (what a CUDA graph capture must record)."""
        with self._lock:
            for entry in self._entries.values():
                entry[2] = None
            self.epoch += 1

    def clear(self) -> None:
        with self._lock:
            self._entries = {}
            self.epoch += 1


_KEY_SLOT = itertools.repeat(2)


class WeightGroup:
    """One graph's group of parameter casts; :meth:`low_copies` returns the copies from
    ``store``, refreshed if a master changed.

    A call where no master changed does no Python work per parameter: the masters' key
    (identities, versions, storages) is read by C-level ``map`` calls and compared as a
    whole; the copies handed out are made by one ``map``; in backward the group's fp32
    gradients are views of one flat buffer, made by one call and filled by one
    multi-tensor copy.

    Example:
        >>> group = WeightGroup(((torch.bfloat16, None),), MasterCopies())
        >>> group.low_copies(torch.ones(2, requires_grad=True))[0].dtype
        torch.bfloat16
    """

    def __init__(self, specs: tuple[_Spec, ...], store: MasterCopies) -> None:
        self.specs = specs
        self.store = store
        self._last = _NOTHING  # the last call's, one object

    def low_copies(self, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``tuple(p.to(low) for p in params)``, differentiable, from the kept copies."""
        if torch.is_grad_enabled() and any(map(_REQUIRES_GRAD, params)):
            return _GroupCast.apply(self, *params)
        return tuple(map(torch.Tensor.detach, self.current(params)))

    def current(self, params: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The copies of ``params``, written again first if any master changed (a master
        changed only if its key did: the last copies stand while every key does)."""
        key = (tuple(map(id, params)), tuple(map(_VERSION, params)),
               tuple(map(torch.Tensor.data_ptr, params)))
        last = self._last
        if key == last.key:
            return last.copies
        if key[0] == last.key[0] and key[2] == last.key[2] and self.store.refresh_versions(
                last.epoch, last.entries, last.copies, params, zip(*key),
                tuple(map(operator.ne, key[1], last.key[1]))):
            self._last = last._replace(key=key)  # changed in place: the same copies
            return last.copies
        copies, entries, epoch = self.store.refreshed(params, self.specs, list(zip(*key)))
        self._last = _Last(key, copies, entries, epoch, _flat_layout(params))
        return copies

    def forget(self) -> None:
        """Look the copies up in the store again at the next call."""
        self._last = _NOTHING


class _Last(NamedTuple):
    """What a group's last call read: its masters' key, their copies and store entries,
    the store's epoch then, and ``flat``: (numel, dtype, device) of one flat buffer whose
    views can be the masters' gradients (None where the masters' layouts differ)."""

    key: tuple
    copies: list[torch.Tensor]
    entries: list[list]
    epoch: int
    flat: tuple | None


_NOTHING = _Last(((), (), ()), [], [], -1, None)


_VERSION = operator.attrgetter("_version")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _flat_layout(params: tuple[torch.Tensor, ...]) -> tuple | None:
    """(numel, dtype, device) of one flat buffer whose views can be the masters'
    gradients: every master contiguous, of one dtype and device; else None."""
    first = params[0]
    dtype, device = first.dtype, first.device
    if all(p.is_contiguous() and p.dtype == dtype and p.device == device for p in params):
        return sum(p.numel() for p in params), dtype, device
    return None


class _GroupCast(torch.autograd.Function):
    """``(p.to(low) for p in params)`` from the group's kept copies; backward converts the
    group's gradients to the masters' dtypes and strides with one multi-tensor copy, into
    views of one flat buffer (one allocation a group) where the masters allow."""

    @staticmethod
    def forward(ctx: Any, group: WeightGroup, *params: torch.Tensor) -> tuple:
        ctx.set_materialize_grads(False)
        copies = group.current(params)
        ctx.copies, ctx.flat = copies, group._last.flat
        if ctx.flat is None:
            ctx.masters = [(p.shape, p.stride(), p.dtype, p.device) for p in params]
        return tuple(map(torch.Tensor.detach, copies))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        flat = ctx.flat
        if flat is not None and not torch.is_grad_enabled() and all(ctx.needs_input_grad[1:]) \
                and all(map(isinstance, grads, _TENSOR)):
            numel, dtype, device = flat
            buffer = torch.empty(numel, dtype=dtype, device=device)
            full = torch._C._nn.unflatten_dense_tensors(buffer, ctx.copies)
            torch._foreach_copy_(full, grads)
            return None, *full
        return None, *_per_parameter(ctx, grads)


_TENSOR = itertools.repeat(torch.Tensor)


def _per_parameter(ctx: Any, grads: tuple) -> list[torch.Tensor | None]:
    """The gradients one by one: some missing or not wanted, masters of mixed layouts, or a
    differentiable backward (``create_graph``)."""
    wanted = [i for i, g in enumerate(grads) if g is not None and ctx.needs_input_grad[i + 1]]
    out: list[torch.Tensor | None] = [None] * len(grads)
    if ctx.flat is None:
        masters = ctx.masters
    else:  # contiguous masters of one dtype and device, shaped as their copies
        masters = [(c.shape, None, ctx.flat[1], ctx.flat[2]) for c in ctx.copies]
    if torch.is_grad_enabled():  # create_graph: differentiable conversions
        for i in wanted:
            out[i] = grads[i].to(masters[i][2])
        return out
    full = [torch.empty(shape, dtype=dtype, device=device) if stride is None else
            torch.empty_strided(shape, stride, dtype=dtype, device=device)
            for shape, stride, dtype, device in (masters[i] for i in wanted)]
    if full:
        torch._foreach_copy_(full, [grads[i] for i in wanted])
    for i, g in zip(wanted, full):
        out[i] = g
    return out
