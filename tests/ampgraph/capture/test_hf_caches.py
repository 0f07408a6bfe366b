"""ampgraph/capture/hf_caches.py: HuggingFace caches as pytree nodes."""

from __future__ import annotations

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
