"""Two gloo ranks on CPU: when only one rank overflows, both skip and stay identical; on
either runtime (the CUDA one runs on CPU tensors when named), whose gradients reach DDP's
hooks before backward ends."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.distributed import free_port, spawn

WORLD = 2
LOSS_ONLY_STEP = 2  # rank 1's loss is inf, its gradients finite: only the flag all-reduce helps
INPUT_STEP = 5  # rank 1's batch holds an inf: its gradients are non-finite
STEPS = 8
ACCUMULATION_STEPS = 2


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _batch(rank: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)


def _worker(rank: int, port: int, out_dir: str, runtime: str) -> None:
    import ampgraph
    import ampgraph.runtime.cuda.runtime as cuda_runtime
    from ampgraph.train.loss_scale import DynamicLossScaleManager
    from ampgraph.train.step import build_train_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    cuda_runtime.GROUP_NUMEL = 1000  # the first layer's weight alone, the rest in another
    model = _mlp()
    ddp = DistributedDataParallel(ampgraph.compile(model, "O2", "bf16", runtime=runtime))
    # the order in which gradients become ready, against the input's (the last one)
    order = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: order.append(i))
             for i, p in enumerate(model.parameters())]
    x, y = _batch(rank, 99)
    x.requires_grad_()
    x.register_hook(lambda g: order.append("input"))
    F.cross_entropy(ddp(x), y).backward()
    for h in hooks:
        h.remove()
    model.zero_grad(set_to_none=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    armed = [False]

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(out, y)
        return loss + float("inf") if armed[0] else loss

    manager = DynamicLossScaleManager(init_loss_scale=2.0**10, scale_window=1000)
    step = build_train_step(ddp, loss_fn, opt, loss_scale_manager=manager)
    records = []
    for i in range(STEPS):
        x, y = _batch(rank, i)
        armed[0] = rank == 1 and i == LOSS_ONLY_STEP
        if rank == 1 and i == INPUT_STEP:
            x[3, 7] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        out = step(x, y)
        changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        records.append((out.overflow, out.loss_scale, changed))
    # the no_sync path: gradient accumulation over DDP micro-batches
    accumulate = build_train_step(ddp, F.cross_entropy, opt, accumulation_steps=2,
                                  loss_scale_manager=manager)
    stepped = [accumulate(*_batch(rank, 50 + i)).stepped for i in range(4)]
    try:
        build_train_step(DistributedDataParallel(_mlp()), F.cross_entropy, opt)
        uncompiled_error = ""
    except ValueError as exc:
        uncompiled_error = str(exc)
    torch.save({
        "records": records, "stepped": stepped, "uncompiled_error": uncompiled_error,
        "order": order,
        "code": step.code + accumulate.code, "scale": manager.get_loss_scale(),
        "params": [p.detach().clone() for p in model.parameters()],
    }, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("runtime", ["cpu", "cuda"])
def test_one_rank_overflowing_makes_every_rank_skip(tmp_path, runtime):
    spawn(_worker, free_port(), str(tmp_path), runtime, nprocs=WORLD)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD))
    assert "dist.all_reduce(found_inf, op=dist.ReduceOp.MAX" in r0["code"]
    assert "with net.no_sync() if micro != 1 else nullcontext():" in r0["code"]
    for i, (a, b) in enumerate(zip(r0["records"], r1["records"])):
        overflow = i in (LOSS_ONLY_STEP, INPUT_STEP)
        assert a[0] is b[0] is overflow, f"step {i}: ranks disagree or wrong flag"
        assert a[1] == b[1] and a[2] is b[2] is (not overflow), f"step {i}"
    assert r0["records"][-1][1] == 2.0**8  # backed off twice
    assert r0["stepped"] == r1["stepped"] == [False, True, False, True]
    assert r0["scale"] == r1["scale"]
    for p, q in zip(r0["params"], r1["params"]):
        assert torch.equal(p, q)
    assert "compile first, then wrap" in r0["uncompiled_error"]
    # gradients reach DDP's hooks during backward: the last layer's before the first's
    order = r0["order"]
    assert order.index(2) < order.index(0) < order.index("input"), order
