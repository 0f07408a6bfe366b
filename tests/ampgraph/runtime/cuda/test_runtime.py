"""ampgraph/runtime/cuda/runtime.py: CudaRuntime, run on CPU tensors (portable ops only)."""

from __future__ import annotations

import torch

from tests.ampgraph.runtime.cuda.helpers import pair


def test_working_copies_are_two_bytes_per_low_weight_and_clear_drops_them():
    model, net, _, _ = pair()
    net(torch.randn(2, 16)).sum().backward()
    low = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("norm"))
    assert sum(c.numel() * c.element_size() for c in net.working_copies()) == 2 * low
    net.clear_weight_cache()
    assert net.working_copies() == []
