"""HuggingFace cache objects (``DynamicCache``, ``EncoderDecoderCache``) as pytree nodes, so
torch.export flattens them into the graph's inputs and outputs instead of failing."""


from __future__ import annotations

import sys
import threading
from typing import Any

from torch.utils import _pytree as pytree

_registry_lock = threading.Lock()
_hf_caches_registered = False


def register_hf_caches() -> None:
    """Make transformers' ``DynamicCache`` and ``EncoderDecoderCache`` pytree nodes, so a
    model taking or returning them is exported whole (their tensors become graph inputs
    and outputs, and the caller gets cache objects back).

    DynamicCache uses transformers' own ``register_dynamic_cache_export_support``;
    EncoderDecoderCache is a node whose children are its two caches. Idempotent and lazy:
    nothing happens until transformers' cache module has been imported by the user, and a
    type somebody registered already (the user, transformers) is left as it is.
    """
    global _hf_caches_registered
    if _hf_caches_registered:
        return
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None:
        return
    with _registry_lock:
        if _hf_caches_registered:
            return
        dynamic = getattr(cache_utils, "DynamicCache", None)
        if dynamic is not None and dynamic not in pytree.SUPPORTED_NODES:
            try:
                from transformers.integrations.executorch import (
                    register_dynamic_cache_export_support,
                )
            except ImportError:  # an older or newer transformers: caches stay eager
                pass
            else:
                register_dynamic_cache_export_support()
        encdec = getattr(cache_utils, "EncoderDecoderCache", None)
        if encdec is not None and encdec not in pytree.SUPPORTED_NODES:
            _register_encoder_decoder_cache(encdec)
        _hf_caches_registered = True


_ENCDEC_FIELDS = ("self_attention_cache", "cross_attention_cache")


def _register_encoder_decoder_cache(cls: type) -> None:
    def flatten(cache: Any) -> tuple[list, Any]:
        return [getattr(cache, f) for f in _ENCDEC_FIELDS], None

    def flatten_with_keys(cache: Any) -> tuple[list, Any]:
        return [(pytree.GetAttrKey(f), getattr(cache, f)) for f in _ENCDEC_FIELDS], None

    def unflatten(children: Any, context: Any) -> Any:
        return cls(*children)  # recomputes is_updated from the cross-attention cache

    try:
        pytree.register_pytree_node(
            cls, flatten, unflatten, flatten_with_keys_fn=flatten_with_keys,
            serialized_type_name=f"{cls.__module__}.{cls.__name__}")
    except ValueError as exc:  # registered meanwhile by someone else: theirs stands
        if "already registered" not in str(exc):
            raise
