"""HuggingFace cache objects as pytree nodes, so torch.export flattens them into the graph's
inputs and outputs instead of failing: every cache and cache-layer class transformers
defines (``DynamicCache`` of any layers, ``StaticCache``, the linear-attention, Mamba and
indexer layers, model-specific caches such as ``MiniMaxCache``)."""


from __future__ import annotations

import sys
import threading
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from ampgraph.capture.object_nodes import (
    ObjectContext,
    flatten_object,
    flatten_object_with_keys,
    rebuild_object,
)

_registry_lock = threading.Lock()
_modules_seen = 0  # len(sys.modules) when the classes were last looked for
_modules_scanned: set[str] = set()
_named_classes: dict[type, None] = {}  # the *Cache classes found in those modules

# transformers' own DynamicCache format takes exactly these layer classes
_PLAIN_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer", "DummyLayer")
# the base classes of transformers' caches and cache layers (cache_utils)
_BASES = ("Cache", "CacheLayerMixin", "LinearAttentionCacheLayerMixin", "DummyLayer")
# model-specific classes that derive from none of them (xLSTMCache, MimiConv1dPaddingCache,
# ParakeetRNNTDecoderCache ...), by transformers' own naming rule for cache classes
_CACHE_SUFFIXES = ("Cache", "CacheLayer")


def register_hf_caches(rescan: bool = False) -> None:
    """Make every cache class of transformers a pytree node, so a model taking or returning
    caches is exported whole (their tensors become graph inputs and outputs, and the caller
    gets objects of the same classes back).

    A ``DynamicCache`` of plain attention layers keeps transformers' own format
    (``register_dynamic_cache_export_support``'s); any other (linear-attention, Mamba,
    indexer layers) and every other class is flattened by its attributes
    (:mod:`ampgraph.capture.object_nodes`); ``EncoderDecoderCache`` is a node whose children
    are its two caches. A class somebody registered already (the user, transformers'
    exporters) is left as it is. Lazy and cheap to call again: nothing happens until
    transformers' cache module has been imported by the user, and the classes are looked
    for again only once more modules have been imported (a model's modeling file defines
    its own cache classes), or when ``rescan`` asks (``export_module`` does, once per
    capture: a subclass defined in a running script comes with no new module).

    Example:
        >>> register_hf_caches()  # flatten_inputs calls it on every call
    """
    global _modules_seen
    if len(sys.modules) == _modules_seen and not rescan:
        return
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None:
        return
    with _registry_lock:
        count = len(sys.modules)
        if count == _modules_seen and not rescan:
            return
        for cls in cache_classes(cache_utils):
            if cls not in pytree.SUPPORTED_NODES:
                _register(cls, cache_utils)
        _modules_seen = count


def cache_classes(cache_utils: Any) -> list[type]:
    """Every cache and cache-layer class defined so far: the subclasses of transformers'
    ``Cache``, ``CacheLayerMixin``, ``LinearAttentionCacheLayerMixin`` and ``DummyLayer``
    (those of the modeling files imported so far included), and the classes named
    ``*Cache`` / ``*CacheLayer`` in imported ``transformers.models`` modules."""
    found: dict[type, None] = {}

    def add_tree(cls: type) -> None:
        if cls not in found:
            found[cls] = None
            for sub in cls.__subclasses__():
                add_tree(sub)

    for name in _BASES:
        base = getattr(cache_utils, name, None)
        if isinstance(base, type):
            add_tree(base)
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers.models.") or name in _modules_scanned:
            continue
        _modules_scanned.add(name)
        for obj in list(vars(module).values()):
            if isinstance(obj, type) and obj.__module__ == name \
                    and obj.__name__.endswith(_CACHE_SUFFIXES):
                _named_classes[obj] = None
    for cls in _named_classes:
        add_tree(cls)
    return list(found)


def _register(cls: type, cache_utils: Any) -> None:
    if cls is getattr(cache_utils, "DynamicCache", None):
        flatten, unflatten, with_keys = _dynamic_cache_node(cls, cache_utils)
    elif cls is getattr(cache_utils, "EncoderDecoderCache", None):
        flatten, unflatten, with_keys = _encoder_decoder_node(cls)
    else:
        flatten, unflatten, with_keys = flatten_object, rebuild_object, flatten_object_with_keys
    try:
        pytree.register_pytree_node(
            cls, flatten, unflatten, flatten_with_keys_fn=with_keys,
            serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
    except ValueError as exc:  # registered meanwhile by someone else: theirs stands
        if "already registered" not in str(exc):
            raise


# ----------------------------------------------------------------------------- DynamicCache


class TransformersFormat(NamedTuple):
    """The context of a DynamicCache flattened by transformers' own functions (their
    ``[dictionary keys, sliding-window layout]``, as tuples so that it hashes)."""

    keys: tuple
    layout: tuple


def _dynamic_cache_node(cls: type, cache_utils: Any) -> tuple:
    """A DynamicCache whose layers are all plain attention layers is flattened the way
    transformers' ``register_dynamic_cache_export_support`` does (keys and values, the
    sliding windows in the context; rebuilt by :func:`_rebuild_plain` where every layer is a
    ``DynamicLayer``, by transformers' ``DynamicCache(...)`` otherwise), any other by its
    attributes, layers included (each layer class is a node of its own)."""
    plain = tuple(getattr(cache_utils, n) for n in _PLAIN_LAYERS if hasattr(cache_utils, n))
    layer_cls = getattr(cache_utils, "DynamicLayer", None)
    hf = _transformers_format()

    def is_plain(cache: Any) -> bool:
        return hf is not None and all(type(layer) in plain for layer in cache.layers)

    def flatten(cache: Any) -> tuple[list, Any]:
        if not is_plain(cache):
            return flatten_object(cache)
        values, (keys, layout) = hf[0](cache)
        return values, TransformersFormat(tuple(keys), tuple(layout))

    def flatten_with_keys(cache: Any) -> tuple[list, Any]:
        if not is_plain(cache):
            return flatten_object_with_keys(cache)
        items, (keys, layout) = hf[1](cache)
        return items, TransformersFormat(tuple(keys), tuple(layout))

    def unflatten(values: Any, context: Any) -> Any:
        if isinstance(context, ObjectContext):
            return rebuild_object(values, context)
        cache = _rebuild_plain(cls, layer_cls, values, context)
        if cache is None:
            cache = hf[2](values, [list(context.keys), list(context.layout)])
        return cache

    return flatten, unflatten, flatten_with_keys


def _rebuild_plain(cls: type, layer_cls: type | None, values: list,
                   context: TransformersFormat) -> Any | None:
    """A ``DynamicCache`` of ``DynamicLayer``s holding the given keys and values themselves,
    or None where the context holds anything else (a sliding window, a layer without
    states, leaves that are not tensors): transformers' rebuild then.

    Transformers' rebuild calls each new layer's ``update``: ``lazy_initialization`` (dtype,
    device, empty keys and values), then a ``torch.cat`` of the empty tensors with the
    states, a copy of every layer's keys and values on every call that returns a cache
    (16 kernels a LLaMA step, 24 a GPT-2 step) that the eager model never makes. Here each
    layer gets transformers' own ``lazy_initialization`` and then the states as they are,
    the state ``update`` leaves, less the copy (``DynamicLayer`` never writes its tensors
    in place: ``update`` concatenates, ``crop`` slices). Any failure building it (another
    transformers' constructor or layer) falls back to transformers' rebuild.
    """
    layout = context.layout
    state = dict(zip(context.keys, values))
    keys, vals = state.get("key_cache"), state.get("value_cache")
    if layer_cls is None or len(state) != 2 or not isinstance(keys, list) \
            or not isinstance(vals, list) or not len(keys) == len(vals) == len(layout) \
            or any(w is not None for w in layout) \
            or not all(isinstance(t, torch.Tensor) for t in (*keys, *vals)):
        return None
    try:
        cache = cls([(None, None)] * len(layout))  # empty DynamicLayers, no update
        layers = cache.layers
        if len(layers) != len(layout) or any(
                type(layer) is not layer_cls or layer.is_initialized for layer in layers):
            return None
        for layer, k, v in zip(layers, keys, vals):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
    except Exception:  # noqa: BLE001 -- a transformers whose classes differ: its own rebuild
        return None
    return cache


def _transformers_format() -> tuple | None:
    """transformers' own DynamicCache flatten, flatten-with-keys and unflatten functions
    (the ones ``register_dynamic_cache_export_support`` registers; private helpers of that
    module), or None where this transformers has none: every DynamicCache is then
    flattened by its attributes."""
    try:
        from transformers.integrations import executorch as hf
        cache_dict, layout = hf._get_cache_dict, hf._get_dynamic_cache_layout
        flatten, with_keys = hf._flatten_cache_dict, hf._flatten_cache_dict_with_keys
        unflatten = hf._unflatten_dynamic_cache
    except (ImportError, AttributeError):
        return None
    return (lambda c: flatten(cache_dict(c), layout(c)),
            lambda c: with_keys(cache_dict(c), layout(c)), unflatten)


# ---------------------------------------------------------------------- EncoderDecoderCache

_ENCDEC_FIELDS = ("self_attention_cache", "cross_attention_cache")


def _encoder_decoder_node(cls: type) -> tuple:
    def flatten(cache: Any) -> tuple[list, Any]:
        return [getattr(cache, f) for f in _ENCDEC_FIELDS], None

    def flatten_with_keys(cache: Any) -> tuple[list, Any]:
        return [(pytree.GetAttrKey(f), getattr(cache, f)) for f in _ENCDEC_FIELDS], None

    def unflatten(children: Any, context: Any) -> Any:
        return cls(*children)  # recomputes is_updated from the cross-attention cache

    return flatten, unflatten, flatten_with_keys
