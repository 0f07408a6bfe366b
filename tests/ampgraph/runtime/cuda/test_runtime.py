"""ampgraph/runtime/cuda/runtime.py: CudaRuntime, run on CPU tensors (portable ops only)."""

from __future__ import annotations

import copy
import gc

import torch

import ampgraph
from ampgraph.runtime.cuda.runtime import GROUP_NUMEL, CudaRuntime
from passes.fx.runtime_ops import RuntimeOps
from tests.ampgraph.runtime.cuda.helpers import pair


def test_working_copies_are_two_bytes_per_low_weight_and_clear_drops_them():
    model, net, _, _ = pair()
    net(torch.randn(2, 16)).sum().backward()
    low = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("norm"))
    assert sum(c.numel() * c.element_size() for c in net.working_copies()) == 2 * low
    net.clear_weight_cache()
    assert net.working_copies() == []


def test_eager_graphs_group_their_parameter_casts_and_a_compiler_gets_none():
    runtime = CudaRuntime()
    ops = runtime.ops(backend=None)
    assert ops.weight_group == runtime.weight_group and ops.group_numel == GROUP_NUMEL
    assert ops.weight_cast is None and ops.linear is None and ops.attention is None
    # grouped key/value heads: the query heads stacked, equal head counts for every fused
    # kernel (enable_gqa with a mask runs on cuDNN or the math path only)
    assert ops.stacked_kv_heads and not ops.unrepeated_kv_heads
    compiled = runtime.ops(backend="inductor")  # only the FP8 product (inline, traceable)
    assert compiled == RuntimeOps(fp8_linear=compiled.fp8_linear)
    assert compiled.fp8_linear.__self__.cache_weights is False


def test_weight_group_tracks_its_groups_while_a_graph_holds_them():
    runtime = CudaRuntime()
    low = runtime.weight_group(((torch.bfloat16, None), (torch.bfloat16, None)))
    a, b = torch.randn(3, 4), torch.randn(4)
    copies = low(a, b)
    assert [c.dtype for c in copies] == [torch.bfloat16] * 2
    assert torch.equal(copies[0], a.to(torch.bfloat16))
    (group,) = runtime.groups()
    assert group.low_copies == low
    assert runtime.nbytes() == 2 * (12 + 4) and len(runtime.working_copies()) == 2
    del low, group
    gc.collect()
    assert runtime.groups() == []  # the runtime only tracks what a graph holds


def test_clear_drops_the_copies_and_the_groups_look_them_up_again():
    runtime = CudaRuntime()
    low = runtime.weight_group(((torch.float16, None),))
    w = torch.randn(5)
    first = low(w)[0]
    runtime.clear()
    assert runtime.working_copies() == [] and runtime.nbytes() == 0
    again = low(w)[0]
    assert again.data_ptr() != first.data_ptr() and torch.equal(again, w.half())
    assert runtime.copies.refreshes == 2


def test_marking_weights_stale_refreshes_the_same_copies_at_the_next_call():
    """What a CUDA graph capture needs: the refresh runs (and is recorded) though no master
    changed, into the copies the eager steps used."""
    model, net, _, _ = pair()
    x = torch.randn(2, 16)
    net(x).sum().backward()
    store = net._amp_runtime.copies
    ptrs, refreshes = [c.data_ptr() for c in store.copies()], store.refreshes
    net(x).sum().backward()
    assert store.refreshes == refreshes, "nothing changed: no refresh"
    net.mark_weights_stale()
    net(x).sum().backward()
    assert store.refreshes == refreshes + 1
    assert [c.data_ptr() for c in store.copies()] == ptrs


def test_a_fused_optimizers_update_is_seen():
    """Fused optimizers write the masters without bumping their version counters: the
    copies would stay stale (a step-post hook bumps them)."""
    model, net, _, _ = pair()
    x = torch.randn(2, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    net(x).sum().backward()
    opt.step()
    fresh = ampgraph.compile(copy.deepcopy(model), "O2", "bf16", runtime="cuda")
    assert torch.equal(net(x), fresh(x))
