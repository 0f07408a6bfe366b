"""Sharded checkpoints: a run resumed from step K through DCP (model shards, optimizer
state, the dynamic loss scale and the counters) gives the losses of the uninterrupted run,
on two gloo ranks and in one process."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.ampgraph.parallel.helpers import batch, lm_loss, make_model
from tests.distributed import spawn

WORLD, ROWS, K, N = 2, 2, 3, 6


def _step(model):
    import ampgraph

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = ampgraph.DynamicLossScaleManager(init_loss_scale=2.0**4, scale_window=2)
    return ampgraph.build_train_step(model, lm_loss, opt, loss_scale_manager=manager)


def _run(step, start: int, stop: int, rows: slice, world: int) -> list[tuple[float, float]]:
    out = []
    for i in range(start, stop):
        x, y = batch(i, world * ROWS)
        o = step(x[rows], y[rows])
        out.append((o.loss.item(), o.loss_scale))
    return out


def _fresh(seed: int):
    torch.manual_seed(seed)
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():  # nothing of the saved run left in the new model
            p.normal_()
    return model


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import ampgraph

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    ckpt = os.path.join(out_dir, "ckpt")
    step = _step(ampgraph.shard(make_model(), None, "O2", "fp16"))
    first = _run(step, 0, K, rows, WORLD)
    ampgraph.save_checkpoint(ckpt, step)
    straight = _run(step, K, N, rows, WORLD)
    resumed_step = _step(ampgraph.shard(_fresh(rank + 1), None, "O2", "fp16"))
    ampgraph.load_checkpoint(ckpt, resumed_step)
    resumed = _run(resumed_step, K, N, rows, WORLD)
    torch.save({"first": first, "straight": straight, "resumed": resumed,
                "index": resumed_step.step_index},
               os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_sharded_resume_gives_the_uninterrupted_losses(tmp_path, one_thread):
    spawn(_worker, str(tmp_path / "init"), str(tmp_path), nprocs=WORLD)
    for rank in range(WORLD):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        assert r["resumed"] == r["straight"], rank
        assert r["index"] == N
        scales = [s for _, s in r["first"] + r["straight"]]
        assert scales[K] > scales[0]  # the scale grew before the save: its state was saved


def test_one_process_resume(tmp_path, one_thread):
    import ampgraph

    step = _step(ampgraph.compile(make_model(), "O2", "bf16"))
    _run(step, 0, K, slice(None), 1)
    ampgraph.save_checkpoint(tmp_path / "ckpt", step)
    straight = _run(step, K, N, slice(None), 1)
    resumed_step = _step(ampgraph.compile(_fresh(1), "O2", "bf16"))
    ampgraph.load_checkpoint(tmp_path / "ckpt", resumed_step)
    assert _run(resumed_step, K, N, slice(None), 1) == straight
