"""ampgraph/runtime/tensors.py: storage references and layout-keeping empties."""

from __future__ import annotations

import torch

from ampgraph.runtime.tensors import all_alone, empty_as, storage_refs


def test_storage_refs_counts_every_tensor_on_the_storage():
    t = torch.zeros(4)
    alone = storage_refs(t)
    view = t[1:]
    assert storage_refs(t) == alone + 1
    other = torch.zeros(4)
    assert storage_refs(other) == alone
    del view
    assert storage_refs(t) == alone


def test_storage_refs_is_exact_and_all_alone_agrees_with_it():
    """A tensor alone on its storage counts 1 (the CUDA runtime's store took 2 for "held
    elsewhere" and made new copies every step)."""
    t, u = torch.zeros(4), torch.zeros(2)
    assert storage_refs(t) == 1 and all_alone([t, u])
    view = u[1:]
    assert storage_refs(u) == 2 and not all_alone([t, u]) and all_alone([t])
    del view
    assert all_alone([t, u]) and all_alone([])


def test_storage_refs_sees_a_view_saved_by_autograd():
    """A kept buffer is handed out as a view: a graph that saved the view holds it."""
    w = torch.randn(3, requires_grad=True)
    t = torch.randn(3)
    alone = storage_refs(t)
    view = t.view_as(t)
    y = (w * view).sum()  # mul saves the view for backward
    del view
    assert storage_refs(t) == alone + 1
    del y
    assert storage_refs(t) == alone


def test_empty_as_keeps_the_strides_or_takes_the_memory_format():
    p = torch.ones(2, 3).t()
    made = empty_as(p, torch.bfloat16, None)
    assert (made.shape, made.stride(), made.dtype) == (p.shape, p.stride(), torch.bfloat16)
    conv = torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last)
    kept = empty_as(conv, torch.float16, None)
    assert kept.is_contiguous(memory_format=torch.channels_last)
    fresh = empty_as(conv, torch.float16, torch.contiguous_format)
    assert fresh.is_contiguous() and fresh.dtype == torch.float16 and fresh.device == conv.device
