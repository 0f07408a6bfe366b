"""FSDP2 over regionally compiled blocks: two gloo ranks on CPU.

Each block is compiled by ampgraph and sharded by ``fully_shard``; the root is sharded
last. The losses must match the unsharded compiled model trained on the same global batch
(computed here, not trusted to gloo's reductions), each rank holds about half the
parameters, and ``build_train_step`` on the sharded model agrees on fp16 overflow across
ranks and clips the sharded (DTensor) gradients.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.distributed import spawn

WORLD = 2
STEPS = 10
D, VOCAB, SEQ, BATCH = 32, 16, 8, 4  # BATCH per rank
FP16_STEPS = 4
OVERFLOW_STEP = 1  # rank 1's input holds an inf at this fp16 step


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, x):
        h = self.proj(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h).clone()  # FSDP2 warns when the root returns a view


def _model(dtype, runtime=None):
    import ampgraph

    torch.manual_seed(0)
    model = Tiny()
    for i, block in enumerate(model.layers):
        model.layers[i] = ampgraph.compile(block, amp_level="O2", dtype=dtype, runtime=runtime)
    return model


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step i: WORLD * BATCH rows; rank r takes rows r*BATCH..."""
    x = torch.randn(WORLD * BATCH, SEQ, D, generator=torch.Generator().manual_seed(i))
    return x, x[..., :VOCAB].argmax(-1)  # learnable labels


def _loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _worker(rank: int, init_file: str, out_dir: str, runtime: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ampgraph.train.loss_scale import DynamicLossScaleManager
    from ampgraph.train.step import build_train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    rows = slice(rank * BATCH, (rank + 1) * BATCH)

    def sharded(dtype):
        model = _model(dtype, runtime)
        for i in range(len(model.layers)):
            fully_shard(model.layers[i], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    # 1. bf16, a plain loop: the pattern of docs/integrations.md
    model = sharded("bf16")
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i in range(STEPS):
        x, y = _batch(i)
        loss = _loss(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # SUM, then divide: the global-batch loss
        losses.append(mean.item() / WORLD)

    # 2. fp16 through build_train_step: clipping on DTensor gradients, one rank overflows
    model = sharded("fp16")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    manager = DynamicLossScaleManager(init_loss_scale=2.0**8, scale_window=1000)
    step = build_train_step(model, _loss, opt, loss_scale_manager=manager,
                            clip_grad_norm=1.0)
    records = []
    for i in range(FP16_STEPS):
        x, y = _batch(100 + i)
        x = x[rows].clone()
        if rank == 1 and i == OVERFLOW_STEP:
            x[0, 0, 0] = float("inf")
        before = [p.to_local().clone() for p in model.parameters()]
        out = step(x, y[rows])
        changed = any(not torch.equal(a, p.to_local())
                      for a, p in zip(before, model.parameters()))
        records.append((out.overflow, out.loss_scale, changed,
                        None if out.overflow else float(out.grad_norm)))
    full = [p.full_tensor() for p in model.parameters()]
    torch.save({"losses": losses, "local": local, "total": total, "records": records,
                "code": step.code, "full": full},
               os.path.join(out_dir, f"rank{rank}.pt"))


def _reference_losses() -> list[float]:
    model = _model("bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i in range(STEPS):
        x, y = _batch(i)
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("runtime", ["cpu", "cuda"])
def test_fully_shard_over_compiled_blocks_matches_the_unsharded_run(tmp_path, one_thread,
                                                                    runtime):
    spawn(_worker, str(tmp_path / "init"), str(tmp_path), runtime, nprocs=WORLD)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD))
    reference = _reference_losses()
    assert r0["losses"] == r1["losses"]
    torch.testing.assert_close(r0["losses"], reference, rtol=2e-2, atol=2e-2)
    assert r0["losses"][-1] < r0["losses"][0] - 0.3  # it learns
    assert r0["local"] + r1["local"] == r0["total"]
    assert abs(r0["local"] / r0["total"] - 0.5) < 0.05  # about half the parameters per rank
    # fp16 via build_train_step: both ranks skip the step only rank 1 overflowed
    assert "local_grads(params)" in r0["code"] and "full_tensor(grad_norm)" in r0["code"]
    assert "dist.all_reduce(found_inf" in r0["code"]
    for i, (a, b) in enumerate(zip(r0["records"], r1["records"])):
        overflow = i == OVERFLOW_STEP
        assert a[0] is b[0] is overflow, f"step {i}"
        assert a[1] == b[1] and a[2] is b[2] is (not overflow), f"step {i}"
        if not overflow:
            assert a[3] == pytest.approx(b[3]) and 0 < a[3] < float("inf")
    assert r0["records"][-1][1] == 2.0**7  # backed off once
    for p, q in zip(r0["full"], r1["full"]):
        assert torch.equal(p, q)
