"""CollectiveBytes counts what each collective carries, by kind and dtype, and puts
torch.distributed's functions back."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ampgraph.parallel.traffic import KINDS, CollectiveBytes


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_bytes_by_kind_and_dtype(one_rank):
    before = {name: getattr(dist, name, None) for names in KINDS.values() for name in names}
    with CollectiveBytes() as traffic:
        dist.all_reduce(torch.ones(10, dtype=torch.bfloat16))
        dist.all_reduce(torch.ones(4))
        out = torch.empty(6)
        dist.all_gather_into_tensor(out, torch.ones(6))
        dist.reduce_scatter_tensor(torch.empty(3, dtype=torch.bfloat16),
                                   torch.ones(3, dtype=torch.bfloat16))
    assert traffic.by_dtype("all_reduce") == {"bfloat16": 20, "float32": 16}
    assert traffic.total("all_gather") == 24
    assert traffic.total("reduce_scatter", torch.bfloat16) == 6
    assert traffic.total("reduce_scatter", torch.float32) == 0
    assert {name: getattr(dist, name, None) for name in before} == before
