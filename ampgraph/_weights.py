"""Low-precision working copies of the fp32 master weights.

The graph's parameter casts call :meth:`WeightCache.cast` instead of ``aten._to_copy``:

- without gradients (inference) a copy is made once and reused until the master changes
  (its version counter, data pointer, device or shape), so repeated inference casts each
  weight once instead of every call;
- with gradients (training) the cast writes into a persistent buffer per weight instead of
  a fresh allocation, which on CPU costs page faults every step; a buffer still referenced
  by a live autograd graph (two forwards before one backward) is never overwritten, a new
  one is made. The cast's backward hands fp32 gradients to the master, likewise converted
  into a persistent buffer: autograd adopts it as ``param.grad`` (no copy), and it is
  written again only once nothing but the cache holds it (after ``zero_grad()``), so a
  gradient the user kept is never overwritten.

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
        buffer.copy_(param)
        return buffer.view_as(buffer)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        param = ctx.param_ref()
        if param is None or grad.shape != param.shape or grad.layout != torch.strided:
            return grad.to(torch.float32 if param is None else param.dtype), None, None
        with ctx.cache._lock:  # pick a free buffer and mark it in use (the view) atomically
            out = ctx.cache.grad_buffer(param).view_as(param)
        # a fresh view: autograd may adopt it as param.grad without copying
        return out.copy_(grad), None, None


class WeightCache:
    """Working copies keyed by parameter identity; thread-safe; entries die with the param."""

    def __init__(self) -> None:
        # id(param) -> (weakref to param, {key: entry}); tensors are not hashable by value.
        self._slots: dict[int, tuple[weakref.ref, dict]] = {}
        self._lock = threading.RLock()  # GC callbacks may fire while it is held

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

    def cast(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``p.to(dtype)``, from a working copy (see the module docstring)."""
        if p.dtype == dtype:
            return p
        if torch.is_grad_enabled() and p.requires_grad:
            with self._lock:  # pick a free buffer and mark it in use (the view) atomically
                return _CastInto.apply(p, self._buffer(p, ("train", dtype), dtype), self)
        key = (p._version, p.data_ptr(), p.device, tuple(p.shape))
        with self._lock:
            per = self._per_param(p)
            entry = per.get(("infer", dtype))
            if entry is None or entry[0] != key:
                with torch.inference_mode(False), torch.no_grad():
                    entry = per[("infer", dtype)] = (key, p.detach().to(dtype))
            return entry[1]

    def grad_buffer(self, p: torch.Tensor) -> torch.Tensor:
        """A persistent buffer for ``p``'s gradient that nothing outside the cache holds."""
        return self._buffer(p, ("grad", p.dtype), p.dtype)

    def _buffer(self, p: torch.Tensor, key: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The buffer stored under ``key`` if no tensor outside the cache shares its storage,
        else a new one (which replaces it: the old one lives on with its other holders)."""
        with self._lock:
            per = self._per_param(p)
            entry = per.get(key)
            if entry is not None:
                buf, alone = entry
                if buf.shape == p.shape and buf.stride() == p.stride() \
                        and buf.device == p.device and _storage_refs(buf) == alone:
                    return buf
            with torch.inference_mode(False):  # the param's strides: channels-last stays so
                buf = torch.empty_strided(p.shape, p.stride(), dtype=dtype, device=p.device)
            per[key] = (buf, _storage_refs(buf))
            return buf

    def clear(self) -> None:
        with self._lock:
            self._slots = {}

    def nbytes(self) -> int:
        """Bytes held by the working copies."""
        with self._lock:
            total = 0
            for _, per in self._slots.values():
                for key, entry in per.items():
                    t = entry[1] if key[0] == "infer" else entry[0]  # train/grad: (buf, n)
                    total += t.numel() * t.element_size()
            return total
