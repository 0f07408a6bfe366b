"""Persistent low-precision working copies of the fp32 master weights, for inference.

With gradients disabled the graph's parameter casts come from ``WeightCache``: a copy is
made once and reused until the master changes (its version counter, data pointer, device or
shape), so repeated inference casts each weight once instead of every call. With gradients
enabled the cast is the ordinary differentiable ``p.to(dtype)``: training never reads a
cached copy. Weights changed through ``.data`` bypass version counters: call
``AmpModule.clear_weight_cache()`` after such an update.
"""

from __future__ import annotations

import threading
import weakref

import torch


class WeightCache:
    """Low-precision copies keyed by parameter; thread-safe; entries die with the param."""

    def __init__(self) -> None:
        # id(param) -> (weakref to param, {dtype: (key, copy)}); tensors are not hashable by
        # value, so entries are keyed by identity and dropped when the parameter dies.
        self._copies: dict[int, tuple[weakref.ref, dict]] = {}
        self._lock = threading.RLock()  # GC callbacks may fire while held

    def cast(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``p.to(dtype)``; served from the cache when no gradient is needed."""
        if torch.is_grad_enabled() and p.requires_grad:
            return p.to(dtype)
        key = (p._version, p.data_ptr(), p.device, tuple(p.shape), dtype)
        with self._lock:
            ref, per_param = self._copies.get(id(p), (None, None))
            if ref is None or ref() is not p:
                per_param = {}
                self._copies[id(p)] = (weakref.ref(p, self._forget(id(p))), per_param)
            entry = per_param.get(dtype)
            if entry is None or entry[0] != key:
                with torch.inference_mode(False), torch.no_grad():
                    entry = per_param[dtype] = (key, p.detach().to(dtype))
            return entry[1]

    def _forget(self, key: int):
        def drop(_ref: weakref.ref) -> None:
            with self._lock:
                if self._copies.get(key, (None,))[0] is _ref:
                    del self._copies[key]
        return drop

    def clear(self) -> None:
        with self._lock:
            self._copies = {}

    def nbytes(self) -> int:
        """Bytes held by the working copies."""
        with self._lock:
            return sum(t.numel() * t.element_size()
                       for _, per in self._copies.values() for _, t in per.values())
