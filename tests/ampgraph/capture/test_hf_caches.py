"""ampgraph/capture/hf_caches.py: HuggingFace caches as pytree nodes."""

from __future__ import annotations

import sys

import pytest

transformers = pytest.importorskip("transformers")


def test_cache_registration_is_idempotent_and_leaves_existing_registrations():
    from torch.utils import _pytree as pytree
    from transformers.integrations.executorch import register_dynamic_cache_export_support

    from ampgraph.capture import register_hf_caches

    register_hf_caches()
    register_hf_caches()
    register_dynamic_cache_export_support()  # the user's own call after ours still works
    assert transformers.DynamicCache in pytree.SUPPORTED_NODES
    assert transformers.EncoderDecoderCache in pytree.SUPPORTED_NODES


def test_nothing_is_registered_before_transformers_caches_are_imported(monkeypatch):
    from ampgraph.capture import hf_caches

    monkeypatch.setattr(hf_caches, "_hf_caches_registered", False)
    monkeypatch.delitem(sys.modules, "transformers.cache_utils")
    hf_caches.register_hf_caches()
    assert hf_caches._hf_caches_registered is False  # tried again once they are imported


def test_an_encoder_decoder_cache_flattens_to_its_two_caches_and_back():
    from torch.utils import _pytree as pytree

    from ampgraph.capture import register_hf_caches

    register_hf_caches()
    cache = transformers.EncoderDecoderCache(transformers.DynamicCache(),
                                             transformers.DynamicCache())
    children, spec = pytree.tree_flatten(cache)
    rebuilt = pytree.tree_unflatten(children, spec)
    assert type(rebuilt) is transformers.EncoderDecoderCache
    assert type(rebuilt.self_attention_cache) is transformers.DynamicCache
    assert rebuilt.get_seq_length() == 0
