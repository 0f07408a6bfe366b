"""Low-precision working copies of the fp32 master weights.

The graph's parameter casts call :meth:`WeightCache.cast` instead of ``aten._to_copy``:

- without gradients (inference) a copy is made once and reused until the master changes
  (its version counter, data pointer, device or shape), so repeated inference casts each
  weight once instead of every call;
- with gradients (training) the cast makes a fresh tensor, as autocast's, placed just
  before its first use (``route_weight_casts``): it lives from there until backward, so
  the weights of later layers are not live at a peak in the middle of forward. Its
  backward hands the master an fp32 gradient with the master's strides (the copy may be
  channels-last; ``cast.py``'s ``CastInto``).

Linear layers whose weight is cast for them alone call :meth:`WeightCache.amp_linear`: the
cast, the linear and the conversion of its weight gradient in one autograd function
(``linear.py``'s ``AmpLinear``). Its
working copy is kept between steps when a fresh one could fault its pages in (above
``KEPT_COPY_BYTES``); a buffer still referenced by a live autograd graph (two forwards
before one backward) is never overwritten, a new one is made. A weight of
``linear.BLOCKED_NUMEL`` elements or more is cast block by block, in forward and again in
backward (``blocked.py``), so no whole low-precision copy of it exists. The gradient of a
weight of ``KEPT_GRAD_NUMEL`` elements or more goes into a buffer kept between steps while
the last gradient lives through forward anyway (zero_grad after forward), unless other
nodes use the weight too (tied embeddings; an embedding table's through
``embedding.py``'s ``AmpEmbedding``); other gradients are fresh tensors, as
autograd's own (docs/performance.md#kept-buffers). A weight or table too small for any of
this trains as autocast's
(a cast, aten's linear or embedding): autograd's own backward, with no Python in it.

Weights changed through ``.data`` bypass version counters: call
``AmpModule.clear_weight_cache()`` after such an update.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

from ampgraph.runtime.cpu import packed
from ampgraph.runtime.cpu.activations import activate
from ampgraph.runtime.cpu.buffers import take_free
from ampgraph.runtime.cpu.cast import CastInto
from ampgraph.runtime.cpu.embedding import AmpEmbedding
from ampgraph.runtime.cpu.linear import AmpLinear, blockable
from ampgraph.runtime.tensors import empty_as, master_ref

_linear = torch.nn.functional.linear  # aten.linear's generated binding: no OpOverload frame


def _small(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a training linear on ``w`` runs as autocast's does, a fresh cast of the
    weight and aten's linear, with autograd's own backward: its copy is not kept (below
    ``KEPT_COPY_BYTES``), nor its gradient, nor is it blocked, so :class:`AmpLinear` would
    add only its Python (docs/performance.md#weight-casts-at-first-use)."""
    return (w.numel() * x.dtype.itemsize < KEPT_COPY_BYTES and w.numel() < KEPT_GRAD_NUMEL
            and not blockable(x, w, x.requires_grad))


def _state(p: torch.Tensor) -> tuple:
    """What an inference copy of ``p`` is made from: its version counter, data pointer,
    device and shape (a copy made from another state is stale)."""
    return p._version, p.data_ptr(), p.device, tuple(p.shape)


# A fresh gradient of 32 MiB or more (glibc's largest mmap threshold) is mmapped, and its
# pages fault in, every step; from 16 MiB often enough too: kept buffers pay from there
# (docs/performance.md#kept-buffers).
KEPT_GRAD_NUMEL = 1 << 22
KEPT_COPY_BYTES = 128 << 10  # glibc's default (smallest) mmap threshold
MAX_SCRATCH = 4  # pooled scratches per shape (threads running backward at once)


class WeightCache:
    """Working copies keyed by parameter identity; thread-safe; entries die with the param."""

    def __init__(self) -> None:
        # id(param) -> (weakref to param, {key: entry}); tensors are not hashable by value.
        self._slots: dict[int, tuple[weakref.ref, dict]] = {}
        self._lock = threading.RLock()  # GC callbacks may fire while it is held
        self._scratch: dict[tuple, list[tuple[torch.Tensor, int]]] = {}

    def _per_param(self, p: torch.Tensor) -> dict:
        ref, per = self._slots.get(id(p), (None, None))
        if ref is None or ref() is not p:
            per = {}
            self._slots[id(p)] = (master_ref(p, self._slots, id(p), self._lock), per)
        return per

    def cast(self, p: torch.Tensor, dtype: torch.dtype,
             memory_format: torch.memory_format | None = None) -> torch.Tensor:
        """``p.to(dtype, memory_format=memory_format)``, from a working copy (see the
        module docstring); the gradient has ``p``'s strides whatever the copy's."""
        if p.dtype == dtype and memory_format is None:
            return p
        if torch.is_grad_enabled() and p.requires_grad:
            self.drop_inference_copies(p)  # stale after the next update anyway
            if p.numel() * dtype.itemsize < KEPT_COPY_BYTES:  # aten's backward, no Python;
                # AccumulateGrad gives the master a gradient of its own strides (a copy)
                return p.to(dtype, memory_format=memory_format or torch.preserve_format)
            with torch.inference_mode(False):
                buf = empty_as(p, dtype, memory_format)
            return CastInto.apply(p, buf)
        return self._inference_copy(p, ("infer", dtype, memory_format), lambda d: d.to(
            dtype, memory_format=memory_format or torch.preserve_format))

    def _current(self, p: torch.Tensor, tag: tuple) -> torch.Tensor | None:
        """``p``'s copy under ``tag`` if it was made from ``p`` as it is now, else None."""
        per = self._peek(p)
        entry = per.get(tag) if per else None
        return entry[1] if entry is not None and entry[0] == _state(p) else None

    def _inference_copy(self, p: torch.Tensor, tag: tuple,
                        make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The copy ``make(p.detach())`` kept under ``tag``, made again once the master
        changes (its version counter, data pointer, device or shape)."""
        key = _state(p)
        with self._lock:
            per = self._per_param(p)
            entry = per.get(tag)
            if entry is None or entry[0] != key:
                with torch.inference_mode(False), torch.no_grad():
                    entry = per[tag] = (key, make(p.detach()))
            return entry[1]

    def amp_linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                   shared: bool = False, activation: str | None = None,
                   transposed: bool = False) -> torch.Tensor:
        """``aten.linear(x, w.to(x.dtype), b)`` for an fp32 master weight ``w`` (see
        :class:`~ampgraph.runtime.cpu.linear.AmpLinear`; ``shared``: other nodes use ``w``
        too), then the ``activation`` (``activations.py``); without gradients, the
        inference working copy is used, packed for oneDNN where it runs the dtype, which
        applies the activation in its epilogue. ``transposed``: ``w`` is stored
        ``[in, out]`` (transformers' ``Conv1D``, ``addmm(b, x, w)``): it trains as the graph
        did, a cast and ``addmm``, and its packed inference copy is of ``w.t()``."""
        training = torch.is_grad_enabled() and w.requires_grad
        if training and not transposed and not _small(x, w):
            return activate(AmpLinear.apply(x, w, b, self, shared), activation)
        b = self.cast(b, x.dtype) if b is not None else None
        if not training:
            # one inference copy a weight for its linears (a frozen one, as under LoRA, is
            # linear'd with and without input gradients): the packed copy in oneDNN's layout
            # (see packed.py) where it can serve, which replaces the plain one when it is
            # made. A transposed weight's (its reorder costs ~3x a plain one's) is made from
            # the plain copy when that is used again on an unchanged master: the first call
            # after an update, as an evaluation after every training step, casts only
            packed_tag = ("infer", x.dtype, "packed_t" if transposed else "packed")
            plain_tag = ("infer", x.dtype, None)
            if packed.usable(x, w.t() if transposed else w, b) and (not transposed or any(
                    self._current(w, tag) is not None for tag in (packed_tag, plain_tag))):
                def pack(d: torch.Tensor) -> torch.Tensor:
                    low = self._current(w, plain_tag)
                    self._drop(w, plain_tag)
                    low = d.to(x.dtype) if low is None else low
                    return packed.pack(low.t().contiguous() if transposed else low,
                                       x.numel() // max(1, x.shape[-1]))
                return packed.linear(x, self._inference_copy(w, packed_tag, pack), b,
                                     activation)
            self._drop(w, packed_tag)
        # a small weight trains as autocast's: a fresh copy (cast also drops the inference
        # copies, packed or not), aten's linear and its backward
        wl = self.cast(w, x.dtype)
        if transposed:
            out = torch.addmm(b, x, wl) if b is not None else torch.mm(x, wl)
        else:
            out = _linear(x, wl, b)
        return activate(out, activation)

    def amp_embedding(self, w: torch.Tensor, ids: torch.Tensor, padding_idx: int = -1,
                      shared: bool = False) -> torch.Tensor:
        """``aten.embedding(w, ids, padding_idx)`` on an fp32 table (see
        :class:`~ampgraph.runtime.cpu.embedding.AmpEmbedding`;
        ``shared``: other nodes use ``w`` too); a table too small for its gradient to be
        kept is aten's, whose backward needs no Python."""
        if torch.is_grad_enabled() and w.requires_grad and w.numel() >= KEPT_GRAD_NUMEL:
            return AmpEmbedding.apply(w, ids, padding_idx, self, shared)
        return torch.embedding(w, ids, padding_idx)  # aten's own backward

    def pooled(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A view of a pooled scratch of ``shape`` that nothing else holds (the blocks of
        :class:`~ampgraph.runtime.cpu.linear.AmpLinear`'s blocked products)."""
        with self._lock:
            return take_free(self._scratch.setdefault((shape, dtype, device), []),
                             lambda buf: True,
                             lambda: torch.empty(shape, dtype=dtype, device=device),
                             MAX_SCRATCH)

    def working_copy(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``p`` cast to ``dtype`` for training: into its buffer kept between steps if it is
        large enough that a fresh one could fault its pages in (above glibc's smallest mmap
        threshold), else into a fresh tensor from the heap's free lists, which then lives
        only from its use in forward until backward, as autocast's."""
        if p.numel() * dtype.itemsize < KEPT_COPY_BYTES:
            return p.to(dtype)
        return self._buffer(p, "train", dtype).copy_(p)

    def grad_buffer(self, p: torch.Tensor) -> torch.Tensor:
        """A view of a buffer for ``p``'s gradient, kept between steps, that nothing else
        holds (autograd adopts it as ``p.grad`` without a copy; a gradient the user kept is
        never overwritten: a new buffer is made)."""
        return self._buffer(p, "grad", p.dtype)

    def _buffer(self, p: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """A view of ``p``'s ``kind`` buffer (in ``dtype``, with ``p``'s strides) if no tensor
        outside the cache shares its storage, else of a new one (which replaces it: the old
        one lives on with its other holders). The view is made under the lock, so the buffer
        is marked in use before another thread can pick it."""
        key = (kind, dtype)
        with self._lock:
            per = self._per_param(p)
            pool = [per[key]] if key in per else []
            view = take_free(pool, lambda buf: buf.shape == p.shape and buf.stride() == p.stride()
                             and buf.device == p.device, lambda: empty_as(p, dtype, None), 1)
            per[key] = pool[0]
            return view

    def tied_grad(self, w: torch.Tensor) -> torch.Tensor:
        """A view of a buffer kept between steps for the share of ``w``'s gradient that one
        of the nodes using it computes (a tied table's lookup), which nothing else holds:
        autograd adds it into the other shares (in place into theirs where it arrives
        last, as a lookup's does), so it stays the cache's."""
        return self._buffer(w, "tied", w.dtype)

    def keep_grad(self, w: torch.Tensor, shared: bool) -> weakref.ref | None:
        """In forward: a reference to ``w`` if its gradient is to go into a buffer kept
        between steps, else None (and any buffer is forgotten).

        Kept for a weight of ``KEPT_GRAD_NUMEL`` elements or more (a fresh gradient that
        size faults its pages in every step), but only while the last gradient lives
        through this forward anyway (zero_grad after forward): the buffer is that gradient,
        and costs nothing at the forward's peak. Not for a weight other nodes use too:
        autograd sums tied gradients in place only into a tensor nothing else holds."""
        if w.numel() >= KEPT_GRAD_NUMEL and not shared and w.grad is not None:
            return weakref.ref(w)
        self._drop(w, ("grad", w.dtype))
        return None

    def kept_grad(self, ref: weakref.ref | None) -> torch.Tensor | None:
        """In backward: the buffer for the gradient of the weight :meth:`keep_grad` kept,
        or None for a fresh gradient (also when gradients accumulate: autograd adds the
        new one into the one the weight holds)."""
        w = ref() if ref is not None else None
        if w is None:
            return None
        if w.grad is not None:
            self._drop(w, ("grad", w.dtype))
            return None
        return self.grad_buffer(w)

    def _peek(self, p: torch.Tensor) -> dict | None:
        """``p``'s entries, without making any (no lock: a read of the slots dict)."""
        ref, per = self._slots.get(id(p), (None, None))
        return per if ref is not None and ref() is p else None

    def _drop(self, p: torch.Tensor, tag: tuple) -> None:
        """Forget ``p``'s entry ``tag`` (a tensor still holding a buffer keeps it alive)."""
        per = self._peek(p)
        if per and tag in per:
            with self._lock:
                per.pop(tag, None)

    def drop_inference_copies(self, *params: torch.Tensor) -> None:
        """Forget the inference copies of ``params``: training changes them, so they would
        be made again. (Called for every weight a training step casts: the lock is taken
        only where there is something to drop.)"""
        for p in params:
            if self._peek(p):  # its entries change under the lock only: read them so too
                with self._lock:
                    per = self._per_param(p)
                    for key in [k for k in per if k[0] == "infer"]:
                        del per[key]

    def clear(self) -> None:
        with self._lock:
            self._slots = {}
            self._scratch = {}

    def train_copies(self) -> list[torch.Tensor]:
        """The persistent low-precision working copies that training casts write into."""
        with self._lock:
            return [entry[0] for _, per in self._slots.values()
                    for key, entry in per.items() if key[0] == "train"]

    def nbytes(self) -> int:
        """Bytes held by the working copies."""
        with self._lock:
            total = 0
            for _, per in self._slots.values():
                for key, entry in per.items():
                    t = entry[1] if key[0] == "infer" else entry[0]  # train/grad: (buf, n)
                    total += t.numel() * t.element_size()
            for pool in self._scratch.values():
                total += sum(buf.numel() * buf.element_size() for buf, _ in pool)
            return total
