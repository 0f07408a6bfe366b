"""Low-precision working copies of the fp32 master weights.

The graph's parameter casts call :meth:`WeightCache.cast` instead of ``aten._to_copy``:

- without gradients (inference) a copy is made once and reused until the master changes
  (its version counter, data pointer, device or shape), so repeated inference casts each
  weight once instead of every call;
- with gradients (training) the cast writes into a persistent buffer per weight (dropping
  the inference copy, which the next update makes stale) instead of a fresh allocation,
  which on CPU costs page faults every step; a buffer still referenced by a live autograd
  graph (two forwards before one backward) is never overwritten, a new one is made. The
  cast's backward hands fp32 gradients to the master, likewise converted into a
  persistent buffer: autograd adopts it as ``param.grad`` (no copy), and it is written
  again only once nothing but the cache holds it (after ``zero_grad()``), so a gradient
  the user kept is never overwritten.

Linear layers whose weight is cast for them alone call :meth:`WeightCache.amp_linear`: the
cast, the linear and the conversion of its weight gradient in one autograd function, which
writes the gradient block by block into the master's gradient buffer, so a training step
allocates no weight-sized tensor (fresh large allocations cost page faults on CPU). A large
weight is also cast block by block, in forward and again in backward, so no whole
low-precision copy of it is kept: an O2 step then needs less memory than autocast, which
keeps its casts from forward until backward.

Weights changed through ``.data`` bypass version counters: call
``AmpModule.clear_weight_cache()`` after such an update.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch


def _storage_refs(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _CastInto(torch.autograd.Function):
    """``buffer <- param`` as a differentiable cast; backward converts the gradient into a
    free persistent buffer of the param's dtype."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, buffer: torch.Tensor, cache: WeightCache
                ) -> torch.Tensor:
        ctx.param_ref = weakref.ref(param)
        ctx.cache = cache
        cache.expect_grad(param, ctx)
        buffer.copy_(param)
        return buffer.view_as(buffer)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        param = ctx.param_ref()
        if param is None or grad.shape != param.shape or grad.layout != torch.strided:
            return grad.to(torch.float32 if param is None else param.dtype), None, None
        # a fresh view: autograd may adopt it as param.grad without copying
        return ctx.cache.grad_buffer(param, ctx).copy_(grad), None, None


class _Linear(torch.autograd.Function):
    """``linear(x, low(w_master), low(b_master))`` with the casts and the conversion of the
    gradients fused in (a bias already in ``x``'s dtype is used as it is).

    A weight of at most ``BLOCKED_NUMEL`` elements is cast into its persistent working copy,
    which ``aten.linear`` uses and backward keeps. A larger one never exists in the low
    dtype as a whole (what an O2 step would otherwise keep beyond autocast's peak): forward
    casts it block of rows by block of rows into a small pooled scratch, each block feeding
    the columns of the output it makes; backward saves the fp32 master itself (so autograd
    checks it is unchanged, as for an fp32 linear) and casts it again, block of columns by
    block of columns, for ``grad_out @ w``. The values are the same as ``aten.linear`` on the
    whole cast weight: every output element is one full-length dot product either way.

    Backward computes ``grad_out.T @ input`` in the low dtype, as aten's linear backward
    does, but block of rows by block of rows into a small reused scratch that is converted
    straight into the master's gradient buffer: a step allocates no weight-sized tensor
    (fresh large allocations cost page faults on CPU) and the conversion reads from cache.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                cache: WeightCache) -> torch.Tensor:
        cast_bias = b is not None and b.dtype != x.dtype  # an fp32 master bias: cast here too
        bl = cache._buffer(b, ("train", x.dtype), x.dtype).copy_(b) if cast_bias else b
        ctx.refs = (weakref.ref(w), weakref.ref(b) if cast_bias else None)
        ctx.cache = cache
        cache.expect_grad(w, ctx)
        if cast_bias:
            cache.expect_grad(b, ctx)
        ctx.has_bias = b is not None
        ctx.blocked = _blockable(x, w)
        if ctx.blocked:
            cache.drop_inference_copy(w, x.dtype)
            ctx.save_for_backward(x, w)
            return cache.blocked_linear(x, w, bl)
        wl = cache._buffer(w, ("train", x.dtype), x.dtype).copy_(w)
        ctx.save_for_backward(x, wl)
        return torch.ops.aten.linear.default(x, wl, bl)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, wl = ctx.saved_tensors
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        gx = gw = gb = None
        grad2 = grad.reshape(-1, grad.shape[-1])
        if need_x:
            if ctx.blocked:  # wl is the fp32 master
                gx = ctx.cache.blocked_grad_input(grad2, wl).view(*grad.shape[:-1], -1)
            else:
                gx = grad.matmul(wl)
        w_ref, b_ref = ctx.refs
        if need_w:
            gw = ctx.cache.linear_weight_grad(w_ref(), grad2, x.reshape(-1, x.shape[-1]), ctx)
        if need_b and ctx.has_bias:
            gb = grad2.sum(0)  # in the low dtype, as aten's linear backward
            b = b_ref() if b_ref is not None else None
            if b is not None:
                gb = ctx.cache.grad_buffer(b, ctx).copy_(gb)
            elif b_ref is not None:
                gb = gb.float()
        return gx, gw, gb, None


class _Embedding(torch.autograd.Function):
    """``aten.embedding(w, ids, padding_idx)`` whose backward sums the rows' gradients into
    ``w``'s persistent gradient buffer (zeroed first) instead of a fresh table-sized tensor
    (``index_add_``, as aten's CPU embedding backward: the same sums in the same order)."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, ids: torch.Tensor, padding_idx: int,
                cache: WeightCache) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.w_ref = weakref.ref(w)
        ctx.padding_idx = padding_idx
        ctx.cache = cache
        cache.expect_grad(w, ctx)
        ctx.table = (w.shape, w.dtype)
        return torch.ops.aten.embedding.default(w, ids, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (ids,) = ctx.saved_tensors
        w = ctx.w_ref()
        shape, dtype = ctx.table
        flat = ids.reshape(-1)
        rows = grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx >= 0:  # the padding row gets no gradient
            rows = rows.masked_fill((flat == ctx.padding_idx).unsqueeze(1), 0)
        if w is not None and w.shape == shape and w.layout == torch.strided:
            out = ctx.cache.grad_buffer(w, ctx).zero_()
        else:
            out = torch.zeros(shape, dtype=dtype, device=grad.device)
        return out.index_add_(0, flat, rows.to(dtype)), None, None, None


def _blockable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :class:`_Linear` runs ``w`` in blocks: a large plain 2-D weight, an input
    with a batch dimension, both on the CPU (where fresh or extra weight-sized memory costs
    page faults; a GPU runs one large product faster than many small ones)."""
    return (w.numel() > BLOCKED_NUMEL and w.dim() == 2 and x.dim() >= 2
            and w.layout == torch.strided and x.layout == torch.strided
            and w.device.type == "cpu" and x.device.type == "cpu")


# Weights above BLOCKED_NUMEL elements are cast, and their gradients computed, in blocks of
# SCRATCH_NUMEL elements. Below it one whole product is faster (ViT-B/16's 768x3072 linears
# in 1M-element blocks made O2 training 0.92x autocast, whole 1.03x; 962 vs 858 MiB peak,
# still under autocast's 1062), and the whole low-precision copy costs no more than
# autocast's, which it keeps from forward until backward.
BLOCKED_NUMEL = 1 << 23
SCRATCH_NUMEL = 1 << 20  # elements of low-precision weight gradient computed per block
MAX_SCRATCH = 4  # pooled scratches per shape (threads running backward at once)


class WeightCache:
    """Working copies keyed by parameter identity; thread-safe; entries die with the param."""

    def __init__(self) -> None:
        # id(param) -> (weakref to param, {key: entry}); tensors are not hashable by value.
        self._slots: dict[int, tuple[weakref.ref, dict]] = {}
        self._lock = threading.RLock()  # GC callbacks may fire while it is held
        self._scratch: dict[tuple, list[tuple[torch.Tensor, int]]] = {}
        # id(param) -> backward nodes (autograd ctxs) still to produce a gradient for it
        self._pending: dict[int, weakref.WeakSet] = {}

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
                    self._pending.pop(key, None)
        return drop

    def cast(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``p.to(dtype)``, from a working copy (see the module docstring)."""
        if p.dtype == dtype:
            return p
        if torch.is_grad_enabled() and p.requires_grad:
            return _CastInto.apply(p, self._buffer(p, ("train", dtype), dtype), self)
        key = (p._version, p.data_ptr(), p.device, tuple(p.shape))
        with self._lock:
            per = self._per_param(p)
            entry = per.get(("infer", dtype))
            if entry is None or entry[0] != key:
                with torch.inference_mode(False), torch.no_grad():
                    entry = per[("infer", dtype)] = (key, p.detach().to(dtype))
            return entry[1]

    def amp_linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """``aten.linear(x, w.to(x.dtype), b)`` for an fp32 master weight ``w`` (see
        :class:`_Linear`); without gradients, the inference working copy is used."""
        if torch.is_grad_enabled() and w.requires_grad:
            return _Linear.apply(x, w, b, self)
        b = self.cast(b, x.dtype) if b is not None else None
        return torch.ops.aten.linear.default(x, self.cast(w, x.dtype), b)

    def amp_embedding(self, w: torch.Tensor, ids: torch.Tensor, padding_idx: int = -1
                      ) -> torch.Tensor:
        """``aten.embedding(w, ids, padding_idx)``; when training on CPU, the table's
        gradient goes into its persistent buffer (see :class:`_Embedding`): a fresh
        table-sized tensor every step costs page faults there."""
        if torch.is_grad_enabled() and w.requires_grad and w.device.type == "cpu" \
                and w.dim() == 2:
            return _Embedding.apply(w, ids, padding_idx, self)
        return torch.ops.aten.embedding.default(w, ids, padding_idx)

    def blocked_linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
                       ) -> torch.Tensor:
        """``aten.linear(x, w.to(x.dtype), b)`` casting ``w`` a block of rows at a time."""
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.empty(x2.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
        for r, n, block in self._cast_blocks(w, 0, x.dtype):
            if b is None:
                torch.mm(x2, block.t(), out=out[:, r:r + n])
            else:
                torch.addmm(b[r:r + n], x2, block.t(), out=out[:, r:r + n])
        return out.view(*x.shape[:-1], w.shape[0])

    def blocked_grad_input(self, grad: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``grad @ w.to(grad.dtype)`` casting ``w`` a block of columns at a time."""
        out = torch.empty(grad.shape[0], w.shape[1], dtype=grad.dtype, device=grad.device)
        for c, n, block in self._cast_blocks(w, 1, grad.dtype):
            torch.mm(grad, block, out=out[:, c:c + n])
        return out

    def _cast_blocks(self, w: torch.Tensor, dim: int, dtype: torch.dtype):
        """Yield ``(start, n, block)``: the 2-D ``w`` cast to ``dtype`` ``n`` rows (``dim``
        0) or columns (``dim`` 1) at a time into a pooled scratch of at most
        ``SCRATCH_NUMEL`` elements (a column block keeps the scratch's row stride)."""
        size, other = w.shape[dim], w.shape[1 - dim]
        step = max(1, SCRATCH_NUMEL // other)
        scratch = self._pooled((step, other) if dim == 0 else (other, step), dtype, w.device)
        for start in range(0, size, step):
            n = min(step, size - start)
            yield start, n, scratch.narrow(dim, 0, n).copy_(w.narrow(dim, start, n))

    def linear_weight_grad(self, w: torch.Tensor | None, grad: torch.Tensor,
                           x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """``(grad.T @ x).to(w.dtype)`` into ``w``'s gradient buffer, in row blocks."""
        rows = grad.shape[1]
        if w is None or w.shape != (rows, x.shape[1]) or w.layout != torch.strided:
            return grad.t().mm(x).to(torch.float32 if w is None else w.dtype)
        out = self.grad_buffer(w, ctx)
        gt = grad.t()
        if w.numel() <= BLOCKED_NUMEL or w.device.type != "cpu":
            # one product: small, or a GPU, whose caching allocator recycles it
            return out.copy_(gt.mm(x))
        step = max(1, SCRATCH_NUMEL // max(1, x.shape[1]))
        scratch = self._pooled((step, x.shape[1]), grad.dtype, grad.device)
        for r in range(0, rows, step):
            n = min(step, rows - r)
            block = scratch[:n]
            torch.mm(gt[r:r + n], x, out=block)
            out[r:r + n].copy_(block)
        return out

    def _pooled(self, shape: tuple, dtype: torch.dtype, device: torch.device
                ) -> torch.Tensor:
        """A view of a pooled buffer of ``shape`` that nothing else holds."""
        key = (shape, dtype, device)
        with self._lock:
            pool = self._scratch.setdefault(key, [])
            for buf, alone in pool:
                if _storage_refs(buf) == alone:
                    return buf.view_as(buf)
            with torch.inference_mode(False):
                buf = torch.empty(shape, dtype=dtype, device=device)
            if len(pool) < MAX_SCRATCH:
                pool.append((buf, _storage_refs(buf)))
            return buf.view_as(buf)

    def expect_grad(self, p: torch.Tensor, ctx: Any) -> None:
        """Note that the backward of ``ctx`` (an autograd ctx) will produce a gradient for
        ``p``; forgotten when ``ctx`` is (its graph freed without a backward)."""
        with self._lock:
            self._per_param(p)  # registers the cleanup when p dies
            self._pending.setdefault(id(p), weakref.WeakSet()).add(ctx)

    def grad_buffer(self, p: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        """A view of a persistent buffer for ``p``'s gradient that nothing else holds.

        When another gradient for ``p`` is still to come (a weight used twice, as tied input
        and output embeddings are; backward ``ctx`` is done with ``p`` once this returns),
        the first ones get fresh tensors: autograd sums a weight's gradients in place only
        into the first that arrives and only if nothing else holds it, so the persistent
        buffer goes to the last. Two cache-held buffers would cost a third, summed tensor.
        """
        with self._lock:
            pending = self._pending.get(id(p))
            if pending is not None and ctx is not None:
                pending.discard(ctx)
                if len(pending):
                    with torch.inference_mode(False):
                        return torch.empty_strided(p.shape, p.stride(), dtype=p.dtype,
                                                   device=p.device)
            return self._buffer(p, ("grad", p.dtype), p.dtype)

    def _buffer(self, p: torch.Tensor, key: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A view of the buffer stored under ``key`` if no tensor outside the cache shares its
        storage, else of a new one (which replaces it: the old one lives on with its other
        holders). The view is made under the lock, so the buffer is marked in use before
        another thread can pick it."""
        with self._lock:
            per = self._per_param(p)
            if key[0] == "train":
                per.pop(("infer", dtype), None)  # stale after the next update anyway
            entry = per.get(key)
            if entry is not None:
                buf, alone = entry
                if buf.shape == p.shape and buf.stride() == p.stride() \
                        and buf.device == p.device and _storage_refs(buf) == alone:
                    return buf.view_as(buf)
            with torch.inference_mode(False):  # the param's strides: channels-last stays so
                buf = torch.empty_strided(p.shape, p.stride(), dtype=dtype, device=p.device)
            per[key] = (buf, _storage_refs(buf))
            return buf.view_as(buf)

    def drop_inference_copy(self, p: torch.Tensor, dtype: torch.dtype) -> None:
        """Forget ``p``'s inference copy: training changes ``p``, so it would be made again."""
        with self._lock:
            self._per_param(p).pop(("infer", dtype), None)

    def clear(self) -> None:
        with self._lock:
            self._slots = {}
            self._scratch = {}
            self._pending = {}

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
