"""compress_ddp_gradients: DDP's buckets all-reduced in bf16 on two gloo ranks, gradients
within bf16's rounding of the fp32 all-reduce."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.ampgraph.parallel.helpers import batch, lm_loss, make_model
from tests.distributed import spawn

WORLD, ROWS = 2, 2


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    import ampgraph
    from ampgraph.parallel import CollectiveBytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    x, y = batch(0, WORLD * ROWS)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    grads = {}
    for compress in (False, True):
        ddp = DistributedDataParallel(ampgraph.compile(make_model(), "O2", "bf16"))
        if compress:
            ampgraph.compress_ddp_gradients(ddp, "bf16")
        with CollectiveBytes() as traffic:
            lm_loss(ddp(x[rows]), y[rows]).backward()
        grads[compress] = [p.grad.clone() for p in ddp.parameters()]
        grads[f"bytes_{compress}"] = traffic.by_dtype("all_reduce")
    torch.save(grads, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_bf16_compressed_all_reduce(tmp_path, one_thread):
    spawn(_worker, str(tmp_path / "init"), str(tmp_path), nprocs=WORLD)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD))
    numel = sum(p.numel() for p in make_model().parameters())
    assert r0["bytes_True"] == {"bfloat16": 2 * numel}  # half of fp32's bytes, all bf16
    assert r0["bytes_False"] == {}  # DDP's own all-reduce runs in C++: nothing seen here
    for a, b, full in zip(r0[True], r1[True], r0[False]):
        assert torch.equal(a, b)  # the ranks agree
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, full, rtol=2**-7, atol=1e-4 * full.abs().max().item())


def test_compress_refuses_what_it_cannot_do():
    import ampgraph

    with pytest.raises(TypeError, match="DistributedDataParallel"):
        ampgraph.compress_ddp_gradients(nn.Linear(2, 2))
