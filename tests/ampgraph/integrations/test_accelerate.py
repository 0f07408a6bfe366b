"""A compiled model through ``accelerator.prepare``: one process, two CPU processes (gloo),
and Accelerate's autocast switched on.

The processes are spawned, not forked: ``accelerate.debug_launcher`` forks the pytest
process, and a fork after earlier tests started threads can deadlock (it did, in the
full suite). The workers set up what debug_launcher sets up: a gloo group on a file
store and Accelerate's CPU environment variables.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests.distributed import free_port, spawn

accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed "
                                 "(pip install -r requirements-pinned.txt)")

STEPS = 6
GLOBAL_BATCH = 32


def _train(out_dir: str, mixed_precision: str, tag: str) -> None:
    """Runs in each launched process: STEPS steps on the same global batches."""
    import torch.nn.functional as F

    import ampgraph
    from tests.helpers import record

    torch.set_num_threads(1)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision=mixed_precision)
    world = accelerator.num_processes
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH * STEPS, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x[:, :4].argmax(1))
    loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // world)
    net, opt, loader = accelerator.prepare(
        ampgraph.compile(model, "O2", "bf16"), torch.optim.SGD(model.parameters(), lr=0.5),
        loader)
    losses = []
    for xb, yb in loader:
        loss = F.cross_entropy(net(xb), yb)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(accelerator.gather(loss.detach()[None]).mean().item())
    _, rec = record(lambda: net(xb))  # the norm in fp32, no fp16 anywhere
    result = {"losses": losses, "norm": rec.norm_compute_dtypes(),
              "dtypes": {dt for _, d in rec.calls for dt in d},
              "autocast_wrapped": "_original_forward" in accelerator.unwrap_model(net).__dict__}
    torch.save(result, os.path.join(out_dir, f"{tag}{accelerator.process_index}.pt"))


def _launch(index: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    if world == 1:  # two independent single-process runs side by side
        mixed, tag, rank = ("no", "one", 0) if index == 0 else ("bf16", "autocast", 0)
    else:
        mixed, tag, rank = "no", "two", index
    os.environ["ACCELERATE_USE_CPU"] = "yes"
    if world > 1:
        os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        store = dist.FileStore(os.path.join(out_dir, "rdv"), world)
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    _train(out_dir, mixed, tag)


def test_prepare_trains_on_one_and_two_processes_and_ignores_autocast(tmp_path):
    spawn(_launch, 1, free_port(), str(tmp_path))
    spawn(_launch, 2, free_port(), str(tmp_path))
    one = torch.load(tmp_path / "one0.pt")
    autocast = torch.load(tmp_path / "autocast0.pt")
    two0, two1 = torch.load(tmp_path / "two0.pt"), torch.load(tmp_path / "two1.pt")
    assert len(one["losses"]) == STEPS and one["losses"][-1] < one["losses"][0]
    # Accelerate's bf16 autocast around forward changes nothing inside the graph (CPU
    # autocast has no fp16; tests/ampgraph/test_module.py checks fp16 autocast)
    assert autocast["autocast_wrapped"] and not one["autocast_wrapped"]
    assert autocast["losses"] == one["losses"]
    assert autocast["norm"] == {torch.float32} and torch.float16 not in autocast["dtypes"]
    # two processes, half the batch each, DDP-averaged gradients: the same trajectory
    assert len(two0["losses"]) == STEPS and two0["losses"] == two1["losses"]
    torch.testing.assert_close(two0["losses"], one["losses"], rtol=1e-2, atol=1e-3)
