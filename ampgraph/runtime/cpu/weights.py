"""Low-precision working copies of the fp32 master weights.

The graph's parameter casts call :meth:`WeightCache.cast` instead of ``aten._to_copy``:

- without gradients (inference) a copy is made once and reused until the master changes
  (its version counter, data pointer, device or shape), so repeated inference casts each
  weight once instead of every call;
- with gradients (training) the cast makes a fresh tensor, as autocast's, placed just
  before its first use (``route_weight_casts``): it lives from there until backward, so
  the weights of later layers are not live at a peak in the middle of forward. Its
  backward hands the master an fp32 gradient with the master's strides (the copy may be
  channels-last).

Linear layers whose weight is cast for them alone call :meth:`WeightCache.amp_linear`: the
cast, the linear and the conversion of its weight gradient in one autograd function. Its
working copy is kept between steps when a fresh one could fault its pages in (above
``KEPT_COPY_BYTES``); a buffer still referenced by a live autograd graph (two forwards
before one backward) is never overwritten, a new one is made. A weight of
``BLOCKED_NUMEL`` elements or more is cast block by block, in forward and again in
backward (``blocked.py``), so no whole low-precision copy of it exists. The gradient of a
weight of ``KEPT_GRAD_NUMEL`` elements or more goes into a buffer kept between steps while
the last gradient lives through forward anyway (zero_grad after forward), unless other
nodes use the weight too (tied embeddings); other gradients are fresh tensors, as
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
from typing import Any

import torch

from ampgraph.runtime.cpu import blocked, packed
from ampgraph.runtime.cpu.buffers import take_free
from ampgraph.runtime.tensors import empty_as

_linear = torch.nn.functional.linear  # aten.linear's generated binding: no OpOverload frame


class _CastInto(torch.autograd.Function):
    """``buffer <- param`` as a differentiable cast; backward converts the gradient to the
    param's dtype and strides (which the buffer's may not have: a channels-last copy)."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        ctx.dtype, ctx.stride = param.dtype, param.stride()
        buffer.copy_(param)
        return buffer.view_as(buffer)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = torch.empty_strided(grad.shape, ctx.stride, dtype=ctx.dtype, device=grad.device)
        return out.copy_(grad), None


class _Linear(torch.autograd.Function):
    """``linear(x, low(w_master), low(b_master))`` with the casts and the conversion of the
    gradients fused in (a bias already in ``x``'s dtype is used as it is).

    A weight below ``BLOCKED_NUMEL`` elements is cast into its working copy (see
    :meth:`WeightCache.working_copy`; unless backward would not read it, see
    :func:`_blockable`), which ``aten.linear`` uses and backward keeps; once
    backward has made ``grad_input`` the copy is dead, and ``grad_out.T @ input`` is
    computed into it before its conversion to fp32 (no fresh low-precision gradient). A
    larger one never exists in the low dtype as a whole: forward casts it block of rows by
    block of rows into a small pooled scratch, each block feeding the columns of the output
    it makes; backward saves the fp32 master itself (so autograd checks it is unchanged, as
    for an fp32 linear) and casts it again, block of columns by block of columns, for
    ``grad_out @ w``, and computes ``grad_out.T @ input`` block of rows by block of rows
    into the scratch, each block converted straight into the fp32 gradient. The values are
    those of ``aten.linear`` on the whole cast weight up to the kernels' summation order.
    A backward that builds a graph (``create_graph``, a gradient penalty) computes the
    gradients as plain differentiable ops of the fp32 master instead.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                cache: WeightCache, shared: bool) -> torch.Tensor:
        cast_bias = b is not None and b.dtype != x.dtype  # an fp32 master bias: cast here too
        cache.drop_inference_copies(w, *([b] if cast_bias else []))  # stale after the update
        bl = cache.working_copy(b, x.dtype) if cast_bias else b
        ctx.bias_dtype = b.dtype if b is not None else None
        ctx.w_dtype = w.dtype
        ctx.cache = cache
        ctx.blocked = _blockable(x, w, ctx.needs_input_grad[0])
        ctx.w_ref = cache.keep_grad(w, shared)
        ctx.master = w  # not saved: an update before backward is allowed, as autocast's
        if ctx.blocked:  # backward reads the master only for grad_input
            ctx.save_for_backward(x, w if ctx.needs_input_grad[0] else None)
            return blocked.linear(x, w, bl, cache._pooled)
        wl = cache.working_copy(w, x.dtype)
        ctx.wl_owned = wl.data_ptr() != w.data_ptr()
        ctx.save_for_backward(x, wl)
        return _linear(x, wl, bl)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, wl = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = gw = gb = None
        grad2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        # create_graph (a gradient penalty differentiates these again): plain ops, and the
        # weight's share through its master, to which the working copy has no graph
        graph = torch.is_grad_enabled()
        in_blocks = ctx.blocked and not graph
        if graph:
            wl = ctx.master.to(grad.dtype)
        if need_x:
            if in_blocks:  # wl is the fp32 master
                gx = blocked.grad_input(grad2, wl, ctx.cache._pooled).view(
                    *grad.shape[:-1], -1)
            else:  # on the 2-D view: matmul would expand wl per batch for a strided grad
                gx = torch.mm(grad2, wl).view(*grad.shape[:-1], -1)
        if need_w:
            out = None if graph else ctx.cache.kept_grad(ctx.w_ref)
            if in_blocks:
                gw = blocked.weight_grad(grad2, x2, ctx.w_dtype, out, ctx.cache._pooled)
            else:  # into the working copy once nothing reads it again, else a fresh tensor
                low = torch.mm(grad2.t(), x2, out=wl) \
                    if not graph and _dead(wl, ctx.wl_owned) else grad2.t().mm(x2)
                gw = low.to(ctx.w_dtype) if out is None else out.copy_(low)
        if need_b and ctx.bias_dtype is not None:
            gb = grad2.sum(0).to(ctx.bias_dtype)  # summed in the low dtype, as aten's
        return gx, gw, gb, None, None


class _Embedding(torch.autograd.Function):
    """``aten.embedding(w, ids, padding_idx)`` whose backward sums the rows' gradients into
    ``w``'s kept gradient buffer (zeroed first) when :meth:`WeightCache.keep_grad` keeps
    one, else into a fresh table as aten's (``index_add_`` either way, as aten's CPU
    embedding backward: the same sums in the same order)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, ids: torch.Tensor, padding_idx: int,
                cache: WeightCache, shared: bool) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.w_ref = cache.keep_grad(w, shared)
        ctx.padding_idx, ctx.cache, ctx.rows = padding_idx, cache, w.shape[0]
        return torch.embedding(w, ids, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (ids,) = ctx.saved_tensors
        out = ctx.cache.kept_grad(ctx.w_ref)
        if out is None:
            gw = torch.ops.aten.embedding_dense_backward.default(
                grad, ids, ctx.rows, ctx.padding_idx, False)
            return gw, None, None, None, None
        flat = ids.reshape(-1)
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx >= 0:  # the padding row gets no gradient
            rows = rows.masked_fill((flat == ctx.padding_idx).unsqueeze(1), 0)
        return out.zero_().index_add_(0, flat, rows.to(out.dtype)), None, None, None, None


def _dead(wl: torch.Tensor, owned: bool) -> bool:
    """Whether :class:`_Linear`'s backward may write the weight gradient over the working
    copy ``wl`` once it has made ``grad_input``: a contiguous copy of the cache's own (not
    the weight itself) that no later backward reads (the graph is not retained). The next
    forward casts into it afresh."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return owned and wl.is_contiguous() and keep_graph is not None and not keep_graph()


def _small(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether a training linear on ``w`` runs as autocast's does, a fresh cast of the
    weight and aten's linear, with autograd's own backward: its copy is not kept (below
    ``KEPT_COPY_BYTES``), nor its gradient, nor is it blocked, so :class:`_Linear` would add
    only its Python (docs/performance.md#weight-casts-at-first-use)."""
    return (w.numel() * x.dtype.itemsize < KEPT_COPY_BYTES and w.numel() < KEPT_GRAD_NUMEL
            and not _blockable(x, w, x.requires_grad))


def _blockable(x: torch.Tensor, w: torch.Tensor, need_x: bool) -> bool:
    """Whether :class:`_Linear` runs ``w`` in blocks: a plain 2-D weight, an input with a
    batch dimension, both on the CPU (where fresh or extra weight-sized memory costs page
    faults; a GPU runs one large product faster than many small ones), and either a large
    weight or one larger than the scratch whose backward never reads a copy: the input
    needs no gradient (a network's first layer), so autocast's copy dies after forward,
    and a kept one would be live at the backward's peak (a smaller one would keep a
    pooled scratch its size instead)."""
    size = w.numel() >= BLOCKED_NUMEL or not need_x and w.numel() > blocked.SCRATCH_NUMEL
    return (size and w.dim() == 2 and x.dim() >= 2
            and w.layout == torch.strided and x.layout == torch.strided
            and w.device.type == "cpu" and x.device.type == "cpu")


# Weights of BLOCKED_NUMEL elements or more are cast, and their gradients computed, in
# blocks: no whole low-precision copy of them exists (a 7B model's 32000x4096 head: 262 MB).
# Below it one whole product is faster, and its working copy costs no more than autocast's
# cast, which autocast keeps from forward until backward (docs/performance.md#blocked-products).
BLOCKED_NUMEL = 1 << 26
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
            self._slots[id(p)] = (weakref.ref(p, self._forget(id(p))), per)
        return per

    def _forget(self, key: int):
        def drop(ref: weakref.ref) -> None:
            with self._lock:
                if self._slots.get(key, (None,))[0] is ref:
                    del self._slots[key]
        return drop

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
            return _CastInto.apply(p, buf)
        return self._inference_copy(p, ("infer", dtype, memory_format), lambda d: d.to(
            dtype, memory_format=memory_format or torch.preserve_format))

    def _inference_copy(self, p: torch.Tensor, tag: tuple,
                        make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The copy ``make(p.detach())`` kept under ``tag``, made again once the master
        changes (its version counter, data pointer, device or shape)."""
        key = (p._version, p.data_ptr(), p.device, tuple(p.shape))
        with self._lock:
            per = self._per_param(p)
            entry = per.get(tag)
            if entry is None or entry[0] != key:
                with torch.inference_mode(False), torch.no_grad():
                    entry = per[tag] = (key, make(p.detach()))
            return entry[1]

    def amp_linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                   shared: bool = False) -> torch.Tensor:
        """``aten.linear(x, w.to(x.dtype), b)`` for an fp32 master weight ``w`` (see
        :class:`_Linear`; ``shared``: other nodes use ``w`` too); without gradients, the
        inference working copy is used, packed for oneDNN where it runs the dtype."""
        training = torch.is_grad_enabled() and w.requires_grad
        if training and not _small(x, w):
            return _Linear.apply(x, w, b, self, shared)
        b = self.cast(b, x.dtype) if b is not None else None
        if training:  # a small weight trains as autocast's: a fresh copy (cast also drops
            # the inference copies, packed or not), aten's linear and its backward
            return _linear(x, self.cast(w, x.dtype), b)
        # one inference copy a weight for its linears (a frozen one, as under LoRA, is
        # linear'd with and without input gradients): the packed copy in oneDNN's layout
        # (see packed.py) where it can serve, which replaces the plain one when it is made
        packed_tag = ("infer", x.dtype, "packed")
        if packed.usable(x, w, b):
            def pack(d: torch.Tensor) -> torch.Tensor:
                self._drop(w, ("infer", x.dtype, None))
                return packed.pack(d.to(x.dtype), x.numel() // max(1, x.shape[-1]))
            return packed.linear(x, self._inference_copy(w, packed_tag, pack), b)
        self._drop(w, packed_tag)
        return _linear(x, self.cast(w, x.dtype), b)

    def amp_embedding(self, w: torch.Tensor, ids: torch.Tensor, padding_idx: int = -1,
                      shared: bool = False) -> torch.Tensor:
        """``aten.embedding(w, ids, padding_idx)`` on an fp32 table (see :class:`_Embedding`;
        ``shared``: other nodes use ``w`` too); a table too small for its gradient to be
        kept is aten's, whose backward needs no Python."""
        if torch.is_grad_enabled() and w.requires_grad and w.numel() >= KEPT_GRAD_NUMEL:
            return _Embedding.apply(w, ids, padding_idx, self, shared)
        return torch.embedding(w, ids, padding_idx)  # aten's own backward

    def _pooled(self, shape: tuple, dtype: torch.dtype, device: torch.device
                ) -> torch.Tensor:
        """A view of a pooled buffer of ``shape`` that nothing else holds."""
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
