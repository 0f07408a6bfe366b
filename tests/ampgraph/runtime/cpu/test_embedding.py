"""ampgraph/runtime/cpu/embedding.py: a large table's gradient as aten's, into a buffer
kept between steps."""

from __future__ import annotations

import pytest
import torch

import ampgraph.runtime.cpu.weights as weights
from tests.ampgraph.runtime.cpu.helpers import Lookup, TiedHead, fused_and_plain, tied_step


@pytest.mark.parametrize("kept", [False, True])
def test_routed_embedding_gradients_are_aten_s_and_a_kept_table_reuses_its_buffer(
        kept, monkeypatch):
    """The same sums in the same order as aten's embedding backward (the padding row gets
    none), into a buffer reused across steps where the last gradient outlives forward."""
    if kept:
        monkeypatch.setattr(weights, "KEPT_GRAD_NUMEL", 800)  # the 50x16 table
    torch.manual_seed(0)
    model = Lookup()
    ids = torch.randint(0, 50, (4, 12))
    ids[0, :3] = 0
    gm, cache, plain = fused_and_plain(model, ids)
    assert any(n.target == cache.amp_embedding for n in gm.graph.nodes)
    seen = []
    for _ in range(3):
        loss = gm(ids).float().square().sum()
        model.zero_grad(set_to_none=True)  # after forward: the last gradient outlived it
        loss.backward()
        plain.zero_grad(set_to_none=True)
        plain(ids).float().square().sum().backward()
        ref = dict(plain.named_parameters())["emb.weight"].grad
        torch.testing.assert_close(model.emb.weight.grad, ref, rtol=0, atol=0)
        assert not model.emb.weight.grad[0].any()
        seen.append(model.emb.weight.grad.data_ptr())
    held = any(k[0] == "grad" for k in cache._per_param(model.emb.weight))
    assert held == kept
    if kept:
        assert seen[1] == seen[2]


def test_a_tied_table_s_lookup_gradient_goes_into_a_kept_table_added_in_place(monkeypatch):
    """The lookup's share of a tied table's gradient: into a table the cache keeps (a fresh
    one faults its pages in every step), which autograd adds into the head's share in
    place; the gradient is aten's."""
    monkeypatch.setattr(weights, "KEPT_GRAD_NUMEL", 800)  # the 50x16 table
    torch.manual_seed(0)
    model, ids = TiedHead(), torch.randint(0, 50, (4, 8))
    gm, cache, plain = fused_and_plain(model, ids)
    (lookup,) = [n for n in gm.graph.nodes if n.target == cache.amp_embedding]
    assert lookup.kwargs == {"shared": True}
    kept = []
    for _ in range(3):
        tied_step(model, gm, plain, ids)
        (buf,) = [entry[0] for key, entry in cache._per_param(model.emb.weight).items()
                  if key[0] == "tied"]
        kept.append(buf.data_ptr())
        assert buf.data_ptr() != model.emb.weight.grad.data_ptr()
    assert kept[0] == kept[1] == kept[2]
