"""``ampgraph.shard`` on 2 and 4 gloo ranks: FSDP2 over a model compiled region by region.

Per world size, one spawn checks: the all-gather bytes of a step equal FSDP2's own bf16
policy's (and are half the fp32 ones), gradients are reduce-scattered in fp32, no weight
that arrives in bf16 is copied again (CPU and CUDA runtimes), ``explain`` lists nothing
eager but the code between the compiled modules, and 20 steps in bf16 and in fp16 with
dynamic loss scaling (one rank overflowing once) match a single-process O2 run of the whole
model on the same global batch.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tests.ampgraph.parallel.helpers import batch, lm_loss, make_model
from tests.distributed import spawn

ROWS = 2  # per rank
STEPS = 20
POISON_STEP = 3  # rank 1's loss is inf at this fp16 step
RUNTIMES = ("cpu", "cuda")  # both on 2 ranks, the first on 4


class LowCopies(TorchDispatchMode):
    """Counts copies of 16-bit tensors into 16-bit tensors of the same dtype (a second copy
    of a weight gathered in bf16) with at least ``numel`` elements."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("_to_copy", "copy_", "_foreach_copy_", "clone"):
            src = args[1] if name in ("copy_", "_foreach_copy_") else args[0]
            dst = args[0] if name in ("copy_", "_foreach_copy_") else out
            for s, d in zip(*(t if isinstance(t, (list, tuple)) else [t] for t in (src, dst))):
                if (s.dtype == d.dtype and s.dtype in (torch.bfloat16, torch.float16)
                        and s.numel() >= self.numel):
                    self.count += 1
        return out


def _global_loss(loss: torch.Tensor, world: int) -> float:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def _poisoned(rank_poisoned: bool):
    poison = torch.ones(())

    def loss_fn(logits, labels):
        return lm_loss(logits, labels) * poison

    def set_step(i: int) -> None:
        poison.fill_(float("inf") if rank_poisoned and i == POISON_STEP else 1.0)

    return loss_fn, set_step


def _manager(dtype: str):
    from ampgraph import DynamicLossScaleManager

    return DynamicLossScaleManager(init_loss_scale=2.0**10) if dtype == "fp16" else None


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import ampgraph
    from ampgraph.parallel import CollectiveBytes, shard
    from ampgraph.report import GLUE

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*returned a view tensor")  # plain FSDP2's
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    result = {}

    def one_step(model, i=0):
        x, y = batch(i, world * ROWS)
        with CollectiveBytes() as traffic:
            lm_loss(model(x[rows]), y[rows]).backward()
        model.zero_grad()
        return traffic

    # FSDP2's own bf16 policy on the plain model, and in fp32: the byte counts to meet
    plain = make_model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in plain.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(plain, mesh=mesh, mp_policy=policy)
    result["fsdp_bf16"] = one_step(plain).counts
    if world == 2:  # what does not depend on the world size: once
        result["amp_fp32_gather"] = one_step(shard(make_model(), mesh, "O2", "bf16",
                                                   gather="fp32")).counts
    for runtime in RUNTIMES[:1 if world > 2 else 2]:
        model = shard(make_model(), mesh, "O2", "bf16", runtime=runtime)
        one_step(model)  # capture
        with LowCopies(numel=32 * 32) as copies:
            result[f"amp_{runtime}"] = one_step(model, 1).counts
        result[f"copies_{runtime}"] = copies.count
    result["eager"] = [(e.path, e.reason == GLUE) for e in ampgraph.explain(model).eager]

    # 20 steps through build_train_step: bf16 (AdamW), fp16 with dynamic loss scaling
    for dtype in ("bf16", "fp16"):
        model = shard(make_model(), mesh, "O2", dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loss_fn, set_step = _poisoned(rank == 1 and dtype == "fp16")
        step = ampgraph.build_train_step(model, loss_fn, opt,
                                         loss_scale_manager=_manager(dtype))
        records = []
        for i in range(STEPS):
            set_step(i)
            x, y = batch(i, world * ROWS)
            out = step(x[rows], y[rows])
            records.append((_global_loss(out.loss, world), out.overflow, out.loss_scale))
        result[dtype] = records
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _single_process(dtype: str, world: int) -> list[tuple[float, bool, float]]:
    import ampgraph

    model = ampgraph.compile(make_model(), "O2", dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn, set_step = _poisoned(dtype == "fp16")
    step = ampgraph.build_train_step(model, loss_fn, opt, loss_scale_manager=_manager(dtype))
    records = []
    for i in range(STEPS):
        set_step(i)
        out = step(*batch(i, world * ROWS))
        records.append((out.loss.item(), out.overflow, out.loss_scale))
    return records


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("world", [2, 4])
def test_shard_moves_bf16_and_matches_one_process(tmp_path, one_thread, world):
    spawn(_worker, world, str(tmp_path / "init"), str(tmp_path), nprocs=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    r0 = ranks[0]

    def total(counts, kind, dtype=None):
        return sum(n for (k, d), n in counts.items() if k == kind and dtype in (None, d))

    fsdp = total(r0["fsdp_bf16"], "all_gather")
    assert fsdp == total(r0["fsdp_bf16"], "all_gather", torch.bfloat16) > 0
    for runtime in RUNTIMES[:1 if world > 2 else 2]:
        amp = r0[f"amp_{runtime}"]
        assert abs(total(amp, "all_gather") / fsdp - 1) < 0.01, (runtime, amp)
        assert total(amp, "all_gather", torch.bfloat16) == total(amp, "all_gather")
        reduced = total(amp, "reduce_scatter")  # gradients reduced in fp32 by default
        assert reduced == total(amp, "reduce_scatter", torch.float32) > 0
        assert reduced == total(r0["fsdp_bf16"], "reduce_scatter")
        assert all(r[f"copies_{runtime}"] == 0 for r in ranks), runtime
    if world == 2:
        fp32_gather = total(r0["amp_fp32_gather"], "all_gather", torch.float32)
        assert fp32_gather == 2 * fsdp  # gather="fp32": twice the bytes
    assert r0["eager"] == [("<root>", True)]  # only the root's own code runs uncompiled

    for dtype, tol in (("bf16", 2e-2), ("fp16", 5e-3)):
        reference = _single_process(dtype, world)
        for r in ranks:
            assert [o for _, o, _ in r[dtype]] == [o for _, o, _ in reference], dtype
            assert [s for _, _, s in r[dtype]] == [s for _, _, s in reference], dtype
        got = [loss for loss, o, _ in r0[dtype] if not o]
        want = [loss for loss, o, _ in reference if not o]
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        assert want[-1] < want[0] - 0.5  # it learns
    overflowed = [o for _, o, _ in r0["fp16"]]
    assert overflowed[POISON_STEP] and sum(overflowed) == 1  # rank 1's inf skipped everyone


def test_lightning_model_parallel_strategy_takes_the_same_path(one_thread):
    """Lightning's FSDP2 strategy: ``ampgraph.shard`` in ``configure_model`` on its mesh."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.strategies import ModelParallelStrategy

    import ampgraph
    from ampgraph.report import GLUE

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model, self.losses = make_model(), []

        def configure_model(self):
            ampgraph.shard(self.model, self.device_mesh["data_parallel"], "O2", "bf16")

        def training_step(self, b, i):
            loss = lm_loss(self.model(b[0]), b[1])
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    lit = Lit()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(),
                         max_steps=8, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(lit, torch.utils.data.DataLoader([batch(i, 4) for i in range(8)],
                                                         batch_size=None))
    finally:
        if dist.is_initialized():  # the strategy's process group of one, left up by Lightning
            dist.destroy_process_group()
    assert type(lit.model.layers[0]).__name__ == "FSDPBlock"  # compiled, then sharded
    assert [e.reason for e in ampgraph.explain(lit.model).eager] == [GLUE]
    assert lit.losses[-1] < lit.losses[0] - 0.5
